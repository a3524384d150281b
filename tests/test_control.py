"""The planner as a control loop (infra/planning/control.py): the forecast, the correction
(damped, bounded, both ways) and short simulated days on the fleet model."""

from __future__ import annotations

import math
import random

import pytest

from infra.planning import control
from infra.planning.control import Observation, correct, forecast, planned_rates, predicted, simulate_loop
from infra.planning.fleet_model import FleetModel, measure_surface, serve
from infra.planning.pd_ratio import SLO
from infra.planning.simulate import day_curve
from infra.planning.surface import Correction, Lengths

FLEET = FleetModel()
SURFACE = measure_surface(FLEET)
SLO_BENCH = SLO(2500, 50, 20)
INPUTS, OUTPUTS = Lengths(3000, 7000), Lengths(400, 940)


def observe(rate, counts, slowdown):
    s = serve(FLEET, rate, INPUTS, OUTPUTS, 0.0, *counts, slowdown=slowdown)
    return Observation(rate, *counts, s.ttft_p99_ms, s.itl_p99_ms)


@pytest.mark.parametrize("slowdown", [(1.25, 0.8), (0.7, 1.4)])
def test_correction_converges_both_ways_without_overshoot(slowdown):
    k = Correction()
    path = [k]
    for _ in range(30):
        k = correct(SURFACE, INPUTS, OUTPUTS, 0.0, observe(60, (20, 3), slowdown), k)
        path.append(k)
    for phase, truth in zip(("prefill", "decode"), slowdown):
        values = [getattr(c, phase) for c in path]
        # Within the dead band of the factor that makes the model match the fleet, which is the
        # slowdown give or take what interpolating the surface adds (a few percent, up).
        assert math.log(values[-1] / truth) == pytest.approx(0, abs=control.DEADBAND + 0.03)
        # Monotone towards the truth: damped, never past it (beyond the dead band).
        steps = [b - a for a, b in zip(values, values[1:]) if b != a]
        assert all(s > 0 for s in steps) if truth > 1 else all(s < 0 for s in steps)
        assert all(max(b / a, a / b) <= control.MAX_STEP + 1e-9 for a, b in zip(values, values[1:]))


def test_the_model_with_the_converged_factor_predicts_what_the_fleet_shows():
    k = Correction()
    for _ in range(30):
        k = correct(SURFACE, INPUTS, OUTPUTS, 0.0, observe(60, (20, 3), (1.25, 0.8)), k)
    obs = observe(60, (20, 3), (1.25, 0.8))
    ttft, itl = predicted(SURFACE, INPUTS, OUTPUTS, 0.0, obs, k)
    assert ttft == pytest.approx(obs.ttft_p99_ms, rel=0.1) and itl == pytest.approx(obs.itl_p99_ms, rel=0.05)


def test_correction_is_bounded_and_an_overload_the_model_predicts_moves_nothing():
    k = Correction()
    for _ in range(40):
        k = correct(SURFACE, INPUTS, OUTPUTS, 0.0, observe(60, (20, 3), (5.0, 0.1)), k)
    assert k.decode == control.BOUNDS[0]
    # Prefill climbs by at most MAX_STEP an interval until the model itself predicts the
    # overload (past ~1.95 here), then stays: never past the bound.
    assert 1.9 <= k.prefill <= control.BOUNDS[1]
    # Too few prefill instances for the load, and the model says so too: the load's doing.
    overloaded = Observation(200, 2, 3, math.inf, observe(60, (20, 3), (1, 1)).itl_p99_ms)
    assert correct(SURFACE, INPUTS, OUTPUTS, 0.0, overloaded, Correction()).prefill == 1.0


def test_the_forecast_never_plans_for_less_than_the_load_there_is_now():
    """Just after a step (40 -> 120 req/s, the last of 24 five-minute points) the damped Holt fit
    (statsmodels 0.15.0 ExponentialSmoothing) has moved its level only part of the way: plan
    --watch planned for 76 req/s while 120 came in, and the step's SLO misses lasted a round longer
    (scripts/bench_planner_sim.py --days). A smaller plan takes effect at once: it must carry the
    load there is now."""
    assert forecast([40.0] * 23 + [120.0], 3) >= 120.0
    assert forecast([120.0] * 23 + [40.0], 3) >= 40.0


