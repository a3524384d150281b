"""The whole test suite, as `make test` and CI run it: the cluster twin's tests and the rest side
by side, since the twin's leave most of the machine idle.

- `tests/twin` run in four pytest processes, each with a twin of its own (its own state folder,
  PDSTACK_TWIN_DIR; the built programs are shared): the tests that drive the real Pulumi engine
  (TWIN_GROUPS["pulumi-engine"], about a minute or more per `up` sequence), those that keep a fleet
  serving live traffic ("live-traffic": rollouts judged by a real Prometheus, alerts), those that
  load a fleet with many clients ("load": how it spreads and scales) and the rest of them (every other file in tests/twin). Tests in one process share its twin and run one after the
  other, since they reuse the same nodes. They spend most of their time waiting on the twin's
  controllers and the Pulumi engine: one run of all of them in one process kept 41% of this
  machine's two cores busy (/proc/stat sampled every 10 s over its 12 min), so twins side
  by side shorten the long pole. They start first, at normal priority: their waits are the long
  pole, and the twins' control planes must not be starved by the rest.
- The tests outside tests/twin that mostly wait (WAITING_FILES: aiperf runs against a stand-in
  that sleeps the latencies it was told) run beside them in a pytest of their own, at normal
  priority, on more workers than cores: at nice 10 on one worker they were 2075 s of a loaded
  run for about 200 s of CPU, the long pole of the rest.
- Everything else runs at the same time on every core (pytest-xdist, a test file to a worker,
  so a module's fixtures stay in one process; the files longest first by their last
  run's times, tests/file_order.py, so no long one runs alone at the end), at a lower priority
  (nice 10): it fills the time the twin leaves idle.

Each twin group's report, and the waiting tests', is written to .twin/tests-<group>.log and
printed whole when all have ended, so the reports do not interleave; the other tests' report is
printed as it runs and kept in .twin/tests-others.log. Last come what failed in every report (pytest's
FAILED and ERROR lines, and why a twin stopped, tests/twin/conftest.py), so that the end of the
output, which a CI page may show alone, says it. The exit status is 0 only if all passed (pytest's 5,
"no test ran", is a failure too).

    .venv/bin/python scripts/run_tests.py
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("PDSTACK_TWIN_DIR", REPO / ".twin"))

# The twin's test files that drive the real Pulumi engine, and those that keep a fleet serving live
# traffic for minutes (a rollout's stages bake and are judged on what a real Prometheus scraped);
# every other file in tests/twin runs in the "control-plane" group. Each group has a twin of its
# own: the live-traffic tests alone take about as long as the Pulumi-engine group, and in one
# group the two would be the whole run's long pole.
PULUMI_ENGINE_FILES = [
    "tests/twin/test_platform_on_twin.py",
    "tests/twin/test_pulumi_on_twin.py",
    "tests/twin/test_rollout_kill_on_twin.py",
    "tests/twin/test_prod_rollout_on_twin.py",
]
LIVE_TRAFFIC_FILES = [
    "tests/twin/test_live_rollout_on_twin.py",
    "tests/twin/test_metrics_on_twin.py",
]
# The tests that load a fleet with many clients and measure how it spreads and scales: about 15
# minutes together, which in the control-plane or live-traffic group would make that group the
# whole run's long pole (each was about 22 minutes without them).
LOAD_FILES = [
    "tests/twin/test_scaling_on_twin.py",  # dev serving for minutes while KEDA and the HPA scale it out and back
    "tests/twin/test_load_spread_on_twin.py",  # clients against two instances a role: who took what
]
TWIN_GROUPS = {  # group: (pytest arguments, the group's twin state folder)
    "control-plane": (["tests/twin", *[f"--ignore={f}" for f in PULUMI_ENGINE_FILES + LIVE_TRAFFIC_FILES + LOAD_FILES]],
                      STATE),
    "pulumi-engine": (PULUMI_ENGINE_FILES, STATE / "pulumi-engine"),
    "live-traffic": (LIVE_TRAFFIC_FILES, STATE / "live-traffic"),
    "load": (LOAD_FILES, STATE / "load"),
}
# Tests outside tests/twin that mostly wait: 15 tests of aiperf runs, about 200 s of CPU, were 2075 s
# at nice 10 on one worker of a loaded run. Four workers overlap their waits; at normal priority the
# stand-ins answer when their sleeps end rather than when nice 10 next gets a core.
WAITING_FILES = ["tests/test_validation.py"]
WAITING_TESTS = [sys.executable, "-m", "pytest", "-n", "4", "--dist", "load", *WAITING_FILES]
OTHER_TESTS = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-n", "auto", "--dist", "loadfile",
               *[f"--ignore={f}" for f in WAITING_FILES], "--ignore=tests/twin"]
WAITING = "waiting"  # the waiting tests' report: twin_log(WAITING)
OTHERS = "others"  # the other tests' report, printed as it runs and kept in twin_log(OTHERS)
TWIN_STOPPED = "the cluster twin stopped during the run"  # tests/twin/conftest.py's section


def twin_log(group: str) -> Path:
    return STATE / f"tests-{group}.log"


def main() -> int:
    STATE.mkdir(exist_ok=True)
    with contextlib.ExitStack() as logs:
        twins = {}
        for group, (args, state) in TWIN_GROUPS.items():
            log = logs.enter_context(open(twin_log(group), "w"))
            twins[group] = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=REPO, stdout=log,
                                            stderr=subprocess.STDOUT, env={**os.environ, "PDSTACK_TWIN_DIR": str(state)})
        waiting_log = logs.enter_context(open(twin_log(WAITING), "w"))
        waiting = subprocess.Popen(WAITING_TESTS, cwd=REPO, stdout=waiting_log, stderr=subprocess.STDOUT)
        others_log = logs.enter_context(open(twin_log(OTHERS), "wb"))
        others = subprocess.Popen(OTHER_TESTS, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        copying = threading.Thread(target=_tee, args=(others.stdout, others_log), daemon=True)
        copying.start()
        # A Ctrl-C reaches all of them (one process group): each pytest tears its fixtures down
        # (a twin group's stops the twin it started) and is waited for here, never killed.
        others_code = _wait(others)
        copying.join()
        beside = {f"{' '.join(WAITING_FILES)} (waiting)": (WAITING, _wait(waiting)),
                  **{f"tests/twin {group}": (group, _wait(proc)) for group, proc in twins.items()}}
    reports = {group: twin_log(group).read_text(errors="replace") for group in [OTHERS, *(g for g, _ in beside.values())]}
    for title, (group, _) in beside.items():
        print(f"\n===== {title} (run beside the others; its report is also in "
              f"{twin_log(group).relative_to(REPO) if twin_log(group).is_relative_to(REPO) else twin_log(group)}) =====",
              flush=True)
        sys.stdout.write(reports[group])
    failures = {title: failed_lines(reports[group])
                for title, group in [("the other tests", OTHERS), *((t, g) for t, (g, _) in beside.items())]}
    if any(failures.values()):
        print("\n===== what failed, from the reports above =====")
        for title, lines in failures.items():
            for line in lines:
                print(f"{title}: {line}")
    print(f"\nthe other tests: exit {others_code}; "
          + "; ".join(f"{title}: exit {code}" for title, (_, code) in beside.items()), flush=True)
    return 0 if others_code == 0 and all(code == 0 for _, code in beside.values()) else 1


def failed_lines(report: str) -> list[str]:
    """pytest's FAILED and ERROR lines of a report (its short test summary), and the reason under
    the twin-stopped section, if the report has one."""
    lines = report.splitlines()
    found = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    for i, line in enumerate(lines):
        if line.startswith("=") and TWIN_STOPPED in line:
            reason = itertools.takewhile(lambda after: not after.startswith("="), lines[i + 1:])
            found.append(f"{TWIN_STOPPED}: " + "\n".join(reason).strip())
            break
    return found


def _tee(source, log) -> None:
    """A child's output to this process's stdout, as it comes, and to its log."""
    for chunk in iter(lambda: source.read1(65536), b""):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        log.write(chunk)
    log.flush()


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the Ctrl-C the children got too: wait for their teardown
            continue


if __name__ == "__main__":
    sys.exit(main())
