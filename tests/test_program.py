"""The Pulumi program under Pulumi's mocks: what it registers, not only that it ran."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.offline import run_spec
from infra.render.manifests import manifests, validate_manifests
from infra.spec import SpecError
from infra.spec_checks import parse_spec
from tests.conftest import stack_data


def test_namespace_and_spec_configmap(run, spec):
    (ns,) = run.by_kind("Namespace")
    assert ns["metadata"]["name"] == spec.environment.namespace
    assert ns["metadata"]["labels"]["pdstack.io/environment"] == spec.environment.name
    cm = next(m for m in run.by_kind("ConfigMap") if m["metadata"]["name"] == "pdstack-spec")
    assert cm["metadata"]["namespace"] == spec.environment.namespace
    assert json.loads(cm["data"]["spec.json"])["deployment"]["pd_ratio"] == spec.deployment.pd_ratio


def test_every_resource_is_labelled_and_namespaced(run, spec):
    for m in manifests(run):
        if m["kind"] in ("Namespace", "NodePool"):
            continue
        assert m["metadata"]["namespace"] == spec.environment.namespace, m["metadata"]
        assert m["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdstack"


def test_every_resource_sits_in_a_layer_component(run):
    assert all(r.layer != "stack" for r in run.custom() if r.type.startswith("kubernetes:"))


def test_shipped_manifests_pass_schema_validation(run, spec):
    report = validate_manifests(manifests(run), spec.environment.kubernetes_version)
    assert report.errors == []
    assert report.checked > 0


def test_schema_validation_catches_a_broken_manifest(run, spec):
    (namespace,) = run.by_kind("Namespace")
    broken = namespace | {"spec": {"bogus": 1}}
    report = validate_manifests([broken], spec.environment.kubernetes_version)
    assert report.errors


@st.composite
def valid_specs(draw):
    """Specs the model accepts: vary hardware, mode, EP and instance counts consistently."""
    data = stack_data("prod")
    gpus_per_node = draw(st.sampled_from([4, 8]))
    hw = data["hardware"]
    hw["gpus_per_node"] = gpus_per_node
    dep = data["deployment"]
    if draw(st.booleans()):
        ep = draw(st.sampled_from([gpus_per_node, 2 * gpus_per_node]))
        del hw["supernode"]
        dep["mode"] = "colocated"
        dep["colocated"] = {"instances": draw(st.integers(1, 4)), "expert_parallel": ep,
                            "redundant_experts": draw(st.sampled_from([0, ep]))}
        if ep > gpus_per_node:
            hw["supernode"] = {"gpus": 72}
        del dep["prefill"], dep["decode"]
    else:
        p_ep = draw(st.sampled_from([4, 8, 16]))
        d_ep = draw(st.sampled_from([8, 16, 32, 64]))
        p_n, d_n = draw(st.integers(1, 8)), draw(st.integers(1, 2))
        for role, ep, n in (("prefill", p_ep, p_n), ("decode", d_ep, d_n)):
            dep[role].update(instances=n, expert_parallel=ep, redundant_experts=draw(st.sampled_from([0, ep])))
            dep[role]["scaling"] = {"min_instances": 1, "max_instances": n + 1}
        from fractions import Fraction

        r = Fraction(p_ep * p_n, d_ep * d_n)
        dep["pd_ratio"] = f"{r.numerator}:{r.denominator}"
    dep["cache"]["prefix_cache"] = draw(st.booleans())
    data["engine"]["kind"] = draw(st.sampled_from(["sglang", "vllm"]))
    data["engine"]["version"] = {"sglang": "0.5.23", "vllm": "0.33.0"}[data["engine"]["kind"]]
    if data["engine"]["kind"] == "vllm":
        dep["load_balancer"]["implementation"] = "gateway_epp"
        data["engine"]["kv_transfer"] = "nixl"  # what llm-d's routing sidecar drives for vLLM
    else:
        dep["load_balancer"]["implementation"] = draw(st.sampled_from(["sglang_router", "gateway_epp"]))
    dep["cache"]["store"] = "lmcache" if data["engine"]["kind"] == "vllm" and draw(st.booleans()) else "mooncake"
    try:
        return parse_spec(data)
    except SpecError:
        from hypothesis import reject

        reject()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(valid_specs())
def test_any_accepted_spec_renders_schema_valid_manifests(spec):
    run = run_spec(spec)
    report = validate_manifests(manifests(run), spec.environment.kubernetes_version)
    assert report.errors == []
