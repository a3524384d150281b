"""Processes the twin (and the tests' pdctl fork server) start: dying with their parent, and
knowing a process again by more than its pid.

Linux only, as the twin is: prctl(2), setpriv(1) (util-linux, as nsenter and unshare) and /proc.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded here, in the parent: in a child between fork and exec, loading a library (dlopen takes a
# lock another thread of the parent may have held at the fork) is not safe.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and die now if it already has.

    The signal is sent only for a death after the call, so prctl(2) (PR_SET_PDEATHSIG) advises
    checking the parent's pid right after it: a parent that died just before is no longer the
    parent (the process has been reparented). Call it first thing in a forked child that runs
    no thread (tests/forked_pdctl.py); a program is started with dying_with_parent instead."""
    if _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def dying_with_parent(argv: list[str], parent_pid: int | None = None) -> list[str]:
    """`argv` as a command whose process the kernel SIGKILLs when its parent (this process, or
    `parent_pid`) dies: die_with_parent's rule, applied after the exec by setpriv(1) --pdeathsig
    (the signal outlives exec(2) but for a set-user-ID program) and a shell comparing $PPID.

    Never Popen(preexec_fn=die_with_parent): CPython forks with fork(2) when there is a preexec_fn
    (Modules/_posixsubprocess.c), which runs every at-fork handler of the parent in the child.
    gRPC's (grpcio, loaded by Pulumi's automation API) restarts its poller thread there; the child
    then closes its fds above 2 before the exec, the poller's epoll fd with them, and the poller
    aborts (SIGABRT, "epoll_wait error: Bad file descriptor") if it polls before the exec ends it.
    With no preexec_fn CPython uses vfork(2), which runs no handler (tests/test_twin_process.py)."""
    parent = os.getpid() if parent_pid is None else parent_pid
    return ["setpriv", "--pdeathsig", "KILL", "--", "/bin/sh", "-c", '[ "$PPID" = "$0" ] || kill -KILL $$; exec "$@"',
            str(parent), *argv]


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
