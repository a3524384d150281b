"""The cluster twin for the tests: started once per session (or the one `make twin-up` left
running, which is then left running), stopped at the end if this session started it.

Never skipped: a machine that cannot build or start the twin fails these tests, with the reason.
"""

from __future__ import annotations

import pytest

from twin import cluster

FIGURES: list[str] = []  # one line per stack, printed at the end of the run


@pytest.fixture(scope="session")
def twin():
    already = cluster.running()
    state = cluster.up(log=lambda line: print(line, flush=True))
    yield state
    if not already:
        cluster.down(log=lambda *_: None)


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("cluster twin: the rendered fleet on a real control plane")
        for line in FIGURES:
            terminalreporter.write_line(line)
