"""The typed deployment spec: one per environment, the single source of truth.

Everything pdstack creates or renders is derived from a `StackSpec`. Parsing is strict:
unknown keys are errors (a typo must not be silently ignored), and cross-field rules are
checked once, with messages that name the field and say how to fix it. This module holds the
data and its own rules (`cross_field_problems`) and imports no planner: a spec is read with
`infra.spec_checks.load_spec`/`parse_spec`, which add the rules that need the planner.
"""

from __future__ import annotations

import ipaddress
import math
import re
import urllib.parse
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from infra.images import ImageRef, platform_key
from infra.inputs import InputError, Strict
from infra.naming import (
    OCI_TAGGED_REFERENCE, PULUMI_STACK_REFERENCE, S3_BUCKET_NAME, is_dns_subdomain, is_hf_repo_id, is_host_path,
    is_label_key, is_label_value,
    release_store_url_problem)
from infra.platform_stack.weight_cache import ARRAY_RESERVE_GIB, INSTANCE_STORE_GB, RAID0_MOUNT, gib_of_gb
from infra.weights import SAFE_NAME, unsafe_name

REPO_ROOT = Path(__file__).resolve().parent.parent
STACKS_DIR = REPO_ROOT / "stacks"

# The engine versions pdstack renders for. Their flag sets live in infra/render/pinned/.
PINNED_ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

PositiveInt = Annotated[int, Field(gt=0)]
Seconds = Annotated[float, Field(gt=0)]


def _dns_label(v: str, most: int = 63) -> str:
    if not _DNS_LABEL.match(v):
        raise ValueError(f"{v!r} is not a DNS label. Fix: lower-case letters, digits and '-'")
    if len(v) > most:
        raise ValueError(f"{v!r} has {len(v)} characters; at most {most} fit"
                         + (" (a DNS label is 63 at most)" if most == 63 else
                            " (release tracks run in '<namespace>-r<revision>', itself a DNS label of 63 at most)")
                         + ". Fix: shorten it")
    return v


NAMESPACE_MAX = 63 - len("-r9999")  # room for the release-track suffix (infra/tracks.py)


_SECRET_QUERY_KEYS = re.compile(r"(key|token|secret|password|passwd|signature|sig|credential|auth)", re.I)


def _url_without_credentials(v: str | None) -> str | None:
    """A URL in the spec may name a host, never carry a secret: specs live in git and in plain
    ConfigMaps. Credentials come from Kubernetes Secrets (e.g. weights.credentials_secret)."""
    if v is None:
        return v
    parsed = urllib.parse.urlsplit(v)
    if parsed.username or parsed.password:
        raise ValueError("the URL carries credentials (user:password@). Fix: remove them; the credentials "
                         "belong in a Kubernetes Secret the component reads")
    leaked = [k for k, _ in urllib.parse.parse_qsl(parsed.query) if _SECRET_QUERY_KEYS.search(k)]
    if leaked:
        raise ValueError(f"the URL's query carries {', '.join(leaked)}, which looks like a credential. Fix: "
                         "remove it; the credentials belong in a Kubernetes Secret")
    return v


def _service_url(v: str | None) -> str | None:
    """An http(s) URL of a service (no credentials in it): what a component will connect to."""
    if v is None:
        return v
    try:
        parsed = urllib.parse.urlsplit(v)
        parsed.port  # noqa: B018 - raises for a port out of range
    except ValueError as exc:
        raise ValueError(f"{v!r} is not a URL ({exc}). Fix: e.g. http://name.namespace.svc:port") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{v[:80]!r} is not an http:// or https:// URL with a host. Fix: e.g. "
                         "http://name.namespace.svc:port")
    return _url_without_credentials(v)


def _dns_subdomain(v: str) -> str:
    if not is_dns_subdomain(v.removeprefix("*.")):
        raise ValueError(f"{v[:80]!r} is not a DNS name (lower-case labels of letters, digits and '-', at most 63 "
                         "each and 253 in all). Fix: correct it")
    return v


