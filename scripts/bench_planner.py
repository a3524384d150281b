#!/usr/bin/env python3
"""The planners against a simulated fleet (infra/planning/fleet_model.py: its performance
model is stated there): over a grid of loads, SLO points met and GPUs against the fewest
that meet the SLO, judged by the fleet model; then the planner as a control loop over
simulated days (a step and a diurnal shape): today's planner sized once for the peak, and the
surface planner for the peak, for the forecast, and for the forecast with correction, on a
fleet as measured and on one whose prefill is 1.25x slower and decode 0.8x (faster) than its
surface.

    .venv/bin/python scripts/bench_planner.py [--grid-only]

Planners on the grid: the surface planner (one measured surface), and today's planner
before surfaces (one capacity figure measured at 3000/400 tokens), with its default 20%
headroom and with none.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.planning.fleet_model import (MEASURED_SHAPE, FleetModel, grid, measure_capacity,  # noqa: E402
                                        measure_surface, run_grid, workload_for)
from infra.planning.control import bench_days  # noqa: E402
from infra.planning.pd_ratio import SLO, PlanError, plan, plan_single_figure  # noqa: E402
from infra.planning.simulate import day_curve  # noqa: E402
from infra.planning.surface import Lengths  # noqa: E402

SLO_BENCH = SLO(ttft_p99_ms=2500, tpot_p99_ms=50, tokens_per_second_per_user=20)


def planner(fleet: FleetModel, sizing, headroom: float, **capacity):
    def counts(point):
        w = workload_for(point.rate, point.inputs, point.outputs, point.hit_rate, headroom=headroom, **capacity)
        try:
            p = sizing(w, SLO_BENCH, fleet.prefill_gpus, fleet.decode_gpus)
        except PlanError:
            return None
        return p.prefill_instances, p.decode_instances
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid-only", action="store_true", help="skip the simulated days (a minute or two)")
    args = parser.parse_args()
    fleet = FleetModel()
    points = grid()
    print(f"grid: {len(points)} loads (rates x mean input x mean output, p99 = 2.34 x mean); SLO TTFT p99 "
          f"{SLO_BENCH.ttft_p99_ms:g} ms, ITL p99 {SLO_BENCH.tpot_p99_ms:g} ms; prefill {fleet.prefill_gpus} GPUs, "
          f"decode {fleet.decode_gpus} GPUs an instance; judged by the fleet model")
    print(f"{'planner':62s} {'SLO met':>8s} {'refused':>8s} {'GPUs/fewest median':>19s} {'worst':>6s}")
    rows = [("surface planner (one measured surface)", planner(fleet, plan, 0.0, surface=measure_surface(fleet))),
            (f"today's, one figure at {MEASURED_SHAPE[0]}/{MEASURED_SHAPE[1]}, headroom 0.2",
             planner(fleet, plan_single_figure, 0.2, capacity=measure_capacity(fleet, *MEASURED_SHAPE))),
            (f"today's, one figure at {MEASURED_SHAPE[0]}/{MEASURED_SHAPE[1]}, headroom 0",
             planner(fleet, plan_single_figure, 0.0, capacity=measure_capacity(fleet, *MEASURED_SHAPE)))]
    # The same grid with 60% of prompt tokens served by the prefix cache: the surface planner
    # discounts them (erring towards more work), the single-figure one cannot.
    warm = [dataclasses.replace(p, hit_rate=0.6) for p in points]
    rows += [(f"{name}, 60% prefix hits", counts, warm) for name, counts in rows[:2]]
    for name, counts, *grid_points in rows:
        results = run_grid(fleet, counts, SLO_BENCH.ttft_p99_ms, SLO_BENCH.tpot_p99_ms,
                           grid_points[0] if grid_points else points)
        met = sum(r.met for r in results)
        overs = [r.over for r in results if r.counts]
        refused = sum(r.counts is None for r in results)
        print(f"{name:62s} {met:4d}/{len(results):<3d} {refused:8d} {statistics.median(overs):18.3f}x "
              f"{max(overs):5.2f}x")
    if args.grid_only:
        return 0
    inputs, outputs = Lengths(3000, 7000), Lengths(400, 940)
    # Turns counted from an hour after the step (none are needed once settled), and over the
    # whole diurnal day (down to the 02:00 valley, up to the peak, down again: 2 a pool); in
    # both, only once the corrected model has converged ("learned at"), the turns before that
    # printed apart (control.bench_days).
    traces = {"step 40->120 req/s at 08:00": ([40.0] * 480 + [120.0] * 960, 540, 0),
              "diurnal 20..150 req/s, peak 14:00": (day_curve(150, 20, 14), 0, 4)}
    print(f"\nsimulated days: input {inputs.mean:g}/{inputs.p99:g}, output {outputs.mean:g}/{outputs.p99:g} "
          "(mean/p99); re-plan every 5 min, new instances serve 10 min later, scale-down window 15 min, "
          "p99s observed with 5% noise")
    print(f"{'trace':34s} {'fleet':28s} {'planner':22s} {'GPU-h':>7s} {'SLO min missed':>15s} "
          f"{'learned at':>10s} {'turns after (needed)':>21s} {'while learning':>14s} {'factors p/d':>12s}")
    for row in bench_days(fleet, measure_surface(fleet), SLO_BENCH, inputs, outputs, traces,
                          {"as measured": (1.0, 1.0), "prefill 1.25x, decode 0.8x": (1.25, 0.8)}):
        print(f"{row.trace:34s} {row.fleet:28s} {row.mode:22s} {row.gpu_hours:7.0f} {row.slo_minutes_missed:15d} "
              f"{row.converged_minute:7d} min {row.direction_changes:17d} ({row.direction_changes_needed}) "
              f"{row.learning_turns:14d}  "
              f"{row.correction.prefill:5.2f}/{row.correction.decode:4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
