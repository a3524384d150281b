"""Sizing from measured surfaces: prefill against input length, decode against batch and
context, over length distributions, with the prefix-cache discount and the KV-cache and
running-request caps. Pure.

The model (README, "The planner's model", says where it stops holding):

- Lengths are distributions. A workload gives each as (mean, p99); the planner reads it as
  the lognormal with that mean and p99 (Prometheus histograms give the same two figures:
  sum/count and histogram_quantile(0.99)). Expectations are taken over QUANTILES evenly
  spaced quantiles of it.
- Prefill. A prompt of L tokens occupies an instance for S(L) = L / tokens_per_second(L)
  (the measured throughput at that length) and, alone, reaches its first token after
  TTFT(L). With a prefix-cache hit rate h the cached prefix is not computed: the work of
  the uncached suffix is the work of the whole prompt minus the work of its prefix,
  f(L) - f(hL) + f(0), for f = S and f = TTFT, each term bounded on the side of more work
  (the cost is taken as convex and rising in L). The pool is an M/G/c queue: the waiting
  time's tail is Erlang C's exponential, stretched by (1 + Cs^2) / 2 for the spread of
  service times (Allen-Cunneen), and TTFT p99 = TTFT(input p99) + waiting p99. This is a
  p99 model, not a mean one: a planner that sizes to mean latency meets the mean and
  misses the tail.
- Decode. By Little's law an instance holds B = rate / D x E[output] x ITL(B, C)
  sequences; C is the context a running sequence holds on average over its life,
  E[input] + E[output^2] / (2 E[output]) (long answers stay longer). The batch
  fluctuates like a Poisson count, so its p99 is B + z99 sqrt(B); ITL p99 is ITL at
  that batch. The batch may not pass the engine's max running requests nor the
  sequences whose KV (C tokens each) fits the instance's KV cache.
- Outside the measured range. Longer prompts: TTFT(L) and S(L) grow from the longest
  measured one along a + bL + cL^2 fitted to the measured lengths (three or more; an
  estimate), or as (L / L_max)^2 (fewer; an upper bound while cost is at most quadratic in L).
  Longer contexts: ITL grows as C / C_max from the longest measured context (an upper
  bound while ITL is affine in C with a non-negative intercept). A batch beyond the
  largest measured one is never planned. Every extrapolation is named in the plan's notes.
- Correction. Factors on prefill and decode times (1 = as measured) that the control loop
  (infra/planning/control.py) moves towards what the fleet shows.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from statistics import NormalDist

from pydantic import Field, model_validator

from infra.inputs import Strict

Z99 = NormalDist().inv_cdf(0.99)
QUANTILES = 64


class SurfaceError(ValueError):
    pass


class PrefillPoint(Strict):
    """One instance at one prompt length: the first token of a prompt alone, and the prompt
    tokens per second it sustains when busy."""

    input_tokens: float = Field(gt=0)
    ttft_ms: float = Field(gt=0)
    tokens_per_second: float = Field(gt=0)


class DecodeSurface(Strict):
    """ITL (ms) of one decode instance: itl_ms[i][j] at contexts[i] tokens per sequence and
    batches[j] running sequences."""

    contexts: list[float] = Field(min_length=1)
    batches: list[float] = Field(min_length=1)
    itl_ms: list[list[float]]

    @model_validator(mode="after")
    def _grid(self) -> DecodeSurface:
        for name in ("contexts", "batches"):
            axis = getattr(self, name)
            if any(b <= a for a, b in zip(axis, axis[1:])) or axis[0] <= 0:
                raise ValueError(f"{name} must be positive and rising. Fix: sort them, drop repeats")
        if len(self.itl_ms) != len(self.contexts) or any(len(r) != len(self.batches) for r in self.itl_ms):
            raise ValueError(f"itl_ms must be {len(self.contexts)} rows (one per context) of {len(self.batches)} "
                             "values (one per batch). Fix: one ITL per (context, batch) measured")
        if any(v <= 0 for row in self.itl_ms for v in row):
            raise ValueError("itl_ms must be positive. Fix: drop runs that measured no tokens")
        return self


def held_batches(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(batch, ITL) points as one rising curve: a batch measured more than once (a sweep that
    reached the engine's cap, whose running requests then stay at it whatever the concurrency
    asked) is one point, at the slowest ITL measured there (an upper bound: errs towards more
    instances)."""
    slowest: dict[float, float] = {}
    for batch, itl in points:
        slowest[batch] = max(itl, slowest.get(batch, itl))
    return sorted(slowest.items())


