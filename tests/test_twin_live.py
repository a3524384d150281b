"""twin/live.py without a twin: reading the client's answers, and what its scenario (live_dev, which
scripts/bench_rollback.py --twin runs outside pytest) needs loaded."""

from __future__ import annotations

import ast
import subprocess
import sys

from infra.spec import REPO_ROOT
from twin.live import Answer, share_back, shares, track_of


def answer(at: float, by: int, ok: bool = True) -> Answer:
    return Answer(at, at + 1, by, by if ok else None, ok)


def test_the_share_is_back_from_the_first_request_after_the_last_one_another_track_answered():
    answers = [answer(0, 2), answer(1, 2), answer(2, 1), answer(3, 2), answer(4, 1), answer(5, 1, ok=False),
               answer(6, 1)]
    assert share_back(answers, 1, since=0.5) == 4 - 0.5  # r2 answered the request sent at 3
    assert share_back(answers, 2, since=0) is None  # the last answer is r1's: not back on r2
    assert share_back([answer(1, 1), answer(2, 1)], 1, since=0) == 1  # already there
    assert shares(answers) == {1: 0.5, 2: 0.5}  # the failed request counts for no track


def test_a_namespace_is_a_track_of_its_environment_or_nothing():
    assert [track_of(n, "pdstack-dev") for n in ("pdstack-dev", "pdstack-dev-r12", "pdstack-dev-research", "other")] \
        == [0, 12, None, None]


def test_the_live_scenario_and_the_twin_bench_load_no_test_module_and_no_pytest():
    """scripts/bench_rollback.py --twin is a script, not a test: it runs twin/live.py's live_dev, which
    must not need pytest (its MonkeyPatch) or a module of tests/ (whose conftest and fixtures are a
    test session's). Every import statement of the bench counts, lazy ones too, and a fresh
    interpreter that imports twin.live has loaded none of them."""
    tree = ast.parse((REPO_ROOT / "scripts" / "bench_rollback.py").read_text())
    named = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert [m for m in named if m == "pytest" or m.split(".")[0] in ("tests", "_pytest")] == []
    loaded = subprocess.run([sys.executable, "-c", "import sys, twin.live; print(' '.join(sys.modules))"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert [m for m in loaded if m.split(".")[0] in ("tests", "pytest", "_pytest")] == []
