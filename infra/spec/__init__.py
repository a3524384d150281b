"""The typed deployment spec: one per environment, the single source of truth.

Everything pdstack creates or renders is derived from a `StackSpec`. Parsing is strict:
unknown keys are errors (a typo must not be silently ignored), and cross-field rules are
checked once, with messages that name the field and say how to fix it. This package holds the
data and its own rules (`cross_field_problems`) and imports no planner: a spec is read with
`infra.spec_checks.load_spec`/`parse_spec`, which add the rules that need the planner.

Each layer's options live in their own module, imported one way: `_base` (paths, field types,
shared validators, SpecError) at the bottom; `engines` (model, weights, engine, hardware),
`environment` (environment, platform, images), `kvcache`, `balancers` (load balancer, hop
timeouts), `deployment` (pools, parallelism, scaling, rollout surge), `access` and `monitoring`
(SLOs, observability) above it; here, on top, the StackSpec that holds them all and the rules
that span layers. Every name is re-exported here, so `from infra.spec import ...` reads as one.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

from pydantic import Field

from infra.images import image_tag, platform_key
from infra.inputs import InputError, Strict
from infra.platform_stack.weight_cache import ARRAY_RESERVE_GIB, INSTANCE_STORE_GB, RAID0_MOUNT, gib_of_gb
from infra.spec._base import (
    NAMESPACE_MAX, REPO_ROOT, STACKS_DIR, PositiveInt, Seconds, SpecError, is_aws_s3, stack_spec_path)
from infra.spec.access import AccessSpec, ApiKeySpec
from infra.spec.balancers import EncoderSpec, HopSpec, LoadBalancerSpec, RouterWeights, TimeoutsSpec
from infra.spec.deployment import (
    AutoscalingSpec, DeploymentSpec, PhaseSpec, RatioBounds, ScalingSpec, ratio_value)
from infra.spec.engines import (
    PINNED_ENGINE_VERSIONS, EngineSpec, FabricSpec, HardwareSpec, ModelSpec, NodeClassRef, SupernodeSpec,
    WeightsCacheSpec, WeightsSpec)
from infra.spec.environment import EngineImageSpec, EnvironmentSpec, ImagesSpec, PlatformRef, ReleaseStoreSpec
from infra.spec.kvcache import CacheSpec
from infra.spec.monitoring import ObservabilitySpec, SLOSpec

__all__ = [
    # the layers' models and helpers, re-exported
    "NAMESPACE_MAX", "REPO_ROOT", "STACKS_DIR", "PositiveInt", "Seconds", "SpecError", "is_aws_s3", "stack_spec_path",
    "AccessSpec", "ApiKeySpec",
    "EncoderSpec", "HopSpec", "LoadBalancerSpec", "RouterWeights", "TimeoutsSpec",
    "AutoscalingSpec", "DeploymentSpec", "PhaseSpec", "RatioBounds", "ScalingSpec", "ratio_value",
    "PINNED_ENGINE_VERSIONS", "EngineSpec", "FabricSpec", "HardwareSpec", "ModelSpec", "NodeClassRef", "SupernodeSpec",
    "WeightsCacheSpec", "WeightsSpec",
    "EngineImageSpec", "EnvironmentSpec", "ImagesSpec", "PlatformRef", "ReleaseStoreSpec",
    "CacheSpec",
    "ObservabilitySpec", "SLOSpec",
    # defined here
    "StackSpec", "engine_capability_problems", "ratio_bounds_problems", "ENGINE_PROCESS_GIB_PER_RANK",
    "NODE_RESERVED_SHARE", "SHM_GIB_PER_RANK", "store_ranks", "store_segment_gib_per_rank", "runs_prefix_cache",
    "weight_load_gib_per_rank", "pod_memory_gib", "all_to_all_needs_nvlink_domain", "image_platforms",
    "gpu_node_images", "image_platform_problems", "ENGINE_IMAGE_RECIPE", "transfer_problems", "weight_cache_gib",
    "weight_cache_problems", "hardware_problems", "cross_field_problems", "SGLANG_DEFAULT_CHUNKED_PREFILL",
    "prefill_chunk_tokens", "longest_prefill_seconds",
]


class StackSpec(Strict):
    environment: EnvironmentSpec
    platform: PlatformRef | None = Field(None, description="The platform stack; without it the cluster and its "
                                                          "controllers are the user's (README: user-provided).")
    model: ModelSpec
    engine: EngineSpec
    images: ImagesSpec
    hardware: HardwareSpec
    deployment: DeploymentSpec
    timeouts: TimeoutsSpec = TimeoutsSpec()
    slo: SLOSpec
    access: AccessSpec
    observability: ObservabilitySpec = ObservabilitySpec()

    def engine_image(self) -> EngineImageSpec:
        """The image of the engine the pools run (the spec check refuses a spec without one)."""
        return self.images.engines[self.engine.kind]

    def labels(self) -> dict[str, str]:
        return {
            "app.kubernetes.io/part-of": "pdstack",
            "app.kubernetes.io/managed-by": "pulumi",
            "pdstack.io/environment": self.environment.name,
        }


# --- cross-field rules --------------------------------------------------------------------


def _ep_fits_nodes(path: str, ep: int, gpus_per_node: int) -> list[str]:
    if ep >= gpus_per_node and ep % gpus_per_node:
        return [
            f"{path}: {ep} does not divide across nodes of {gpus_per_node} GPUs. "
            f"Fix: use a multiple of {gpus_per_node} (e.g. {ep - ep % gpus_per_node or gpus_per_node})"
        ]
    if ep < gpus_per_node and gpus_per_node % ep:
        return [
            f"{path}: {ep} GPUs do not pack onto nodes of {gpus_per_node} GPUs. "
            f"Fix: use a divisor of {gpus_per_node}"
        ]
    return []


def _placement_problems(field: str, placement: Path, model: ModelSpec, slots: int) -> list[str]:
    """A static expert placement must be what the engine loads for this model and pool: SGLang's
    --init-expert-location reads one row per hidden layer and one logical expert per physical
    slot (sglang/srt/eplb/expert_location.py, init_by_mapping) and fails at start otherwise."""
    from infra.inputs import load_json

    fix = "Fix: write it with `pdctl eplb` for this role"
    if not placement.exists():
        return [f"{field}: {placement} does not exist. Fix: write it with `pdctl eplb`, or remove the field (the "
                "engine's own EPLB then places experts)"]
    try:
        rows = load_json(placement, "expert placement")["physical_to_logical_map"]
    except InputError as exc:
        return [f"{field}: {exc}"]
    except (KeyError, TypeError):
        return [f"{field}: {placement} has no physical_to_logical_map. {fix}"]
    if not isinstance(rows, list) or len(rows) != model.num_layers:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        return [f"{field}: {placement} has {got} layers; the model has {model.num_layers}. {fix}"]
    for layer, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != slots:
            got = len(row) if isinstance(row, list) else type(row).__name__
            return [f"{field}: {placement} layer {layer} has {got} slots; this pool has {slots} "
                    f"({model.num_routed_experts} experts + redundant). {fix}"]
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < model.num_routed_experts for e in row):
            return [f"{field}: {placement} layer {layer} names an expert outside 0..{model.num_routed_experts - 1}. {fix}"]
    return []


def engine_capability_problems(spec: StackSpec) -> list[str]:
    """What the chosen engine's pinned version cannot do (see infra/render/pinned/)."""
    eng, dep = spec.engine, spec.deployment
    problems = []
    if eng.kind == "sglang" and dep.cache.store == "lmcache":
        problems.append(
            f"deployment.cache.store: sglang {eng.version} has no LMCache backend (its "
            "--hicache-storage-backend has mooncake, nixl, file, ... but not lmcache). "
            "Fix: store: mooncake, or engine.kind: vllm"
        )
    if eng.kind != "sglang" and dep.load_balancer.implementation == "sglang_router":
        problems.append(
            "deployment.load_balancer.implementation: sglang_router speaks SGLang's PD bootstrap "
            f"protocol, not {eng.kind}'s. Fix: gateway_epp"
        )
    for role, phase in dep.pools().items():
        if eng.kind == "vllm" and phase.expert_placement:
            problems.append(
                f"deployment.{role}.expert_placement: vllm {eng.version} has no flag to load a static "
                "expert placement (its EPLB rebalances at runtime). Fix: remove it, or engine.kind: sglang"
            )
    if dep.load_balancer.implementation == "gateway_epp":
        if spec.images.endpoint_picker is None:
            problems.append("images.endpoint_picker: gateway_epp runs llm-d-inference-scheduler's endpoint picker, and "
                            "no image is named. Fix: its image of v0.7.1, pinned by digest")
        if dep.mode == "disaggregated":
            if spec.images.routing_sidecar is None:
                problems.append("images.routing_sidecar: gateway_epp in PD mode needs llm-d's routing sidecar on decode "
                                "pods. Fix: its image of v0.7.1, pinned by digest")
            # The sidecar's KV connectors: nixlv2 (vLLM's NixlConnector) and sglang (SGLang's own
            # bootstrap, whatever its transfer backend) (llm-d-inference-scheduler v0.7.1,
            # pkg/sidecar/proxy/options.go): none for vLLM's MooncakeConnector.
            if eng.kind == "vllm" and eng.kv_transfer != "nixl":
                problems.append(
                    f"engine.kv_transfer: llm-d's routing sidecar runs vLLM's prefill hop only over NIXL (its "
                    f"connectors: nixlv2, shared-storage, sglang), not {eng.kv_transfer}. Fix: kv_transfer: nixl")
    if dep.cache.disk_path and dep.cache.store != "lmcache":
        problems.append(
            f"deployment.cache.disk_path: a disk tier needs the LMCache store (local_disk); the {dep.cache.store} "
            "store keeps the prefix cache in host memory. Fix: remove disk_path, or store: lmcache (engine vllm)")
    if dep.load_balancer.encoder.mode == "dedicated" and (eng.kind != "sglang" or not spec.model.multimodal):
        problems.append(
            "deployment.load_balancer.encoder.mode: dedicated encoders need a multimodal model on "
            "sglang (--encoder-only). Fix: mode: engine"
        )
    return problems


