"""The engines' own rules, each encoded as a test that names where the engine states it.

The engine check (scripts/check_engine_args.py) ran every rendered command through the
pinned engines' real validation; these tests keep the reasons visible and fail fast here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.render.engine_args import all_launches, dense_mlp_fully_data_parallel
from infra.render.engine_check import (
    committed_commands, launch_argv, load_verdicts, unverified, variant_spec)
from infra.render.kvcache_config import kv_cache_plan
from infra.spec import pod_memory_gib, store_segment_gib_per_rank
from infra.spec_checks import parse_spec
from tests.conftest import problems_of, stack_data


def test_every_rendered_command_passed_the_engines_own_validation():
    """Verdicts in infra/render/engine_check/verdicts.json come from probe.py runs of sglang 0.5.23
    (prepare_server_args, resolve_once, check_server_args, and the FP8 dense-MLP block check) and
    vllm 0.33.0 (`vllm serve` validate + cmd through create_engine_config)."""
    assert unverified(committed_commands(), load_verdicts()) == []


def test_the_check_bites_on_known_bad_commands():
    """Two commands recorded from real runs that the engines refuse: decode with HiCache
    (sglang/srt/arg_groups/kv_cache_hook.py, handle_cache_compatibility) and vLLM decode without a
    batched-token budget (vllm/config/scheduler.py). And a changed command is unverified."""
    bad = {v["label"]: v for v in load_verdicts().values() if "known-bad" in v["label"]}
    assert "mutually exclusive" in bad["prod/sglang/known-bad-decode-hicache"]["detail"]
    assert bad["prod/sglang/known-bad-decode-hicache"]["verdict"] == "fail"
    assert "max_num_batched_tokens (256)" in bad["prod/vllm/known-bad-decode-batched-tokens"]["detail"]
    command = committed_commands()[0]
    changed = type(command)(**{**command.__dict__, "argv": (*command.argv, "--page-size", "32")})
    assert unverified([changed], load_verdicts()) == [f"{command.label}: never checked. Fix: run scripts/check_engine_args.py"]


def test_every_pool_resolves_the_kv_page_size_the_spec_names():
    """KV moves from prefill to decode page by page, so both must hold the same page size. Each
    engine changes the size to suit its attention backend: SGLang forces 64 for FlashMLA and
    TensorRT-LLM MLA, 128 for FA4 without MLA (sglang/srt/arg_groups/overrides.py,
    _mla_backend_page_constraints); vLLM picks one for its attention backends unless --block-size
    is given (vllm/platforms/interface.py, update_block_size_for_backend, run when the executor
    starts). The size each engine resolved for every rendered command is recorded by probe.py
    from the engine's own resolution (SGLang's resolved arguments, vLLM's CacheConfig); whether
    vLLM's chosen kernel supports it is decided at executor start, which the probe does not reach."""
    verdicts = load_verdicts()
    for command in committed_commands():
        stack, engine = command.label.split("/")[:2]
        resolved = verdicts[command.key()].get("resolved", {})
        assert resolved.get("kv_page_size") == variant_spec(stack, engine).engine.kv_page_size, command.label


