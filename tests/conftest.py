"""Shared fixtures. One resource-collecting fixture: the real program under Pulumi mocks."""

from __future__ import annotations

import copy
import functools

import pytest
import yaml

from infra.offline import OfflineRun, run_spec
from infra.spec import StackSpec, load_spec, parse_spec, stack_spec_path


@functools.cache
def _stack_data(stack: str) -> dict:
    return yaml.safe_load(stack_spec_path(stack).read_text())


def stack_data(stack: str) -> dict:
    """A fresh, mutable copy of a shipped stack's spec mapping."""
    return copy.deepcopy(_stack_data(stack))


@functools.cache
def shipped_run(stack: str) -> OfflineRun:
    return run_spec(load_spec(stack_spec_path(stack)))


@pytest.fixture(params=["dev", "prod"])
def stack_name(request) -> str:
    return request.param


@pytest.fixture
def spec(stack_name) -> StackSpec:
    return load_spec(stack_spec_path(stack_name))


@pytest.fixture
def run(stack_name) -> OfflineRun:
    """The shipped stack's program run once under mocks (cached: runs are deterministic)."""
    return shipped_run(stack_name)


@pytest.fixture
def colocated_spec() -> StackSpec:
    """dev hardware without a supernode, serving both phases from one pool."""
    data = stack_data("dev")
    dep = data["deployment"]
    dep["mode"] = "colocated"
    dep["colocated"] = {"instances": 2, "expert_parallel": 8, "redundant_experts": 0}
    del dep["prefill"], dep["decode"]
    return parse_spec(data)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    import os

    from tests.servers import moto_s3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    with moto_s3() as url:
        yield url
