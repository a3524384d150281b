"""The cluster twin for the tests: started once per session (or the one `make twin-up` left
running, which is then left running), stopped at the end if this session started it.

Never skipped: a machine that cannot build or start the twin fails these tests, with the reason.
"""

from __future__ import annotations

import pytest

from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from twin import cluster
from twin.api import kubectl

FIGURES: list[str] = []  # one line per stack, printed at the end of the run
TWIN_STOPPED = "the cluster twin stopped during the run"  # the section's title, which scripts/run_tests.py looks for
_twin_stopped: list[str] = []  # why, as its supervisor recorded it (once)


@pytest.fixture(scope="session")
def twin():
    already = cluster.running()
    state = cluster.up(log=lambda line: print(line, flush=True))
    yield state
    if not already:
        cluster.down(log=lambda *_: None)


@pytest.fixture
def dev_nodes(twin):
    """dev's spec, with the kwok nodes its pools would hold on the twin (removed afterwards)."""
    from twin import fleet
    from twin.nodes import TWIN_LABEL, stack_nodes

    from twin.engine import stand_in_pins

    spec = stand_in_pins(load_spec(stack_spec_path("dev")))  # deployable: the policy pack refuses placeholders
    assert fleet.apply_each_pass(stack_nodes(spec)).rejected == {}
    yield spec
    kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed because the twin stopped says so, with why. The twin's supervisor stops
    every component when one exits (twin/cluster.py Supervisor.run) and records which, with its
    exit status and the end of its log; the tests after it fail on "connection refused" alone,
    which says nothing of the cause."""
    report = yield
    if report.failed and cluster.read_state() and not cluster.running():
        why = cluster.not_running()  # a component's exit, or a supervisor that is gone (a signal)
        report.sections.append((TWIN_STOPPED, why))
        if not _twin_stopped:
            _twin_stopped.append(why)
    return report


def pytest_terminal_summary(terminalreporter):
    if _twin_stopped:
        terminalreporter.section(TWIN_STOPPED)
        terminalreporter.write_line(_twin_stopped[0])
    if FIGURES:
        terminalreporter.section("cluster twin: the rendered fleet on a real control plane")
        for line in FIGURES:
            terminalreporter.write_line(line)
