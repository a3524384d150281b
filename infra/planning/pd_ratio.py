"""PD ratio planner: from workload, SLOs and measured per-instance surfaces to instance
counts, card ratio and headroom. Pure.

`plan` sizes from the measured surfaces over the length distributions, p99 by p99 (the
model is in infra/planning/surface.py). A workload file of one capacity figure (the format
before surfaces) is read as a degenerate surface: that figure at every length and context,
which the plan says.

`plan_single_figure` is the planner as it was, kept as the baseline `scripts/bench_planner.py`
prints beside it. Its model, kept simple enough to check by hand:
- Decode holds each request for output_tokens x TPOT seconds (Little's law), so it needs
  arrival_rate x mean_output x TPOT concurrent slots. An instance's slots at a TPOT come
  from the measured (TPOT, concurrency) points, interpolated linearly. The TPOT target is
  the tighter of the TPOT SLO and 1000 / tokens-per-second-per-user.
- Prefill must process arrival_rate x mean_input tokens per second. A p99 prompt alone
  takes input_p99 / prefill_tps; queueing stretches that by 1 / (1 - utilisation), so
  utilisation is capped where that still fits the TTFT SLO.
- Each phase also keeps the headroom asked for (default 20%).
The bottleneck, for the counts a spec runs now, is the phase with the higher utilisation:
prefill ("decode waits for prefill": decode slots idle while prompts queue) or decode
("KV cache piles up": finished prefills wait in decode memory for a free slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from pydantic import Field, field_validator, model_validator

from infra.inputs import Strict
from infra.planning.surface import (Correction, DecodeSurface, Lengths, Notes, PrefillPoint, Surface, decode_state,
                                    held_batches, itl_ms, mean_context, prefill_load, prefill_ms, queued_per_instance,
                                    smallest)


class PlanError(ValueError):
    pass

class TokenStats(Strict):
    """Tokens a request has: a prompt, or an answer, has one at least (below, a mean squared
    underflows and the spread of service times divides by zero)."""

    mean: float = Field(ge=1)
    p99: float = Field(ge=1)


class DecodePoint(Strict):
    tpot_ms: float = Field(gt=0)
    concurrency: float = Field(gt=0)


class Capacity(Strict):
    prefill_tokens_per_second: float = Field(gt=0, description="per prefill instance")
    decode: list[DecodePoint] = Field(min_length=1, description="per decode instance: slots at a TPOT")

    @field_validator("decode")
    @classmethod
    def _sorted(cls, v: list[DecodePoint]) -> list[DecodePoint]:
        return sorted(v, key=lambda p: p.tpot_ms)


class DayShape(Strict):
    """How the arrival rate moves over a day: arrival_rate_rps is the peak."""

    valley_rps: float = Field(gt=0)
    peak_hour: float = Field(14, ge=0, lt=24)


class Measurement(Strict):
    """Where a workload's figures come from, when `pdctl validate-deployment` measured them."""

    where: str
    when: str
    tool: str
    scenario: str
    notes: list[str] = Field(default_factory=list, description="how: where the sweep stopped and why, what was "
                             "estimated")


class Workload(Strict):
    arrival_rate_rps: float = Field(gt=0)
    input_tokens: TokenStats
    output_tokens: TokenStats
    capacity: Capacity | None = Field(None, description="one figure per phase (the format before surfaces)")
    surface: Surface | None = Field(None, description="per-instance surfaces measured by validate-deployment")
    prefix_cache_hit_rate: float = Field(0, ge=0, lt=1, description="share of prompt tokens served from the "
                                         "prefix cache (measured: the engines' cache hit counters)")
    headroom: float = Field(0.2, ge=0, lt=1, description="share of capacity kept free above the planned rate")
    day: DayShape | None = None
    measured: Measurement | None = None  # None: typed in by hand

    @model_validator(mode="after")
    def _one_capacity(self) -> Workload:
        if (self.capacity is None) == (self.surface is None):
            raise ValueError("give exactly one of capacity (one figure per phase) and surface (measured by "
                             "pdctl validate-deployment --profile-out). Fix: keep the surface if you have one")
        return self

    def measured_surface(self) -> Surface:
        """The surface, or the one capacity figure read as a degenerate one."""
        if self.surface is not None:
            return self.surface
        cap = self.capacity
        points = held_batches([(p.concurrency, p.tpot_ms) for p in cap.decode])
        return Surface(
            prefill=[PrefillPoint(input_tokens=1000, ttft_ms=1000 * 1000 / cap.prefill_tokens_per_second,
                                  tokens_per_second=cap.prefill_tokens_per_second)],
            decode=DecodeSurface(contexts=[1], batches=[b for b, _ in points], itl_ms=[[t for _, t in points]]),
            degenerate=True)


