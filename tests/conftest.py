"""Shared fixtures. One resource-collecting fixture: the real program under Pulumi mocks."""

from __future__ import annotations

import copy
import functools
import importlib
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from infra.offline import run_spec
from infra.program import load_any_spec
from infra.recording import OfflineRun
from infra.spec import SpecError, StackSpec, stack_spec_path
from infra.spec_checks import load_spec, parse_spec
from tests.servers import require_binary, sshd
from tests.ssh_hosts import write_stubs

pytest_plugins = ["tests.file_order"]  # test files longest first under pytest-xdist


def script_modules(*names: str) -> tuple:
    """Modules of scripts/ by name: it is no package and its scripts import their neighbours, so it is on
    sys.path while they load."""
    folder = str(Path(__file__).resolve().parent.parent / "scripts")
    sys.path.insert(0, folder)
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(folder)


@functools.cache
def _stack_data(stack: str) -> dict:
    return yaml.safe_load(stack_spec_path(stack).read_text())


def problems_of(data) -> list[str]:
    """The SpecError lines a spec mapping is rejected with (fails if it is accepted)."""
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    return caught.value.problems


def stack_data(stack: str) -> dict:
    """A fresh, mutable copy of a shipped stack's spec mapping."""
    return copy.deepcopy(_stack_data(stack))


def vllm_with_epp(data: dict) -> dict:
    """A spec switched to vLLM, with the balancer and the KV connector it can use (llm-d's
    endpoint picker; NIXL, which llm-d's routing sidecar drives)."""
    data["engine"].update(kind="vllm", version="0.33.0", kv_transfer="nixl")
    data["deployment"]["load_balancer"]["implementation"] = "gateway_epp"
    return data


@functools.cache
def shipped_run(stack: str) -> OfflineRun:
    """A shipped stack's program (serving or platform) run once per test process under mocks, for
    every test module that reads it: runs are deterministic, and a platform stack's takes seconds
    (the SDK serializing its charts' values and CRDs), which each module repeated."""
    return run_spec(load_any_spec(stack_spec_path(stack)))


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
    dep["colocated"] = {"instances": 1, "expert_parallel": 8, "redundant_experts": 0}
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


# --- GPU hosts over SSH (preflight, cache hygiene) ----------------------------------------------


@pytest.fixture(scope="session")
def client_key(tmp_path_factory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("client")
    key = folder / "id_ed25519"
    subprocess.run([require_binary("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key, (folder / "id_ed25519.pub").read_text().strip()


@pytest.fixture(scope="session")
def hosts(tmp_path_factory, client_key):
    """Real sshd processes: a healthy node, one with the wrong driver, one whose nvidia-smi hangs, one
    without the NVIDIA Container Toolkit."""
    root = tmp_path_factory.mktemp("hosts")
    stubs = {
        "good": write_stubs(root / "good-bin"),
        "old-driver": write_stubs(root / "old-bin", driver="550.54.15"),
        "hung": write_stubs(root / "hung-bin", hang=True),
        "no-toolkit": write_stubs(root / "bare-bin", toolkit=None),
    }
    with ExitStack() as stack:
        started = {name: stack.enter_context(sshd(root / name, [str(path)], client_key[1])) for name, path in stubs.items()}
        yield started
