"""pyflakes (pinned in pyproject's test extra) over every Python file of the project: unused
imports, undefined names and shadowed definitions fail the suite instead of piling up."""

from __future__ import annotations

import subprocess
import sys

from infra.spec import REPO_ROOT


def test_pyflakes_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "pyflakes", "infra", "tests", "scripts", "stacks", "policy", "twin", "engine"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
