"""The end of `make test`'s output says what failed in every report (scripts/run_tests.py), since a
CI page may show only the end: the twin groups' reports are printed whole before it, and a
failure in the first of them is otherwise thousands of lines up."""

from __future__ import annotations

import runpy
import subprocess
import sys

from infra.spec import REPO_ROOT

RUNNER = runpy.run_path(str(REPO_ROOT / "scripts/run_tests.py"))

FAILING_FILE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup failed")

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_errors(broken):
    pass
'''

# What tests/twin/conftest.py prints when the twin stopped under a run (its pytest_terminal_summary).
STOPPED_CONFTEST = '''
def pytest_terminal_summary(terminalreporter):
    terminalreporter.section(%r)
    terminalreporter.write_line("twin: not running (last recorded: failed: kubelet exited with -9)")
'''


def test_the_failed_and_errored_tests_of_a_real_pytest_report_and_why_the_twin_stopped(tmp_path):
    """The report is pytest's own (pytest -p no:cacheprovider on a file with one test passing, one
    failing and one erroring in its fixture), its short summary as pytest 9 prints it by default
    (-r fE), with the section tests/twin/conftest.py adds when the twin stopped."""
    import tests.twin.conftest as twin_conftest

    assert RUNNER["TWIN_STOPPED"] == twin_conftest.TWIN_STOPPED
    (tmp_path / "test_some.py").write_text(FAILING_FILE)
    (tmp_path / "conftest.py").write_text(STOPPED_CONFTEST % RUNNER["TWIN_STOPPED"])
    report = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_some.py"],
                            cwd=tmp_path, capture_output=True, text=True).stdout
    lines = RUNNER["failed_lines"](report)
    assert [line.split(" - ")[0] for line in lines[:2]] == ["FAILED test_some.py::test_fails",
                                                              "ERROR test_some.py::test_errors"], report
    assert lines[2] == (f"{RUNNER['TWIN_STOPPED']}: twin: not running (last recorded: failed: kubelet exited "
                        "with -9)"), report
    assert len(lines) == 3


def test_a_report_with_nothing_failed_gives_no_line(tmp_path):
    (tmp_path / "test_fine.py").write_text("def test_passes():\n    pass\n")
    report = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_fine.py"],
                            cwd=tmp_path, capture_output=True, text=True).stdout
    assert "1 passed" in report and RUNNER["failed_lines"](report) == []
