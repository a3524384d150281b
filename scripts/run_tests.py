"""The whole test suite, as `make test` and CI run it: the cluster twin's tests and the rest side
by side, since the twin's leave most of the machine idle.

- `tests/twin` share one twin, so they run in one pytest process. They spend most of their time
  waiting on the twin's controllers and the Pulumi engine: one run of them alone kept 41% of
  this machine's two cores busy (/proc/stat sampled every 10 s over its 12 min). They start
  first, at normal priority: their waits are the long pole, and the twin's control plane must
  not be starved by the rest.
- Everything else runs at the same time on every core (pytest-xdist, a test file to a worker,
  so a module's fixtures stay in one process), at a lower priority (nice 10): it fills the
  time the twin leaves idle.

The twin's report is written to .twin/tests.log and printed whole when both have ended, so the
two reports do not interleave. The exit status is 0 only if both passed (pytest's 5, "no test
ran", is a failure too).

    .venv/bin/python scripts/run_tests.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TWIN_LOG = REPO / ".twin" / "tests.log"

TWIN_TESTS = [sys.executable, "-m", "pytest", "tests/twin"]
OTHER_TESTS = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-n", "auto", "--dist", "loadfile",
               "--ignore=tests/twin"]


def main() -> int:
    TWIN_LOG.parent.mkdir(exist_ok=True)
    with open(TWIN_LOG, "w") as log:
        twin = subprocess.Popen(TWIN_TESTS, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        others = subprocess.Popen(OTHER_TESTS, cwd=REPO)
        # A Ctrl-C reaches all three (one process group): each pytest tears its fixtures down
        # (the twin's stops the twin it started) and is waited for here, never killed.
        others_code, twin_code = _wait(others), _wait(twin)
    print(f"\n===== tests/twin (run beside the others; its report is also in {TWIN_LOG.relative_to(REPO)}) =====",
          flush=True)
    sys.stdout.write(TWIN_LOG.read_text())
    print(f"\ntests outside tests/twin: exit {others_code}; tests/twin: exit {twin_code}", flush=True)
    return 0 if others_code == 0 and twin_code == 0 else 1


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the Ctrl-C the children got too: wait for their teardown
            continue


if __name__ == "__main__":
    sys.exit(main())
