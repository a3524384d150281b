"""The KV transfer path each hardware profile gets, and the image it needs (infra/spec.py
transfer_problems, infra/render/fabric.py), and the engine image following the engine."""

from __future__ import annotations

import pytest

from infra.offline import run_spec
from infra.render.engine_args import all_launches
from infra.render.engine_check import variant_spec
from infra.render.kvcache_config import kv_cache_plan
from infra.spec import SpecError
from infra.spec_checks import parse_spec, switch_engine
from tests.conftest import problems_of, stack_data


def test_mooncake_over_efa_is_refused_on_arm64():
    """Mooncake's efa transport is compiled only with -DUSE_EFA=ON (kvcache-ai/Mooncake,
    mooncake-transfer-engine/src/transport/efa_transport, and its EFA transport guide), and its
    EFA wheels are published for x86_64 only: GB200's Grace nodes have no Mooncake path over EFA."""
    data = stack_data("prod")
    data["engine"]["kv_transfer"] = "mooncake"
    data["images"]["engines"]["sglang"]["mooncake_efa"] = True  # not even a claimed build helps on arm64
    assert any(p.startswith("engine.kv_transfer: Mooncake's efa transport is built for x86_64 only")
               and "Fix: kv_transfer: nixl" in p for p in problems_of(data))


def test_an_image_without_what_efa_needs_is_refused_with_field_and_fix():
    """EFA is reached only through AWS's libfabric (EFA provider); NIXL uses it through its LIBFABRIC
    backend plugin (ai-dynamo/nixl src/plugins/libfabric), which SGLang 0.5.23 selects with
    SGLANG_DISAGGREGATION_NIXL_BACKEND (sglang/srt/environ.py, default UCX) and vLLM 0.33.0 with the
    connector's "backends" (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py)."""
    data = stack_data("dev")  # x86_64, Mooncake over efa
    data["images"]["engines"]["sglang"]["mooncake_efa"] = False
    assert any(p.startswith("images.engines.sglang.mooncake_efa:") and "images/engine-efa.Dockerfile" in p
               for p in problems_of(data))
    data = stack_data("dev")
    data["images"]["engines"]["sglang"]["efa_libfabric"] = False
    assert any(p.startswith("images.engines.sglang.efa_libfabric:") and "Fix:" in p for p in problems_of(data))
    data = stack_data("prod")  # NIXL over EFA
    data["images"]["engines"]["sglang"]["nixl_backends"] = ["UCX"]
    assert any(p.startswith("images.engines.sglang.nixl_backends: NIXL over efa needs its LIBFABRIC backend")
               for p in problems_of(data))


def test_mooncake_efa_claimed_for_a_mooncake_without_an_efa_transport_is_refused():
    """Mooncake's efa transport (USE_EFA, src/transport/efa_transport) and a Python binding that
    honours protocol "efa" first appear in v0.3.10: 0.3.8.post1's TransferEngine.initialize ignores
    its protocol (kvcache-ai/Mooncake v0.3.8.post1, mooncake-integration/transfer_engine/
    transfer_engine_py.cpp, `(void)(protocol);`). The release is the master image's tag, which the
    engine image's Mooncake is built at (tests/test_mooncake_efa.py ties the recipe to it)."""
    data = stack_data("dev")  # x86_64, Mooncake over efa
    data["images"]["mooncake_master"]["ref"] = "docker.io/kvcacheai/mooncake:v0.3.8.post1"
    said = [p for p in problems_of(data) if p.startswith("images.engines.sglang.mooncake_efa:")]
    assert said and "from 0.3.10 on" in said[0] and "is tagged v0.3.8.post1" in said[0], problems_of(data)
    assert "Fix: kvcacheai/mooncake:v0.3.10 or later" in said[0] and "MOONCAKE_VERSION" in said[0]
    data["images"]["mooncake_master"] = "docker.io/kvcacheai/mooncake@sha256:" + "a" * 64  # no tag: no release known
    assert any(p.startswith("images.engines.sglang.mooncake_efa:") and "names no version tag" in p
               for p in problems_of(data))
    data = stack_data("prod")  # a store-only Mooncake over TCP, no efa claimed: any release is accepted
    data["images"]["mooncake_master"]["ref"] = "docker.io/kvcacheai/mooncake:v0.3.8.post1"
    parse_spec(data)
    parse_spec(stack_data("dev"))  # the committed pin, v0.3.13.post1, is accepted


def test_nccl_across_nodes_over_efa_needs_aws_ofi_nccl():
    """NCCL reaches EFA only through the aws-ofi-nccl plugin (aws/aws-ofi-nccl); a group spanning
    nodes outside an NVLink domain runs its collectives over EFA."""
    data = stack_data("dev")
    data["deployment"]["prefill"]["expert_parallel"] = 16  # two p5 nodes, no supernode
    data["images"]["engines"]["sglang"]["aws_ofi_nccl"] = False
    assert any(p.startswith("images.engines.sglang.aws_ofi_nccl:") for p in problems_of(data))