def ratio_bounds_problems(spec: StackSpec) -> list[str]:
    """Can the ratio bounds hold at every count? (What the pools reserve against quota and NVLink
    domains needs the planner: infra/spec_checks.py checks it.)"""
    dep = spec.deployment
    problems = []
    bounds = dep.autoscaling.pd_ratio_bounds
    lo, hi = bounds.low(), bounds.high()
    if lo > hi:
        problems.append(f"deployment.autoscaling.pd_ratio_bounds: min {bounds.min} is above max {bounds.max}. Fix: swap them")
    elif dep.mode == "disaggregated" and dep.prefill and dep.decode:
        p, d = dep.prefill, dep.decode
        if not lo <= dep.ratio() <= hi:
            problems.append(f"deployment.pd_ratio: {dep.pd_ratio} is outside deployment.autoscaling.pd_ratio_bounds "
                            f"[{bounds.min}, {bounds.max}]. Fix: move the bounds or the pools")
        # Each side must be able to follow the other to its maximum within the bounds.
        if p.max_gpus() < lo * d.max_gpus():
            problems.append(
                f"deployment.prefill.scaling.max_instances: at decode's maximum ({d.max_gpus()} GPUs) the ratio "
                f"floor {bounds.min} needs {math.ceil(lo * d.max_gpus())} prefill GPUs, but prefill stops at "
                f"{p.max_gpus()}. Fix: raise prefill's maximum or lower pd_ratio_bounds.min")
        if d.max_gpus() < p.max_gpus() / hi:
            problems.append(
                f"deployment.decode.scaling.max_instances: at prefill's maximum ({p.max_gpus()} GPUs) the ratio "
                f"ceiling {bounds.max} needs {math.ceil(p.max_gpus() / hi)} decode GPUs, but decode stops at "
                f"{d.max_gpus()}. Fix: raise decode's maximum or pd_ratio_bounds.max")
    return problems