def test_sglang_over_efa_renders_no_cuda_vmm_allocator():
    """Mooncake over EFA cannot register CUDA VMM memory: SGLang refuses
    SGLANG_MOONCAKE_CUSTOM_MEM_POOL=NVLINK/BAREX and expandable_segments with MOONCAKE_PROTOCOL=efa
    (sglang/srt/disaggregation/mooncake/utils.py, _validate_efa_allocator_compatibility). So dev's
    pods (x86_64, Mooncake's EFA build) move KV over EFA with neither set. (prod, arm64, moves it
    over NIXL: Mooncake has no efa transport there.)"""
    from infra.offline import run_spec

    for group in run_spec(variant_spec("dev", "sglang")).by_kind("LeaderWorkerSet"):
        templates = group["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key not in templates:  # a one-node group: its worker template is the leader
                continue
            env = {e["name"]: e.get("value") for e in templates[key]["spec"]["containers"][0]["env"]}
            assert env["MOONCAKE_PROTOCOL"] == "efa", group["metadata"]["name"]
            assert "SGLANG_MOONCAKE_CUSTOM_MEM_POOL" not in env
            assert "expandable_segments" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")


def test_sglang_decode_keeps_no_hierarchical_cache():
    """sglang/srt/arg_groups/pd_disaggregation_hook.py turns the radix cache off in PD decode mode,
    and kv_cache_hook.py refuses HiCache without it. Prefill keeps HiCache and the store."""
    launches = all_launches(variant_spec("prod", "sglang"))
    assert "--enable-hierarchical-cache" not in launches["decode"].args
    assert "--enable-hierarchical-cache" in launches["prefill"].args


def test_dense_mlp_is_replicated_when_its_tp_split_breaks_fp8_blocks():
    """sglang/srt/layers/quantization/fp8_utils.py validate_fp8_block_shape: 18432 / 64 = 288 is not a
    multiple of 128, so prod decode gets --moe-dense-tp-size 1; prefill's 18432 / 8 = 2304 = 18 x 128."""
    spec = variant_spec("prod", "sglang")
    pools = spec.deployment.pools()
    assert dense_mlp_fully_data_parallel(spec, pools["decode"])
    assert not dense_mlp_fully_data_parallel(spec, pools["prefill"])
    launches = all_launches(spec)
    assert "--moe-dense-tp-size" in launches["decode"].args and "--enable-dp-lm-head" in launches["decode"].args
    # Qwen3-30B-A3B has no dense layers: nothing to split.
    dev = variant_spec("dev", "sglang")
    assert not dense_mlp_fully_data_parallel(dev, dev.deployment.pools()["decode"])


def test_sglang_chunked_prefill_is_rendered_per_rank_times_dp():
    """sglang divides --chunked-prefill-size over attention-DP ranks; the spec gives tokens per rank."""
    spec = variant_spec("prod", "sglang")
    args = all_launches(spec)["prefill"].args
    assert args[args.index("--chunked-prefill-size") + 1] == str(16384 * 8)
    vargs = all_launches(variant_spec("prod", "vllm"))["prefill"].args
    assert vargs[vargs.index("--max-num-batched-tokens") + 1] == "16384"


def test_vllm_workers_are_headless_without_api_servers_and_the_leader_balances_all_ranks():
    """vllm/entrypoints/cli/serve.py: --api-server-count with --headless is refused, and
    --data-parallel-start-rank on the leader means hybrid LB (its API server would reach only its
    local ranks)."""
    prefill = all_launches(variant_spec("prod", "vllm"))["prefill"]
    leader, worker = launch_argv(prefill, 0), launch_argv(prefill, 1)
    assert "--api-server-count" in leader and "--data-parallel-start-rank" not in leader
    assert "--headless" in worker and "--api-server-count" not in worker
    assert worker[worker.index("--data-parallel-start-rank") + 1] == "4"


def test_vllm_decode_budget_covers_its_running_sequences():
    """vllm/config/scheduler.py: max_num_batched_tokens >= max_num_seqs; batched DP MoE would default it to 256."""
    args = all_launches(variant_spec("prod", "vllm"))["decode"].args
    assert int(args[args.index("--max-num-batched-tokens") + 1]) >= int(args[args.index("--max-num-seqs") + 1])


def test_vllm_pd_roles_nixl_transport_and_store_config_file():
    """vLLM 0.33.0: kv_producer / kv_consumer, NIXL's backend plugin from the fabric (LIBFABRIC on EFA;
    vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py "backends"), and the store's JSON file
    from MOONCAKE_CONFIG_PATH (vllm/distributed/mooncake_store.py, from_file keys)."""
    spec = variant_spec("prod", "vllm")
    launches = all_launches(spec)
    configs = {r: json.loads(l.args[l.args.index("--kv-transfer-config") + 1]) for r, l in launches.items()}
    assert configs["prefill"]["kv_role"] == "kv_producer"
    assert configs["decode"] == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                 "kv_connector_extra_config": {"kv_lease_duration": 30, "backends": ["LIBFABRIC"]}}
    plan = kv_cache_plan(spec)
    assert plan.engine_env == {"MOONCAKE_CONFIG_PATH": "/etc/pdstack/kvcache/mooncake.json"}
    store = json.loads(plan.files["mooncake.json"])
    assert {"metadata_server", "master_server_address", "protocol", "device_name", "global_segment_size"} <= set(store)
    assert store["protocol"] == "tcp"  # arm64: Mooncake has no efa transport; the store is off the latency path


def test_each_sglang_rank_lends_the_segment_the_memory_budget_counts():
    """sglang 0.5.23 sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py: each rank sets up
    MOONCAKE_GLOBAL_SEGMENT_SIZE // (tp_size x pp_size) of its storage config, whose tp_size is the
    attention-TP size under DP attention (sglang/srt/managers/cache_controller.py,
    _generate_storage_config). Rendered: per-rank segment x that divisor, so the store is the size
    the spec says and each pod's limit counts what its ranks lend."""
    data = stack_data("prod")
    spec = parse_spec(data)
    per_rank = store_segment_gib_per_rank(spec)
    assert kv_cache_plan(spec).engine_env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == f"{per_rank}gb"  # attention TP 1
    data["deployment"]["prefill"]["dp_attention"] = False  # attention TP 8: SGLang divides by 8
    tp = parse_spec(data)
    assert kv_cache_plan(tp).engine_env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == f"{per_rank * 8}gb"
    assert pod_memory_gib(tp, "prefill")["store segments"] == 4 * per_rank