def test_each_hardware_profile_gets_a_transfer_path_that_exists_for_it():
    prod = all_launches(variant_spec("prod", "sglang"))  # GB200, arm64, EFA
    for role in ("prefill", "decode"):
        args = prod[role].args
        assert args[args.index("--disaggregation-transfer-backend") + 1] == "nixl"
        assert prod[role].env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "LIBFABRIC"
    assert kv_cache_plan(variant_spec("prod", "sglang")).engine_env["MOONCAKE_PROTOCOL"] == "tcp"  # store only
    dev = variant_spec("dev", "sglang")  # H100, x86_64, EFA, Mooncake's EFA build
    assert dev.engine.kv_transfer == "mooncake" and kv_cache_plan(dev).engine_env["MOONCAKE_PROTOCOL"] == "efa"
    data = stack_data("dev")  # the same on InfiniBand: verbs, no libfabric needed
    data["hardware"]["fabric"].update(kind="infiniband", resource="rdma/ib", devices=["mlx5_0"], per_node=8)
    data["images"]["engines"]["sglang"].update(efa_libfabric=False, aws_ofi_nccl=False, mooncake_efa=False)
    ib = parse_spec(data)  # accepted
    assert kv_cache_plan(ib).engine_env["MOONCAKE_PROTOCOL"] == "rdma"


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_render_engine_vllm_runs_vllms_own_image(stack):
    spec = variant_spec(stack, "vllm")
    images = {c["image"] for lws in run_spec(spec).by_kind("LeaderWorkerSet")
              for t in lws["spec"]["leaderWorkerTemplate"].values() if isinstance(t, dict)
              for c in t["spec"]["containers"]}
    assert images == {spec.images.engines["vllm"].image} != {spec.images.engines["sglang"].image}


def test_switching_to_an_engine_without_an_image_is_refused():
    data = stack_data("dev")
    del data["images"]["engines"]["vllm"]
    spec = parse_spec(data)
    with pytest.raises(SpecError) as err:
        switch_engine(spec, "vllm")
    assert any("images.engines.vllm: engine.kind is vllm and no image is named for it" in p
               for p in err.value.problems)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_vllm_nixl_side_channel_listens_on_the_pod_ip(stack):
    """vllm 0.33.0 vllm/envs.py: VLLM_NIXL_SIDE_CHANNEL_HOST defaults to "localhost", where the NIXL
    handshake would go; llm-d sets it from the downward API's status.podIP
    (llm-d/llm-d guides/wide-ep-lws/manifests/modelserver/base/decode.yaml)."""
    seen = 0
    for lws in run_spec(variant_spec(stack, "vllm")).by_kind("LeaderWorkerSet"):
        for template in lws["spec"]["leaderWorkerTemplate"].values():
            if not isinstance(template, dict):
                continue
            env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            seen += 1
    assert seen >= 2


def test_vllm_decode_runs_one_api_server_per_local_rank():
    """vllm 0.33.0 vllm/entrypoints/cli/serve.py: without --api-server-count, internal load balancing
    starts one API server per DP rank of the instance (64 on one node for prod's decode); hybrid LB, as
    llm-d's wide-EP guide runs it (guides/wide-ep-lws/manifests/modelserver/base/decode.yaml,
    --data-parallel-hybrid-lb), defaults it to the node's local DP size, on every node. A single-node
    instance gets that count explicitly."""
    for stack, local in (("dev", 8), ("prod", 4)):
        decode = all_launches(variant_spec(stack, "vllm"))["decode"]
        if decode.multi_node:
            assert "--data-parallel-hybrid-lb" in decode.args and "--api-server-count" not in decode.script()
            assert decode.args[decode.args.index("--data-parallel-size-local") + 1] == str(local)
        else:
            assert decode.args[decode.args.index("--api-server-count") + 1] == str(local)


def test_nccl_proto_simple_only_where_collectives_cross_efa():
    """aws/aws-ofi-nccl src/platform-aws.c (configure_nccl_proto): LL/LL128 need 128-byte in-order
    aligned stores; where the EFA endpoint cannot give them the plugin sets NCCL_PROTO=simple. The
    variable is process-wide, so on GB200 NVL72, where every collective runs over multi-node NVLink
    (LL128's home), it is not forced; on p5 (no NVLink domain) collectives cross EFA and it is."""
    from infra.render.fabric import fabric_env

    assert fabric_env(variant_spec("dev", "sglang"))["NCCL_PROTO"] == "simple"
    prod = fabric_env(variant_spec("prod", "sglang"))
    assert "NCCL_PROTO" not in prod and prod["NCCL_MNNVL_ENABLE"] == "1"


def test_no_kv_bandwidth_quota_is_claimed():
    """The kubernetes.io/egress-bandwidth annotation is applied by the CNI bandwidth plugin to the
    pod's kernel network interface; EFA/RDMA traffic bypasses the kernel, and no transfer library at
    the pinned versions has a rate limit (sglang/srt/environ.py in 0.5.23: none for Mooncake or
    NIXL). So no pod carries the annotation and no policy rule asks for it."""
    from infra.policy.rules import RULES

    for stack in ("dev", "prod"):
        for lws in run_spec(variant_spec(stack, "sglang")).by_kind("LeaderWorkerSet"):
            for template in lws["spec"]["leaderWorkerTemplate"].values():
                if isinstance(template, dict):
                    assert "kubernetes.io/egress-bandwidth" not in template["metadata"]["annotations"]
    assert not [r for r in RULES if "quota" in r.name]
