"""Test files longest first, by their last run's times, for pytest-xdist's `--dist loadfile`
(scripts/run_tests.py). xdist hands a worker a whole file at a time, in queue order, and orders
the queue by each file's number of tests: the fault matrix (2 tests, over 2 minutes) was queued
among the last and ran alone at the end while the other worker sat idle. Longest first (the
classic longest-processing-time rule) needs each file's time:

- the controller sums each file's setup, call and teardown times at the end of a distributed run
  into the machine's cache (scripts/machine_cache.py: `test-times/file-seconds.json`, outside the
  checkout, so a fresh clone on a machine that ran the tests before finds them, as it finds the
  built binaries; a run of some files updates theirs only);
- it hands those figures to each worker, which orders its collection by them: every worker must
  collect the same order, so none reads the file itself, which a run beside it may be rewriting;
- a file without a figure (a new file, a machine's first run) comes after the timed ones, by its
  number of tests, as xdist orders them (whose own reordering is switched off, since it would
  undo this).

Registered by tests/conftest.py; imports nothing of pdstack's package, so a test can run it on its own.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from scripts.machine_cache import cache_folder

WORKER_INPUT = "pdstack_file_seconds"


def times_file() -> Path:
    return cache_folder("test-times", "PDSTACK_TEST_TIMES") / "file-seconds.json"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(nodeids: list[str], seconds: dict[str, float]) -> list[str]:
    """`nodeids` with whole files reordered: the longest last time first, then the untimed ones by
    their number of tests, most first; a file's own tests keep their order."""
    count = Counter(file_of(n) for n in nodeids)
    return sorted(nodeids, key=lambda n: (-seconds.get(file_of(n), 0.0), -count[file_of(n)]))


class FileSeconds:
    """The controller's side: each file's time, recorded, and handed to the workers."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @staticmethod
    def recorded() -> dict[str, float]:
        try:
            figures = json.loads(times_file().read_text())
        except (OSError, ValueError):  # none yet, or not JSON: the files go by their number of tests
            return {}
        return {f: float(s) for f, s in figures.items() if isinstance(s, (int, float))} if isinstance(figures, dict) else {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        node.workerinput[WORKER_INPUT] = self.recorded()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        where = file_of(report.nodeid)
        self.seconds[where] = self.seconds.get(where, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        path = times_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({**self.recorded(), **{f: round(s, 2) for f, s in self.seconds.items()}},
                                      indent=1, sort_keys=True))
        partial.replace(path)  # whole or not at all: a run beside this one reads either figures


def pytest_configure(config: pytest.Config) -> None:
    distributed = bool(config.getoption("tx", None)) and not hasattr(config, "workerinput")  # as xdist decides
    if distributed and config.getoption("dist") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False  # the workers order the files (pytest_collection_modifyitems)
        config.pluginmanager.register(FileSeconds(), "pdstack-file-seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = getattr(config, "workerinput", {}).get(WORKER_INPUT)
    if seconds is None:  # not a worker of a run FileSeconds orders
        return
    position = {n: i for i, n in enumerate(longest_first([item.nodeid for item in items], seconds))}
    items.sort(key=lambda item: position[item.nodeid])
