"""Where an operation changes the environment, named, so crash safety can be tested.

Every write to the release store and every change to a cluster calls `before_change(what)`
first. Normally that does nothing. With PDSTACK_FAULT_TRACE=<file> each call is appended to
that file (how many change points a run has, and which); with PDSTACK_FAULT_AT=<n> the
process kills itself with SIGKILL just before its n-th change, as a crash, an OOM kill or a
lost node would stop it (tests/test_rollout_faults.py runs a rollout once per point). With
PDSTACK_FAULT_RUN=<shell command> as well, that command runs there instead and the process
goes on: it breaks a real dependency (fills the store's disk, remounts it read-only, cuts
the bucket's endpoint off), so what follows meets the real failure. With PDSTACK_FAULT_STOP=1
instead, the process stops itself there with SIGSTOP (a paused VM, a long GC, a laptop lid)
and carries on from that point when it is sent SIGCONT: while it is stopped another
operator may take its lease over (tests/test_fault_matrix.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

_changes = 0


def before_change(what: str) -> None:
    global _changes
    trace, at = os.environ.get("PDSTACK_FAULT_TRACE"), os.environ.get("PDSTACK_FAULT_AT")
    if not trace and not at:
        return
    _changes += 1
    if trace:
        with open(trace, "a") as f:
            f.write(f"{_changes} {what}\n")
    if at and _changes == int(at):
        command = os.environ.get("PDSTACK_FAULT_RUN")
        if command:
            subprocess.run(command, shell=True, check=True)
        elif os.environ.get("PDSTACK_FAULT_STOP") == "1":
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def process_alive(pid: int) -> bool:
    """Whether a process of this host still runs (a temp file or lease of a dead one is stale)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_dead_writers(temp_files: Iterable[Path]) -> None:
    """Remove temp files whose writer died between writing and renaming them. Every temp file
    the release store and the simulated cluster write is named `...<pid>.tmp`."""
    for tmp in temp_files:
        parts = tmp.name.split(".")
        pid = int(parts[-2]) if len(parts) > 2 and parts[-2].isdigit() else None
        if pid is not None and pid != os.getpid() and not process_alive(pid):
            tmp.unlink(missing_ok=True)