# Host memory an engine pod needs besides its caches: the engine processes (one per rank),
# pinned staging buffers, the tokenizer workers. 16 GiB a rank is an estimate, not measured
# here (no GPU): replace it with a node's measured RSS per rank. Nodes keep a share for the
# kubelet and OS.
ENGINE_PROCESS_GIB_PER_RANK = 16
NODE_RESERVED_SHARE = 0.05
SHM_GIB_PER_RANK = 8  # NCCL / torch IPC through /dev/shm, and the Mooncake local buffer


def store_ranks(spec: StackSpec) -> int:
    """Rank processes that lend a segment to the distributed store: those that run the prefix cache.

    Decode receives each request's KV from prefill and keeps no prefix tier (see engine_args).
    """
    pools = spec.deployment.pools()
    return sum(p.instances * p.gpus_per_instance() for r, p in pools.items() if r in ("prefill", "colocated"))


def store_segment_gib_per_rank(spec: StackSpec) -> int:
    """Each rank process mounts its own store segment: the spec's capacity split over all of them."""
    return max(1, spec.deployment.cache.capacity_gib // max(1, store_ranks(spec)))


def runs_prefix_cache(spec: StackSpec, role: str) -> bool:
    return spec.deployment.cache.prefix_cache and role in ("prefill", "colocated")


def weight_load_gib_per_rank(spec: StackSpec, phase: PhaseSpec) -> int:
    """Host memory a rank holds while it loads its weights: its share of the checkpoint, read from
    the files into host memory before the copy to its GPU (an estimate, not measured here: replicated
    layers make a rank's share larger, a loader that streams tensors smaller)."""
    return math.ceil((spec.model.weights.size_gib or 0) / phase.gpus_per_instance())


def pod_memory_gib(spec: StackSpec, role: str) -> dict[str, int]:
    """Host memory one engine pod needs, by part, and what a node can give it (all GiB).

    The engine processes and the memory-backed /dev/shm are there from start to end. Loading the
    weights comes first and is freed before the caches are allocated (SGLang's HiCache host pool
    and the store segments are set up once the model is on the GPU), so the pod's need is the
    larger of the two phases, not their sum.
    """
    phase = spec.deployment.pools()[role]
    hw = spec.hardware
    ranks = min(phase.gpus_per_instance(), hw.gpus_per_node)
    parts = {
        "engine processes": ranks * ENGINE_PROCESS_GIB_PER_RANK,
        "/dev/shm": ranks * SHM_GIB_PER_RANK,
        "weight loading": ranks * weight_load_gib_per_rank(spec, phase),
        "host cache tier": ranks * phase.host_cache_gib_per_rank if runs_prefix_cache(spec, role) else 0,
        "store segments": ranks * store_segment_gib_per_rank(spec)
        if runs_prefix_cache(spec, role) and spec.deployment.cache.store == "mooncake" else 0,
    }
    always = parts["engine processes"] + parts["/dev/shm"]
    need = always + max(parts["weight loading"], parts["host cache tier"] + parts["store segments"])
    share = ranks / hw.gpus_per_node
    available = int(hw.node_memory_gib * (1 - NODE_RESERVED_SHARE) * share)
    return {**parts, "total": need, "limit": max(need, int(need * 1.1)), "available": available}


def all_to_all_needs_nvlink_domain(spec: StackSpec, phase: PhaseSpec) -> bool:
    """A multi-node instance whose DeepEP all-to-all can only run over multi-node NVLink.

    DeepEP's internode kernels use NVSHMEM over IBGDA (mlx5 verbs); EFA has no IBGDA. Inside
    one NVLink domain (GB200 NVL72) NVSHMEM goes over multi-node NVLink instead. So the spec
    rejects such an instance without a supernode, and placement keeps it inside one.
    """
    fab = spec.hardware.fabric
    multi_node = phase.nodes_per_instance(spec.hardware.gpus_per_node) > 1
    return (multi_node and spec.engine.moe_a2a_backend == "deepep" and phase.expert_parallel > 1
            and (fab is None or fab.kind == "efa"))


def image_platforms(spec: StackSpec, ref: str) -> list[str] | None:
    """The architectures `ref`'s digest runs on (a placeholder: is to be built for), as images.platforms
    says (None: not listed)."""
    return spec.images.platforms.get(platform_key(ref))


def gpu_node_images(spec: StackSpec) -> dict[str, str]:
    """Images whose containers run on the GPU nodes, by the field that names them."""
    images = {"images.weights_fetcher": spec.images.weights_fetcher}
    if spec.engine.kind in spec.images.engines:
        images[f"images.engines.{spec.engine.kind}.image"] = spec.engine_image().image
    lb = spec.deployment.load_balancer
    if lb.implementation == "gateway_epp" and spec.deployment.mode == "disaggregated" and spec.images.routing_sidecar:
        images["images.routing_sidecar"] = spec.images.routing_sidecar
    return images


def image_platform_problems(spec: StackSpec) -> list[str]:
    """An image digest that cannot run on the nodes it is scheduled to (an exec format error at
    start, after the node was paid for)."""
    arch, problems = spec.hardware.cpu_architecture, []
    for field, ref in gpu_node_images(spec).items():
        platforms = image_platforms(spec, ref)
        if platforms is None:
            problems.append(f"images.platforms: {field} ({platform_key(ref)}) is not listed. Fix: add it with the "
                            f"platforms its manifest names (`pdctl images` reads them from the registry)")
        elif arch not in platforms:
            problems.append(f"{field}: its digest runs on {', '.join(platforms)}, the GPU nodes are {arch} "
                            f"(hardware.cpu_architecture). Fix: an image built for {arch}, or an index that "
                            f"includes it, listed in images.platforms")
    return problems


ENGINE_IMAGE_RECIPE = "images/engine-efa.Dockerfile"
# The first Mooncake whose transfer engine has an efa transport (USE_EFA, src/transport/efa_transport)
# and whose Python TransferEngine.initialize honours protocol "efa": 0.3.8.post1's binding ignores its
# protocol argument (mooncake-integration/transfer_engine/transfer_engine_py.cpp). PyPI publishes
# the build as mooncake-transfer-engine-efa (tests/test_mooncake_efa.py runs it).
MOONCAKE_EFA_SINCE = (0, 3, 10)


def mooncake_release(spec: StackSpec) -> str | None:
    """The Mooncake release the stack runs, as PyPI and kvcacheai/mooncake's tags (v<release>) spell
    it: the tag of images.mooncake_master, which the engine image's Mooncake is built at too (the
    recipe's MOONCAKE_VERSION). None when the reference has no release tag."""
    tag = image_tag(spec.images.mooncake_master) or ""
    return tag.removeprefix("v") if re.match(r"v?\d+(\.\d+)*", tag) else None


def mooncake_version(spec: StackSpec) -> tuple[int, ...] | None:
    """mooncake_release's numeric part (0.3.13.post1 -> (0, 3, 13)), to compare."""
    release = mooncake_release(spec)
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", release).group().split(".")) if release else None


def mooncake_efa_problems(spec: StackSpec) -> list[str]:
    """The engine's image said to carry Mooncake's efa transport, at a Mooncake release that has
    none: the engine would be told MOONCAKE_PROTOCOL=efa and move KV over something else, silently."""
    version, since = mooncake_version(spec), ".".join(map(str, MOONCAKE_EFA_SINCE))
    if not spec.engine_image().mooncake_efa or (version is not None and version >= MOONCAKE_EFA_SINCE):
        return []
    tag = image_tag(spec.images.mooncake_master)
    return [f"images.engines.{spec.engine.kind}.mooncake_efa: Mooncake has an efa transport from {since} on, and "
            f"images.mooncake_master (the Mooncake release the stack runs) "
            f"{f'is tagged {tag}' if version else 'names no version tag'}. Fix: kvcacheai/mooncake:v{since} or later "
            f"for the master and {ENGINE_IMAGE_RECIPE} built with MOONCAKE_VERSION at that release, or "
            "mooncake_efa: false"]


def transfer_problems(spec: StackSpec) -> list[str]:
    """Can the engine's image move KV (and NCCL traffic) over this fabric on this architecture?

    EFA is reached only through AWS's libfabric (EFA provider). NIXL's LIBFABRIC backend builds
    on it for x86_64 and arm64 (ai-dynamo/nixl, src/plugins/libfabric). Mooncake's `efa` transport
    exists only in builds made with EFA support, published for x86_64 alone (kvcache-ai/Mooncake,
    the mooncake-transfer-engine wheels; USE_EFA in mooncake-transfer-engine/CMakeLists). On
    InfiniBand/RoCE Mooncake uses verbs (`rdma`) and NIXL its UCX backend. The transport each
    backend then uses is chosen in infra/render/fabric.py.
    """
    kind, fab, hw, dep = spec.engine.kind, spec.hardware.fabric, spec.hardware, spec.deployment
    if kind not in spec.images.engines:
        return [f"images.engines.{kind}: engine.kind is {kind} and no image is named for it. Fix: add "
                f"images.engines.{kind} with its image pinned by digest and what it contains"]
    img, field, problems = spec.engine_image(), f"images.engines.{kind}", mooncake_efa_problems(spec)
    recipe = f"build {ENGINE_IMAGE_RECIPE} and name that image"
    kv = spec.engine.kv_transfer
    if fab is not None and fab.kind == "efa":
        if not img.efa_libfabric:
            problems.append(f"{field}.efa_libfabric: EFA is reached only through AWS's libfabric (EFA provider), "
                            f"which the image does not have. Fix: {recipe}, with efa_libfabric: true")
        spans_fabric = hw.supernode is None and any(p.nodes_per_instance(hw.gpus_per_node) > 1
                                                    for p in dep.pools().values())
        if spans_fabric and not img.aws_ofi_nccl:
            problems.append(f"{field}.aws_ofi_nccl: a group spans nodes over EFA and NCCL reaches EFA only through "
                            f"aws-ofi-nccl, which the image does not have. Fix: {recipe}, with aws_ofi_nccl: true")
        if dep.mode == "disaggregated" and kv == "mooncake":
            if hw.cpu_architecture != "amd64":
                problems.append(f"engine.kv_transfer: Mooncake's efa transport is built for x86_64 only, and the "
                                f"nodes are {hw.cpu_architecture}. Fix: kv_transfer: nixl (NIXL's LIBFABRIC backend "
                                "over EFA)")
            elif not img.mooncake_efa:
                problems.append(f"{field}.mooncake_efa: the P->D hop over EFA needs Mooncake built with EFA support "
                                f"(its efa transport), and the image's Mooncake has none. Fix: {recipe} with "
                                "mooncake_efa: true, or kv_transfer: nixl")
    if dep.mode == "disaggregated" and kv == "nixl":
        needed = "LIBFABRIC" if fab is not None and fab.kind == "efa" else "UCX"
        if needed not in img.nixl_backends:
            problems.append(f"{field}.nixl_backends: NIXL over {fab.kind if fab else 'TCP'} needs its {needed} "
                            f"backend, and the image has {', '.join(img.nixl_backends)}. Fix: "
                            + (f"{recipe}, with LIBFABRIC listed" if needed == "LIBFABRIC" else "an image with "
                               "NIXL's UCX plugin (the stock builds have it)"))
    return problems


def weight_cache_gib(spec: StackSpec) -> float | None:
    """What the node cache must hold: every copy of the weights (none known without size_gib)."""
    w = spec.model.weights
    if w.size_gib is None:
        return None
    return w.size_gib * w.cache.copies


def weight_cache_problems(spec: StackSpec) -> list[str]:
    """Whether the weights fit where the node cache lives (infra/platform_stack/weight_cache.py)."""
    w = spec.model.weights
    cache, path = w.cache, w.node_cache_path.rstrip("/")
    need = weight_cache_gib(spec)
    problems = []
    if cache.medium == "instance-store":
        if not (path + "/").startswith(RAID0_MOUNT + "/"):
            problems.append(
                f"model.weights.node_cache_path: {w.node_cache_path} is not on the instance-store array (RAID0 mounts "
                f"it at {RAID0_MOUNT}; anywhere else is the root volume). Fix: {RAID0_MOUNT}/pdstack-weights")
        # (a spec without size_gib is refused by hardware_problems: the startup probes need it too)
        for itype in spec.hardware.instance_types:
            gb = INSTANCE_STORE_GB.get(itype)
            if gb is None:
                problems.append(
                    f"hardware.instance_types: {itype}'s instance-store size is not known to pdstack "
                    f"(infra/platform_stack/weight_cache.py INSTANCE_STORE_GB). Fix: add it from DescribeInstanceTypes "
                    "(InstanceStorageInfo.TotalSizeInGB), or model.weights.cache.medium: host-path")
            elif need is not None and need + ARRAY_RESERVE_GIB > gib_of_gb(gb):
                problems.append(
                    f"model.weights.size_gib: {w.size_gib} GiB x {cache.copies} copies + {ARRAY_RESERVE_GIB} GiB for "
                    f"images and logs does not fit {itype}'s instance store ({gib_of_gb(gb):.0f} GiB). Fix: fewer "
                    "cache.copies, or a type with more instance store")
    else:
        # Without capacity_gib the preflight's free-disk check (the inventory's min_free_disk_gib) is the only one.
        if cache.capacity_gib is not None and need is not None and need > cache.capacity_gib:
            problems.append(
                f"model.weights.size_gib: {w.size_gib} GiB x {cache.copies} copies does not fit the "
                f"{cache.capacity_gib} GiB disk at {w.node_cache_path}. Fix: a bigger disk, or fewer cache.copies")
    return problems


def hardware_problems(spec: StackSpec) -> list[str]:
    """Images, fabric and memory against the hardware the spec names."""
    hw, eng, dep = spec.hardware, spec.engine, spec.deployment
    problems = []
    if hw.gpu_type == "GB200" and hw.cpu_architecture != "arm64":
        problems.append("hardware.cpu_architecture: GB200 nodes run Grace CPUs (arm64). Fix: arm64")
    problems += image_platform_problems(spec)
    problems += transfer_problems(spec)
    if hw.supernode is not None and hw.gpu_type != "GB200":
        problems.append(
            f"hardware.supernode: {hw.gpu_type} nodes share no NVLink domain across nodes (multi-node NVLink is "
            "GB200 NVL72's). Fix: remove supernode (wide EP then runs colocated or over the fabric), or gpu_type: GB200")
    if hw.supernode is not None and any(p.nodes_per_instance(hw.gpus_per_node) > 1 for p in dep.pools().values()):
        major, minor = (int(x) for x in spec.environment.kubernetes_version.split(".")[:2])
        if (major, minor) < (1, 34):
            problems.append(
                f"environment.kubernetes_version: groups spanning nodes of an NVLink domain claim an IMEX channel "
                f"through NVIDIA's DRA driver (ComputeDomain), and DRA is on by default from Kubernetes 1.34 "
                f"(resource.k8s.io/v1); {spec.environment.kubernetes_version} is older. Fix: 1.34 or later")
    problems += weight_cache_problems(spec)
    w = spec.model.weights
    if w.size_gib is None:
        problems.append("model.weights.size_gib: the engines' startup probes allow the load time it implies "
                        "(with load_gib_per_second and start_minutes); without it a large model is killed while it "
                        "loads. Fix: set the weight files' total size")
    if w.access == "secret" and is_aws_s3(w.endpoint_url):
        problems.append("model.weights.access: secret means a static AWS key copied into every namespace, and the "
                        "endpoint is AWS S3. Fix: pod-identity (or irsa): the platform stack creates the role")
    if w.access in ("pod-identity", "irsa") and not is_aws_s3(w.endpoint_url):
        problems.append(f"model.weights.access: {w.access} gives AWS credentials, and {w.endpoint_url} is not AWS S3. "
                        "Fix: secret (a Secret with the store's keys in each namespace)")
    fab = hw.fabric
    if fab is not None and len(fab.devices) > fab.per_node:
        problems.append(f"hardware.fabric.devices: {len(fab.devices)} devices named but per_node is {fab.per_node}. "
                        "Fix: name at most per_node devices")
    if fab is not None and fab.kind == "efa" and fab.resource != "vpc.amazonaws.com/efa":
        problems.append(f"hardware.fabric.resource: EFA's device plugin advertises vpc.amazonaws.com/efa, not "
                        f"{fab.resource}. Fix: vpc.amazonaws.com/efa")
    if fab is not None and fab.kind != "efa" and fab.resource == "vpc.amazonaws.com/efa":
        problems.append(f"hardware.fabric.kind: {fab.kind} with the EFA resource. Fix: kind: efa, or the RDMA "
                        "device plugin's resource (e.g. rdma/ib)")
    for role, phase in dep.pools().items():
        if all_to_all_needs_nvlink_domain(spec, phase):
            wide_rule_fired = role in ("decode", "colocated")  # "needs a supernode" already says it
            if hw.supernode is None and not wide_rule_fired:
                have = "no RDMA fabric" if fab is None else "EFA, which has no IBGDA"
                problems.append(
                    f"engine.moe_a2a_backend: deepep across nodes ({role}, EP {phase.expert_parallel}) needs "
                    f"InfiniBand/RoCE with IBGDA or one NVLink domain, and this hardware has {have}. "
                    f"Fix: moe_a2a_backend: none, keep deployment.{role}.expert_parallel within a node, or "
                    "hardware.fabric.kind: infiniband")
        if hw.fabric is None and dep.mode == "disaggregated" and eng.kv_transfer == "mooncake" and role == "prefill":
            problems.append("hardware.fabric: PD disaggregation moves every prompt's KV between nodes and no RDMA "
                            "fabric is named. Fix: describe the fabric (efa, infiniband or roce)")
        mem = pod_memory_gib(spec, role)
        if mem["limit"] > mem["available"]:
            parts = ", ".join(f"{k} {v}" for k, v in mem.items() if k not in ("total", "limit", "available") and v)
            problems.append(
                f"deployment.{role}.host_cache_gib_per_rank: one {role} pod needs {mem['limit']} GiB of host memory "
                f"({parts}; loading and caches at different times, +10% headroom) but its share of a node is "
                f"{mem['available']} GiB "
                f"(hardware.node_memory_gib {hw.node_memory_gib}). Fix: lower host_cache_gib_per_rank or "
                "deployment.cache.capacity_gib, or add prefill ranks")
        if spec.model.num_dense_layers() and spec.model.dense_intermediate_size is None:
            problems.append("model.dense_intermediate_size: the model has dense layers (num_layers > num_moe_layers) "
                            "and their FFN width is needed to split them. Fix: set it from config.json "
                            "intermediate_size")
            break
    return problems


def cross_field_problems(spec: StackSpec) -> list[str]:
    """Every rule that spans fields. Each line: `field.path: what is wrong. Fix: how.`"""
    problems: list[str] = []
    dep, hw = spec.deployment, spec.hardware

    pinned = PINNED_ENGINE_VERSIONS[spec.engine.kind]
    if spec.engine.version != pinned:
        problems.append(
            f"engine.version: {spec.engine.version} is not the pinned {spec.engine.kind} version. "
            f"Fix: use {pinned} (flag sets are checked against it)"
        )

    if dep.mode == "colocated":
        if dep.colocated is None:
            problems.append("deployment.colocated: missing. Fix: describe the one pool colocated mode runs")
        for extra in ("prefill", "decode"):
            if getattr(dep, extra) is not None:
                problems.append(
                    f"deployment.{extra}: set in colocated mode. Fix: remove it, or set mode: disaggregated"
                )
    else:
        for needed in ("prefill", "decode"):
            if getattr(dep, needed) is None:
                problems.append(f"deployment.{needed}: missing. Fix: describe the {needed} pool")
        if dep.colocated is not None:
            problems.append("deployment.colocated: set in disaggregated mode. Fix: remove it")

    for role, phase in dep.pools().items():
        path = f"deployment.{role}"
        problems += _ep_fits_nodes(f"{path}.expert_parallel", phase.expert_parallel, hw.gpus_per_node)
        if phase.expert_placement:
            problems += _placement_problems(f"{path}.expert_placement", REPO_ROOT / phase.expert_placement,
                                            spec.model, spec.model.num_routed_experts + phase.redundant_experts)
        slots = spec.model.num_routed_experts + phase.redundant_experts
        if slots % phase.expert_parallel:
            problems.append(
                f"{path}.redundant_experts: {spec.model.num_routed_experts} experts + {phase.redundant_experts} "
                f"redundant = {slots} slots do not split evenly over EP {phase.expert_parallel}. "
                f"Fix: make experts + redundant a multiple of {phase.expert_parallel}"
            )
        if phase.scaling and not (
            phase.scaling.min_instances <= phase.instances <= phase.scaling.max_instances
        ):
            problems.append(
                f"{path}.instances: {phase.instances} is outside scaling bounds "
                f"[{phase.scaling.min_instances}, {phase.scaling.max_instances}]. Fix: move one of them"
            )

    wide = {r: p for r, p in dep.pools().items() if p.nodes_per_instance(hw.gpus_per_node) > 1}
    if dep.mode == "disaggregated" and dep.decode and "decode" in wide:
        if hw.supernode is None:
            problems.append(
                f"deployment.decode.expert_parallel: wide EP ({dep.decode.expert_parallel} GPUs over "
                f"{dep.decode.nodes_per_instance(hw.gpus_per_node)} nodes) needs a supernode and "
                "hardware.supernode is not set. Fix: set hardware.supernode, or use mode: colocated"
            )
        elif dep.decode.expert_parallel > hw.supernode.gpus:
            problems.append(
                f"deployment.decode.expert_parallel: {dep.decode.expert_parallel} is larger than the "
                f"supernode's {hw.supernode.gpus} GPUs. Fix: at most {hw.supernode.gpus}, or a bigger supernode"
            )
    if dep.mode == "colocated" and dep.colocated and "colocated" in wide and hw.supernode is None:
        problems.append(
            "deployment.colocated.expert_parallel: spans nodes but hardware.supernode is not set. "
            f"Fix: at most {hw.gpus_per_node} (one node) without a supernode"
        )

    if dep.mode == "disaggregated" and dep.prefill and dep.decode:
        actual = Fraction(dep.prefill.total_gpus(), dep.decode.total_gpus())
        if actual != dep.ratio():
            problems.append(
                f"deployment.pd_ratio: '{dep.pd_ratio}' disagrees with the pools: prefill "
                f"{dep.prefill.instances}x{dep.prefill.gpus_per_instance()} GPUs, decode "
                f"{dep.decode.instances}x{dep.decode.gpus_per_instance()} GPUs is "
                f"{actual.numerator}:{actual.denominator}. Fix: set pd_ratio to "
                f"'{actual.numerator}:{actual.denominator}' or change the instance counts"
            )

    problems += engine_capability_problems(spec)
    problems += ratio_bounds_problems(spec)
    problems += hardware_problems(spec)

    if dep.cache.store == "mooncake" and dep.cache.eviction_policy != "lru":
        problems.append(
            f"deployment.cache.eviction_policy: the Mooncake store evicts least-recently-used objects only, "
            f"not {dep.cache.eviction_policy}. Fix: lru, or store: lmcache"
        )

    t = spec.timeouts
    order = [
        ("gateway_to_router", t.gateway_to_router),
        ("router_to_prefill", t.router_to_prefill),
        ("prefill_to_decode_kv", t.prefill_to_decode_kv),
    ]
    for (outer_name, outer), (inner_name, inner) in zip(order, order[1:]):
        # An inner hop, retried, must finish before the outer hop gives up, or the outer
        # side times out while the inner one is still working. (The router's own whole-request
        # timeout is gateway_to_router's: it covers the longest stream the gateway allows.)
        inner_budget = inner.timeout_seconds * (inner.retries + 1)
        if inner_budget >= outer.timeout_seconds:
            problems.append(
                f"timeouts.{inner_name}.timeout_seconds: {inner.timeout_seconds}s x {inner.retries + 1} "
                f"attempts is not below timeouts.{outer_name}.timeout_seconds ({outer.timeout_seconds}s). "
                f"Fix: lower it, or its retries, below {outer.timeout_seconds / (inner.retries + 1):g}s"
            )

    floor = longest_prefill_seconds(spec)
    if dep.mode == "disaggregated" and t.router_to_prefill.timeout_seconds < floor:
        problems.append(
            f"timeouts.router_to_prefill.timeout_seconds: {t.router_to_prefill.timeout_seconds:g}s is shorter than a "
            f"full-context prompt's prefill at the TTFT SLO ({floor:g}s: {spec.model.context_length} tokens in "
            f"chunks of {prefill_chunk_tokens(spec)}, each allowed slo.ttft_p99_ms); the engines would drop long "
            f"prompts mid-prefill. Fix: at least {math.ceil(floor)}")

    if spec.slo.tokens_per_second_per_user > 1000 / spec.slo.tpot_p99_ms:
        problems.append(
            f"slo.tokens_per_second_per_user: {spec.slo.tokens_per_second_per_user} cannot be met with "
            f"tpot_p99_ms {spec.slo.tpot_p99_ms} (at most {1000 / spec.slo.tpot_p99_ms:g}). "
            "Fix: lower it or tighten tpot_p99_ms"
        )
    return problems


SGLANG_DEFAULT_CHUNKED_PREFILL = 8192  # sglang 0.5.23 server_args: --chunked-prefill-size on large GPUs


def prefill_chunk_tokens(spec: StackSpec) -> int:
    """Prompt tokens one request advances per prefill pass (a request runs on one DP rank)."""
    pool = spec.deployment.prefill or spec.deployment.colocated
    return (pool.chunked_prefill_tokens_per_rank if pool and pool.chunked_prefill_tokens_per_rank
            else SGLANG_DEFAULT_CHUNKED_PREFILL)


def longest_prefill_seconds(spec: StackSpec) -> float:
    """How long the prefill hop may take for a prompt filling the context: one TTFT budget per
    chunked pass (an estimate from the SLO, not a measurement; the hop timeouts must not be shorter)."""
    passes = math.ceil(spec.model.context_length / prefill_chunk_tokens(spec))
    return passes * spec.slo.ttft_p99_ms / 1000