@dataclass(frozen=True)
class SLO:
    ttft_p99_ms: float
    tpot_p99_ms: float
    tokens_per_second_per_user: float


@dataclass(frozen=True)
class Plan:
    prefill_instances: int
    decode_instances: int
    prefill_gpus: int
    decode_gpus: int
    pd_ratio: str
    tpot_target_ms: float
    decode_slots_per_instance: float
    prefill_utilisation: float
    decode_utilisation: float
    prefill_headroom: float
    decode_headroom: float
    current_bottleneck: str | None
    current_prefill_utilisation: float | None
    current_decode_utilisation: float | None
    # What the surface planner predicts at the recommended counts (None from plan_single_figure).
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    decode_batch_per_instance: float | None = None  # sequences one instance holds at the planned rate (mean)
    decode_batch_cap: float | None = None  # the least of the KV cache, max running requests, largest measured batch
    notes: tuple[str, ...] = ()
    # The scalers' targets on the same model (deployment.autoscaling; `pdctl plan --write` writes them).
    scaler_targets: dict[str, float] | None = None


# Below half a queued request per instance, a queue-depth target counts noise.
MIN_QUEUE_TARGET = 0.5


def slots_at(capacity: Capacity, tpot_ms: float) -> float:
    points = capacity.decode
    if tpot_ms < points[0].tpot_ms:
        raise PlanError(
            f"no decode instance count can meet TPOT {tpot_ms:g} ms: the fastest measured point is "
            f"{points[0].tpot_ms:g} ms (more instances do not make one token faster). "
            "Fix: relax slo.tpot_p99_ms / tokens_per_second_per_user, or measure a faster configuration"
        )
    if tpot_ms >= points[-1].tpot_ms:
        return points[-1].concurrency
    for lo, hi in zip(points, points[1:]):
        if lo.tpot_ms <= tpot_ms <= hi.tpot_ms:
            t = (tpot_ms - lo.tpot_ms) / (hi.tpot_ms - lo.tpot_ms)
            return lo.concurrency + t * (hi.concurrency - lo.concurrency)
    raise AssertionError("unreachable")


def bottleneck(prefill_util: float, decode_util: float) -> str:
    return "prefill: decode waits for prefill" if prefill_util >= decode_util else "decode: KV cache piles up"


