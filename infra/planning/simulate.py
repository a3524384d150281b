"""A day of load through the scaling rules, minute by minute. Pure.

The load is a daily curve between a valley and a peak. Each minute:
1. the instances that are ready serve the load, and the queueing model of
   infra/planning/pd_ratio.py (the same measured capacity) gives what the scalers would
   read: queue depth and TTFT p99 for prefill, running sequences, KV-cache usage and TPOT
   p99 for decode;
2. `desired_counts` (the rules the live scalers run) turns that into instance counts;
3. like an HPA, scale-up is immediate (at most `up_step` instances a minute), scale-down
   takes the highest desire of the stabilisation window and one instance per period;
4. a new instance serves only after it has loaded the model (`startup_minutes`).

GPU-hours count every instance asked for (its nodes are held while it loads and drains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.planning.capacity import claims_whole_domain
from infra.planning.autoscaling import desired_counts, max_scale_up, ratio_in_bounds
from infra.planning.pd_ratio import Capacity, Workload
from infra.spec import StackSpec

MINUTES_PER_DAY = 24 * 60


def day_curve(peak_rps: float, valley_rps: float, peak_hour: float = 14.0, minutes: int = MINUTES_PER_DAY) -> list[float]:
    """Arrival rate per minute: a cosine between valley (12 h from the peak) and peak."""
    return [valley_rps + (peak_rps - valley_rps) * (1 + math.cos(2 * math.pi * (m / 60 - peak_hour) / 24)) / 2
            for m in range(minutes)]


def tpot_at(capacity: Capacity, concurrency: float) -> float:
    """Decode TPOT (ms) of one instance holding `concurrency` sequences: the measured
    (TPOT, concurrency) points read the other way, extrapolated past the last one."""
    pts = capacity.decode
    if concurrency <= pts[0].concurrency:
        return pts[0].tpot_ms
    for lo, hi in zip(pts, pts[1:]):
        if concurrency <= hi.concurrency:
            return lo.tpot_ms + (concurrency - lo.concurrency) / (hi.concurrency - lo.concurrency) * (hi.tpot_ms - lo.tpot_ms)
    last = pts[-1]
    return last.tpot_ms * concurrency / last.concurrency


@dataclass(frozen=True)
class Served:
    ttft_p99_ms: float
    tpot_p99_ms: float
    observed: dict[str, dict[str, float]]


def serve(spec: StackSpec, workload: Workload, rps: float, ready: dict[str, int]) -> Served:
    cap = workload.capacity
    # Prefill: M/M/1-like stretch of a p99 prompt, as the planner models it.
    p_util = rps * workload.input_tokens.mean / (ready["prefill"] * cap.prefill_tokens_per_second)
    alone_ms = workload.input_tokens.p99 / cap.prefill_tokens_per_second * 1000
    u = min(p_util, 0.999)
    ttft_ms = alone_ms / (1 - u) if p_util < 1 else math.inf
    queue = ready["prefill"] * u * u / (1 - u)
    # Decode: Little's law, concurrency = rate x output tokens x TPOT, solved for TPOT.
    tpot = cap.decode[0].tpot_ms
    for _ in range(60):
        per_instance = rps * workload.output_tokens.mean * tpot / 1000 / ready["decode"]
        new = tpot_at(cap, per_instance)
        if abs(new - tpot) < 1e-6 or new > 10 * cap.decode[-1].tpot_ms:
            tpot = new
            break
        tpot = new
    per_instance = rps * workload.output_tokens.mean * tpot / 1000 / ready["decode"]
    slots = spec.deployment.decode.max_running_requests or cap.decode[-1].concurrency
    observed = {
        "prefill": {"queue_depth": queue, "ttft_p99_s": ttft_ms / 1000},
        "decode": {"kv_cache_usage": min(1.0, per_instance / slots), "running_requests": per_instance * ready["decode"],
                   "tpot_p99_s": tpot / 1000, "generation_tokens_per_s": rps * workload.output_tokens.mean},
    }
    return Served(ttft_ms, tpot, observed)


@dataclass(frozen=True)
class Minute:
    minute: int
    rps: float
    asked: dict[str, int]  # replicas the scalers set
    ready: dict[str, int]  # instances serving
    ttft_p99_ms: float
    tpot_p99_ms: float
    slo_met: bool
    ratio_ok: bool


@dataclass(frozen=True)
class DayResult:
    minutes: list[Minute]
    gpu_hours: dict[str, float]
    fixed_fleet_gpu_hours: dict[str, float]

    @property
    def saved_gpu_hours(self) -> float:
        return sum(self.fixed_fleet_gpu_hours.values()) - sum(self.gpu_hours.values())


def simulate_day(spec: StackSpec, workload: Workload, curve: list[float], startup_minutes: dict[str, int] | None = None,
                 ) -> DayResult:
    if spec.deployment.mode != "disaggregated":
        raise ValueError("the day simulation models a disaggregated spec (prefill and decode pools)")
    auto = spec.deployment.autoscaling
    pools = spec.deployment.pools()
    startup = startup_minutes or {"prefill": 10, "decode": 20}
    window = max(1, auto.scale_down_stabilization_seconds // 60)
    down_period = max(5, math.ceil((auto.drain_seconds + 60) / 60))
    asked = {r: p.instances for r, p in pools.items()}
    starting: dict[str, list[int]] = {r: [] for r in pools}  # minute each pending instance becomes ready
    ready = dict(asked)
    history: list[dict[str, int]] = []
    last_down = {r: -down_period for r in pools}
    out = []
    for minute, rps in enumerate(curve):
        for role in pools:
            done = [t for t in starting[role] if t <= minute]
            starting[role] = [t for t in starting[role] if t > minute]
            ready[role] = min(asked[role], ready[role] + len(done))
        served = serve(spec, workload, rps, ready)
        want = desired_counts(spec, served.observed, asked)
        history.append(want)
        for role in pools:
            up_step = max_scale_up(claims_whole_domain(spec, role), asked[role])
            if want[role] > asked[role]:
                add = min(up_step, want[role] - asked[role])
                asked[role] += add
                starting[role] += [minute + startup[role]] * add
            else:
                # Scale down only to the highest desire of the window, one per period.
                floor = max(h[role] for h in history[-window:])
                if floor < asked[role] and minute - last_down[role] >= down_period:
                    asked[role] -= 1
                    last_down[role] = minute
                    if starting[role]:
                        starting[role].pop()  # cancel one still loading, before stopping a serving one
                    else:
                        ready[role] = min(ready[role], asked[role])
        slo = spec.slo
        out.append(Minute(minute, rps, dict(asked), dict(ready), served.ttft_p99_ms, served.tpot_p99_ms,
                          served.ttft_p99_ms <= slo.ttft_p99_ms and served.tpot_p99_ms <= slo.tpot_p99_ms,
                          ratio_in_bounds(spec, asked)))
    hours = len(curve) / 60
    gpu_hours = {r: sum(m.asked[r] for m in out) * p.gpus_per_instance() / 60 for r, p in pools.items()}
    fixed = {r: max(m.asked[r] for m in out) * p.gpus_per_instance() * hours for r, p in pools.items()}
    return DayResult(out, gpu_hours, fixed)

