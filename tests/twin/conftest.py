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


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("cluster twin: the rendered fleet on a real control plane")
        for line in FIGURES:
            terminalreporter.write_line(line)
