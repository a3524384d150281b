"""The planner as a control loop: forecast the next interval's load, correct the model from
what the fleet shows, re-plan. Pure (the forecast is statsmodels', fitted on the history
handed in), and run over a simulated day on the fleet model.

- Forecast. Holt's linear trend with a damped trend (statsmodels ExponentialSmoothing) over
  the last FORECAST_WINDOW observations, taking the highest forecast over the horizon plus
  the safety quantile of its one-step errors (grown with sqrt(steps)). A damped trend
  follows a ramp without shooting past a turn the way an undamped one does; a seasonal
  model would need two days of history at the interval's resolution, which a re-plan
  every few minutes seldom has.
- Correction. Each phase's factor on the measured times is moved towards the factor the
  observation implies: the one with which the model, at the counts and the load that
  produced the observation, predicts what was observed (found by bisection; the model is
  monotone in it). The move is damped (a share DAMPING of the distance, in log terms),
  bounded per step (MAX_STEP) and overall (BOUNDS), ignores differences under DEADBAND
  (the noise of a p99 read from a histogram), and goes both ways: a fleet faster than
  measured gives back instances, one slower gets more. Where the implied factor is the
  model's overload edge at those counts and the fleet missed the SLO, the observation only
  bounds the factor from below: it grows by MAX_STEP, and comes back down damped once the
  fleet's p99 is in the model's range. A factor that only ever shrinks
  capacity, or only grows it, walks until the other side's SLO or budget pushes back, and
  the counts flip between the two.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field
from statistics import NormalDist, quantiles

from infra.planning.fleet_model import MEASURED_SHAPE, FleetModel, measure_capacity, serve, workload_for
from infra.planning.pd_ratio import SLO, PlanError, decode_batch_cap, plan, plan_single_figure
from infra.planning.surface import (Correction, Lengths, Notes, Surface, decode_state, itl_ms, mean_context,
                                    prefill_load, prefill_ms)

FORECAST_WINDOW = 60
DAMPING = 0.4
MAX_STEP = 1.25
BOUNDS = (0.5, 2.0)
DEADBAND = 0.03


def forecast(history: list[float], steps: int, quantile: float = 0.95) -> float:
    """The highest value the next `steps` observations are expected to reach, at `quantile`, and
    never below the last one: a plan takes effect at once where it asks for fewer instances, so
    it must carry the load there is now (just after a step, Holt's level has moved only part of
    the way: 40 -> 120 req/s was planned for 76, and the step's misses lasted a round longer)."""
    recent = [max(v, 0.0) for v in without_level_shifts(history[-FORECAST_WINDOW:], quantile)]
    if len(recent) < 10 or max(recent) - min(recent) < 1e-9:
        return recent[-1] if recent else 0.0
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter on short, smooth series
        fit = ExponentialSmoothing(recent, trend="add", damped_trend=True, initialization_method="estimated").fit()
    ahead = max(float(v) for v in fit.forecast(steps))
    # The spread of its one-step errors, robustly (1.4826 x median absolute error): a step in
    # the load is one large error, which must not widen the margin for the next hour.
    errors = sorted(abs(float(e)) for e in fit.resid)
    spread = 1.4826 * errors[len(errors) // 2]
    return max(0.0, recent[-1], ahead + NormalDist().inv_cdf(quantile) * spread * math.sqrt(steps))


def without_level_shifts(series: list[float], quantile: float = 0.95) -> list[float]:
    """`series` with each level shift taken out of the points before it: a change from one point
    to the next that the noise of the others would exceed with probability under 1 - `quantile`
    over the whole series (Bonferroni: a two-sided normal quantile at (1 - quantile) / 2 per
    change; centre and spread the median and the interquartile range / 1.349 of the changes, which
    one jump does not move; not the median absolute deviation, which is 0 for a load alternating
    between two values) is replaced by the typical change, and the series rebuilt back
    from its last point. A step in the load is then a new level, not a slope: fitted as it is,
    40 -> 120 req/s made Holt's damped trend forecast 145 for as long as the step stayed in the
    window (`tests/test_control.py`). A ramp's changes are alike and stay; a one-point spike is
    two jumps and comes out whole. The intervention model of level-shift outliers (Box and Tiao
    1975; Chen and Liu 1993, the tsoutliers "LS" type)."""
    changes = [b - a for a, b in zip(series, series[1:])]
    if len(changes) < 3:
        return list(series)
    q1, centre, q3 = quantiles(changes, n=4)
    spread = (q3 - q1) / (2 * NormalDist().inv_cdf(0.75))
    z = NormalDist().inv_cdf(1 - (1 - quantile) / (2 * len(changes)))
    kept = [centre if abs(c - centre) > z * spread else c for c in changes]
    rebuilt = [series[-1]]
    for change in reversed(kept):
        rebuilt.append(rebuilt[-1] - change)
    return rebuilt[::-1]


@dataclass(frozen=True)
class Observation:
    """What the fleet showed over an interval, and at which counts."""

    rate: float
    prefill: int
    decode: int
    ttft_p99_ms: float
    itl_p99_ms: float


def predicted(surface: Surface, inputs: Lengths, outputs: Lengths, hit_rate: float, obs: Observation,
              correction: Correction) -> tuple[float, float]:
    """TTFT p99 and ITL p99 the model predicts for an observation's load and counts; inf where
    the model has those counts overloaded (a queue without end, or more sequences a decode
    instance than it may hold: its ITL there is not a prediction, the batch cannot be held)."""
    notes = Notes()
    load = prefill_load(lambda which, n: prefill_ms(surface, which, n, hit_rate, notes), inputs, obs.rate,
                        correction.prefill)
    context = mean_context(inputs, outputs)
    d = decode_state(lambda b: itl_ms(surface, b, context, notes), obs.rate, obs.decode, outputs,
                     decode_batch_cap(surface, context), correction.decode)
    return load.ttft_p99_ms(obs.prefill), d.itl_p99_ms if d.batch_p99 <= d.batch_cap else math.inf


def _implied(model, observed: float, lo: float, hi: float, now: float) -> float:
    """The factor k in [lo, hi] with model(k) = observed (model rises with k). A queue the model
    at `now` already predicts overloaded says nothing about k (the load's doing): `now`. One
    the fleet shows overloaded and the model does not: the model is too fast, `hi`."""
    if not math.isfinite(model(now)):
        return now
    if not math.isfinite(observed) or model(hi) <= observed:
        return hi
    if model(lo) >= observed:
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(25):
        mid = (a + b) / 2
        a, b = (mid, b) if model(math.exp(mid)) < observed else (a, mid)
    return math.exp((a + b) / 2)


def _step(factor: float, towards: float, damping: float = DAMPING) -> float:
    gap = math.log(towards / factor)
    if abs(gap) < DEADBAND:
        return factor
    move = max(-math.log(MAX_STEP), min(math.log(MAX_STEP), damping * gap))
    return min(BOUNDS[1], max(BOUNDS[0], factor * math.exp(move)))


def _corrected(model, observed: float, factor: float, target: float) -> float:
    """One phase's factor after an observation. Where the fleet missed the SLO `target` its counts
    were planned to meet, and the model explains the p99 only at its own overload edge (raised by
    the dead band, the model has those counts overloaded) while at today's factor it does not,
    the observation says only that the factor is at least that edge, a bound and not an
    estimate: the factor grows by the most a step may (MAX_STEP), as a sweep grows towards a
    limit it cannot see, and comes back down damped once a p99 inside the model's range says
    where it is. Damped towards the bound, a fleet 30% slower than profiled crept 2-4% a round
    for six rounds while the SLO was missed (the step day); taken whole, the bound (1.09 at 8
    instances for 40 req/s) planned the one instance more that was still short. Within the SLO
    the move stays damped: the planner sizes prefill close to the model's edge (utilisation
    ~0.95), so a p99 there well inside the SLO often has its implied factor at the edge too."""
    wide = (BOUNDS[0] / 2, BOUNDS[1] * 2)
    implied = _implied(model, observed, *wide, factor)
    edge = math.exp(DEADBAND)
    if observed > target and not math.isfinite(model(implied * edge)) and math.isfinite(model(factor * edge)):
        return _step(factor, factor * MAX_STEP, 1.0)  # undamped: a bound, not an estimate
    return _step(factor, implied)


def correct(surface: Surface, inputs: Lengths, outputs: Lengths, hit_rate: float, obs: Observation,
            correction: Correction, slo: SLO | None = None) -> Correction:
    """The correction after one observation: each factor a damped, bounded step towards the
    factor the observation implies, up or down; by MAX_STEP where the fleet missed the `slo` its
    counts were planned for and the model can explain that only at its overload edge."""
    ttft_target, itl_target = ((slo.ttft_p99_ms, min(slo.tpot_p99_ms, 1000 / slo.tokens_per_second_per_user))
                               if slo else (math.inf, math.inf))
    return Correction(
        _corrected(lambda k: predicted(surface, inputs, outputs, hit_rate, obs, Correction(k, correction.decode))[0],
                   obs.ttft_p99_ms, correction.prefill, ttft_target),
        _corrected(lambda k: predicted(surface, inputs, outputs, hit_rate, obs, Correction(correction.prefill, k))[1],
                   obs.itl_p99_ms, correction.decode, itl_target))


# ---------------------------------------------------------------- a simulated day

TODAY = "today's planner, peak"  # plan_single_figure, one figure at MEASURED_SHAPE, headroom 0.2, for the peak
MODES = (TODAY, "plan for the peak", "forecast", "forecast + correction")


@dataclass
class Day:
    mode: str
    interval: int = 5  # minutes between re-plans
    asked: list[tuple[int, int]] = field(default_factory=list)  # per minute
    gpu_hours: float = 0.0
    slo_minutes_missed: int = 0
    corrections: list[Correction] = field(default_factory=list)  # per interval

    def converged_minute(self) -> int:
        """The re-plan from which every later correction stays within the dead band of the day's
        last one: the model has learned the fleet. Before it, the counts follow what the loop is
        still learning (a slower fleet than measured: more instances at once, whatever the load
        does); turns there are that transient, not a loop that swings."""
        final = self.corrections[-1]
        first = len(self.corrections)
        for index in range(len(self.corrections) - 1, -1, -1):
            c = self.corrections[index]
            if max(abs(math.log(c.prefill / final.prefill)), abs(math.log(c.decode / final.decode))) >= DEADBAND:
                break
            first = index
        return first * self.interval

    def direction_changes(self, after: int = 0) -> int:
        """Times a pool's count turned (up after down or down after up) from minute `after` on,
        both pools summed: a step needs none after it settles, a day with one valley and one
        peak needs one turn each of those per pool; more is oscillation."""
        count = 0
        for phase in (0, 1):
            last = 0
            for m in range(max(1, after), len(self.asked)):
                delta = self.asked[m][phase] - self.asked[m - 1][phase]
                if delta:
                    direction = 1 if delta > 0 else -1
                    count += bool(last and direction != last)
                    last = direction
        return count


def planned_rates(trace: list[float], mode: str, interval: int = 5, startup: int = 10,
                  quantile: float = 0.95) -> list[float]:
    """The rate each re-plan sizes for: the day's peak, or the forecast of the next
    `startup + interval` minutes from the minutes before it."""
    if mode in ("plan for the peak", TODAY):
        return [max(trace)] * math.ceil(len(trace) / interval)
    return [forecast(trace[:m] or trace[:1], startup + interval, quantile) for m in range(0, len(trace), interval)]


@dataclass
class Scaling:
    """How a fleet takes each re-plan's (prefill, decode) counts: a larger count is asked for at
    once and serves `startup` minutes later; a smaller one only when every plan of the last
    `stabilization` minutes asked for no more (the HPA's scale-down window), and at once."""

    interval: int
    startup: int
    stabilization: int
    asked: tuple[int, int] | None = None
    ready: tuple[int, int] | None = None
    pending: list[tuple[int, tuple[int, int]]] = field(default_factory=list)  # (minute it serves, counts)
    wants: list[tuple[int, int]] = field(default_factory=list)  # the plans of the window

    def ask(self, minute: int, now: tuple[int, int]) -> None:
        self.wants = (self.wants + [now])[-max(1, self.stabilization // self.interval):]
        if self.ready is None:
            self.ready = self.asked = now  # the day starts with the fleet its first plan asked for
            return
        keep = tuple(max(w[i] for w in self.wants) for i in (0, 1))
        want = tuple(now[i] if now[i] >= self.asked[i] else min(self.asked[i], keep[i]) for i in (0, 1))
        if want != self.asked:
            self.asked = want
            grows = any(a > r for a, r in zip(want, self.ready))
            self.pending.append((minute + self.startup if grows else minute, want))

    def at(self, minute: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The counts serving at `minute`, and those held (paid for: asked for, or still serving)."""
        while self.pending and self.pending[0][0] <= minute:
            self.ready = self.pending.pop(0)[1]
        return self.ready, (max(self.asked[0], self.ready[0]), max(self.asked[1], self.ready[1]))


def simulate_loop(fleet: FleetModel, surface: Surface, slo: SLO, trace: list[float], inputs: Lengths,
                  outputs: Lengths, mode: str, rates: list[float] | None = None,
                  slowdown: tuple[float, float] = (1.0, 1.0), hit_rate: float = 0.0, interval: int = 5,
                  startup: int = 10, stabilization: int = 15, noise: float = 0.05, seed: int = 0) -> Day:
    """Minute by minute: every `interval` minutes the planner re-plans for `rates` (one per
    re-plan, from `planned_rates`), corrected or not; a larger count is asked for at once
    and serves `startup` minutes later (GPU-hours count it from when it is asked for); a
    smaller one only when every plan of the last `stabilization` minutes asked for no more
    (a scale-down window, as the HPA's). The fleet, `slowdown` times slower than its surface
    (prefill, decode), serves each minute and is judged against the SLO; the loop observes
    the interval's p99s (each minute's with `noise`, averaged) and corrects the model. It
    plans with the factors raised by the dead band: a factor left inside it errs towards
    more capacity."""
    rng = random.Random(seed)
    rates = rates or planned_rates(trace, mode, interval, startup)
    day = Day(mode, interval)
    correction = Correction()
    itl_slo = min(slo.tpot_p99_ms, 1000 / slo.tokens_per_second_per_user)
    fleet_counts = Scaling(interval, startup, stabilization)
    seen: list[Observation] = []
    for minute, rate in enumerate(trace):
        if minute % interval == 0:
            if mode == "forecast + correction" and seen:
                correction = correct(surface, inputs, outputs, hit_rate, _mean(seen), correction, slo)
            seen = []
            margin = math.exp(DEADBAND) if mode == "forecast + correction" else 1.0
            if mode == TODAY:
                p = plan_single_figure(workload_for(rates[0], inputs, outputs, hit_rate, headroom=0.2,
                                                    capacity=measure_capacity(fleet, *MEASURED_SHAPE)),
                                       slo, fleet.prefill_gpus, fleet.decode_gpus)
            else:
                p = plan(workload_for(max(rates[minute // interval], 1e-3), inputs, outputs, hit_rate,
                                      surface=surface), slo, fleet.prefill_gpus, fleet.decode_gpus,
                         correction=Correction(correction.prefill * margin, correction.decode * margin))
            fleet_counts.ask(minute, (p.prefill_instances, p.decode_instances))
            day.corrections.append(correction)
        ready, held = fleet_counts.at(minute)
        day.asked.append(fleet_counts.asked)
        day.gpu_hours += (held[0] * fleet.prefill_gpus + held[1] * fleet.decode_gpus) / 60
        served = serve(fleet, rate, inputs, outputs, hit_rate, *ready, slowdown=slowdown)
        day.slo_minutes_missed += not served.meets(slo.ttft_p99_ms, itl_slo)
        if seen and (seen[-1].prefill, seen[-1].decode) != ready:
            seen = []  # the counts changed: observe the new ones
        seen.append(Observation(rate, *ready, served.ttft_p99_ms * rng.lognormvariate(0, noise),
                                served.itl_p99_ms * rng.lognormvariate(0, noise)))
    return day


def _mean(seen: list[Observation]) -> Observation:
    n = len(seen)
    return Observation(sum(o.rate for o in seen) / n, seen[-1].prefill, seen[-1].decode,
                       sum(o.ttft_p99_ms for o in seen) / n, sum(o.itl_p99_ms for o in seen) / n)


# ---------------------------------------------------------------- the bench's days


@dataclass(frozen=True)
class DayRow:
    trace: str
    fleet: str
    mode: str
    gpu_hours: float
    slo_minutes_missed: int
    converged_minute: int  # Day.converged_minute
    direction_changes: int  # from the trace's settling minute or the model's convergence, the later
    direction_changes_needed: int
    learning_turns: int  # turns before the model converged (the whole day's, less the above)
    correction: Correction


def bench_days(fleet: FleetModel, surface: Surface, slo: SLO, inputs: Lengths, outputs: Lengths,
               traces: dict[str, tuple[list[float], int, int]],
               slowdowns: dict[str, tuple[float, float]]) -> list[DayRow]:
    """Each trace (minutes, the minute from which turns count, the turns it needs from then)
    x fleet (slowdown) x mode, simulated. Turns are counted once the model has converged too
    (a loop that swings keeps turning after that; one that learns turns at most while it
    learns), and the turns while it learned are counted apart."""
    rows = []
    for trace_name, (trace, settled, needed) in traces.items():
        ahead = planned_rates(trace, "forecast")  # the forecast is the same for both forecasting modes
        for fleet_name, slowdown in slowdowns.items():
            for mode in MODES:
                day = simulate_loop(fleet, surface, slo, trace, inputs, outputs, mode,
                                    rates=ahead if "forecast" in mode else None, slowdown=slowdown)
                converged = day.converged_minute()
                after = day.direction_changes(max(settled, converged))
                rows.append(DayRow(trace_name, fleet_name, mode, day.gpu_hours, day.slo_minutes_missed, converged,
                                   after, needed, max(0, day.direction_changes(settled) - after),
                                   day.corrections[-1]))
    return rows


# ---------------------------------------------------------------- one re-plan (pdctl plan --watch)


@dataclass(frozen=True)
class Replan:
    rate: float  # the rate the plan sizes for
    plan: object  # pd_ratio.Plan
    correction: Correction  # after this round's observation


def replan(workload, slo: SLO, prefill_gpus: int, decode_gpus: int, history: list[float], steps: int,
           observation: Observation | None, correction: Correction, quantile: float = 0.95) -> Replan:
    """One round of the loop on live figures: correct the model from the observation (if any),
    forecast the rate over the next `steps` points of `history` (none: the workload's rate),
    and plan for it. The forecast's safety quantile stands in for the workload's headroom. A
    PlanError names the rate it could not plan for."""
    surface = workload.measured_surface()
    inputs = Lengths(workload.input_tokens.mean, workload.input_tokens.p99)
    outputs = Lengths(workload.output_tokens.mean, workload.output_tokens.p99)
    if observation is not None:
        correction = correct(surface, inputs, outputs, workload.prefix_cache_hit_rate, observation, correction,
                             slo)
    rate = forecast(history, steps, quantile) if history else workload.arrival_rate_rps
    margin = math.exp(DEADBAND)
    try:
        p = plan(workload.model_copy(update={"arrival_rate_rps": max(rate, 1e-3), "headroom": 0.0}), slo,
                 prefill_gpus, decode_gpus,
                 correction=Correction(correction.prefill * margin, correction.decode * margin))
    except PlanError as exc:
        raise PlanError(f"at {rate:.1f} req/s: {exc}") from None
    return Replan(rate, p, correction)
