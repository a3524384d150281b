"""The EFA engine image's NIXL (images/engine-efa.Dockerfile) against the pinned engines' own wheels
(issue #37 item 1): the recipe built NIXL 0.7.1, which SGLang 0.5.23's connector cannot import, so
every prefill and decode scheduler raised at start.

What each engine needs of NIXL is read from its wheel on PyPI (scripts/pinned_wheels.py, checked
against the sha256 infra/render/pinned records), never transcribed:
- its METADATA's Requires-Dist on nixl: neither sglang 0.5.23 nor vllm 0.33.0 declares one, not
  even as an extra (vLLM's requirements/kv_connectors.txt, `nixl==1.5.0`, is not in the wheel);
- the minimum its connector enforces: vllm 0.33.0
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py calls
  `check_nixl_version("1.5.0")` (vllm/distributed/nixl_utils.py raises below it);
- the names its connector imports from `nixl._api` (sglang 0.5.23
  sglang/srt/disaggregation/nixl/conn.py: nixl_agent, nixl_agent_config, nixl_thread_sync_t, the
  last first in NIXL 1.1.0) and each `nixl_agent_config(...)` call it makes (SGLang passes
  `sync_mode=`; vLLM `capture_telemetry=` and `backends=`).

The recipe's Python layer is the PyPI meta package `nixl==<ARG NIXL_VERSION>` (the import name
`nixl`) and a CUDA backend at that version (the recipe builds it from source; PyPI's nixl-cu12 and
nixl-cu13 stand for it here, and nixl 1.5.0's METADATA pins both): the real wheels are downloaded
and installed into a scratch folder, which is put on the path of the engines' own CPU virtualenv
(scripts/extract_engine_flags.py engine_venv(): the pinned engine wheels, torch 2.14.1; NIXL 0.7.1's
nixl._api imports torch). `nixl._api` imports there without a GPU or CUDA driver (NIXL's loader
loads the CUDA backend torch was built for), so each engine's `nixl_agent_config(...)` calls are
evaluated as written and an agent is made with each config.
"""

from __future__ import annotations

import ast
import ctypes.util
import functools
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from infra.render.metrics import catalogue
from infra.spec import ENGINE_IMAGE_RECIPE, REPO_ROOT, STACKS_DIR
from infra.spec_checks import load_spec
from tests.conftest import script_modules

RECIPE = REPO_ROOT / ENGINE_IMAGE_RECIPE

# Each engine's NIXL KV connector, the one `kv_transfer: nixl` (and vLLM's NixlConnector) selects:
# the files of its wheel that make the agent.
KV_CONNECTOR_FILES = {
    "sglang": ("sglang/srt/disaggregation/nixl/",),
    "vllm": ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/", "vllm/distributed/nixl_utils.py"),
}
# The recipe's NIXL Python layer: PyPI's meta package and its CUDA backends, at one version.
NIXL_DISTS = ("nixl", "nixl-cu12", "nixl-cu13")


def _scripts():
    return script_modules("pinned_wheels", "extract_engine_flags")


def recipe_args(text: str) -> dict[str, str]:
    """The recipe's build arguments with a default (`ARG NAME=value`)."""
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def recipe_nixl_version() -> str:
    args = recipe_args(RECIPE.read_text())
    assert "NIXL_VERSION" in args, f"{ENGINE_IMAGE_RECIPE}: no `ARG NIXL_VERSION=<version>` (the NIXL it installs)"
    return args["NIXL_VERSION"]


