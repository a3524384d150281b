"""Test files longest first under pytest-xdist's --dist loadfile (tests/file_order.py): what
`make test` runs outside tests/twin. xdist 3.8.0 orders its queue of files by their number of
tests (xdist/scheduler/loadscope.py, LoadScopeScheduling.schedule, --loadscope-reorder), so a
long file of few tests ran alone at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from infra.spec import REPO_ROOT
from tests.file_order import longest_first

# Three files: "many" has the most tests, "slow" the longest time last run, "new" no figure.
FILES = {"test_many.py": 3, "test_slow.py": 1, "test_new.py": 2}
BY_COUNT = ["test_many.py", "test_new.py", "test_slow.py"]


def test_files_go_longest_first_then_untimed_by_their_number_of_tests():
    nodeids = [f"{f}::test_{i}" for f, n in FILES.items() for i in range(n)]
    seconds = {"test_slow.py": 140.0, "test_many.py": 3.0}
    assert longest_first(nodeids, seconds) == [
        "test_slow.py::test_0", "test_many.py::test_0", "test_many.py::test_1", "test_many.py::test_2",
        "test_new.py::test_0", "test_new.py::test_1"]
    assert longest_first(nodeids, {}) == [  # no figures: by number of tests, as xdist does
        "test_many.py::test_0", "test_many.py::test_1", "test_many.py::test_2", "test_new.py::test_0",
        "test_new.py::test_1", "test_slow.py::test_0"]


def _project(root: Path) -> None:
    log = root / "ran.txt"
    (root / "pytest.ini").write_text("[pytest]\n")
    for name, count in FILES.items():
        (root / name).write_text("".join(
            f"def test_{i}():\n    open({str(log)!r}, 'a').write({name!r} + '\\n')\n" for i in range(count)))


def _run(root: Path, times: Path) -> list[str]:
    """The files in the order one worker ran them: it runs the controller's queue in order."""
    log = root / "ran.txt"
    log.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadfile", "-p", "tests.file_order",
                           "-q", "-p", "no:cacheprovider"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PDSTACK_TEST_TIMES": str(times)})
    assert done.returncode == 0, done.stdout + done.stderr
    return list(dict.fromkeys(log.read_text().split()))


def test_a_distributed_run_records_each_files_time_and_the_next_runs_the_longest_first(tmp_path):
    (tmp_path / "project").mkdir()
    _project(tmp_path / "project")
    times = tmp_path / "machine-cache"
    assert _run(tmp_path / "project", times) == BY_COUNT  # a machine's first run
    recorded = json.loads((times / "file-seconds.json").read_text())
    assert set(recorded) == set(FILES) and all(s >= 0 for s in recorded.values())

    # As a run where test_slow.py took longest left them; an old figure of a file not run stays.
    (times / "file-seconds.json").write_text(json.dumps({"test_slow.py": 140.0, "test_many.py": 3.0, "test_gone.py": 9}))
    assert _run(tmp_path / "project", times) == ["test_slow.py", "test_many.py", "test_new.py"]
    assert set(json.loads((times / "file-seconds.json").read_text())) == {*FILES, "test_gone.py"}

    (times / "file-seconds.json").write_text("{not json")  # a damaged file is no figures, and is rewritten
    assert _run(tmp_path / "project", times) == BY_COUNT
    assert set(json.loads((times / "file-seconds.json").read_text())) == set(FILES)