class Surface(Strict):
    """What one instance of each pool does, measured (`pdctl validate-deployment --profile-out`)."""

    prefill: list[PrefillPoint] = Field(min_length=1, description="per prefill instance, by prompt length")
    decode: DecodeSurface = Field(description="per decode instance: ITL by context and batch")
    kv_cache_tokens: float | None = Field(None, gt=0, description="tokens of KV one decode instance holds, as "
                                          "its engines report it (validate-deployment --prometheus), or the "
                                          "instance's KV cache bytes over the model's KV bytes per token")
    max_running_requests: int | None = Field(None, gt=0, description="the decode engine's cap on sequences")
    degenerate: bool = Field(False, description="made from one capacity figure: the same figure at every length")

    @model_validator(mode="after")
    def _sorted(self) -> Surface:
        lengths = [p.input_tokens for p in self.prefill]
        if any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise ValueError("prefill points must rise in input_tokens. Fix: sort them, one per length")
        return self


# ---------------------------------------------------------------- length distributions


@dataclass(frozen=True)
class Lengths:
    """A length distribution as the lognormal with this mean and p99."""

    mean: float
    p99: float

    @property
    def sigma(self) -> float:
        ratio = self.p99 / self.mean
        if ratio <= 1:
            return 0.0
        # p99 / mean = exp(z sigma - sigma^2 / 2): the smaller root; past exp(z^2 / 2) no lognormal fits,
        # and the heaviest one (sigma = z) stands in.
        return Z99 - math.sqrt(max(0.0, Z99 * Z99 - 2 * math.log(ratio)))

    def quantiles(self, n: int = QUANTILES) -> list[float]:
        s = self.sigma
        mu = math.log(self.mean) - s * s / 2
        nd = NormalDist()
        return [math.exp(mu + s * nd.inv_cdf((i + 0.5) / n)) for i in range(n)]

    @property
    def second_moment(self) -> float:
        return self.mean * self.mean * math.exp(self.sigma ** 2)


def mean_context(inputs: Lengths, outputs: Lengths) -> float:
    """Context a running sequence holds, averaged over its decode time (input and output independent)."""
    return inputs.mean + outputs.second_moment / (2 * outputs.mean)


# ---------------------------------------------------------------- interpolation


@dataclass
class Notes:
    """What a plan had to assume beyond the measurements, said once each."""

    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear between the measured points around x (xs[0] <= x <= xs[-1], two points or more)."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def _prefill_curve(surface: Surface, which: str, length: float, notes: Notes) -> float:
    xs, ys = _prefill_points(surface, which)
    if surface.degenerate:
        return ys[0] * length / xs[0]
    if length > xs[-1]:
        return _beyond_longest(xs, ys, length, notes)
    if length <= xs[0] or len(xs) == 1:
        return ys[0]  # shorter than the shortest measured: at most its cost (the cost rises with L)
    return _interp(xs, ys, length)


def _beyond_longest(xs: list[float], ys: list[float], length: float, notes: Notes) -> float:
    """A prompt longer than the longest measured. With three lengths or more: along the
    a + b L + c L^2 (none negative: fixed cost, per-token work, attention) that fits the measured
    points best, anchored at the longest, and never below the last chord extended (a convex cost
    lies above it): an estimate, said so. With fewer: (L / L_max)^2 from the longest, an upper
    bound while cost is at most quadratic in L (it over-sizes a cost that is mostly linear:
    measure more lengths)."""
    if len(xs) < 3:
        notes.add(f"prompts of up to {length:.0f} tokens: beyond the longest measured ({xs[-1]:.0f}); prefill "
                  "extrapolated as (L / L_max)^2 from it (an upper bound). Fix: measure longer prompts "
                  "(validate-deployment --profile-lengths)")
        return ys[-1] * (length / xs[-1]) ** 2
    fit = _quadratic_fit(tuple(xs), tuple(ys))
    chord = ys[-1] + (length - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    notes.add(f"prompts of up to {length:.0f} tokens: beyond the longest measured ({xs[-1]:.0f}); prefill "
              "extrapolated along a + bL + cL^2 fitted to the measured lengths (an estimate, not a measurement). "
              "Fix: measure longer prompts (validate-deployment --profile-lengths)")
    return max(chord, ys[-1] * fit(length) / fit(xs[-1]))


@functools.lru_cache(maxsize=256)
def _quadratic_fit(xs: tuple[float, ...], ys: tuple[float, ...]):
    """a + b x + c x^2, a, b, c >= 0, least squares relative to each point (scipy's NNLS)."""
    from scipy.optimize import nnls

    rows = [[1 / y, x / y, x * x / y] for x, y in zip(xs, ys)]
    (a, b, c), _ = nnls(rows, [1.0] * len(xs))
    if a + b * xs[-1] + c * xs[-1] ** 2 <= 0:
        return lambda x: x * x  # nothing fitted: the upper bound's shape
    return lambda x: a + b * x + c * x * x


def prefill_ms(surface: Surface, which: str, length: float, hit_rate: float, notes: Notes) -> float:
    """TTFT alone (which="ttft") or instance time (which="service") of a prompt, in ms, its
    cached prefix (hit_rate of it) not computed."""
    whole = _prefill_curve(surface, which, length, notes)
    if hit_rate <= 0:
        return whole
    if surface.degenerate:  # proportional to length: exact
        return whole * (1 - hit_rate)
    # f(L) - f(hL) + f(0), erring towards more work for a convex, rising cost: f(L) interpolated (a
    # chord lies above), f(hL) from below (the neighbouring chords, extended, lie below), and for f(0)
    # the shortest prompt measured (so a sweep should include a short one: validate-deployment's does).
    xs, ys = _prefill_points(surface, which)
    return max(ys[0], whole - _below(xs, ys, hit_rate * length) + ys[0])


def _prefill_points(surface: Surface, which: str) -> tuple[list[float], list[float]]:
    pts = surface.prefill
    return ([p.input_tokens for p in pts],
            [p.ttft_ms if which == "ttft" else p.input_tokens / p.tokens_per_second * 1000 for p in pts])


def _below(xs: list[float], ys: list[float], x: float) -> float:
    """A lower bound of a convex, rising curve through the points, at x."""
    if len(xs) == 1:
        return ys[0] * min(1.0, x / xs[0])

    def chord(i: int) -> float:  # the chord of points i, i+1, extended to x
        return ys[i] + (x - xs[i]) * (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])

    i = bisect.bisect_right(xs, x) - 1  # xs[i] <= x < xs[i+1]
    if i < 0:
        return max(0.0, chord(0))
    if i >= len(xs) - 1:
        return chord(len(xs) - 2)
    candidates = [ys[i]] + [chord(j) for j in (i - 1, i + 1) if 0 <= j < len(xs) - 1]
    return max(candidates)