def test_a_step_in_the_load_is_a_new_level_not_a_trend():
    """A step from 40 to 120 req/s, one to seven 5-minute points old, with the Poisson noise of a
    5-minute count: Holt's damped trend (statsmodels 0.15.0 ExponentialSmoothing) fitted on the
    series as it is took the jump for a slope and forecast about 145 req/s for as long as the step
    stayed in the window (204 the round after a noiseless one); with the level shift taken out
    (control.without_level_shifts, the level-shift outlier of Chen and Liu 1993) it forecasts the
    new level and its noise margin."""
    rng = random.Random(3)
    for after in range(1, 8):
        loads = [40.0] * (24 - after) + [120.0] * after
        counted = [r + rng.gauss(0, math.sqrt(r * 300)) / 300 for r in loads]  # a 5-minute Poisson count
        assert 120.0 <= forecast(loads, 3) <= 120.0 + 1e-6
        assert max(counted[-after:]) <= forecast(counted, 3) <= 125.0
    # A ramp's changes are alike and stay a trend; one point's spike is two jumps and comes out.
    ramp = [10 + 2.0 * m for m in range(24)]
    assert control.without_level_shifts(ramp) == pytest.approx(ramp)
    spike = [50.0] * 12 + [90.0] + [50.0] * 11
    assert control.without_level_shifts(spike) == pytest.approx([50.0] * 24)


def test_forecast_follows_a_ramp_and_adds_its_safety_quantile():
    ramp = [10 + 0.5 * m for m in range(60)]
    ahead = forecast(ramp, 15)
    # A damped trend lags a ramp a little (the price of not shooting past a turn).
    assert 0.97 * (10 + 0.5 * 74) <= ahead <= 1.1 * (10 + 0.5 * 74)
    assert forecast([50.0] * 30, 15) == 50.0
    noisy = [50 + (3 if m % 2 else -3) for m in range(60)]
    assert forecast(noisy, 15, 0.99) > forecast(noisy, 15, 0.5)


def test_a_step_day_with_a_slower_fleet_settles_only_with_correction():
    trace = [40.0] * 60 + [120.0] * 120
    rates = planned_rates(trace, "forecast")
    plain = simulate_loop(FLEET, SURFACE, SLO_BENCH, trace, INPUTS, OUTPUTS, "forecast", rates=rates,
                          slowdown=(1.25, 0.8))
    loop = simulate_loop(FLEET, SURFACE, SLO_BENCH, trace, INPUTS, OUTPUTS, "forecast + correction", rates=rates,
                         slowdown=(1.25, 0.8))
    # Uncorrected, the planner trusts a surface the fleet is slower than: it misses all day.
    assert plain.slo_minutes_missed > 150
    # Corrected: misses only while it learns the fleet and while new instances load after the step.
    assert loop.slo_minutes_missed <= 40
    assert loop.direction_changes(after=60 + 45) == 0  # settled: no turn after the step's transient
    assert loop.corrections[-1].prefill > 1.15 and loop.corrections[-1].decode < 0.85


def diurnal_loop(slowdown):
    trace = day_curve(150, 20, 14)
    rates = [max(trace[m:m + 15]) for m in range(0, len(trace), 5)]
    return simulate_loop(FLEET, SURFACE, SLO_BENCH, trace, INPUTS, OUTPUTS, "forecast + correction", rates=rates,
                         slowdown=slowdown)


@pytest.mark.parametrize("slowdown", [(1.25, 0.8), (0.7, 1.4)])
def test_a_diurnal_day_is_learned_within_the_hour_and_then_turns_only_with_the_load(slowdown):
    """Started on a model the fleet is slower (or faster) than, the loop learns the factors in
    its first re-plans and from then on turns only where the load does: down to the 02:00
    valley, up to the 14:00 peak, down again, at most one turn each per pool. A loop that
    swings (an undamped or one-way correction) keeps turning after it has "learned". The
    forecast here knows the next 15 minutes, so that what turns is the correction's doing."""
    loop = diurnal_loop(slowdown)
    learned = loop.converged_minute()
    assert 0 < learned <= 60
    assert loop.direction_changes(after=learned) <= 4
    for phase, truth in zip(("prefill", "decode"), slowdown):
        assert math.log(getattr(loop.corrections[-1], phase) / truth) == pytest.approx(0, abs=control.DEADBAND + 0.03)
    # Once learned, the fleet meets the SLO all day: what it missed was while it learned.
    assert loop.slo_minutes_missed <= learned


def test_the_diurnal_checks_fail_a_loop_that_swings_and_one_that_only_shrinks(monkeypatch):
    """The checks above bite. Undamped, unbounded and without a dead band, the factors chase
    every noisy p99, so the model never stops moving within the day. A correction that only
    ever lowers its factors cannot learn a slower prefill, and it
    misses the SLO most of the day."""
    with monkeypatch.context() as m:
        m.setattr(control, "DAMPING", 1.0)
        m.setattr(control, "MAX_STEP", 10.0)
        m.setattr(control, "DEADBAND", 0.0)
        assert diurnal_loop((1.25, 0.8)).converged_minute() > 60
    step = control._step
    monkeypatch.setattr(control, "_step", lambda factor, *towards: min(factor, step(factor, *towards)))
    assert diurnal_loop((1.25, 0.8)).slo_minutes_missed > 600


