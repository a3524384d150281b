"""The real Pulumi engine for the tests: twin/engine.py's project (the CLI and the Kubernetes provider
that `make engine` builds, a local file backend, a throwaway copy of the project in the test's
folder), skipped where the engine is not built and its environment set through pytest's
monkeypatch. What is real and what stands in: twin/engine.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from twin import engine as pulumi_engine
from twin.engine import EngineProject, deployable_spec_file, program_stack, serving_program

# twin/engine.py's, under the names the tests import them by
__all__ = ["EngineProject", "deployable_spec_file", "engine_project", "program_stack", "require_engine", "serving_program"]


def require_engine() -> None:
    """Skip where `make engine` has not run; in CI (CI=true) a missing build fails instead."""
    message = pulumi_engine.missing_engine()
    if message:
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def engine_project(tmp_path: Path, monkeypatch, stack: str = "dev", twin: Path | None = None,
                   platform_stand_in_stack: bool = True, engine: str | None = None) -> EngineProject:
    """Environment and project for the real engine (twin/engine.py engine_project), its environment
    set for the test. `platform_stand_in_stack`: make the stand-in platform stack the serving stack reads."""
    require_engine()
    project = pulumi_engine.engine_project(tmp_path, stack, twin, engine)
    for name, value in project.environment.items():
        monkeypatch.setenv(name, value)
    if platform_stand_in_stack:
        pulumi_engine.platform_stand_in(project)
    return project