def plan_single_figure(workload: Workload, slo: SLO, prefill_gpus: int, decode_gpus: int,
                       current: tuple[int, int] | None = None) -> Plan:
    """Today's planner before surfaces (the baseline): one prefill figure, one decode curve."""
    if workload.capacity is None:
        raise PlanError("the single-figure planner reads capacity:, and this workload has a surface")
    cap = workload.capacity
    tpot_target = min(slo.tpot_p99_ms, 1000 / slo.tokens_per_second_per_user)
    slots = slots_at(cap, tpot_target)
    decode_demand = workload.arrival_rate_rps * workload.output_tokens.mean * tpot_target / 1000
    max_util = 1 - workload.headroom
    decode_n = max(1, math.ceil(decode_demand / (slots * max_util) - 1e-9))

    prefill_demand = workload.arrival_rate_rps * workload.input_tokens.mean  # tokens/s
    alone_ms = workload.input_tokens.p99 / cap.prefill_tokens_per_second * 1000
    if alone_ms >= slo.ttft_p99_ms:
        raise PlanError(
            f"no prefill instance count can meet TTFT p99 {slo.ttft_p99_ms:g} ms: a p99 prompt of "
            f"{workload.input_tokens.p99:g} tokens alone takes {alone_ms:g} ms at "
            f"{cap.prefill_tokens_per_second:g} tokens/s. Fix: relax slo.ttft_p99_ms or raise per-instance prefill throughput"
        )
    ttft_util = 1 - alone_ms / slo.ttft_p99_ms
    prefill_n = max(1, math.ceil(prefill_demand / (cap.prefill_tokens_per_second * min(max_util, ttft_util)) - 1e-9))

    p_util = prefill_demand / (prefill_n * cap.prefill_tokens_per_second)
    d_util = decode_demand / (decode_n * slots)
    cur = None
    if current:
        cur = (prefill_demand / (current[0] * cap.prefill_tokens_per_second), decode_demand / (current[1] * slots))
    return _counted(prefill_n, decode_n, prefill_gpus, decode_gpus, tpot_target, slots, (p_util, d_util), cur)


def _counted(prefill_n: int, decode_n: int, prefill_gpus: int, decode_gpus: int, tpot_target: float, slots: float,
             util: tuple[float, float], cur: tuple[float, float] | None, **predicted) -> Plan:
    """The Plan of these counts: GPUs, card ratio, headroom and today's bottleneck."""
    ratio = Fraction(prefill_n * prefill_gpus, decode_n * decode_gpus)
    return Plan(
        prefill_instances=prefill_n, decode_instances=decode_n,
        prefill_gpus=prefill_n * prefill_gpus, decode_gpus=decode_n * decode_gpus,
        pd_ratio=f"{ratio.numerator}:{ratio.denominator}",
        tpot_target_ms=tpot_target, decode_slots_per_instance=slots,
        prefill_utilisation=util[0], decode_utilisation=util[1],
        prefill_headroom=1 - util[0], decode_headroom=1 - util[1],
        current_bottleneck=bottleneck(*cur) if cur else None,
        current_prefill_utilisation=cur[0] if cur else None,
        current_decode_utilisation=cur[1] if cur else None,
        **predicted,
    )


def decode_batch_cap(surface: Surface, context: float, notes: Notes | None = None) -> float:
    """Sequences one decode instance may hold: the least of its KV cache at this context, the
    engine's max running requests, and the largest batch measured (never planned beyond)."""
    caps = {"the largest measured batch": surface.decode.batches[-1]}
    if surface.kv_cache_tokens:
        caps[f"the KV cache ({surface.kv_cache_tokens:.0f} tokens at {context:.0f} per sequence)"] = \
            surface.kv_cache_tokens / context
    if surface.max_running_requests:
        caps["the engine's max running requests"] = surface.max_running_requests
    why, cap = min(caps.items(), key=lambda kv: kv[1])
    if notes is not None and not surface.degenerate:
        notes.add(f"decode batch capped at {cap:.0f} sequences per instance by {why}")
    return cap


