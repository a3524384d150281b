"""The router's policies read load the pinned engine serves: read from both pinned packages.

sglang-router 0.3.2 (its sdist's Rust source; the wheel holds only the compiled library): the
LoadMonitor polls `{worker}/get_load` (src/core/worker_manager.rs parse_load_response) and hands
the loads to the policies that take them (`update_loads`, a no-op by default in
src/policies/mod.rs; src/policies/power_of_two.rs overrides it). SGLang 0.5.23 (its wheel): the
routes srt/entrypoints/http_server.py serves, with the routers it includes (/v1/loads from
srt/entrypoints/v1_loads.py). A policy polling a route the engine does not serve reads -1 for
every worker, and power_of_two then keeps its first random pick.

Both packages are downloaded once into the machine's upstream cache (scripts/pinned_wheels.py
CACHE): the SGLang wheel by pip, the router's sdist from PyPI's simple index
(scripts/pinned_sdist.py), each checked against its pinned sha256.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from infra.render.metrics import catalogue
from infra.render.router_config import ENGINE_LOAD_ROUTES, POLICY_POLLS, router_launch
from infra.spec import SpecError
from infra.spec_checks import parse_spec
from tests.conftest import script_modules, stack_data

ROUTER_VERSION = "0.3.2"
ROUTER_SDIST_SHA256 = "bdbea1d54cce879fb83d2885d01ee3c006f242d0adbbac806f2fb2b91a5fe73d"  # PyPI's simple index


def _scripts():
    return script_modules("pinned_wheels", "pinned_sdist")


def sglang_wheel() -> Path:
    pinned = catalogue("sglang")
    path = _scripts()[0].pinned_wheel("sglang", pinned["version"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pinned["sha256"], f"{path} is not the pinned wheel"
    return path


def router_sdist() -> Path:
    path = _scripts()[1].download_sdist("sglang-router", ROUTER_VERSION)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ROUTER_SDIST_SHA256, f"{path} is not the pinned sdist"
    return path


def served_routes(wheel: Path) -> set[str]:
    """Every path SGLang's HTTP server routes: its own decorators and those of the routers it includes."""
    with zipfile.ZipFile(wheel) as z:
        read = lambda module: z.read(module.replace(".", "/") + ".py").decode()  # noqa: E731
        server = read("sglang.srt.entrypoints.http_server")
        routes = set(re.findall(r'@app\.(?:get|post|put|delete|api_route)\(\s*"([^"]+)"', server))
        for module, alias in re.findall(r"from (sglang\.[\w.]+) import router as (\w+)", server):
            if re.search(rf"app\.include_router\({alias}\)", server):
                routes |= set(re.findall(r'@router\.(?:get|post|put|delete|api_route)\(\s*"([^"]+)"', read(module)))
    return routes


def polled_by_policy(sdist: Path) -> dict[str, str]:
    """Policy name -> the worker path its loads are polled from."""
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        read = lambda rel: tar.extractfile(f"{root}/{rel}").read().decode()  # noqa: E731
        monitor = read("src/core/worker_manager.rs")
        parse = monitor[monitor.index("async fn parse_load_response"):]
        (path,) = set(re.findall(r'format!\("\{\}(/[\w/]+)", url\)', parse[:parse.index("\n    }\n")]))
        assert "get_all_power_of_two_policies" in monitor[monitor.index("async fn monitor_loop"):]
        taking = {}
        for member in tar.getnames():
            if member.startswith(f"{root}/src/policies/") and member.endswith(".rs") and not member.endswith("/mod.rs"):
                source = read(member.removeprefix(f"{root}/"))
                if "fn update_loads" in source:
                    (name,) = re.findall(r'fn name\(&self\) -> &\'static str \{\s*"(\w+)"', source)
                    taking[name] = path
    return taking


def test_the_load_sources_pdstack_records_are_the_pinned_packages():
    polled, served = polled_by_policy(router_sdist()), served_routes(sglang_wheel())
    assert polled == POLICY_POLLS
    assert ENGINE_LOAD_ROUTES["sglang"] <= served
    assert {p for p in polled.values() if p in served} <= ENGINE_LOAD_ROUTES["sglang"]


def rendered_policies(strategy: str, stack: str) -> list[str]:
    data = stack_data(stack)
    data["deployment"]["load_balancer"]["strategy"] = strategy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # round robin's
        args = router_launch(parse_spec(data)).args
    return [args[i + 1] for i, a in enumerate(args) if a in ("--policy", "--prefill-policy", "--decode-policy")]


@pytest.mark.parametrize("strategy", ["cache_aware", "least_load", "round_robin"])
def test_no_rendered_policy_polls_a_route_the_engine_does_not_serve(strategy):
    """What fails here on a decode side left at power_of_two: it polls /get_load, which SGLang
    0.5.23 does not serve."""
    polled, served = polled_by_policy(router_sdist()), served_routes(sglang_wheel())
    for stack in ("dev", "prod"):
        policies = rendered_policies(strategy, stack)
        assert policies, stack
        assert [p for p in policies if p in polled and polled[p] not in served] == [], (stack, policies)


def test_a_strategy_whose_load_the_engine_does_not_serve_is_refused_naming_the_field():
    with pytest.raises(SpecError) as caught:
        rendered_policies("power_of_two", "prod")
    (problem,) = caught.value.problems
    assert problem.startswith("deployment.load_balancer.strategy: power_of_two makes sglang-router poll each "
                              "worker's /get_load, which sglang 0.5.23 does not serve")
    assert problem.endswith("Fix: cache_aware or least_load")