@functools.cache
def engine_wheel(engine: str) -> Path:
    pinned = catalogue(engine)
    path = _scripts()[0].pinned_wheel(engine, pinned["version"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pinned["sha256"], f"{path} is not the pinned wheel"
    return path


@functools.cache
def nixl_needs(wheel: Path, engine: str) -> dict:
    """What the engine's wheel requires of NIXL: a specifier (Requires-Dist and the connector's
    check_nixl_version calls), the names its connector imports from nixl._api, and the source of
    each nixl_agent_config(...) call its connector makes."""
    metadata = _scripts()[0].wheel_metadata(wheel)
    specifier = SpecifierSet()
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name in NIXL_DISTS:
            specifier &= req.specifier
    names: set[str] = set()
    calls: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if not (member.endswith(".py") and member.startswith(KV_CONNECTOR_FILES[engine])):
                continue
            source = z.read(member).decode()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and node.module == "nixl._api":
                    names |= {alias.name for alias in node.names}
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    if node.func.id == "check_nixl_version" and isinstance(node.args[0], ast.Constant):
                        specifier &= SpecifierSet(f">={node.args[0].value}")
                    elif node.func.id == "nixl_agent_config":
                        calls.append(ast.get_source_segment(source, node))
    assert calls, f"{wheel.name}: no nixl_agent_config(...) call in {KV_CONNECTOR_FILES[engine]}; update this test"
    return {"specifier": specifier, "names": sorted(names), "calls": calls}


def nixl_backends_in_specs(engine: str) -> list[str]:
    """The NIXL backends the committed stacks say the engine's image carries (images.engines)."""
    backends = []
    for path in sorted(STACKS_DIR.glob("*.yaml")):
        if path.name.startswith("platform-"):
            continue
        image = load_spec(path).images.engines.get(engine)
        backends += [b for b in (image.nixl_backends if image else []) if b not in backends]
    return backends


# Run in a child interpreter with the recipe's NIXL on its path: evaluates each engine's
# nixl_agent_config(...) call as written (the names it uses besides nixl._api's given values the
# engine would have) and makes an agent with each config, as the engine does. Where that fails
# (a backend's plugin whose library this machine lacks), the agent is made without backends and
# each backend created alone, and the ones that fail are reported with their error.
CONSTRUCT = """
import importlib.metadata, json, sys, types
import nixl._api as api

asked = json.load(sys.stdin)
missing = [n for n in asked["names"] if not hasattr(api, n)]
made = []
if not missing:
    scope = dict(vars(api), num_threads=8, self=types.SimpleNamespace(nixl_backends=asked["backends"]))
    for call in asked["calls"]:
        config = eval(call, scope)
        name = f"check-{len(made)}"
        failed = {}
        try:
            agent = api.nixl_agent(name, config)
        except Exception:
            backends, config.backends = config.backends, []
            agent = api.nixl_agent(name + "-alone", config)
            for backend in backends:
                try:
                    agent.create_backend(backend)
                except Exception as exc:
                    failed[backend] = type(exc).__name__
        made.append({"plugins": sorted(agent.get_plugin_list()), "failed": failed})
print(json.dumps({"version": importlib.metadata.version("nixl"), "missing": missing, "made": made}))
"""


@pytest.fixture(scope="module")
def nixl_installed(tmp_path_factory) -> dict:
    """The recipe's NIXL Python layer from PyPI, unpacked into a scratch folder as pip installs it."""
    version = recipe_nixl_version()
    folder = tmp_path_factory.mktemp("nixl")
    wheels = [_scripts()[0].pinned_wheel(dist, version) for dist in NIXL_DISTS]
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(folder)
    return {"version": version, "folder": folder, "wheels": wheels}


@pytest.mark.parametrize("engine", sorted(KV_CONNECTOR_FILES))
def test_the_recipes_nixl_is_one_each_engine_accepts(engine):
    """The NIXL the recipe installs satisfies what the engine's wheel requires (its Requires-Dist
    and its connector's own check_nixl_version minimum: vllm 0.33.0 refuses NIXL below 1.5.0)."""
    needs = nixl_needs(engine_wheel(engine), engine)
    version = recipe_nixl_version()
    assert Version(version) in needs["specifier"], (
        f"{ENGINE_IMAGE_RECIPE}: ARG NIXL_VERSION={version}, but {engine} {catalogue(engine)['version']} "
        f"requires nixl{needs['specifier']}")


@pytest.mark.parametrize("engine", sorted(KV_CONNECTOR_FILES))
def test_the_recipes_nixl_resolves_with_the_engine_wheel(engine, nixl_installed):
    """Every requirement of the recipe's NIXL wheels (nixl 1.5.0 pins nixl-cu12 and nixl-cu13 at its
    version; they require torch and numpy) admits the version the engine wheel or the other NIXL
    wheels pin, and each wheel's Requires-Python admits this interpreter (the one pip chose the
    wheels for)."""
    scripts = _scripts()[0]
    engine_pins = {}
    for line in scripts.wheel_metadata(engine_wheel(engine)).get_all("Requires-Dist") or []:
        req = Requirement(line)
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if pins and req.marker is None:
            engine_pins[req.name.lower()] = pins[0]
    engine_pins |= {dist: nixl_installed["version"] for dist in NIXL_DISTS}
    python = ".".join(map(str, sys.version_info[:3]))
    names = set()
    for wheel in nixl_installed["wheels"]:
        metadata = scripts.wheel_metadata(wheel)
        names.add(metadata["Name"])
        assert metadata["Version"] == nixl_installed["version"], wheel.name
        assert python in SpecifierSet(metadata.get("Requires-Python") or ""), f"{wheel.name}: Requires-Python"
        for line in metadata.get_all("Requires-Dist") or []:
            req = Requirement(line)
            pinned = engine_pins.get(req.name.lower())
            if pinned and (req.marker is None or req.marker.evaluate({"extra": ""})):
                assert req.specifier.contains(pinned, prereleases=True), (
                    f"{wheel.name} requires {req}, {engine} pins {req.name}=={pinned}")
    assert names == set(NIXL_DISTS), names


@pytest.mark.parametrize("engine", sorted(KV_CONNECTOR_FILES))
def test_each_connector_imports_the_recipes_nixl_and_makes_its_agent_as_the_engine_does(engine, nixl_installed):
    """SGLang 0.5.23 (sglang/srt/disaggregation/nixl/conn.py) imports nixl_thread_sync_t from
    nixl._api and calls nixl_agent_config(backends=[], num_threads=..., sync_mode=
    nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT); vLLM 0.33.0 (kv_connector/v1/nixl/base_worker.py)
    calls it with backends= (the spec's nixl_backends) and capture_telemetry=True. Each call is
    evaluated as written against the recipe's NIXL, and an agent is made with each config. NIXL
    0.7.1 has neither nixl_thread_sync_t nor sync_mode=."""
    needs = nixl_needs(engine_wheel(engine), engine)
    asked = {"names": needs["names"], "calls": needs["calls"], "backends": nixl_backends_in_specs(engine)}
    python = _scripts()[1].engine_venv() / "bin" / "python"
    done = subprocess.run([str(python), "-c", CONSTRUCT], input=json.dumps(asked), capture_output=True, text=True,
                          cwd=nixl_installed["folder"], env={"PYTHONPATH": str(nixl_installed["folder"]),
                                                             "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, f"{engine}'s connector against nixl {nixl_installed['version']}: {done.stderr[-2000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == nixl_installed["version"]
    assert not result["missing"], f"nixl {result['version']}'s nixl._api lacks {result['missing']}, which {engine} imports"
    assert len(result["made"]) == len(needs["calls"])
    for made in result["made"]:
        assert set(asked["backends"]) <= set(made["plugins"]), (asked["backends"], made["plugins"])
        # The one backend this machine cannot create: LIBFABRIC's plugin links libfabric.so.1, which
        # only the image has (the recipe's step 4 checks it with ldd and creates the backend there).
        assert not (set(made["failed"]) - {"LIBFABRIC"}), made["failed"]
        if made["failed"]:
            assert ctypes.util.find_library("fabric") is None, "libfabric is here, yet NIXL's LIBFABRIC backend failed"