def _shown(v: str) -> str:
    return repr(v[:80])


def _checked(test, fix: str):
    """A field validator: `test(v)` must hold, else the value (cut, quoted) and the fix. Every
    string that reaches a rendered script, a command line or a path is held to what the system
    that reads it accepts, so no spec value can be read as shell syntax, an option or a path
    elsewhere."""
    def check(cls, v):
        if v is not None and not test(v):
            raise ValueError(f"{_shown(v)} {fix}")
        return v
    return classmethod(check)


def _key_prefix(v: str) -> bool:
    """An S3 key prefix of weight files: a name infra/weights.py would fetch (SAFE_NAME, parts that
    fit a node's file names), optionally ending in '/'."""
    return unsafe_name(v.removesuffix("/")) is None and len(v.encode()) <= 512


_REGION = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,30}[a-z0-9])?")  # us-east-1; a MinIO/RGW zone group like "default"
_RDMA_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:]{0,63}")  # ibv_devices names: mlx5_0, rdmap79s0
# Karpenter v1.14.1 NodePool spec.disruption.budgets[].nodes (pkg/apis/crds/karpenter.sh_nodepools.yaml)
_BUDGET = re.compile(r"((100|[0-9]{1,2})%|[0-9]+)")


def is_aws_s3(endpoint_url: str) -> bool:
    host = urllib.parse.urlsplit(endpoint_url).hostname or ""
    return host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")


def _version_number(v: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+){0,3}", v):
        raise ValueError(f"{v[:40]!r} is not a version number. Fix: e.g. 570.124.06 (what nvidia-smi prints)")
    return v


def _cidr_list(v: list[str], example: str) -> list[str]:
    for cidr in v:
        try:
            ipaddress.ip_network(cidr, strict=True)
        except ValueError as exc:
            raise ValueError(f"{cidr!r} is not a CIDR ({exc}). Fix: e.g. '{example}'") from None
        if ipaddress.ip_network(cidr).prefixlen == 0:
            raise ValueError(f"{cidr!r} allows the whole internet. Fix: name the address ranges")
    return v


