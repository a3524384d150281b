#!/usr/bin/env python3
"""Prefix-cache hit rate with the balancer as several replicas: one tree, N trees behind a
round-robin gateway, N trees behind a gateway that hashes each API key to one replica.

The model and its workload are infra/planning/prefix_affinity.py's (24 tenants with Zipf
popularity, a 2,000-token system prompt each, multi-turn chats re-sending their history, 8
workers with LRU page caches, sglang-router's cache_aware pick with --cache-threshold 0.5).
    .venv/bin/python scripts/bench_balancer_replicas.py [--requests N]
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from infra.planning.prefix_affinity import ARRANGEMENTS, Arrangement, Workload, hit_rate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=Workload.requests)
    args = p.parse_args()
    workload = replace(Workload(), requests=args.requests)
    cases = [*ARRANGEMENTS, Arrangement("8 replicas, round robin", 8, "round_robin")]
    print(f"{'arrangement':<46}{'prefix-cache hit rate':>22}")
    for arrangement in cases:
        print(f"{arrangement.name:<46}{hit_rate(workload, arrangement):>21.1%}")


if __name__ == "__main__":
    main()
