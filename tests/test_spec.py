"""Each validation rule gets a bad spec and the clear error that names the field and fix."""

from __future__ import annotations

import pytest

from infra.spec import SpecError
from infra.spec_checks import parse_spec
from tests.conftest import problems_of, stack_data, vllm_with_epp


def test_shipped_stacks_parse(spec):
    assert spec.deployment.pools()
    assert spec.engine.version == "0.5.23"


def test_unknown_key_is_an_error_naming_the_path_with_a_did_you_mean():
    data = stack_data("prod")
    data["deployment"]["decode"]["expert_paralel"] = 64
    data["deployment"]["decode"]["colour"] = "blue"
    data["access"]["api_keys"][0]["nmae"] = "x"  # inside a list: the list item's own fields
    problems = problems_of(data)
    assert sorted(problems) == [
        "access.api_keys.0.nmae: unknown key. Fix: did you mean name?",
        "deployment.decode.colour: unknown key. Fix: remove it or correct its spelling (see infra/spec/__init__.py StackSpec)",
        "deployment.decode.expert_paralel: unknown key. Fix: did you mean expert_parallel?",
    ]


def test_decode_ep_larger_than_supernode():
    data = stack_data("prod")
    data["deployment"]["decode"].update(expert_parallel=128, redundant_experts=0)
    data["deployment"]["pd_ratio"] = "1:2"
    problems = problems_of(data)
    assert any(
        p.startswith("deployment.decode.expert_parallel: 128 is larger than the supernode's 72 GPUs")
        and "Fix:" in p
        for p in problems
    ), problems


def test_ep_that_does_not_divide_across_nodes():
    data = stack_data("prod")
    data["deployment"]["prefill"]["expert_parallel"] = 6
    problems = problems_of(data)
    assert any(p.startswith("deployment.prefill.expert_parallel: 6 does not divide across nodes of 4 GPUs") for p in problems), problems


def test_ep_smaller_than_a_node_must_pack():
    data = stack_data("dev")
    data["deployment"]["prefill"]["expert_parallel"] = 3
    problems = problems_of(data)
    assert any(p.startswith("deployment.prefill.expert_parallel: 3 GPUs do not pack onto nodes of 8 GPUs") for p in problems)


def test_pd_ratio_disagreeing_with_instances():
    data = stack_data("prod")
    data["deployment"]["prefill"]["instances"] = 4
    problems = problems_of(data)
    assert problems == [
        "deployment.pd_ratio: '1:1' disagrees with the pools: prefill 4x8 GPUs, decode 1x64 GPUs is 1:2. "
        "Fix: set pd_ratio to '1:2' or change the instance counts"
    ]


def test_wide_ep_without_supernode_suggests_colocated():
    data = stack_data("prod")
    del data["hardware"]["supernode"]
    problems = problems_of(data)
    assert len(problems) == 2
    assert problems[0].startswith("deployment.decode.expert_parallel: wide EP (64 GPUs over 16 nodes) needs a supernode")
    assert "mode: colocated" in problems[0]
    # Without the NVLink domain, prefill's two-node DeepEP would need IBGDA, which EFA lacks.
    assert problems[1].startswith("engine.moe_a2a_backend: deepep across nodes (prefill, EP 8)")


def test_timeouts_must_shrink_inwards():
    data = stack_data("dev")
    data["timeouts"]["prefill_to_decode_kv"] = {"timeout_seconds": 200, "retries": 1}
    problems = problems_of(data)
    assert problems == [
        "timeouts.prefill_to_decode_kv.timeout_seconds: 200.0s x 2 attempts is not below "
        "timeouts.router_to_prefill.timeout_seconds (280.0s). Fix: lower it, or its retries, below 140s"
    ]


def test_image_must_be_pinned_by_digest():
    data = stack_data("dev")
    data["images"]["engines"]["sglang"]["image"] = "lmsysorg/sglang:latest"
    (problem,) = problems_of(data)
    assert problem.startswith("images.engines.sglang.image: image 'lmsysorg/sglang:latest' is not an image "
                              "reference pinned by digest")


