#!/usr/bin/env python3
"""A day of load through the autoscaling rules: instance counts per hour, SLO and ratio
checks, and the GPU-hours saved against a fixed fleet sized for the peak.

    .venv/bin/python scripts/simulate_day.py [--stack prod] [--workload stacks/workloads/prod-day.yaml]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.inputs import InputError, load_model  # noqa: E402
from infra.planning.pd_ratio import Workload  # noqa: E402
from infra.planning.simulate import day_curve, simulate_day  # noqa: E402
from infra.spec import REPO_ROOT, SpecError, stack_spec_path  # noqa: E402
from infra.spec_checks import load_spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--workload", default=str(REPO_ROOT / "stacks/workloads/prod-day.yaml"))
    args = parser.parse_args()
    try:
        spec = load_spec(stack_spec_path(args.stack))
        workload = load_model(args.workload, Workload, "workload")  # the reader every command uses
    except (InputError, SpecError) as exc:
        parser.exit(2, f"{exc}\n")
    if workload.day is None:
        parser.error(f"{args.workload} has no `day:` (valley_rps, peak_hour)")
    if workload.capacity is None:  # the scalers' day reads one figure; the planner's loop is bench_planner's
        parser.error(f"{args.workload} has a surface, and this day runs the scaling rules on one capacity figure "
                     "(capacity:). Fix: a workload with capacity:, or scripts/bench_planner.py for the planner's loop")
    day = simulate_day(spec, workload, day_curve(workload.arrival_rate_rps, workload.day.valley_rps, workload.day.peak_hour))
    print(f"{args.stack}: {workload.day.valley_rps:g} to {workload.arrival_rate_rps:g} req/s, peak at {workload.day.peak_hour:g}h")
    print(" hour  req/s  prefill  decode  TTFT p99 ms  TPOT p99 ms")
    for m in day.minutes[::60]:
        print(f"{m.minute // 60:5d} {m.rps:6.0f} {m.asked['prefill']:8d} {m.asked['decode']:7d} "
              f"{m.ttft_p99_ms:12.0f} {m.tpot_p99_ms:12.1f}")
    misses = sum(not m.slo_met for m in day.minutes)
    ratio = sum(not m.ratio_ok for m in day.minutes)
    print(f"minutes over SLO: {misses} of {len(day.minutes)}; minutes outside the P:D ratio bounds: {ratio}")
    for role in day.gpu_hours:
        print(f"{role:8s} autoscaled {day.gpu_hours[role]:8.1f} GPU-h   fixed fleet for the peak "
              f"{day.fixed_fleet_gpu_hours[role]:8.1f} GPU-h")
    fixed = sum(day.fixed_fleet_gpu_hours.values())
    print(f"saved {day.saved_gpu_hours:.1f} GPU-hours of {fixed:.1f} ({day.saved_gpu_hours / fixed:.1%}) in one day")
    return 0


if __name__ == "__main__":
    sys.exit(main())
