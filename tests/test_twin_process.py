"""How the twin starts its processes (twin/process.py dying_with_parent, twin/pods.py _spawn), without a twin.

The flake it fixes: `make up`'s Mooncake master pod exited with SIGABRT, its log one line of
gRPC's, "(event_engine) Epoll1Poller:... encountered epoll_wait error: Bad file descriptor"
(grpcio 1.85.4, src/core/lib/event_engine/posix_engine/ev_epoll1_linux.cc), though nothing in the
pod runs gRPC (the wheel's mooncake_master and its libraries hold no gRPC C-core). The line came
from the test process's own copy: Pulumi's automation API had loaded grpcio there, and the pod was
started with a preexec_fn (die_with_parent). CPython 3.11's Modules/_posixsubprocess.c forks with
fork(2) when there is a preexec_fn (vfork(2) otherwise), so the C library runs every at-fork
handler in the child; gRPC's child handler (built into grpcio with GRPC_ENABLE_FORK_SUPPORT and
GRPC_POSIX_FORK_ALLOW_PTHREAD_ATFORK) restarts its poller thread there, then the child closes every
fd above 2 (close_fds) before exec, the poller's epoll fd with them, and the poller aborts if it
polls before the exec ends it: a race, lost about once in 20 spawns here with a gRPC server
running in the parent, more often on a loaded machine. The subprocess module's documentation says
as much: "The preexec_fn parameter is NOT SAFE to use in the presence of threads".

The tests stand an at-fork child handler that always aborts (glibc's __register_atfork, what
pthread_atfork(3) registers, with abort(3) as the handler) in for gRPC's, which aborts sometimes:
a process started in the child of a fork runs it, every time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from infra.spec import REPO_ROOT
from twin import process

# In a fresh interpreter: the handler cannot be taken back, and pytest itself forks.
ABORTING_FORK_HANDLER = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
assert libc.__register_atfork(None, None, ctypes.cast(libc.abort, ctypes.c_void_p), None) == 0
"""


def run_with_an_aborting_fork_handler(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ABORTING_FORK_HANDLER + textwrap.dedent(code), str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_the_handler_stands_in_for_grpcs_a_child_forked_to_run_python_aborts(tmp_path):
    """The condition itself, on today's Popen(preexec_fn=...): the child aborts before its exec."""
    done = run_with_an_aborting_fork_handler("""
        import functools, os, subprocess
        from twin.process import die_with_parent
        print(subprocess.Popen(["true"], preexec_fn=functools.partial(die_with_parent, os.getpid())).wait())
        """, tmp_path)
    assert done.stdout.split() == [str(-signal.SIGABRT)], done


def test_a_pods_process_is_started_with_no_fork_handler_of_the_twins_process(tmp_path):
    """twin/pods.py _spawn, which starts each pod's network holder and its program: the child
    runs nothing of its parent's between fork and exec, so the pod's program starts."""
    done = run_with_an_aborting_fork_handler("""
        import sys
        from pathlib import Path
        from twin.pods import _spawn
        log = Path(sys.argv[1]) / "pod.log"
        print(_spawn(["sh", "-c", "echo started"], log).wait(), log.read_text().strip())
        """, tmp_path)
    assert done.stdout.split() == ["0", "started"], done


def test_dying_with_parent_is_killed_with_its_parent(tmp_path):
    """prctl(2) PR_SET_PDEATHSIG, set by setpriv(1) --pdeathsig after the fork: a process started by
    one that is then SIGKILLed (no cleanup runs) is killed by the kernel."""
    middle = subprocess.Popen([sys.executable, "-c", "import subprocess\nfrom twin.process import dying_with_parent\n"
                               "print(subprocess.Popen(dying_with_parent(['sleep', '600'])).pid, flush=True)\n"
                               "import time\ntime.sleep(600)"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(middle.stdout.readline())
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait()
        deadline = time.monotonic() + 60
        while process.identity(child) is not None and _state(child) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.identity(child) is None or _state(child) == "Z", f"{child} outlived its parent"
    finally:
        middle.kill()
        middle.wait()


@pytest.mark.parametrize("parent, survives", [(None, True), (1, False)])
def test_dying_with_parent_whose_parent_is_already_gone_dies_at_once(parent, survives):
    """prctl(2): the parent-death signal is sent only for a death after it is set, so the man page
    advises comparing getppid() with the parent's pid right after; a process whose parent is not
    the one named (pid 1: as if it had died and the process been reparented) is killed there."""
    done = subprocess.run(process.dying_with_parent(["echo", "alive"], parent), capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == ((0, "alive") if survives else (-signal.SIGKILL, "")), done


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
