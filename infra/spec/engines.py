"""The model and its weights, the engine, and the hardware it runs on (GPUs, fabric, NVLink
domains, node class)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from infra.inputs import Strict
from infra.naming import S3_BUCKET_NAME, is_dns_subdomain, is_hf_repo_id, is_host_path, is_label_key, is_label_value
from infra.spec._base import _REGION, PositiveInt, _checked, _service_url, is_aws_s3
from infra.weights import SAFE_NAME, unsafe_name


# The engine versions pdstack renders for. Their flag sets live in infra/render/pinned/.
PINNED_ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}


def _key_prefix(v: str) -> bool:
    """An S3 key prefix of weight files: a name infra/weights.py would fetch (SAFE_NAME, parts that
    fit a node's file names), optionally ending in '/'."""
    return unsafe_name(v.removesuffix("/")) is None and len(v.encode()) <= 512


_RDMA_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:]{0,63}")  # ibv_devices names: mlx5_0, rdmap79s0
# Karpenter v1.14.1 NodePool spec.disruption.budgets[].nodes (pkg/apis/crds/karpenter.sh_nodepools.yaml)
_BUDGET = re.compile(r"((100|[0-9]{1,2})%|[0-9]+)")


def _version_number(v: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+){0,3}", v):
        raise ValueError(f"{v[:40]!r} is not a version number. Fix: e.g. 570.124.06 (what nvidia-smi prints)")
    return v


# --- model and weights -------------------------------------------------------------------


class WeightsCacheSpec(Strict):
    """Where the node-local weight cache lives (weight_cache_problems checks the fit)."""

    medium: Literal["instance-store", "host-path"] = Field(
        "host-path", description="instance-store: the node class's RAID0 array of NVMe instance stores (AWS; the "
                                 "path must be under its mount, /mnt/k8s-disks/0); host-path: a disk the operator "
                                 "mounted at node_cache_path (on-prem).")
    capacity_gib: PositiveInt | None = Field(None, description="host-path: the size of the disk at the path.")
    copies: PositiveInt = Field(2, description="Weight sets the cache must hold at once: this revision's and the "
                                               "next one's, while a rollout runs both.")


class WeightsSpec(Strict):
    endpoint_url: str = Field(description="S3-compatible endpoint (cloud, Ceph RGW, MinIO).")

    _url = field_validator("endpoint_url")(classmethod(lambda cls, v: _service_url(v)))
    region: str = "us-east-1"
    bucket: str
    _region = field_validator("region")(_checked(_REGION.fullmatch, "is not a region name (lower-case letters, digits "
                                                 "and '-'). Fix: e.g. us-east-1"))
    _prefix = field_validator("prefix")(_checked(_key_prefix, (
        "is not a key prefix pdstack fetches from: parts of letters, digits, '.', '_' and '-' joined by '/', no '..' "
        "part, no leading '/' (AWS's safe characters for object keys). Fix: e.g. deepseek-v3/")))
    _manifest = field_validator("checksum_manifest")(_checked(lambda v: re.fullmatch(SAFE_NAME, v), (
        "is not a key name (letters, digits, '.', '_', '-', '/'). Fix: SHA256SUMS.json")))
    _cache_path = field_validator("node_cache_path")(_checked(is_host_path, (
        "is not an absolute node path of letters, digits, '.', '_' and '-' parts (no '..'). Fix: e.g. /mnt/weights")))
    _secret = field_validator("credentials_secret")(_checked(is_dns_subdomain, (
        "is not a Kubernetes Secret name (lower-case DNS subdomain). Fix: e.g. weights-s3-credentials")))

    @field_validator("bucket")
    @classmethod
    def _bucket_named(cls, v: str) -> str:
        if not S3_BUCKET_NAME.fullmatch(v):
            raise ValueError(f"{v[:80]!r} is not an S3 bucket name (3-63 lower-case letters, digits, '.' and '-'). "
                             "Fix: correct it")
        return v
    prefix: str = Field(description="Key prefix under which the weight files live.")
    checksum_manifest: str = Field(
        "SHA256SUMS.json", description="Key, relative to prefix, of the sha256 manifest."
    )
    node_cache_path: str = "/mnt/weights"
    node_cache_retention_hours: PositiveInt = Field(
        168, description="`pdctl cost` flags weight-cache folders on nodes unused for longer than this.")
    size_gib: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Total size of the weight files; with load_gib_per_second, how long an instance is "
                          "out of service when it restarts (`pdctl diff`'s capacity estimate).")
    load_gib_per_second: Annotated[float, Field(gt=0)] = Field(
        4.0, description="Rate an instance reads its weights from the node cache into GPU memory.")
    start_minutes: Annotated[float, Field(ge=0)] = Field(
        3.0, description="Minutes an engine needs after loading (CUDA graphs, warm-up) before it serves.")
    fetch_gib_per_second: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Rate one node fetches the weights from the bucket into its cache (the init container's "
                         "parallel GETs): with size_gib, how long a node's fetch takes, a fetch wave.")
    fetch_nodes_at_once: PositiveInt = Field(
        16, description="Nodes that fetch the weights from the bucket at once. On a first deploy the pools' nodes, "
                        "in group order, fetch in waves of this many, each node waiting its wave's turn (a node whose "
                        "cache is already verified waits for nothing); the startup probes count the wait.")
    credentials_secret: str = Field(
        "weights-s3-credentials",
        description="access: secret only: an existing Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the "
                    "environment's namespace, which the stack copies into each release track's (non-AWS S3: MinIO, "
                    "Ceph RGW).",
    )
    access: Literal["pod-identity", "irsa", "secret"] | None = Field(
        None, description="How the fetch step gets credentials: EKS Pod Identity or IRSA (a role the platform stack "
                          "creates, no key anywhere), or a Secret (S3-compatible stores outside AWS only). Default: "
                          "pod-identity for AWS S3 endpoints, secret otherwise.")
    cache: WeightsCacheSpec = WeightsCacheSpec()

    def restart_seconds(self) -> float:
        """From container start to serving: the weight load plus warm-up (estimates, no margin; 0 for an
        unknown size, which the spec refuses where it matters)."""
        return (self.size_gib or 0) / self.load_gib_per_second + self.start_minutes * 60

    def access_mode(self) -> str:
        if self.access:
            return self.access
        return "pod-identity" if is_aws_s3(self.endpoint_url) else "secret"


