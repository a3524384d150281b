"""PD ratio planner: from workload, SLOs and measured per-instance capacity to instance
counts, card ratio and headroom. Pure.

The model, kept simple enough to check by hand:
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

from pydantic import Field, field_validator

from infra.inputs import Strict


class PlanError(ValueError):
    pass




class TokenStats(Strict):
    mean: float = Field(gt=0)
    p99: float = Field(gt=0)


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


class Workload(Strict):
    arrival_rate_rps: float = Field(gt=0)
    input_tokens: TokenStats
    output_tokens: TokenStats
    capacity: Capacity
    headroom: float = Field(0.2, ge=0, lt=1)
    day: DayShape | None = None
    measured: Measurement | None = None  # None: typed in by hand


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


def plan(workload: Workload, slo: SLO, prefill_gpus: int, decode_gpus: int,
         current: tuple[int, int] | None = None) -> Plan:
    """Recommend counts; `current` (prefill, decode instances) also diagnoses today's spec."""
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
    ratio = Fraction(prefill_n * prefill_gpus, decode_n * decode_gpus)
    cur = None
    if current:
        cur = (prefill_demand / (current[0] * cap.prefill_tokens_per_second), decode_demand / (current[1] * slots))
    return Plan(
        prefill_instances=prefill_n, decode_instances=decode_n,
        prefill_gpus=prefill_n * prefill_gpus, decode_gpus=decode_n * decode_gpus,
        pd_ratio=f"{ratio.numerator}:{ratio.denominator}",
        tpot_target_ms=tpot_target, decode_slots_per_instance=slots,
        prefill_utilisation=p_util, decode_utilisation=d_util,
        prefill_headroom=1 - p_util, decode_headroom=1 - d_util,
        current_bottleneck=bottleneck(*cur) if cur else None,
        current_prefill_utilisation=cur[0] if cur else None,
        current_decode_utilisation=cur[1] if cur else None,
    )
