#!/usr/bin/env python3
"""Time `rollback` against the in-memory cluster with a simulated apply latency.

Each run: two good revisions are rolled out (not timed), then the environment is rolled
back to the first (timed: lock, checks, one route change at the simulated latency, health
verification, history and audit writes). Prints the median and the slowest run, and what
each step would take on a real cluster.

    .venv/bin/python scripts/bench_rollback.py [--runs 10] [--apply-latency 2.0]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402

from infra.rollout.canary import Observation  # noqa: E402
from infra.rollout.cluster import InMemoryCluster  # noqa: E402
from infra.rollout.releases import ReleaseStore  # noqa: E402
from infra.rollout.rollback import rollback  # noqa: E402
from infra.rollout.rollout import RolloutOptions, rollout  # noqa: E402
from infra.spec import load_spec, parse_spec, stack_spec_path  # noqa: E402

# On a real cluster (per step, seconds): what the in-memory run stands in for.
REAL_CLUSTER_ESTIMATE = [
    ("lock, history, target checks (local files)", "< 0.1"),
    ("target health pre-check (kubectl wait on its router and engine groups)", "1-2"),
    ("the program under mocks, to find the route's URN (measured here: 0.5-0.8 for prod)", "0.5-1"),
    ("route change: `pulumi up --target` of the HTTPRoute (CLI start, plugins, diff, one PATCH)", "8-15"),
    ("Envoy Gateway reconciles the route and pushes xDS to the proxies", "1-3"),
    ("verify: consecutive healthy probes through the gateway", "3-5"),
    ("total, target still warm (the revision before the last rollout)", "14-26"),
    ("total, target no longer running (weights fetched and loaded again)", "minutes: outside the 60 s budget"),
]


def one_run(spec_a, spec_b, apply_latency: float) -> float:
    good = Observation(ttft_p99_s=0.3, tpot_p99_s=0.02, error_rate=0.0, kv_transfer_errors=0)
    quiet = Console(file=io.StringIO())
    with tempfile.TemporaryDirectory() as tmp:
        store, cluster = ReleaseStore("bench", Path(tmp)), InMemoryCluster()
        options = RolloutOptions(stages=(100,), bake_seconds=0, poll_seconds=0.001)
        for spec in (spec_a, spec_b):
            rollout(spec, store, cluster, lambda rev: good, options, console=quiet)
        cluster.apply_latency = apply_latency
        return rollback(store, cluster, console=quiet).seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--apply-latency", type=float, default=2.0, help="seconds one cluster change takes")
    parser.add_argument("--stack", default="prod")
    args = parser.parse_args()
    spec_a = load_spec(stack_spec_path(args.stack))
    data = spec_a.model_dump(mode="json")
    data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = 0.6
    spec_b = parse_spec(data)
    times = [one_run(spec_a, spec_b, args.apply_latency) for _ in range(args.runs)]
    print(f"rollback, {args.stack}, in-memory cluster, {args.apply_latency:g}s per cluster change, {args.runs} runs")
    print(f"  median  {statistics.median(times):.3f} s")
    print(f"  slowest {max(times):.3f} s")
    print(f"  budget  60 s: {'met' if max(times) < 60 else 'MISSED'}")
    print("on a real cluster, per step (estimate, seconds):")
    for step, seconds in REAL_CLUSTER_ESTIMATE:
        print(f"  {step}: {seconds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
