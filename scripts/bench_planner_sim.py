#!/usr/bin/env python3
"""The planner judged on what a user gets (issue #41 item 4): profiles measured only through
validate-deployment's own profile code (infra/validation/profile.py: its capacity sweep, its
ProfilePlan of runs, measured_workload's rows) on a fleet simulated request by request
(infra/planning/fleet_sim.py: engines that pack prompts into chunked passes, step decode
batches, run out of KV; it shares no formula with the planner), then each plan (headroom 0)
judged by simulating Poisson arrivals on that fleet, against the fewest instances the simulation
finds meet the SLO.

    .venv/bin/python scripts/bench_planner_sim.py [--quick]
    .venv/bin/python scripts/bench_planner_sim.py --days [--only TEXT]

With --days, simulated days instead (issue #41's day targets): `pdctl plan --watch`'s own round
(infra/planning/control.py replan: its forecaster over the last 2 h of 5-minute rates, its
correction from the p99s the fleet showed, at the horizon plan --watch gives it) every 5 minutes,
on this simulated fleet as profiled, 30% slower and 25% faster, from the one default sweep's
profile. A larger count is asked for at once and serves 10 minutes later (GPU-hours count it from
the ask); a smaller one only when no plan of the last 30 minutes asked for more (the HPA's
scale-down window, as long as the reversal target's). Each 5 minutes is judged by simulating 3000 Poisson arrivals a pool at that
interval's rate with the counts serving (SLO-minutes missed: 5 per interval missed); the fewest
GPU-hours are those of the fewest counts the simulation finds meet the SLO at each interval's
rate (an oracle that knows the rate and starts instances at once); a reversal is a pool's count
turning within 30 minutes of its last change the other way.

Profiles: one default sweep (`--profile-out` with no other option: --concurrency capacity,
--profile-lengths 0.05,0.5,2, --profile-contexts 2) of one scenario, on a measuring deployment of
8 prefill and 1 decode instances; "one profile for every load" is the 3000/400 scenario's,
"matched" the scenario at each load's mean lengths. Loads: lognormal lengths (p99 2.34x the
mean) and bimodal prompts (80% short, 20% long); fleets as profiled, 30% slower, 25% faster
(planned from the profile of the fleet as profiled; and after ROUNDS re-plans of the control
loop's own correction at a steady load: no forecast, no day).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.cli.plan import HISTORY_POINTS, HISTORY_STEP_SECONDS  # noqa: E402
from infra.planning.control import Observation, Scaling, replan  # noqa: E402
from infra.planning.fleet_sim import Engine, Mix, aiperf_run, itl_p99, ttft_p99  # noqa: E402
from infra.planning.pd_ratio import SLO, PlanError, Workload, plan  # noqa: E402
from infra.planning.simulate import day_curve  # noqa: E402
from infra.planning.surface import Correction, Lengths, smallest  # noqa: E402
from infra.validation.loadtest import judge, measured_workload  # noqa: E402
from infra.validation.profile import REQUESTS_PER_CONCURRENCY, ProfilePlan, capacity_sweep  # noqa: E402

SLO_SIM = SLO(ttft_p99_ms=2500, tpot_p99_ms=50, tokens_per_second_per_user=20)
MEASURING = (8, 1)  # prefill, decode instances the profile is measured on
REQUESTS = 200  # validate-deployment's default --requests
P99_OVER_MEAN = 2.34


def profile(engine: Engine, input_tokens: int, output_tokens: int) -> dict:
    """What `validate-deployment --profile-out` writes on this fleet, by its own code."""
    prefill_n, decode_n = MEASURING

    def run(concurrency: int, n: int = input_tokens, o: int = output_tokens):
        r = aiperf_run(engine, concurrency, n, o, max(REQUESTS, REQUESTS_PER_CONCURRENCY * concurrency),
                       prefill_n, decode_n)
        return r, judge(r, SLO_SIM.ttft_p99_ms, SLO_SIM.tpot_p99_ms, SLO_SIM.tokens_per_second_per_user)

    found = capacity_sweep("sim", run, decode_n, engine.max_running_requests)
    plan_runs = ProfilePlan(input_tokens, output_tokens, [0.05, 0.5, 2], [2], engine.chunk_tokens, prefill_n)
    others = {key: [run(c, *key)[0] for c in sorted(levels)] for key, levels in
              plan_runs.levels(found.concurrencies).items()}
    lengths, loaded, contexts = plan_runs.inputs([r for r, _ in found.runs], others)
    return measured_workload(found.sweep(), prefill_n, decode_n, "fleet_sim", "-", headroom=0.0, lengths=lengths,
                             loaded=loaded, contexts=contexts, max_running_requests=engine.max_running_requests,
                             kv_cache_tokens=engine.kv_cache_tokens, notes=[f"decode sweep {found.stopped}"])


def loads(quick: bool) -> list[tuple[str, float, Mix, Mix]]:
    rates = (5, 40, 160) if quick else (5, 20, 80, 200)
    out = [(f"{r:g} req/s, {i}/{o}", r, Mix.of(i, i * P99_OVER_MEAN), Mix.of(o, o * P99_OVER_MEAN))
           for r in rates for i in (1000, 4000) for o in (200, 1000)]
    bimodal = Mix(((0.8, Lengths(500, 1170)), (0.2, Lengths(8000, 18720))))
    out += [(f"{r:g} req/s, bimodal/300", r, bimodal, Mix.of(300, 700)) for r in rates]
    return out


def fewest_from(ok, hint: int) -> int:
    """The fewest instances for which `ok` holds (it holds for more once it holds), searched from a
    hint: down while it still holds, else up until it does (each try one simulation)."""
    memo: dict[int, bool] = {}

    def holds(n: int) -> bool:
        if n not in memo:
            memo[n] = ok(n)
        return memo[n]

    if holds(hint):
        while hint > 1 and holds(hint - 1):
            hint -= 1
        return hint
    found = smallest(holds, hint + 1)
    return found if found is not None else 1 << 16


ROUNDS = 6  # re-plans of the correction loop at a steady load


def corrected(workload: Workload, fleet: Engine, rate: float, inputs: Mix, outputs: Mix, ttft_ok, itl_ok):
    """The control loop's own correction (infra/planning/control.py replan: observe the p99s the
    fleet shows at the counts it runs, correct, re-plan), ROUNDS times at a steady load, from the
    uncorrected plan: its last counts, and whether they meet the SLO."""
    correction, observation = Correction(), None
    for _ in range(ROUNDS):
        try:
            r = replan(workload, SLO_SIM, fleet.prefill_gpus, fleet.decode_gpus, [], 0, observation, correction)
        except PlanError:
            return None, False
        correction, counts = r.correction, (r.plan.prefill_instances, r.plan.decode_instances)
        observation = Observation(rate, *counts, ttft_p99(fleet, rate, inputs, counts[0]),
                                  itl_p99(fleet, rate, inputs, outputs, counts[1]))
    return counts, ttft_ok(counts[0]) and itl_ok(counts[1])


def workload_at(measured: dict, rate: float, inputs: Mix, outputs: Mix) -> Workload:
    return Workload.model_validate({**measured, "arrival_rate_rps": rate, "headroom": 0.0,
                                    "input_tokens": {"mean": inputs.mean, "p99": inputs.p99()},
                                    "output_tokens": {"mean": outputs.mean, "p99": outputs.p99()}})


INTERVAL, STARTUP, REVERSAL_WINDOW = 5, 10, 30  # minutes
# The scale-down window (deployment.autoscaling.scale_down_stabilization_seconds) is the reversal
# target's window: a pool may only come down once no plan of the last 30 minutes asked for more,
# so one round's plan a count higher (a p99 drawn from a few thousand requests, a forecast's
# noise) is never taken back within 30 minutes. With 15, every such round was a reversal.
STABILIZATION = REVERSAL_WINDOW
DAY_INPUTS, DAY_OUTPUTS = Mix.of(3000, 7000), Mix.of(400, 940)


def reversals(asked: list[tuple[int, int]], within: int) -> int:
    """Times a pool's count turned (up after down, down after up) within `within` minutes of its
    last change the other way, both pools summed (`asked`: the counts per interval)."""
    count = 0
    for phase in (0, 1):
        last = None  # (direction, minute) of the pool's last change
        for k in range(1, len(asked)):
            delta = asked[k][phase] - asked[k - 1][phase]
            if delta:
                direction = 1 if delta > 0 else -1
                count += bool(last and direction != last[0] and (k - last[1]) * INTERVAL < within)
                last = (direction, k)
    return count


def simulate_day(measured: dict, fleet: Engine, trace: list[float], fewest_memo: dict) -> dict:
    """One day of plan --watch's rounds on `fleet` (the module docstring): GPU-hours against the
    fewest, SLO-minutes missed, reversals, and the factors the correction ended at."""
    rates = [sum(trace[m:m + INTERVAL]) / INTERVAL for m in range(0, len(trace), INTERVAL)]
    rng = np.random.default_rng(7)  # the rate Prometheus shows: the requests an interval counted (Poisson)
    seen = [rng.poisson(r * INTERVAL * 60) / (INTERVAL * 60) for r in rates]
    workload = workload_at(measured, rates[0], DAY_INPUTS, DAY_OUTPUTS)
    steps = max(1, round((HISTORY_STEP_SECONDS + STARTUP * 60) / HISTORY_STEP_SECONDS))  # as cmd_watch asks
    correction, observation = Correction(), None
    fleet_counts = Scaling(INTERVAL, STARTUP, STABILIZATION)
    day = {"gpu_h": 0.0, "fewest_gpu_h": 0.0, "missed": 0, "asked": []}

    def gpus(counts: tuple[int, int]) -> int:
        return counts[0] * fleet.prefill_gpus + counts[1] * fleet.decode_gpus

    for k, rate in enumerate(rates):
        history = seen[max(0, k - HISTORY_POINTS):k]  # the 5-minute rates Prometheus holds, to the last
        r = replan(workload, SLO_SIM, fleet.prefill_gpus, fleet.decode_gpus, history, steps, observation, correction)
        correction = r.correction
        now = (r.plan.prefill_instances, r.plan.decode_instances)
        fleet_counts.ask(k * INTERVAL, now)
        ready, held = fleet_counts.at(k * INTERVAL)
        day["asked"].append(fleet_counts.asked)
        day["gpu_h"] += gpus(held) * INTERVAL / 60
        ttft = ttft_p99(fleet, rate, DAY_INPUTS, ready[0], seed=k)
        itl = itl_p99(fleet, rate, DAY_INPUTS, DAY_OUTPUTS, ready[1], seed=k)
        day["missed"] += INTERVAL * (not (ttft <= SLO_SIM.ttft_p99_ms and itl <= SLO_SIM.tpot_p99_ms))
        observation = Observation(seen[k], *ready, ttft, itl)  # what the next round reads from Prometheus
        key = round(rate, 1)
        if key not in fewest_memo:
            fewest_memo[key] = (
                fewest_from(lambda n: ttft_p99(fleet, key, DAY_INPUTS, n) <= SLO_SIM.ttft_p99_ms, now[0]),
                fewest_from(lambda n: itl_p99(fleet, key, DAY_INPUTS, DAY_OUTPUTS, n) <= SLO_SIM.tpot_p99_ms, now[1]))
        day["fewest_gpu_h"] += gpus(fewest_memo[key]) * INTERVAL / 60
    day["reversals"] = reversals(day["asked"], REVERSAL_WINDOW)
    day["factors"] = (correction.prefill, correction.decode)
    return day


def days(engine: Engine, measured: dict, only: str = "") -> None:
    traces = {"step 40->120 req/s at 08:00": [40.0] * 480 + [120.0] * 960,
              "diurnal 20..150 req/s, peak 14:00": day_curve(150, 20, 14)}
    fleets = {"as profiled": engine, "30% slower": Engine(slowdown=(1.3, 1.3)),
              "25% faster": Engine(slowdown=(0.75, 0.75))}
    print(f"\nDays: plan --watch's round every {INTERVAL} min on the simulated fleet, input 3000/7000, output "
          f"400/940 mean/p99; new instances serve {STARTUP} min later, a {STABILIZATION}-min scale-down window")
    print(f"{'trace':34s} {'fleet':28s} {'GPU-h':>6s} {'fewest':>7s} {'ratio':>6s} {'SLO min missed':>15s} "
          f"{'reversals <30 min':>18s} {'factors p/d':>12s}")
    for fleet_name, fleet in fleets.items():
        memo: dict = {}  # the fewest counts at a rate, on this fleet
        for trace_name, trace in traces.items():
            if only not in f"{trace_name} {fleet_name}":
                continue
            d = simulate_day(measured, fleet, trace, memo)
            print(f"{trace_name:34s} {fleet_name:28s} {d['gpu_h']:6.0f} {d['fewest_gpu_h']:7.0f} "
                  f"{d['gpu_h'] / d['fewest_gpu_h']:5.2f}x {d['missed']:15d} {d['reversals']:18d} "
                  f"{d['factors'][0]:5.2f}/{d['factors'][1]:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three rates, not four")
    parser.add_argument("--days", action="store_true", help="simulated days of plan --watch's loop instead")
    parser.add_argument("--only", default="", metavar="TEXT",
                        help="with --days: only the days whose trace and fleet names contain TEXT, e.g. 'step 40->120 "
                             "req/s at 08:00 30% slower' (a day takes minutes)")
    args = parser.parse_args()
    started = time.monotonic()
    engine = Engine()
    shared = profile(engine, 3000, 400)
    if args.days:
        days(engine, shared, args.only)
        print(f"\n({time.monotonic() - started:.0f} s)")
        return 0
    print(f"one default sweep at 3000/400 on {MEASURING[0]} prefill + {MEASURING[1]} decode instance(s): "
          f"decode batches {shared['surface']['decode']['batches']}")
    for note in shared["measured"].get("notes", []):
        print(f"  {note}")
    fleets = {"as profiled": engine, "30% slower": Engine(slowdown=(1.3, 1.3)),
              "25% faster": Engine(slowdown=(0.75, 0.75))}
    rows: dict[tuple[str, str], list] = {}
    for name, rate, inputs, outputs in loads(args.quick):
        matched = profile(engine, round(inputs.mean), round(outputs.mean))
        for fleet_name, fleet in fleets.items():
            def ttft_ok(n: int) -> bool:
                return ttft_p99(fleet, rate, inputs, n) <= SLO_SIM.ttft_p99_ms

            def itl_ok(n: int) -> bool:
                return itl_p99(fleet, rate, inputs, outputs, n) <= SLO_SIM.tpot_p99_ms

            planned = {}
            for profile_name, measured in (("one profile for every load", shared), ("profile matched to the load", matched)):
                try:
                    p = plan(workload_at(measured, rate, inputs, outputs), SLO_SIM, fleet.prefill_gpus, fleet.decode_gpus)
                    planned[profile_name] = (p.prefill_instances, p.decode_instances)
                except PlanError:
                    planned[profile_name] = None
            hints = [c for c in planned.values() if c] or [(1, 1)]
            fewest = (fewest_from(ttft_ok, min(c[0] for c in hints)), fewest_from(itl_ok, min(c[1] for c in hints)))
            fewest_gpus = fewest[0] * fleet.prefill_gpus + fewest[1] * fleet.decode_gpus
            if fleet_name != "as profiled":
                w = workload_at(shared, rate, inputs, outputs)
                planned["one profile, corrected by the loop"] = corrected(w, fleet, rate, inputs, outputs, ttft_ok,
                                                                         itl_ok)[0]
            for profile_name, counts in planned.items():
                met = counts is not None and ttft_ok(counts[0]) and itl_ok(counts[1])
                gpus = counts[0] * fleet.prefill_gpus + counts[1] * fleet.decode_gpus if counts else None
                rows.setdefault((profile_name, fleet_name), []).append((name, counts, fewest, met, gpus, fewest_gpus))
    print(f"\n{len(loads(args.quick))} loads; SLO TTFT p99 {SLO_SIM.ttft_p99_ms:g} ms, ITL p99 {SLO_SIM.tpot_p99_ms:g} ms; "
          "plans at headroom 0, judged by simulating 3000 Poisson arrivals a pool")
    print(f"{'profile':36s} {'fleet':12s} {'SLO met':>8s} {'refused':>8s} {'GPUs/fewest median':>19s} {'worst':>6s}")
    for (profile_name, fleet_name), results in rows.items():
        overs = [g / f for _, c, _, _, g, f in results if c]
        print(f"{profile_name:36s} {fleet_name:12s} {sum(r[3] for r in results):4d}/{len(results):<3d} "
              f"{sum(r[1] is None for r in results):8d} {statistics.median(overs):18.3f}x {max(overs):5.2f}x")
    print("\nper load (one profile for every load, fleet as profiled): planned (prefill, decode) / fewest")
    for name, counts, fewest, met, _, _ in rows[("one profile for every load", "as profiled")]:
        print(f"  {name:28s} {counts} / {fewest} {'met' if met else 'MISSED'}")
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