class ModelSpec(Strict):
    name: str = Field(description="Served model name, e.g. deepseek-ai/DeepSeek-V3.")
    _name = field_validator("name")(_checked(is_hf_repo_id, (
        "is not a Hugging Face model id ([owner/]name of letters, digits, '_', '.' and '-', at most 96, no '--' or "
        "'..'). Fix: e.g. deepseek-ai/DeepSeek-V3")))
    num_layers: PositiveInt
    num_moe_layers: PositiveInt
    num_routed_experts: PositiveInt
    num_expert_groups: PositiveInt = 1
    multimodal: bool = False
    context_length: PositiveInt = 32768
    dense_intermediate_size: PositiveInt | None = Field(
        None, description="FFN width of the dense (non-MoE) layers, from the model's config.json "
                          "(`intermediate_size`). Needed when num_layers > num_moe_layers: how the dense MLP may "
                          "be split across GPUs depends on it.")
    fp8_block_size: PositiveInt | None = Field(
        None, description="Block size of block-wise FP8 weights (config.json quantization_config."
                          "weight_block_size, 128 for DeepSeek-V3); none for BF16 weights.")
    weights: WeightsSpec

    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers


# --- engine and hardware ------------------------------------------------------------------


class EngineSpec(Strict):
    """The engine the pools run; its image is images.engines.<kind>, so it follows the engine."""

    kind: Literal["sglang", "vllm"]
    version: str
    kv_transfer: Literal["mooncake", "nixl"] = Field(
        "mooncake", description="The prefill-to-decode KV transfer library. Over EFA: nixl (its LIBFABRIC backend, "
                                "every architecture) or mooncake (its efa transport: x86_64 builds with EFA only).")
    moe_a2a_backend: Literal["deepep", "none"] = "deepep"
    mem_fraction_static: Annotated[float, Field(gt=0, le=1)] = 0.85
    kv_page_size: PositiveInt = Field(
        64, description="Tokens per KV-cache page (SGLang --page-size, vLLM --block-size), the same on every "
                        "pool: KV moves from prefill to decode page by page. Each engine otherwise picks it per "
                        "attention backend, and prefill and decode may pick different backends. 64 is what "
                        "SGLang forces for MLA (FlashMLA, TensorRT-LLM MLA) and what every backend here accepts; "
                        "`scripts/check_engine_args.py` records the size each engine resolves.")
    trust_remote_code: bool = True


