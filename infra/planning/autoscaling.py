"""The scaling rules of each phase, once: as PromQL signals for the live scalers, and as a
pure function that the day-long simulation runs. Pure.

Each phase scales on its own signals, the way a Kubernetes HPA (which KEDA drives) turns a
metric into a replica count:
- AverageValue: desired = ceil(total / target per instance) (queue depth, running requests);
- Value: desired = ceil(current x value / target), left alone within 10% of the target (p99
  latencies, KV-cache usage).
The HPA takes the largest desire over a scaler's signals, then clamps it to min and max.

Each signal reads its pool's series in this namespace (the environment's, or its release
track's), and a role's TTFT where its engine times it (infra/render/metrics.py `ttft_pool`): an
SGLang PD prefill observes none (sglang 0.5.23 srt/managers/tokenizer_manager.py collect_metrics),
so its scaler reads the TTFT decode times from each request's arrival, the client's, which grows
as prompts wait for prefill. Prefill's demand signal is its own queue: SGLang's
sglang:num_queue_reqs on a PD prefill counts its waiting queue, prompts ready to run
(srt/managers/scheduler_components/metrics_reporter.py report_prefill_stats), not those still
in the bootstrap queue waiting on decode's KV preallocation (num_prefill_bootstrap_queue_reqs),
which more prefill would not serve sooner; vLLM's vllm:num_requests_waiting on prefill.

The P:D ratio bounds are signals too: the prefill scaler asks for at least
ceil(min_ratio x decode GPUs / GPUs per prefill instance) instances, and the decode scaler
for at least ceil(prefill GPUs / max_ratio / GPUs per decode instance). Since an HPA can
only be pushed up by a signal, the lagging side is raised instead of the leading side
being held back: neither phase starves the other. The spec check (infra/spec/,
ratio_bounds_problems) makes sure both maximums leave room for that.

A decode instance is a whole LeaderWorkerSet group, and the scalers target the
LeaderWorkerSet's scale subresource, whose replicas are groups: counts here are groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from infra.render import metrics
from infra.render.metrics import ENGINE_METRICS, p99, pools_selector, ttft_selector, with_selector
from infra.spec import PhaseSpec, StackSpec

HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default

MetricType = Literal["AverageValue", "Value"]


@dataclass(frozen=True)
class Signal:
    name: str  # also the observation key in `desired_counts`
    query: str  # PromQL giving one number
    target: float
    metric_type: MetricType
    why: str
    up_only: bool = False  # reads 0 below its target: can add instances, never holds them


def running_target(spec: StackSpec, phase: PhaseSpec) -> float | None:
    auto = spec.deployment.autoscaling
    if auto.decode_running_per_instance:
        return float(auto.decode_running_per_instance)
    return 0.8 * phase.max_running_requests if phase.max_running_requests else None


def pool_selector(spec: StackSpec, role: str) -> str:
    """The series of one pool of this namespace (environment or release track)."""
    return pools_selector(spec.environment.namespace, [role])


def instances_query(spec: StackSpec, role: str) -> str:
    """Serving instances of a pool: their leader pods (every pod of an SGLang group exports)."""
    return metrics.instances_query(ENGINE_METRICS[spec.engine.kind].running, pool_selector(spec, role))


def ratio_floor_factor(spec: StackSpec, role: str) -> Fraction:
    """Instances of `role` the ratio bounds need per instance of the other phase: prefill
    keeps at least the minimum ratio, decode keeps prefill at most at the maximum."""
    dep = spec.deployment
    bounds, p, d = dep.autoscaling.pd_ratio_bounds, dep.prefill, dep.decode
    if role == "prefill":
        return bounds.low() * d.gpus_per_instance() / p.gpus_per_instance()
    return p.gpus_per_instance() / (bounds.high() * d.gpus_per_instance())


def signals(spec: StackSpec, role: str) -> list[Signal]:
    """What the scaler of one pool watches, with the targets from the spec."""
    auto, slo, dep = spec.deployment.autoscaling, spec.slo, spec.deployment
    m = ENGINE_METRICS[spec.engine.kind]
    phase = dep.pools()[role]
    sel = pool_selector(spec, role)
    # Latency barely falls with load (TPOT has a floor), so a latency signal would pin the
    # count at ceil(current x p99 / target) forever: it only pushes up, and demand signals
    # (queue, running sequences, KV usage) bring the count back down.
    ttft_target = slo.ttft_p99_ms / 1000 * auto.latency_headroom
    tpot_target = slo.tpot_p99_ms / 1000 * auto.latency_headroom
    ttft = Signal("ttft_p99_s", f"({p99(m.ttft_bucket, ttft_selector(spec, role), '2m')} > {ttft_target:g}) or vector(0)",
                  ttft_target, "Value", "TTFT p99 near its SLO: prompts wait for prefill", up_only=True)
    tpot = Signal("tpot_p99_s", f"({p99(m.tpot_bucket, sel, '2m')} > {tpot_target:g}) or vector(0)", tpot_target,
                  "Value", "TPOT p99 near its SLO: decode batches too large", up_only=True)
    queue = Signal("queue_depth", f"sum({with_selector(m.queue_depth, sel)})", auto.prefill_queue_per_instance,
                   "AverageValue", "requests queued per instance")
    kv = Signal("kv_cache_usage", f"avg({with_selector(m.kv_cache_usage, sel)})", auto.decode_kv_cache_target, "Value",
                "KV cache filling up: sequences will be preempted")
    out = {"prefill": [queue, ttft], "colocated": [queue, ttft, kv, tpot], "decode": [kv, tpot]}[role]
    if role in ("decode", "colocated") and auto.decode_tokens_per_second_per_instance:
        out.insert(0, Signal("generation_tokens_per_s", f"sum(rate({with_selector(m.generation_tokens, sel)}[2m]))",
                             auto.decode_tokens_per_second_per_instance, "AverageValue", "output tokens/s per instance"))
    running = running_target(spec, phase)
    if role in ("decode", "colocated") and running:
        out.insert(1 if role == "decode" else 3, Signal(
            "running_requests", f"sum({with_selector(m.running, sel)})", running, "AverageValue",
            "sequences in flight per instance"))
    if dep.mode == "disaggregated":
        bounds = dep.autoscaling.pd_ratio_bounds
        other, why = ("decode", f"at least {bounds.min}") if role == "prefill" else ("prefill", f"at most {bounds.max}")
        need = ratio_floor_factor(spec, role)
        out.append(Signal("ratio_floor", f"ceil({float(need):g} * {instances_query(spec, other)})", 1.0,
                          "AverageValue", f"prefill:decode GPUs {why}"))
    return out


def scale_up_policies(claims_supernode: bool) -> list[dict]:
    """A wide-EP group claims a whole NVLink domain: add one a minute. Other pools may
    double (or add 4) a minute, so their ratio floor keeps up with a new wide group."""
    if claims_supernode:
        return [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    return [{"type": "Pods", "value": 4, "periodSeconds": 60}, {"type": "Percent", "value": 100, "periodSeconds": 60}]


def max_scale_up(claims_supernode: bool, current: int) -> int:
    """Instances the policies above allow in one minute (the HPA takes the largest policy)."""
    return 1 if claims_supernode else max(4, current)


def hpa_desire(signal: Signal, value: float, current: int) -> int:
    """The replica count one signal asks for, as the HPA computes it."""
    if math.isnan(value):
        return current  # no data: the HPA leaves the count alone
    if signal.up_only and value <= signal.target:
        value = 0.0  # what the query returns below its target
    if signal.metric_type == "AverageValue":
        return math.ceil(value / signal.target - 1e-9)
    ratio = value / signal.target
    if abs(ratio - 1) <= HPA_TOLERANCE:
        return current
    return math.ceil(current * ratio - 1e-9)


def desired_counts(spec: StackSpec, observed: dict[str, dict[str, float]], current: dict[str, int]) -> dict[str, int]:
    """Instance counts the scalers settle on for these observations (per role: signal -> value).

    Demand signals first, clamped to each pool's bounds; then the ratio floors, each from
    the other side's count, until neither moves (the live scalers reach the same point one
    polling interval apart).
    """
    pools = spec.deployment.pools()
    desired = {}
    for role, phase in pools.items():
        lo, hi = phase.bounds()
        wants = [hpa_desire(s, observed[role][s.name], current[role]) for s in signals(spec, role) if s.name != "ratio_floor"]
        desired[role] = min(hi, max(lo, *wants))
    if spec.deployment.mode != "disaggregated":
        return desired
    for _ in range(8):
        before = dict(desired)
        for role, other in (("prefill", "decode"), ("decode", "prefill")):
            lo, hi = pools[role].bounds()
            floor = math.ceil(ratio_floor_factor(spec, role) * desired[other] - 1e-9)
            desired[role] = min(hi, max(desired[role], floor))
        if desired == before:
            break
    return desired


def gpu_ratio(spec: StackSpec, counts: dict[str, int]) -> Fraction:
    dep = spec.deployment
    return Fraction(counts["prefill"] * dep.prefill.gpus_per_instance(), counts["decode"] * dep.decode.gpus_per_instance())


def ratio_in_bounds(spec: StackSpec, counts: dict[str, int]) -> bool:
    bounds = spec.deployment.autoscaling.pd_ratio_bounds
    return bounds.low() <= gpu_ratio(spec, counts) <= bounds.high()