def test_engine_version_must_be_the_pinned_one():
    data = stack_data("dev")
    data["engine"]["version"] = "0.4.0"
    (problem,) = problems_of(data)
    assert problem == "engine.version: 0.4.0 is not the pinned sglang version. Fix: use 0.5.23 (flag sets are checked against it)"


def test_open_allowlist_is_refused():
    data = stack_data("dev")
    data["access"]["allowlist_cidrs"] = ["0.0.0.0/0"]
    (problem,) = problems_of(data)
    assert problem.startswith("access.allowlist_cidrs: Value error") or problem.startswith("access.allowlist_cidrs:")
    assert "whole internet" in problem


def test_a_kv_bandwidth_quota_is_refused_as_unenforceable():
    """The quota was an egress-bandwidth annotation, which the CNI's shaper applies to kernel
    traffic only: EFA/RDMA bypasses it, and neither SGLang 0.5.23 (sglang/srt/environ.py) nor vLLM
    0.33.0's NixlConnector has a transfer rate limit. A spec that asks for one is told so."""
    data = stack_data("dev")
    data["deployment"]["cache"]["transfer_bandwidth_limit"] = "80%"
    (problem,) = problems_of(data)
    assert problem.startswith("deployment.cache:") and "transfer_bandwidth_limit: removed" in problem
    assert "Fix: delete it" in problem


def test_expert_slots_must_split_over_ep():
    data = stack_data("prod")
    data["deployment"]["decode"]["redundant_experts"] = 32
    problems = problems_of(data)
    assert any(p.startswith("deployment.decode.redundant_experts: 256 experts + 32 redundant = 288 slots") for p in problems)


def test_colocated_mode_needs_one_pool(colocated_spec):
    assert list(colocated_spec.deployment.pools()) == ["colocated"]
    data = stack_data("dev")
    data["deployment"]["mode"] = "colocated"
    problems = problems_of(data)
    assert "deployment.colocated: missing. Fix: describe the one pool colocated mode runs" in problems
    assert any(p.startswith("deployment.prefill: set in colocated mode") for p in problems)


def test_a_prefix_cache_disk_tier_needs_lmcache():
    data = stack_data("dev")
    data["deployment"]["cache"]["disk_path"] = "/mnt/kvdisk"
    with pytest.raises(SpecError, match="deployment.cache.disk_path: a disk tier needs the LMCache store"):
        parse_spec(data)
    vllm_with_epp(data)
    data["deployment"]["cache"]["store"] = "lmcache"
    spec = parse_spec(data)
    from infra.render.kvcache_config import kv_cache_plan

    assert "local_disk: file:///mnt/kvdisk/" in kv_cache_plan(spec).files["lmcache.yaml"]


def test_ratio_bounds_must_be_ordered():
    data = stack_data("prod")
    data["deployment"]["autoscaling"]["pd_ratio_bounds"] = {"min": "2:1", "max": "1:2"}
    with pytest.raises(SpecError, match="min 2:1 is above max 1:2. Fix: swap them"):
        parse_spec(data)


def test_the_spec_is_data_and_imports_no_planner():
    """infra/spec.py and infra/planning/capacity.py imported each other (the spec lazily, inside a
    function); the rules that need the planner now live above both (infra/spec_checks.py), and
    still run on every spec read, with the spec's own rules, all problems at once."""
    import ast

    from infra.spec import REPO_ROOT

    trees = [ast.parse(path.read_text()) for path in sorted((REPO_ROOT / "infra/spec").glob("*.py"))]
    imported = {n.module for tree in trees for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.startswith(("infra.planning", "infra.spec_checks"))}, imported
    data = stack_data("prod")
    data["hardware"]["max_gpus"] = 8  # the planner's rule: what the pools reserve against the quota
    data["timeouts"]["prefill_to_decode_kv"] = {"timeout_seconds": 900, "retries": 0}  # and one of the spec's own
    problems = problems_of(data)
    assert any(p.startswith("hardware.max_gpus: the pools reserve") for p in problems), problems
    assert any(p.startswith("timeouts.prefill_to_decode_kv.timeout_seconds") for p in problems), problems