def test_a_rate_beyond_what_the_decode_instances_may_hold_moves_no_decode_factor():
    """A rate the observed decode count cannot hold (its batch past the cap: KV cache, max running
    requests, largest batch measured) is an overload the model predicts, so it says nothing about
    the factor (README, "Correction that goes both ways"). The ITL read at the clamped batch took
    it as a fleet far faster than measured: one such sample (a hostile or broken rate series in
    `plan --watch`, issue #36 item 4) moved decode's factor down by the most a step may."""
    fine = observe(60, (20, 3), (1, 1))
    beyond = Observation(1e5, 20, 3, fine.ttft_p99_ms, fine.itl_p99_ms)
    assert predicted(SURFACE, INPUTS, OUTPUTS, 0.0, beyond, Correction())[1] == math.inf
    assert correct(SURFACE, INPUTS, OUTPUTS, 0.0, beyond, Correction()).decode == 1.0


def test_the_overload_after_a_step_teaches_nothing_on_a_fleet_as_measured():
    """After a step the new instances are not serving yet and decode holds more than it may: an
    overload the model predicts. Read at the clamped batch it looked like a slower fleet, and the
    decode factor climbed to 1.95 on a fleet exactly as measured, settling back only at minute 105
    (scripts/bench_planner.py's step day: "learned at" 550 min, 70 after the step; now 0)."""
    trace = [40.0] * 60 + [120.0] * 120
    loop = simulate_loop(FLEET, SURFACE, SLO_BENCH, trace, INPUTS, OUTPUTS, "forecast + correction",
                         rates=planned_rates(trace, "forecast"))
    assert all(abs(math.log(c.decode)) < control.DEADBAND for c in loop.corrections)
    assert loop.converged_minute() == 0


def test_a_p99_past_the_models_overload_edge_grows_the_factor_by_the_most_a_step_may():
    """At the counts planned for 40 req/s on the measured surface (8 prefill instances), the
    simulated fleet 30% slower showed a TTFT p99 of 15,083 ms (scripts/bench_planner_sim.py --days,
    the step day's first round). The model explains any such p99 with a factor just below its
    overload edge at those counts (~1.06 here): the observation bounds the factor from below and
    says nothing of how far above it lies. Damped towards it, the loop moved 2.5% and crept 2-4% a
    round for six rounds while the SLO was missed (35 minutes); taken whole, the bound planned one
    instance more, still short. It now grows by MAX_STEP, as a sweep grows towards a limit it cannot
    see. A p99 inside the model's range is a damped move as before, and an overload the model at
    today's factor predicts too (a load the counts cannot carry) moves nothing."""
    counts = (8, 2)
    ok = predicted(SURFACE, INPUTS, OUTPUTS, 0.0, Observation(40, *counts, 0, 0), Correction())
    assert ok[0] <= SLO_BENCH.ttft_p99_ms  # the model at factor 1 plans these counts
    past = Observation(40, *counts, 15000.0, ok[1])
    assert correct(SURFACE, INPUTS, OUTPUTS, 0.0, past, Correction(), SLO_BENCH) == Correction(control.MAX_STEP, 1.0)
    # Within the SLO its counts were planned for (or with none given), the same p99 is a damped move: the planner
    # sizes prefill close to the model's edge, where a p99 well inside the SLO can imply the edge too.
    relaxed = SLO(20000, 50, 20)
    for slo in (relaxed, None):
        assert 1.0 < correct(SURFACE, INPUTS, OUTPUTS, 0.0, past, Correction(), slo).prefill < 1.05
    # Inside the model's range (two instances more, twice the p99 it predicts): 40% of the gap.
    roomy = (counts[0] + 2, counts[1])
    there = predicted(SURFACE, INPUTS, OUTPUTS, 0.0, Observation(40, *roomy, 0, 0), Correction())
    inside = Observation(40, *roomy, 2.0 * there[0], there[1])
    implied = control._implied(lambda f: predicted(SURFACE, INPUTS, OUTPUTS, 0.0, inside, Correction(f, 1.0))[0],
                               inside.ttft_p99_ms, 0.25, 4.0, 1.0)
    assert correct(SURFACE, INPUTS, OUTPUTS, 0.0, inside, Correction(), SLO_BENCH).prefill == pytest.approx(
        implied ** control.DAMPING)
    # The model at today's factor is itself at its edge: the load's doing, not the factor's.
    edge = control._implied(lambda f: predicted(SURFACE, INPUTS, OUTPUTS, 0.0, past, Correction(f, 1.0))[0],
                            past.ttft_p99_ms, 0.25, 4.0, 1.0)
    assert correct(SURFACE, INPUTS, OUTPUTS, 0.0, past, Correction(edge, 1.0), SLO_BENCH).prefill == edge