class SpecError(ValueError):
    """A spec that cannot be deployed. `problems` holds one line per field: path, what, fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid spec:\n" + "\n".join(f"  - {p}" for p in problems))




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


class EngineImageSpec(Strict):
    """One engine's image and what it was built with. A fabric is only as usable as the libraries in
    the image: EFA is reached through AWS's libfabric alone, and the stock SGLang and vLLM images
    carry neither it nor aws-ofi-nccl (images/engine-efa.Dockerfile builds one that does)."""

    image: ImageRef = Field(description="Pinned by digest (name@sha256:...), or a marked placeholder ({ref: name:tag, "
                                        "digest: placeholder}); its platforms are listed in images.platforms.")
    efa_libfabric: bool = Field(False, description="AWS's libfabric with the EFA provider (the EFA installer).")
    aws_ofi_nccl: bool = Field(False, description="NCCL's libfabric plugin (aws-ofi-nccl): NCCL between nodes over EFA.")
    mooncake_efa: bool = Field(
        False, description="Mooncake's transfer engine built with EFA support (its `efa` transport); Mooncake "
                           "publishes it for x86_64 only.")
    nixl_backends: list[Literal["UCX", "LIBFABRIC"]] = Field(
        ["UCX"], description="NIXL's backend plugins in the image (stock builds: UCX; LIBFABRIC is built against "
                             "the EFA installer's libfabric).")


class ImagesSpec(Strict):
    """Every image, each pinned by digest or marked a placeholder (infra/images.py)."""

    engines: dict[Literal["sglang", "vllm"], EngineImageSpec] = Field(
        min_length=1, description="Each engine's image and what it contains; engine.kind picks one, so "
                                  "`render --engine` runs the other engine in its own image.")
    router: ImageRef
    mooncake_master: ImageRef
    lmcache_server: ImageRef
    weights_fetcher: ImageRef = Field(description="Image for the weights init step; what it must hold is "
                                             "weights_fetcher_tool.")
    weights_fetcher_tool: Literal["aws-cli", "python-boto3"] = Field(
        "aws-cli", description="aws-cli: the image has `aws` and `sha256sum` (amazon/aws-cli does); "
                               "python-boto3: it has python3 with boto3.")
    otel_collector: ImageRef
    endpoint_picker: ImageRef | None = Field(
        None, description="llm-d-inference-scheduler's endpoint picker (gateway_epp), e.g. "
                          "ghcr.io/llm-d/llm-d-inference-scheduler@sha256:... of v0.7.1.")
    routing_sidecar: ImageRef | None = Field(
        None, description="llm-d's routing sidecar for decode pods (gateway_epp, disaggregated), e.g. "
                          "ghcr.io/llm-d/llm-d-routing-sidecar@sha256:... of v0.7.1.")

    loadtest: ImageRef | None = Field(
        None, description="NVIDIA aiperf at the release pdstack pins (infra/validation/loadtest.py), for the "
                          "in-cluster load-test Job `pdctl validate-deployment --render-job` writes.")
    platforms: dict[str, list[Literal["amd64", "arm64"]]] = Field(
        default_factory=dict,
        description="The CPU architectures each image digest runs on, keyed by digest (sha256:...), or by a "
                    "placeholder's reference (name:tag) for the platforms it is to be built for: one for a "
                    "single-platform manifest, the index's platforms for a manifest list, as `pdctl images` "
                    "reads them from the registry. A digest names one manifest, so it has the same "
                    "platforms in every stack. Every image that runs on the GPU nodes (the engine's, the "
                    "weights fetcher, the routing sidecar) must be listed with hardware.cpu_architecture; "
                    "images with one platform pin their CPU pods to it.")

    @field_validator("platforms")
    @classmethod
    def _digest_keys(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for digest, archs in v.items():
            if not (re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or OCI_TAGGED_REFERENCE.fullmatch(digest)):
                raise ValueError(f"{digest[:80]!r} is not an image digest or a placeholder's reference. Fix: the "
                                 "sha256:<64 hex digits> after '@' in the image reference, or a placeholder's name:tag")
            if not archs:
                raise ValueError(f"{digest}: no platforms. Fix: the architectures its manifest names, e.g. [amd64]")
        return v


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


# --- deployment (the seed's sketch) -------------------------------------------------------


class ScalingSpec(Strict):
    min_instances: Annotated[int, Field(ge=0)] = 1
    max_instances: PositiveInt = 1

    @model_validator(mode="after")
    def _min_not_above_max(self) -> ScalingSpec:
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances {self.min_instances} is above max_instances {self.max_instances}. "
                             "Fix: swap them, or raise max_instances")
        return self


def ratio_value(v: str) -> Fraction:
    p, d = (int(x) for x in v.split(":"))
    return Fraction(p, d)


def _check_ratio(v: str) -> str:
    if not re.fullmatch(r"\s*\d+\s*:\s*\d+\s*", v) or "0" in [p.strip() for p in v.split(":")]:
        raise ValueError(f"{v!r} is not a ratio. Fix: write it as 'P:D', e.g. '1:1' or '2:1'")
    return v


class RatioBounds(Strict):
    """Prefill:decode GPU ratio the autoscalers keep, so one side cannot starve the other."""

    min: str = "1:3"
    max: str = "3:1"

    _ratios = field_validator("min", "max")(classmethod(lambda cls, v: _check_ratio(v)))

    def low(self) -> Fraction:
        return ratio_value(self.min)

    def high(self) -> Fraction:
        return ratio_value(self.max)


class AutoscalingSpec(Strict):
    """How each phase scales on its own signals (see infra/planning/autoscaling.py)."""

    enabled: bool = True
    scaler: Literal["keda", "hpa"] = Field("keda", description="KEDA ScaledObjects, or HPAs on external metrics.")
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"

    _url = field_validator("prometheus_url")(classmethod(lambda cls, v: _service_url(v)))
    polling_interval_seconds: PositiveInt = 15
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0)] = 0
    scale_down_stabilization_seconds: PositiveInt = 600
    drain_seconds: PositiveInt = Field(120, description="A stopping instance finishes in-flight requests this long.")
    pd_ratio_bounds: RatioBounds = RatioBounds()
    latency_headroom: Annotated[float, Field(gt=0, le=1)] = Field(
        0.8, description="Scale up when a p99 latency passes this share of its SLO.")
    prefill_queue_per_instance: Annotated[float, Field(gt=0)] = Field(
        2, description="Queued requests per prefill instance to aim for (2 is ~73% busy in an M/M/1 queue).")
    decode_kv_cache_target: Annotated[float, Field(gt=0, le=1)] = 0.8
    decode_tokens_per_second_per_instance: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Output tokens/s one decode instance serves at the TPOT target (measured: its "
                          "concurrency at that TPOT / TPOT). Throughput does not feed back on latency the way "
                          "sequences in flight do, so it is decode's main demand signal when set.")
    decode_running_per_instance: PositiveInt | None = Field(
        None, description="Sequences in flight per decode instance before adding one (a guard below the "
                          "engine's cap). Default: 80% of decode.max_running_requests, if set.")


class PhaseSpec(Strict):
    """One pool of identical engine instances. An instance spans expert_parallel GPUs."""

    instances: PositiveInt
    expert_parallel: PositiveInt
    dp_attention: bool = True
    redundant_experts: Annotated[int, Field(ge=0)] = 0
    enable_eplb: bool = True
    max_running_requests: PositiveInt | None = None
    chunked_prefill_tokens_per_rank: PositiveInt | None = Field(
        None, description="Prompt tokens one attention-DP rank (one GPU under DP attention) takes per forward "
                          "pass. pdstack renders what each engine means by its own flag: SGLang divides "
                          "--chunked-prefill-size over the DP ranks, vLLM's --max-num-batched-tokens is per rank.")
    host_cache_gib_per_rank: Annotated[int, Field(ge=0)] = Field(
        32, description="Host-memory tier of the prefix cache (SGLang HiCache --hicache-size) per rank, in GiB, "
                        "where a prefix cache runs on this pool. Counted in the pod's memory limit.")
    scaling: ScalingSpec | None = None
    rollout_surge_instances: Annotated[int, Field(ge=0)] = Field(
        1, description="Instances a rolling update starts beyond the pool's maximum before stopping old ones; "
                       "the node pool (and NVLink domains) reserve room for them. 0: replace one instance at a "
                       "time in place, serving one fewer meanwhile.")
    expert_placement: str | None = Field(
        None, description="Placement JSON written by `pdctl eplb`, relative to the project root."
    )
    _placement = field_validator("expert_placement")(_checked(
        lambda v: re.fullmatch(SAFE_NAME, v) or is_host_path(v), (
            "is not a file path of letters, digits, '.', '_', '-' and '/' parts (no '..'; relative to the project, "
            "or absolute). Fix: e.g. stacks/placements/prod-decode.json")))

    def gpus_per_instance(self) -> int:
        return self.expert_parallel

    def nodes_per_instance(self, gpus_per_node: int) -> int:
        return max(1, self.expert_parallel // gpus_per_node)

    def total_gpus(self) -> int:
        return self.instances * self.gpus_per_instance()

    def bounds(self) -> tuple[int, int]:
        """(min, max) instances; a pool without scaling stays at its instance count."""
        if self.scaling is None:
            return self.instances, self.instances
        return self.scaling.min_instances, self.scaling.max_instances

    def max_gpus(self) -> int:
        """GPUs the pool may grow to: the node pool's limit."""
        return self.bounds()[1] * self.gpus_per_instance()