def plan(workload: Workload, slo: SLO, prefill_gpus: int, decode_gpus: int,
         current: tuple[int, int] | None = None, correction: Correction = Correction()) -> Plan:
    """The fewest instances whose predicted TTFT p99 and ITL p99 meet the SLO at the workload's
    rate (over its headroom), from the measured surface; `current` (prefill, decode instances)
    also diagnoses today's spec; `correction` scales the measured times (the control loop's)."""
    surface = workload.measured_surface()
    notes = Notes()
    if workload.capacity is not None and len(workload.capacity.decode) > len(surface.decode.batches):
        notes.add("capacity.decode: a concurrency measured more than once (a curve that plateaus at the engine's "
                  "cap) is read as one point, at the slowest tpot_ms measured there")
    if surface.degenerate:
        notes.add("capacity is one figure per phase (a degenerate surface): the same prefill tokens/s at every "
                  "prompt length and one decode curve at every context. Fix: measure a surface with "
                  "`pdctl validate-deployment --profile-out`")
    inputs = Lengths(workload.input_tokens.mean, workload.input_tokens.p99)
    outputs = Lengths(workload.output_tokens.mean, workload.output_tokens.p99)
    rate = workload.arrival_rate_rps / (1 - workload.headroom)
    tpot_target = min(slo.tpot_p99_ms, 1000 / slo.tokens_per_second_per_user)

    def time_ms(which: str, length: float) -> float:
        return prefill_ms(surface, which, length, workload.prefix_cache_hit_rate, notes)

    load = prefill_load(time_ms, inputs, rate, correction.prefill)
    if load.ttft_alone_p99_ms >= slo.ttft_p99_ms:
        raise PlanError(
            f"no prefill instance count can meet TTFT p99 {slo.ttft_p99_ms:g} ms: a p99 prompt of "
            f"{inputs.p99:g} tokens alone takes {load.ttft_alone_p99_ms:.0f} ms on the measured surface. "
            "Fix: relax slo.ttft_p99_ms or raise per-instance prefill throughput")
    prefill_n = smallest(lambda n: load.ttft_p99_ms(n) <= slo.ttft_p99_ms)

    context = mean_context(inputs, outputs)
    cap = decode_batch_cap(surface, context, notes)

    def itl(batch: float) -> float:
        return itl_ms(surface, batch, context, notes)

    if correction.decode * itl(1) > tpot_target:
        raise PlanError(
            f"no decode instance count can meet TPOT {tpot_target:g} ms: one sequence at a context of "
            f"{context:.0f} tokens already takes {correction.decode * itl(1):.1f} ms (more instances do not make "
            "one token faster). Fix: relax slo.tpot_p99_ms / tokens_per_second_per_user, or measure a faster "
            "configuration")
    decode_n = smallest(lambda n: decode_state(itl, rate, n, outputs, cap, correction.decode).meets(tpot_target))
    if prefill_n is None or decode_n is None:
        raise PlanError("no instance count up to 65536 meets the SLO. Fix: check the workload's rate and lengths")
    # Slots: the largest batch whose p99 still meets the ITL target, under the cap.
    slots = _largest_batch(lambda b: correction.decode * itl(b + 2.3263 * math.sqrt(b)) <= tpot_target, cap)

    actual = workload.arrival_rate_rps
    planned_decode = decode_state(itl, actual, decode_n, outputs, cap, correction.decode)
    at_rate = prefill_load(time_ms, inputs, actual, correction.prefill)

    def utilisation(p: int, d: int) -> tuple[float, float]:
        return (actual * at_rate.service_mean_ms / 1000 / p,
                decode_state(itl, actual, d, outputs, cap, correction.decode).batch / slots)

    cur = utilisation(*current) if current else None
    # What each scaler aims for per instance, so the HPA's ceil(total / target) lands on these counts:
    # decode at the slots that meet the ITL p99 (sequences, or the output tokens/s they make), prefill
    # at the queue its planned count holds at the planned rate.
    targets = {"decode_running_per_instance": max(1, math.floor(slots)),
               "decode_tokens_per_second_per_instance": round(slots / (correction.decode * itl(slots)) * 1000, 1),
               "prefill_queue_per_instance": round(max(MIN_QUEUE_TARGET, queued_per_instance(
                   prefill_n, rate, load.service_mean_ms)), 2)}
    return _counted(prefill_n, decode_n, prefill_gpus, decode_gpus, tpot_target, slots,
                    utilisation(prefill_n, decode_n), cur,
                    ttft_p99_ms=at_rate.ttft_p99_ms(prefill_n), itl_p99_ms=planned_decode.itl_p99_ms,
                    decode_batch_per_instance=planned_decode.batch, decode_batch_cap=cap, notes=tuple(notes.lines),
                    scaler_targets=targets)


def _largest_batch(fits, cap: float) -> float:
    if not fits(1.0):
        return 1.0
    if fits(cap):
        return cap
    lo, hi = 1.0, cap
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
