#!/usr/bin/env python3
"""The planners against a simulated fleet (infra/planning/fleet_model.py: its performance
model is stated there): over a grid of loads, SLO points met and GPUs against the fewest
that meet the SLO, judged by the fleet model; then the control loop over simulated days.

    .venv/bin/python scripts/bench_planner.py

Planners on the grid: the surface planner (one measured surface), and today's planner
before surfaces (one capacity figure measured at 3000/400 tokens), with its default 20%
headroom and with none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.planning.fleet_model import (MEASURED_SHAPE, FleetModel, grid, measure_capacity,  # noqa: E402
                                        measure_surface, run_grid, workload_for)
from infra.planning.pd_ratio import SLO, PlanError, plan, plan_single_figure  # noqa: E402

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
    parser.parse_args()
    fleet = FleetModel()
    points = grid()
    print(f"grid: {len(points)} loads (rates x mean input x mean output, p99 = 2.34 x mean); SLO TTFT p99 "
          f"{SLO_BENCH.ttft_p99_ms:g} ms, ITL p99 {SLO_BENCH.tpot_p99_ms:g} ms; prefill {fleet.prefill_gpus} GPUs, "
          f"decode {fleet.decode_gpus} GPUs an instance; judged by the fleet model")
    print(f"{'planner':44s} {'SLO met':>8s} {'refused':>8s} {'GPUs/fewest median':>19s} {'worst':>6s}")
    rows = [("surface planner (one measured surface)", planner(fleet, plan, 0.0, surface=measure_surface(fleet))),
            (f"today's, one figure at {MEASURED_SHAPE[0]}/{MEASURED_SHAPE[1]}, headroom 0.2",
             planner(fleet, plan_single_figure, 0.2, capacity=measure_capacity(fleet, *MEASURED_SHAPE))),
            (f"today's, one figure at {MEASURED_SHAPE[0]}/{MEASURED_SHAPE[1]}, headroom 0",
             planner(fleet, plan_single_figure, 0.0, capacity=measure_capacity(fleet, *MEASURED_SHAPE)))]
    for name, counts in rows:
        results = run_grid(fleet, counts, SLO_BENCH.ttft_p99_ms, SLO_BENCH.tpot_p99_ms, points)
        met = sum(r.met for r in results)
        overs = [r.over for r in results if r.counts]
        refused = sum(r.counts is None for r in results)
        print(f"{name:44s} {met:4d}/{len(results):<3d} {refused:8d} {statistics.median(overs):18.3f}x "
              f"{max(overs):5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