class CacheSpec(Strict):
    prefix_cache: bool = True
    store: Literal["mooncake", "lmcache"] = "mooncake"
    eviction_policy: Literal["lru", "lfu", "fifo"] = "lru"
    capacity_gib: PositiveInt = 512
    disk_path: str | None = Field(
        None, description="Node-local folder for a disk tier of the prefix cache (LMCache local_disk).")
    _disk_path = field_validator("disk_path")(_checked(is_host_path, (
        "is not an absolute node path of letters, digits, '.', '_' and '-' parts (no '..'). Fix: e.g. /mnt/kvcache")))
    disk_gib: PositiveInt = Field(500, description="Disk tier size per engine node.")
    retention_hours: PositiveInt = Field(
        24, description="`pdctl cost` flags disk-tier prefix-cache entries untouched for longer than this.")

    @model_validator(mode="before")
    @classmethod
    def _no_bandwidth_quota(cls, data):
        if isinstance(data, dict) and "transfer_bandwidth_limit" in data:
            raise ValueError("transfer_bandwidth_limit: removed; no quota can be enforced: EFA/RDMA traffic "
                             "bypasses the CNI's egress-bandwidth shaper and the pinned transfer libraries have no "
                             "rate limit. Fix: delete it")
        return data


class RouterWeights(Strict):
    """Endpoint-picker scorer weights (gateway_epp) or cache-aware thresholds (sglang_router)."""

    prefix_cache: Annotated[float, Field(ge=0)] = 3.0
    queue_depth: Annotated[float, Field(ge=0)] = 2.0
    kv_cache_utilization: Annotated[float, Field(ge=0)] = 1.0
    cache_threshold: Annotated[float, Field(ge=0, le=1)] = 0.5
    balance_abs_threshold: Annotated[int, Field(ge=0)] = 32
    balance_rel_threshold: Annotated[float, Field(ge=1)] = 1.1


