"""Processes the twin (and the tests' pdctl fork server) start: dying with their parent, and
knowing a process again by more than its pid.

Linux only, as the twin is: prctl(2) and /proc.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded here, in the parent: a preexec_fn runs between fork and exec, where loading a library
# (dlopen takes a lock another thread of the parent may have held at the fork) is not safe.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and die now if it already has.

    The signal is sent only for a death after the call, so prctl(2) (PR_SET_PDEATHSIG) advises
    checking the parent's pid right after it: a parent that died just before is no longer the
    parent (the process has been reparented). Call it first thing in the child, e.g. as
    Popen(preexec_fn=functools.partial(die_with_parent, os.getpid()))."""
    if _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def identity(pid: int) -> str | None:
    """The boot and start time of process `pid` ("<boot id>:<start time in clock ticks>"), or None
    if there is none. A pid is reused once its process is gone; the same pid with the same start
    time on the same boot is the same process (proc(5): /proc/<pid>/stat field 22)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or parentheses itself
    start = stat.rsplit(")", 1)[1].split()[19]
    return f"{boot}:{start}"


def has_open(pid: int, path: Path) -> bool:
    """Whether process `pid` holds `path` open (it must be ours to look: /proc/<pid>/fd)."""
    target = str(path.resolve())
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False