def itl_ms(surface: Surface, batch: float, context: float, notes: Notes) -> float:
    """ITL of one decode instance at this batch and context (bilinear in the measured grid)."""
    d = surface.decode
    scale = 1.0
    if context > d.contexts[-1]:
        if not surface.degenerate:
            notes.add(f"contexts of {context:.0f} tokens: beyond the longest measured ({d.contexts[-1]:.0f}); "
                      "ITL extrapolated as C / C_max from it (an upper bound)")
            scale = context / d.contexts[-1]
        context = d.contexts[-1]
    batch = max(batch, d.batches[0])
    rows = [_interp_clamped(d.batches, row, batch) for row in d.itl_ms]
    if context < d.contexts[0] and len(d.contexts) > 1 and not surface.degenerate:
        # Shorter than the shortest row: along the two shortest rows (ITL affine in the context, as
        # each step reads every sequence's KV), never below the shortest row at the smallest batch.
        notes.add(f"contexts of {context:.0f} tokens: below the shortest measured ({d.contexts[0]:.0f}); ITL "
                  "extrapolated along the two shortest rows (an estimate)")
        slope = (rows[1] - rows[0]) / (d.contexts[1] - d.contexts[0])
        return max(d.itl_ms[0][0], rows[0] + (context - d.contexts[0]) * max(0.0, slope))
    return scale * _interp_clamped(d.contexts, rows, max(context, d.contexts[0]))


