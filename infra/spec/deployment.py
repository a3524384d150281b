"""The engine pools: disaggregated or colocated, each pool's instances and parallelism, how it
scales and rolls out, and the prefill:decode ratio."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from infra.inputs import Strict
from infra.naming import is_host_path
from infra.spec._base import PositiveInt, _checked, _service_url
from infra.spec.balancers import LoadBalancerSpec
from infra.spec.kvcache import CacheSpec
from infra.weights import SAFE_NAME


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