class EncoderSpec(Strict):
    mode: Literal["engine", "dedicated"] = "engine"
    workers: Annotated[int, Field(ge=0)] = 0


class LoadBalancerSpec(Strict):
    strategy: Literal["least_load", "cache_aware", "power_of_two", "round_robin"] = "cache_aware"
    implementation: Literal["sglang_router", "gateway_epp"] = "sglang_router"
    replicas: PositiveInt = 2
    weights: RouterWeights = RouterWeights()
    encoder: EncoderSpec = EncoderSpec()


class DeploymentSpec(Strict):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    pd_ratio: str = Field("1:1", description="Card ratio prefill:decode, a starting point.")
    prefill: PhaseSpec | None = None
    decode: PhaseSpec | None = None
    colocated: PhaseSpec | None = None
    cache: CacheSpec = CacheSpec()
    load_balancer: LoadBalancerSpec = LoadBalancerSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()

    _ratio_form = field_validator("pd_ratio")(classmethod(lambda cls, v: _check_ratio(v)))

    def ratio(self) -> Fraction:
        return ratio_value(self.pd_ratio)

    def pools(self) -> dict[str, PhaseSpec]:
        """The engine pools this mode runs, by role name (the node pool label too)."""
        if self.mode == "colocated":
            return {"colocated": self.colocated} if self.colocated else {}
        return {k: v for k, v in (("prefill", self.prefill), ("decode", self.decode)) if v}


# --- hops, SLOs, access, environment ------------------------------------------------------


class HopSpec(Strict):
    timeout_seconds: Seconds
    retries: Annotated[int, Field(ge=0, le=5)] = 1


class TimeoutsSpec(Strict):
    """How long each hop of a request may take, outermost first.

    - gateway_to_router: the whole request, stream included: the Envoy route's request timeout,
      and the router's --request-timeout-secs, which in sglang-router is a whole-request timeout
      too (a shorter one cuts streams the gateway allows).
    - router_to_prefill: one attempt at the prefill side, up to the prompt's KV being handed over
      (queue and prefill included), retried `retries` times by the router. The engines give up on
      the hop after as long: SGLang's PD bootstrap and waiting timeouts (both 300 s by default).
    - prefill_to_decode_kv: the KV transfer once prefill is done: how long the prefill side holds
      a request's KV for its decode peer (vLLM's NIXL kv_lease_duration).
    """

    gateway_to_router: HopSpec = HopSpec(timeout_seconds=900, retries=0)
    router_to_prefill: HopSpec = HopSpec(timeout_seconds=280, retries=2)
    prefill_to_decode_kv: HopSpec = HopSpec(timeout_seconds=30, retries=1)