def _interp_clamped(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    return _interp(xs, ys, x)


# ---------------------------------------------------------------- queueing


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c (offered = arrival rate x mean service time,
    0 or more), in constant time at any count. The textbook sum, divided by e^a, is in terms of
    X ~ Poisson(a): C = P(X = c) / (P(X = c) + (1 - rho) P(X <= c - 1)). P(X <= c - 1) is the
    regularized upper incomplete gamma Q(c, a) (scipy.special.gammaincc, asymptotic where c is
    large); P(X = c) is taken in log space as c (ln rho + 1 - rho) - (lgamma(c + 1) - c ln c + c),
    two parts each of which stays accurate at any c, where c ln a - a - lgamma(c + 1) loses
    every digit to cancellation once c is large. (The Erlang B recursion this replaces took
    c steps: hours at a count of 1e9, never ending at 1e300.)"""
    if offered >= servers:
        return 1.0
    if offered <= 0:
        return 0.0
    from scipy.special import gammaincc

    c = float(servers)
    idle = (c - offered) / c  # 1 - rho
    at_c = math.exp(c * _log_rho_plus_idle(offered / c, idle) - _stirling_rest(c))
    if at_c == 0.0:
        return 0.0
    return at_c / (at_c + idle * float(gammaincc(c, offered)))


def _log_rho_plus_idle(rho: float, idle: float) -> float:
    """ln rho + (1 - rho) (= log1p(x) - x at x = rho - 1), for 0 < rho < 1 with idle = 1 - rho
    computed apart: near rho = 1 the two terms cancel, and there it is -(y^2/2 + y^3/3 + ...)
    with y = idle, a series of terms of one sign."""
    if idle >= 0.01:
        return math.log(rho) + idle
    total, power, k = 0.0, idle * idle, 2
    while k == 2 or power / k > 1e-18 * total:
        total += power / k
        power *= idle
        k += 1
    return -total


def _stirling_rest(c: float) -> float:
    """lgamma(c + 1) - (c ln c - c) without the cancellation of its two large terms: Stirling's
    series past c = 100 (its next term, 1 / (1680 c^7), is below 1e-17 there)."""
    if c < 100:
        return math.lgamma(c + 1) - (c * math.log(c) - c)
    r = 1 / c
    return 0.5 * math.log(2 * math.pi * c) + r / 12 - r ** 3 / 360 + r ** 5 / 1260


def waiting_p99_ms(servers: int, rate: float, mean_ms: float, scv: float) -> float:
    """Waiting time p99 (ms) of an M/G/c queue: P(W > t) = C e^{-(c mu - lambda) t 2 / (1 + Cs^2)}."""
    offered = rate * mean_ms / 1000
    if offered >= servers:
        return math.inf
    c = erlang_c(servers, offered)
    if c <= 0.01:
        return 0.0
    drain_per_ms = (servers / mean_ms - rate / 1000)
    return math.log(c / 0.01) * (1 + scv) / 2 / drain_per_ms


def queued_per_instance(servers: int, rate: float, mean_ms: float) -> float:
    """Requests waiting per instance, on average, in M/M/c: C x rho / (1 - rho) / c."""
    offered = rate * mean_ms / 1000
    if offered >= servers:
        return math.inf
    rho = offered / servers
    return erlang_c(servers, offered) * rho / (1 - rho) / servers


@dataclass(frozen=True)
class PrefillLoad:
    """What the pool sees: arrival rate, instance time per prompt (mean, squared coefficient of
    variation) and the TTFT of a p99 prompt alone."""

    rate: float
    service_mean_ms: float
    service_scv: float
    ttft_alone_p99_ms: float

    def ttft_p99_ms(self, instances: int) -> float:
        return self.ttft_alone_p99_ms + waiting_p99_ms(instances, self.rate, self.service_mean_ms, self.service_scv)


def prefill_load(time_ms, inputs: Lengths, rate: float, factor: float = 1.0) -> PrefillLoad:
    """`time_ms(which, length)`: a prompt's TTFT alone ("ttft") or instance time ("service")."""
    services = [factor * time_ms("service", x) for x in inputs.quantiles()]
    mean = sum(services) / len(services)
    var = sum((s - mean) ** 2 for s in services) / len(services)
    return PrefillLoad(rate, mean, var / (mean * mean) if mean > 0 else 0.0, factor * time_ms("ttft", inputs.p99))


def smallest(feasible, start: int = 1, limit: int = 1 << 16) -> int | None:
    """The smallest count >= start for which feasible(count) holds (feasible is monotone)."""
    if feasible(start):
        return start
    hi = start * 2
    while not feasible(hi):
        if hi > limit:
            return None
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class DecodeState:
    """One decode instance in steady state: sequences held (mean, p99), ITL at them, and the cap."""

    batch: float
    batch_p99: float
    itl_ms: float
    itl_p99_ms: float
    batch_cap: float

    def meets(self, itl_target_ms: float) -> bool:
        return self.itl_p99_ms <= itl_target_ms and self.batch_p99 <= self.batch_cap


def decode_state(itl, rate: float, instances: int, outputs: Lengths, batch_cap: float,
                 factor: float = 1.0) -> DecodeState:
    """`itl(batch)`: ITL (ms) at that batch. Solves B = rate / D x E[out] x ITL(B) (monotone fixed point)."""
    per_instance = rate / instances * outputs.mean / 1000  # sequences per ms of ITL
    batch = 0.0
    for _ in range(200):
        new = per_instance * factor * itl(max(batch, 1.0))
        if new > 1e7:
            batch = math.inf
            break
        if abs(new - batch) < 1e-6 * max(1.0, new):
            batch = new
            break
        batch = new
    if math.isinf(batch):
        return DecodeState(math.inf, math.inf, math.inf, math.inf, batch_cap)
    p99 = batch + Z99 * math.sqrt(batch)
    return DecodeState(batch, p99, factor * itl(max(batch, 1.0)), factor * itl(max(p99, 1.0)), batch_cap)


@dataclass(frozen=True)
class Correction:
    """Factors on the measured prefill and decode times (1: as measured), from the control loop."""

    prefill: float = 1.0
    decode: float = 1.0