def test_store_clients_register_under_the_pod_ip_and_handshake_peer_to_peer():
    """sglang 0.5.23 (sglang/srt/environ.py MOONCAKE_LOCAL_HOSTNAME, default "localhost";
    mooncake_store.py _resolve_local_hostname) registers each client under that name, which no peer
    can reach. Mooncake's Kubernetes guide (kvcache-ai/Mooncake docs/source/deployment/
    kubernetes-deployment-guide/mooncake-on-kubernetes.md) uses P2PHANDSHAKE metadata and a master
    without an HTTP metadata server."""
    from infra.offline import run_spec

    run = run_spec(variant_spec("prod", "sglang"))
    for group in run.by_kind("LeaderWorkerSet"):
        for template in group["spec"]["leaderWorkerTemplate"].values():
            if isinstance(template, dict):
                env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
                assert env["MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
                assert env["MOONCAKE_TE_META_DATA_SERVER"]["value"] == "P2PHANDSHAKE"
    plan = kv_cache_plan(variant_spec("prod", "sglang"))
    assert not any("metadata_server" in a for a in plan.command) and "metadata" not in plan.ports


def test_store_capacity_is_split_over_the_ranks_that_mount_segments():
    """Each rank process of SGLang HiCache / vLLM's store connector mounts its own segment
    (MOONCAKE_GLOBAL_SEGMENT_SIZE per client): 2048 GiB over 8 prefill instances x 8 ranks is 32 each."""
    spec = variant_spec("prod", "sglang")
    assert store_segment_gib_per_rank(spec) == 2048 // 64
    assert kv_cache_plan(spec).engine_env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "32gb"
    mem = pod_memory_gib(spec, "prefill")
    assert mem["store segments"] == 4 * 32 and mem["host cache tier"] == 4 * 32


def test_decode_memory_leaves_room_to_load_the_model_beside_its_shm():
    """A decode pod's /dev/shm is memory-backed (emptyDir medium Memory) and counts against its limit;
    the limit was 105 GiB for four GB200 ranks, 32 of them shm, with nothing for the weights each rank
    reads into host memory while it loads. The limit now holds the processes, shm and each rank's
    share of the checkpoint (loading comes before the caches, so the larger of the two counts)."""
    from infra.offline import run_spec

    spec = variant_spec("prod", "sglang")
    mem = pod_memory_gib(spec, "decode")
    share = -(-spec.model.weights.size_gib // 64)  # 642 GiB over 64 ranks
    assert mem["weight loading"] == 4 * share
    assert mem["limit"] >= mem["engine processes"] + mem["/dev/shm"] + 4 * share
    (decode,) = [g for g in run_spec(spec).by_kind("LeaderWorkerSet") if g["metadata"]["name"] == "engine-decode"]
    pod = decode["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    limit = int(pod["containers"][0]["resources"]["limits"]["memory"].removesuffix("Gi"))
    shm = int(next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"].removesuffix("Gi"))
    assert limit - shm - mem["engine processes"] >= 4 * share
    prefill = pod_memory_gib(spec, "prefill")  # loading and caches at different times: the larger counts
    assert prefill["total"] == prefill["engine processes"] + prefill["/dev/shm"] + max(
        prefill["weight loading"], prefill["host cache tier"] + prefill["store segments"])


def test_pod_memory_that_no_node_can_hold_is_rejected():
    data = stack_data("prod")
    data["deployment"]["prefill"]["host_cache_gib_per_rank"] = 256
    (line,) = [p for p in problems_of(data) if "host_cache_gib_per_rank" in p]
    assert "needs 1372 GiB" in line and "share of a node is 912 GiB" in line


def test_engine_pods_request_their_memory_and_fabric(run_prod):
    (decode,) = [g for g in run_prod.by_kind("LeaderWorkerSet") if g["metadata"]["name"].endswith("decode")]
    pod = decode["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["vpc.amazonaws.com/efa"] == "4" and res["limits"]["nvidia.com/gpu"] == "4"
    assert pod["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_MNNVL_ENABLE"] == "1"


def test_prefill_groups_stay_in_one_nvlink_domain_on_efa(run_prod):
    """DeepEP across nodes on EFA (no IBGDA) needs multi-node NVLink: prefill's two-node groups get a
    pod affinity on the clique label scoped to their LWS group (matchLabelKeys on
    leaderworkerset.sigs.k8s.io/group-key, kubernetes/enhancements KEP-3633)."""
    (prefill,) = [g for g in run_prod.by_kind("LeaderWorkerSet") if g["metadata"]["name"].endswith("prefill")]
    term = prefill["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
    assert term["topologyKey"] == "nvidia.com/gpu.clique"


def h100_infiniband(data: dict) -> dict:
    data["hardware"].update(gpu_type="H100", cpu_architecture="amd64", gpus_per_node=8, gpu_memory_gib=80,
                            node_memory_gib=2048, instance_types=["nd96isr-h100-v5"], fabric={
                                "kind": "infiniband", "resource": "rdma/ib", "per_node": 8,
                                "devices": [f"mlx5_{i}" for i in range(8)]})
    # Not an EC2 type: no instance-store array; the weight cache is a disk the operator mounts.
    data["model"]["weights"].update(node_cache_path="/mnt/weights", cache={"medium": "host-path"})
    return data


def test_h100_infiniband_profile_renders_rdma_devices_and_ibgda():
    from infra.render.fabric import fabric_env, fabric_resources, mooncake_protocol

    spec = parse_spec(h100_infiniband(stack_data("dev")))
    assert fabric_resources(spec, 8) == {"rdma/ib": "8"}
    env = fabric_env(spec)
    assert env["NCCL_IB_HCA"].startswith("mlx5_0,") and env["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert mooncake_protocol(spec) == "rdma"


def test_mixed_hardware_profiles_are_rejected_with_field_and_fix():
    from infra.images import platform_key

    data = stack_data("prod")
    data["hardware"]["cpu_architecture"] = "amd64"
    assert any(p.startswith("hardware.cpu_architecture: GB200") for p in problems_of(data))
    data = stack_data("prod")
    image = data["images"]["engines"]["sglang"]["image"]  # pinned, or a marked placeholder (infra/images.py)
    data["images"]["platforms"][platform_key(image["ref"] if isinstance(image, dict) else image)] = ["amd64"]
    assert any(p.startswith("images.engines.sglang.image:") and "arm64" in p for p in problems_of(data))
    data = stack_data("prod")
    data["hardware"]["fabric"]["resource"] = "rdma/ib"
    assert any(p.startswith("hardware.fabric.resource:") for p in problems_of(data))
    # H100 over EFA with DeepEP across two nodes and no NVLink domain: no IBGDA.
    data = stack_data("dev")
    data["engine"]["moe_a2a_backend"] = "deepep"
    data["deployment"]["prefill"]["expert_parallel"] = 16
    data["deployment"]["decode"]["expert_parallel"] = 16
    data["hardware"]["max_gpus"] = 32
    assert any(p.startswith("engine.moe_a2a_backend: deepep across nodes (prefill") for p in problems_of(data))


@pytest.fixture(scope="module")
def run_prod():
    from tests.conftest import shipped_run

    return shipped_run("prod")


def test_verdict_file_is_in_the_package():
    assert (Path(__file__).parent.parent / "infra/render/engine_check/verdicts.json").exists()


def test_placement_file_has_a_row_per_hidden_layer_and_says_when_it_fell_back():
    """sglang/srt/eplb/expert_location.py: init_by_mapping takes physical_to_logical_map with one row per
    ModelConfigForExpertLocation.num_layers, which DeepseekV2ForCausalLM sets to num_hidden_layers (61),
    dense layers included, and num_logical_experts + ep_num_redundant_experts columns."""
    import numpy as np

    from infra.planning.eplb import place_experts

    rng = np.random.default_rng(0)
    loads = rng.pareto(1.5, (58, 256)) * 100
    loads[5] = 1.0  # a perfectly even layer: any replication is no better than the default
    placement = place_experts(loads, 64, 16, 64, 8)
    rows = placement.engine_file(61)["physical_to_logical_map"]
    assert len(rows) == 61 and all(len(r) == 256 + 64 for r in rows)
    assert sorted(set(rows[0])) == list(range(256))
    from dataclasses import replace

    hier = replace(placement, policy="hierarchical", fallback_layers=(3, 7))
    assert hier.report()["policy"].startswith("hierarchical, except 2 layers") and \
        "group locality broken" in hier.report()["policy"]
    assert hier.report()["fallback_layers"] == [3, 7]