class SLOSpec(Strict):
    ttft_p99_ms: Annotated[float, Field(gt=0)]
    tpot_p99_ms: Annotated[float, Field(gt=0)]
    tokens_per_second_per_user: Annotated[float, Field(gt=0)]
    max_error_rate: Annotated[float, Field(ge=0, lt=1)] = 0.01


class ApiKeySpec(Strict):
    name: str
    requests_per_minute: PositiveInt

    _dns = field_validator("name")(classmethod(lambda cls, v: _dns_label(v)))


class AccessSpec(Strict):
    domains: list[str] = Field(min_length=1)
    tls_secret_name: str = Field(description="Existing Secret with the certificate (cert-manager).")

    _names = field_validator("tls_secret_name")(classmethod(lambda cls, v: _dns_subdomain(v)))
    _domains = field_validator("domains")(classmethod(lambda cls, v: [_dns_subdomain(d) for d in v]))
    gateway_class: str = Field("envoy-gateway", description="A GatewayClass of Envoy Gateway (its policies carry auth and rate limits).")
    gateway_namespace: str = Field("envoy-gateway-system", description="Where the gateway's proxy pods run.")
    allowlist_cidrs: list[str] = Field(min_length=1)
    api_keys: list[ApiKeySpec] = Field(min_length=1)
    gateway_replicas: PositiveInt = Field(2, description="Envoy proxy replicas of this environment's Gateway.")
    rate_limit_scope: Literal["local", "global"] = Field(
        "local", description="local: each Envoy replica counts on its own, so each gets its share of a key's "
                             "limit (requests_per_minute / gateway_replicas, rounded up). global: Envoy Gateway's "
                             "rate-limit service counts across replicas (needs its Redis backend enabled).")

    _cidrs = field_validator("allowlist_cidrs")(classmethod(lambda cls, v: _cidr_list(v, "10.0.0.0/8")))
    _class = field_validator("gateway_class")(_checked(is_dns_subdomain, "is not a GatewayClass name. Fix: e.g. "
                                                                         "envoy-gateway"))
    _gw_ns = field_validator("gateway_namespace")(_checked(lambda v: _DNS_LABEL.fullmatch(v) and len(v) <= 63,
                                                           "is not a namespace name. Fix: e.g. envoy-gateway-system"))

    @field_validator("api_keys")
    @classmethod
    def _unique_key_names(cls, v: list[ApiKeySpec]) -> list[ApiKeySpec]:
        names = [k.name for k in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"API key name(s) {', '.join(twice)} appear more than once (each is a client id "
                             "and a key in one Secret). Fix: give every key its own name")
        return v


class ReleaseStoreSpec(Strict):
    """Where this environment's release history, state and lease live (infra/rollout/releases.py):
    the one place every actor (operators, CI's `pulumi up`, the Pulumi program) finds them."""

    url: str = Field(
        "releases", description="`s3://bucket/prefix` (AWS S3, MinIO, Ceph RGW: what teams use; credentials from the "
                                "standard AWS chain, never from here), or a folder of the project (one operator).")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint, e.g. https://minio.internal:9000; default AWS's (or "
                          "AWS_ENDPOINT_URL_S3 in the environment).")
    region: str = "us-east-1"

    _no_credentials = field_validator("url")(classmethod(lambda cls, v: _url_without_credentials(v)))
    _url = field_validator("endpoint_url")(classmethod(lambda cls, v: _service_url(v)))
    _region = field_validator("region")(_checked(_REGION.fullmatch, "is not a region name. Fix: e.g. us-east-1"))

    @field_validator("url")
    @classmethod
    def _store_url(cls, v: str) -> str:
        problem = release_store_url_problem(v)
        if problem:
            raise ValueError(f"{v[:80]!r}: {problem}")
        return v


