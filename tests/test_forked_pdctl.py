"""The pdctl fork server (tests/forked_pdctl.py) and what it forks die with the test run that
started them, even one killed by SIGKILL, which runs no cleanup of its own."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A test run in miniature: it starts the server, has it fork a pdctl process that blocks (it reads
# its spec from a FIFO no one writes), says both pids, then waits to be killed.
TEST_RUN = """
import sys, time
from tests.forked_pdctl import PdctlServer
server = PdctlServer().__enter__()
pdctl = server.start(["validate", sys.argv[1]], env={"PATH": "/usr/bin:/bin"}, cwd=sys.argv[2])
print(server._proc.pid, pdctl.pid, flush=True)
time.sleep(600)
"""


def _exits(pidfd: int) -> bool:
    """Whether the process exits within a minute (a pidfd is readable once it has; pidfd_open(2))."""
    return bool(select.select([pidfd], [], [], 60)[0])


def test_the_fork_server_and_its_pdctl_processes_die_with_a_killed_test_run(tmp_path):
    """prctl(2), PR_SET_PDEATHSIG: the server asks for SIGKILL when its parent dies, and each
    monitor and pdctl process when theirs does. Before, the server and the blocked pdctl process
    were left running, reparented, after the test run was killed."""
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    run = subprocess.Popen([sys.executable, "-c", TEST_RUN, str(fifo), str(tmp_path)], cwd=REPO,
                           stdout=subprocess.PIPE, text=True)
    pidfds = []
    try:
        pids = [int(p) for p in run.stdout.readline().split()]
        assert len(pids) == 2, f"the miniature test run did not start its server and pdctl: {pids}"
        pidfds = [os.pidfd_open(pid) for pid in pids]
        server, pdctl = pidfds
        assert not select.select([pdctl], [], [], 0)[0], "the pdctl process should be blocked on its FIFO"
        run.kill()
        run.wait()
        assert _exits(server), "the fork server outlived the test run that started it"
        assert _exits(pdctl), "a forked pdctl process outlived the test run that started it"
    finally:
        run.kill()
        run.wait()
        run.stdout.close()
        for pidfd in pidfds:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(pidfd)
