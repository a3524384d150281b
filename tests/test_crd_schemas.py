"""Every rendered custom resource against its project's CRD schema, strictly.

The schemas are the upstream CRDs at release tags (infra/render/crds/README.md lists
repository, tag, commit and path of each), checked the way the API server checks a custom
resource: the served version's openAPIV3Schema, unknown fields refused (kubectl's default
`--validate=strict`; the API server would otherwise prune them silently).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from infra.offline import run_offline, run_spec
from infra.program import build_stack
from infra.render.crd_schemas import CRD_DIR, crd_schema, vendored_crds
from infra.render.manifests import manifests, unwrap, validate_manifests
from infra.spec_checks import parse_spec
from tests.conftest import stack_data, vllm_with_epp
from tests.test_tracks import prod_tracks
from twin.paths import TWIN_SRC

TWIN_MODULES = [p.parent for p in TWIN_SRC.glob('*/go.mod')]


def prod_variant(change) -> dict:
    data = stack_data("prod")
    change(data)
    return data


def epp_vllm(data):
    vllm_with_epp(data)


def hpa(data):
    data["deployment"]["autoscaling"]["scaler"] = "hpa"


def colocated(data):
    dep = data["deployment"]
    dep["mode"] = "colocated"
    dep["colocated"] = {"instances": 1, "expert_parallel": 64, "redundant_experts": 64,
                        "max_running_requests": 2048, "scaling": {"min_instances": 1, "max_instances": 2}}
    del dep["prefill"], dep["decode"]


RENDERS = {
    "dev": lambda: run_spec(parse_spec(stack_data("dev"))),
    "prod": lambda: run_spec(parse_spec(stack_data("prod"))),
    "prod-gateway_epp-vllm": lambda: run_spec(parse_spec(prod_variant(epp_vllm))),
    "prod-hpa": lambda: run_spec(parse_spec(prod_variant(hpa))),
    "prod-colocated": lambda: run_spec(parse_spec(prod_variant(colocated))),
    "prod-two-tracks": lambda: run_offline(
        lambda: build_stack(parse_spec(stack_data("prod")), release="8", tracks=prod_tracks()), stack="prod"),
}


@pytest.mark.parametrize("name", RENDERS)
def test_every_custom_resource_passes_its_crd_schema(name):
    """Each render checks every object: built-in kinds against the Kubernetes schemas, custom
    kinds against their CRDs; none is left unchecked and none has an error."""
    items = manifests(RENDERS[name]())
    report = validate_manifests(items, "1.34")
    assert report.errors == []
    assert report.unchecked_kinds == {}
    custom = [m for m in items if crd_schema(m["apiVersion"], m["kind"]) is not None]
    assert sum(report.custom_checked.values()) == len(custom) > 0


@pytest.fixture(scope="module")
def prod_items() -> list[dict]:
    return [unwrap(m) for m in manifests(run_spec(parse_spec(stack_data("prod"))))]


def first(items: list[dict], kind: str) -> dict:
    return copy.deepcopy(next(m for m in items if m["kind"] == kind))


@pytest.mark.parametrize("kind, break_it, expected", [
    ("NodePool", lambda m: m["spec"].update(replica=3),
     ": spec: Additional properties are not allowed ('replica' was unexpected)"),
    ("LeaderWorkerSet", lambda m: m["spec"]["leaderWorkerTemplate"].update(size="16"),
     ": spec.leaderWorkerTemplate.size: '16' is not of type 'integer'"),
    ("HTTPRoute", lambda m: m["spec"]["rules"][0].update(weight=3),
     "HTTPRoute/gateway: spec.rules.0: Additional properties are not allowed ('weight' was unexpected)"),
    ("ScaledObject", lambda m: m["spec"].update(minReplicaCount=-1),
     ": spec.minReplicaCount: -1 is less than the minimum of 0"),
    ("ComputeDomain", lambda m: m["spec"]["channel"].update(allocationMode="Some"),
     "-nvlink: spec.channel.allocationMode: 'Some' is not one of ['All', 'Single']"),
    ("PrometheusRule", lambda m: m["spec"]["groups"][0].update(rule=[]),
     "Additional properties are not allowed ('rule' was unexpected)"),
])
def test_a_broken_custom_resource_is_caught(prod_items, kind, break_it, expected):
    broken = first(prod_items, kind)
    break_it(broken)
    report = validate_manifests([broken], "1.34")
    assert any(expected in e for e in report.errors), report.errors


def test_a_wrong_api_version_is_not_silently_passed(prod_items):
    pool = first(prod_items, "NodePool")
    pool["apiVersion"] = "karpenter.sh/v1beta1"  # removed in Karpenter v1
    report = validate_manifests([pool], "1.34")
    assert report.unchecked_kinds == {"NodePool (karpenter.sh/v1beta1)": 1}


def test_every_schema_names_its_origin():
    """Derived by scripts/derive_crds.py from the Go modules twin/*/go.sum pins: each keeps
    module, version, path and go.sum hash (Apache-2.0, notice in crds/README.md). The one schema
    no module carries (ComputeDomain) names repository, tag, commit and why."""
    index = vendored_crds()
    assert {r["kind"] for r in index} >= {
        "LeaderWorkerSet", "NodePool", "EC2NodeClass", "Gateway", "HTTPRoute", "ReferenceGrant", "InferencePool",
        "ScaledObject", "PodMonitor", "ServiceMonitor", "PrometheusRule", "SecurityPolicy", "BackendTrafficPolicy",
        "EnvoyProxy", "ComputeDomain"}
    notice = (CRD_DIR / "README.md").read_text()
    assert "Apache License, Version 2.0" in notice
    go_sums = "".join((p / "go.sum").read_text() for p in TWIN_MODULES)
    for row in index:
        origin = json.loads((CRD_DIR / row["file"]).read_text())["origin"]
        assert origin["path"].endswith(".yaml")
        if "module" in origin:
            assert f"{origin['module']} {origin['version']} {origin['go_sum']}" in go_sums
            assert origin["module"] in notice
        else:
            assert row["kind"] == "ComputeDomain" and len(origin["commit"]) == 40 and origin["why_not_a_module"]
            assert origin["commit"] in notice


def test_the_schemas_are_what_the_pinned_modules_hold():
    """infra/render/crds/ is exactly what scripts/derive_crds.py derives from the module zips
    `go mod download` verifies against twin/*/go.sum: no hand edit, no stale pin."""
    done = subprocess.run([sys.executable, "scripts/derive_crds.py", "--check"], capture_output=True, text=True,
                          cwd=CRD_DIR.parent.parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