class NodeClassRef(Strict):
    group: str = "karpenter.k8s.aws"
    kind: str = "EC2NodeClass"
    name: str = "gpu"

    _group = field_validator("group")(_checked(is_dns_subdomain, "is not an API group. Fix: karpenter.k8s.aws"))
    _kind = field_validator("kind")(_checked(lambda v: re.fullmatch(r"[A-Z][A-Za-z0-9]{0,62}", v),
                                             "is not a Kubernetes kind. Fix: EC2NodeClass"))
    _name = field_validator("name")(_checked(is_dns_subdomain, "is not an object name (lower-case DNS subdomain). "
                                                               "Fix: the node class's metadata.name"))


class SupernodeSpec(Strict):
    gpus: PositiveInt = Field(description="GPUs in one NVLink domain, e.g. 72 for GB200 NVL72.")
    count: PositiveInt = Field(1, description="NVLink domains this environment may use.")
    topology_label: str = "nvidia.com/gpu.clique"

    @field_validator("topology_label")
    @classmethod
    def _label_key(cls, v: str) -> str:
        if not is_label_key(v):
            raise ValueError(f"{v[:80]!r} is not a Kubernetes label key ([prefix/]name, the name 63 at most). "
                             "Fix: e.g. nvidia.com/gpu.clique")
        return v


class FabricSpec(Strict):
    """The RDMA network between nodes: what pods request and what the transfer backends use.

    efa: AWS Elastic Fabric Adapter (libfabric; p5, p6e-gb200). infiniband / roce: Mellanox
    mlx5 NICs (verbs, GPUDirect RDMA, DeepEP's IBGDA).
    """

    kind: Literal["efa", "infiniband", "roce"]
    resource: str = Field(description="Device-plugin resource each engine pod requests, e.g. "
                                      "vpc.amazonaws.com/efa or rdma/ib.")
    per_node: PositiveInt = Field(description="Devices of that resource on one node.")
    devices: list[str] = Field(min_length=1, description="Device names the engines bind (ibv_devices), "
                                                         "e.g. rdmap79s0 on EFA, mlx5_0 on InfiniBand.")

    _resource = field_validator("resource")(_checked(is_label_key, (
        "is not a Kubernetes extended resource name ([domain/]name). Fix: e.g. vpc.amazonaws.com/efa or rdma/ib")))
    _devices = field_validator("devices")(classmethod(lambda cls, v: [
        _checked(_RDMA_DEVICE.fullmatch, "is not an RDMA device name as ibv_devices lists it. Fix: e.g. mlx5_0")
        .__func__(cls, d) for d in v]))


class HardwareSpec(Strict):
    gpu_type: Literal["H100", "H200", "B200", "GB200"]
    cpu_architecture: Literal["amd64", "arm64"] = Field(
        "amd64", description="The nodes' CPU architecture (GB200: arm64 Grace).")
    gpus_per_node: PositiveInt
    gpu_memory_gib: PositiveInt
    node_memory_gib: PositiveInt = Field(description="Host memory of one node (p5.48xlarge 2048, "
                                                     "p6e-gb200.36xlarge 960).")
    fabric: FabricSpec | None = Field(None, description="RDMA fabric; without it KV moves over TCP.")
    instance_types: list[str] = Field(min_length=1)
    supernode: SupernodeSpec | None = None
    capacity_type: Literal["on-demand", "reserved"] = Field(
        "on-demand", description="Karpenter capacity type of the GPU nodes. reserved: On-Demand Capacity "
                                 "Reservations or EC2 Capacity Blocks for ML (how NVL72 UltraServers are sold), "
                                 "selected by the node class's capacityReservationSelectorTerms.")
    driver_version: str = Field(description="NVIDIA driver version the preflight expects.")
    cuda_version: str

    _versions = field_validator("driver_version", "cuda_version")(classmethod(lambda cls, v: _version_number(v)))
    node_class: NodeClassRef = Field(
        NodeClassRef(), description="The Karpenter node class the GPU pools launch from (owned by the platform); "
                                    "with capacity_type reserved it selects the reservations.")
    max_gpus: PositiveInt | None = Field(
        None, description="GPU quota of the environment: the pools' limits together may not exceed it.")
    disruption_budget: str = Field("10%", description="Karpenter: nodes that may be disrupted at once.")

    _budget = field_validator("disruption_budget")(_checked(_BUDGET.fullmatch, (
        "is not a Karpenter budget (a count or a percentage). Fix: e.g. 10% or 1")))
    _instance_types = field_validator("instance_types")(classmethod(lambda cls, v: [
        _checked(lambda t: t and is_label_value(t), "is not an instance type (a node label value). Fix: e.g. "
                                                    "p5.48xlarge").__func__(cls, t) for t in v]))