class EnvironmentSpec(Strict):
    name: str
    namespace: str
    kubernetes_version: Annotated[str, Field(pattern=r"^1\.\d+$")] = Field(
        "1.33", description="Kubernetes minor version of the cluster, e.g. '1.34' (manifests are checked "
                            "against its schemas).")
    api_server_cidrs: list[str] = Field(
        [], description="Addresses of the Kubernetes API server's endpoints (`kubectl get endpoints kubernetes`), "
                        "which the router or endpoint picker reach for service discovery. Empty: the "
                        "NetworkPolicy lets them reach ports 443 and 6443 anywhere.")
    release_store: ReleaseStoreSpec = ReleaseStoreSpec()

    _api_cidrs = field_validator("api_server_cidrs")(classmethod(lambda cls, v: _cidr_list(v, "10.0.0.12/32")))

    _dns = field_validator("name")(classmethod(lambda cls, v: _dns_label(v)))
    _namespace = field_validator("namespace")(classmethod(lambda cls, v: _dns_label(v, NAMESPACE_MAX)))


class ObservabilitySpec(Strict):
    otlp_endpoint: str | None = Field(
        None, description="Where traces go (OTLP/gRPC), e.g. http://tempo.observability:4317. When set, an "
                          "OpenTelemetry Collector in the namespace receives every hop's spans and forwards them.")
    trace_sample_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        0.05, description="Share of traces the collector keeps (by trace id, so a request is kept whole).")
    scrape_interval_seconds: PositiveInt = 15

    _url = field_validator("otlp_endpoint")(classmethod(lambda cls, v: _service_url(v)))


class PlatformRef(Strict):
    """The per-cluster platform stack this environment runs on (infra/platform_stack/)."""

    stack: str = Field(description="Its Pulumi stack, as a StackReference names it: <org>/pdstack/<stack>, or the "
                                   "stack's name alone in the same organization and project (a two-part name is "
                                   "<org>/<stack>).")
    spec: str = Field(description="Its platform spec, relative to the project (what the offline preview and the "
                                  "cross-checks read).")
    # Pulumi's names: organization, project and stack of letters, digits, '-', '_', '.', 100 at most each.
    _stack = field_validator("stack")(_checked(
        lambda v: PULUMI_STACK_REFERENCE.fullmatch(v),
        "is not a stack reference (<org>/<project>/<stack>, each 100 characters at most). Fix: e.g. "
        "example/pdstack/platform-prod"))
    # Pulumi reads a two-part name as <org>/<stack>: "pdstack/platform-dev" names an organization
    # called pdstack, which no self-managed backend has ("organization name must be 'organization'").
    _not_project_slash_stack = field_validator("stack")(_checked(
        lambda v: not re.fullmatch(r"pdstack/[^/]+", v),
        "names organization 'pdstack' (Pulumi reads <a>/<b> as <org>/<stack>). Fix: the stack's name alone "
        "(e.g. platform-prod) or <org>/pdstack/<stack>"))
    _spec = field_validator("spec")(_checked(lambda v: re.fullmatch(SAFE_NAME, v) and v.endswith((".yaml", ".yml"))
                                             and len(v) <= 255,
                                             "is not a project file path of a YAML spec. Fix: e.g. "
                                             "stacks/platform-prod.yaml"))

    def name(self) -> str:
        return self.stack.rsplit("/", 1)[-1]


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
    img, field, problems = spec.engine_image(), f"images.engines.{kind}", []
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


def stack_spec_path(stack: str) -> Path:
    """The spec file of a named stack (Pulumi.<stack>.yaml selects the same name)."""
    return STACKS_DIR / f"{stack}.yaml"
