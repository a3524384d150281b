"""A simulated fleet with a stated performance model: what `scripts/bench_planner.py` judges
the planners against, and what the control loop's day runs on. Pure.

The model (a synthetic DeepSeek-V3 on one prefill instance of 8 GPUs and one decode
instance of 16; the coefficients are stated, not measured):

- Prefill computes one prompt at a time (chunked prefill of long prompts). A prompt of L
  tokens, h of them cached, takes a + b (1 - h) L + c (1 - h^2) L^2 ms: the linear part is
  the uncached tokens' matmuls, the quadratic part their attention over the whole prefix.
  The pool is an M/G/c queue; TTFT p99 is the p99 prompt's time plus the waiting time's
  p99 (Erlang C, Allen-Cunneen), as infra/planning/surface.py states it.
- Decode ITL at batch B and mean context C is d0 + d1 B + d2 B C ms: weights read once a
  step, per-sequence work, and the KV read of every sequence. An instance holds by Little's
  law B = rate / D x E[out] x ITL; its p99 is B + z99 sqrt(B). A batch above the KV cache
  (C tokens a sequence) or the engine's max running requests queues: the SLO is missed.
- `slowdown` scales each phase's times (prefill, decode): the fleet as it really runs against the surface it
  was measured at (an engine upgrade, a noisy neighbour, a cooler cache).

`measure_surface` is what `pdctl validate-deployment --profile-out` would write on this
fleet; `measure_capacity` is the single figure of the format before surfaces, measured at
one shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.planning.pd_ratio import Capacity, DecodePoint, Workload
from infra.planning.surface import (DecodeState, DecodeSurface, Lengths, PrefillPoint, Surface, decode_state,
                                    mean_context, prefill_load)

PREFILL_LENGTHS = (32, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DECODE_BATCHES = (1, 8, 16, 32, 64, 128, 256, 384, 512)
DECODE_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class FleetModel:
    prefill_fixed_ms: float = 15.0
    prefill_ms_per_token: float = 0.05
    prefill_ms_per_token2: float = 2e-6
    decode_fixed_ms: float = 15.0
    decode_ms_per_sequence: float = 0.04
    decode_ms_per_kv_token: float = 4e-6
    kv_cache_tokens: float = 3.0e6  # 16 GPUs x ~6.6 GB of KV / 35,136 bytes per token (MLA, FP8)
    max_running_requests: int = 512
    prefill_gpus: int = 8
    decode_gpus: int = 16

    def prefill_time_ms(self, length: float, hit_rate: float = 0.0) -> float:
        return (self.prefill_fixed_ms + self.prefill_ms_per_token * (1 - hit_rate) * length
                + self.prefill_ms_per_token2 * (1 - hit_rate ** 2) * length * length)

    def itl_ms(self, batch: float, context: float) -> float:
        return self.decode_fixed_ms + self.decode_ms_per_sequence * batch + self.decode_ms_per_kv_token * batch * context


@dataclass(frozen=True)
class Served:
    ttft_p99_ms: float
    itl_p99_ms: float
    decode: DecodeState

    def meets(self, ttft_slo_ms: float, itl_slo_ms: float) -> bool:
        return self.ttft_p99_ms <= ttft_slo_ms and self.decode.meets(itl_slo_ms)


def prefill_p99_ms(fleet: FleetModel, rate: float, inputs: Lengths, hit_rate: float, instances: int,
                   slowdown: float = 1.0) -> float:
    load = prefill_load(lambda _which, length: fleet.prefill_time_ms(length, hit_rate), inputs, rate, slowdown)
    return load.ttft_p99_ms(instances)


def decode_at(fleet: FleetModel, rate: float, inputs: Lengths, outputs: Lengths, instances: int,
              slowdown: float = 1.0) -> DecodeState:
    context = mean_context(inputs, outputs)
    cap = min(fleet.max_running_requests, fleet.kv_cache_tokens / context)
    return decode_state(lambda b: fleet.itl_ms(b, context), rate, instances, outputs, cap, slowdown)


def serve(fleet: FleetModel, rate: float, inputs: Lengths, outputs: Lengths, hit_rate: float, prefill: int,
          decode: int, slowdown: tuple[float, float] = (1.0, 1.0)) -> Served:
    d = decode_at(fleet, rate, inputs, outputs, decode, slowdown[1])
    return Served(prefill_p99_ms(fleet, rate, inputs, hit_rate, prefill, slowdown[0]), d.itl_p99_ms, d)


def fewest(fleet: FleetModel, rate: float, inputs: Lengths, outputs: Lengths, hit_rate: float, ttft_slo_ms: float,
           itl_slo_ms: float, limit: int = 4096) -> tuple[int, int] | None:
    """The fewest instances of each phase that meet the SLO on this fleet, by trying every
    count from 1 up (TTFT depends on prefill alone and ITL on decode alone in this model)."""
    counts = []
    for meets in (lambda n: prefill_p99_ms(fleet, rate, inputs, hit_rate, n) <= ttft_slo_ms,
                  lambda n: decode_at(fleet, rate, inputs, outputs, n).meets(itl_slo_ms)):
        n = 1
        while not meets(n):
            n += 1
            if n > limit:
                return None
        counts.append(n)
    return counts[0], counts[1]


def measure_surface(fleet: FleetModel) -> Surface:
    """The surface validate-deployment measures on this fleet: a sweep of prompt lengths, a
    grid of batches x contexts, and the caps."""
    return Surface(
        prefill=[PrefillPoint(input_tokens=n, ttft_ms=fleet.prefill_time_ms(n),
                              tokens_per_second=n / fleet.prefill_time_ms(n) * 1000) for n in PREFILL_LENGTHS],
        decode=DecodeSurface(contexts=list(DECODE_CONTEXTS), batches=list(DECODE_BATCHES),
                             itl_ms=[[fleet.itl_ms(b, c) for b in DECODE_BATCHES] for c in DECODE_CONTEXTS]),
        kv_cache_tokens=fleet.kv_cache_tokens, max_running_requests=fleet.max_running_requests)


def measure_capacity(fleet: FleetModel, input_tokens: float, output_tokens: float) -> Capacity:
    """The single figure of the format before surfaces, measured at one shape (mean lengths)."""
    context = input_tokens + output_tokens / 2
    return Capacity(
        prefill_tokens_per_second=input_tokens / fleet.prefill_time_ms(input_tokens) * 1000,
        decode=[DecodePoint(tpot_ms=fleet.itl_ms(b, context), concurrency=b) for b in DECODE_BATCHES])


def workload_for(rate: float, inputs: Lengths, outputs: Lengths, hit_rate: float = 0.0, headroom: float = 0.0,
                 surface: Surface | None = None, capacity: Capacity | None = None) -> Workload:
    return Workload(arrival_rate_rps=rate, input_tokens={"mean": inputs.mean, "p99": inputs.p99},
                    output_tokens={"mean": outputs.mean, "p99": outputs.p99}, prefix_cache_hit_rate=hit_rate,
                    headroom=headroom, surface=surface, capacity=capacity)


# ---------------------------------------------------------------- the bench's grid

GRID_RATES = (1, 5, 20, 50, 100, 200)  # requests/s
GRID_INPUTS = (1000, 2000, 4000, 8000)  # mean prompt tokens
GRID_OUTPUTS = (200, 500, 1000, 2000)  # mean output tokens
P99_OVER_MEAN = 2.34  # a lognormal of sigma 0.4
MEASURED_SHAPE = (3000, 400)  # where the single figure of the format before surfaces is measured


@dataclass(frozen=True)
class GridPoint:
    rate: float
    inputs: Lengths
    outputs: Lengths
    hit_rate: float = 0.0


@dataclass(frozen=True)
class GridResult:
    point: GridPoint
    counts: tuple[int, int] | None  # what the planner asked for (None: it refused)
    fewest: tuple[int, int]
    met: bool  # judged by the fleet model at the planner's counts
    gpus: int
    fewest_gpus: int

    @property
    def over(self) -> float:
        return self.gpus / self.fewest_gpus


def grid() -> list[GridPoint]:
    return [GridPoint(r, Lengths(i, i * P99_OVER_MEAN), Lengths(o, o * P99_OVER_MEAN))
            for r in GRID_RATES for i in GRID_INPUTS for o in GRID_OUTPUTS]


def run_grid(fleet: FleetModel, planner, ttft_slo_ms: float, itl_slo_ms: float,
             points: list[GridPoint] | None = None) -> list[GridResult]:
    """`planner(point) -> (prefill, decode)` or None; each answer judged on the fleet model."""
    out = []
    for point in points or grid():
        best = fewest(fleet, point.rate, point.inputs, point.outputs, point.hit_rate, ttft_slo_ms, itl_slo_ms)
        counts = planner(point)
        met = counts is not None and serve(fleet, point.rate, point.inputs, point.outputs, point.hit_rate,
                                           *counts).meets(ttft_slo_ms, itl_slo_ms)
        gpus = counts[0] * fleet.prefill_gpus + counts[1] * fleet.decode_gpus if counts else 0
        out.append(GridResult(point, counts, best, met, gpus,
                              best[0] * fleet.prefill_gpus + best[1] * fleet.decode_gpus))
    return out
