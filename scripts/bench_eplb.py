#!/usr/bin/env python3
"""Expert placement on a DeepSeek-V3-sized case: time and imbalance for each policy.

58 MoE layers, 256 experts in 8 groups, Zipf-skewed loads with a fixed seed.
- 8 nodes x 8 GPUs with 32 redundant experts (288 slots, 4.5 per GPU: not whole, so
  the script uses 320 slots, 5 per GPU, and says so), and
- 40 nodes x 8 GPUs: 320 GPUs need at least 320 slots, so 64 redundant (DeepSeek's
  decode layout: one expert per GPU).
Imbalance is max over mean GPU load, per layer; "none" is the engine's default layout.
    .venv/bin/python scripts/bench_eplb.py
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from infra.planning.eplb import PlacementError, place_experts  # noqa: E402

LAYERS, EXPERTS, GROUPS, ASKED_REDUNDANT = 58, 256, 8, 32


def skewed_loads(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = 1e6 / np.arange(1, EXPERTS + 1) ** 1.1
    loads = np.stack([rng.permutation(base) for _ in range(LAYERS)])
    return np.round(loads * rng.uniform(0.8, 1.2, loads.shape))


def redundant_for(gpus: int) -> int:
    """The smallest count >= 32 that gives every GPU the same whole number of slots."""
    slots = max(EXPERTS + ASKED_REDUNDANT, gpus)
    return -(-slots // gpus) * gpus - EXPERTS


def main() -> None:
    loads = skewed_loads()
    print(f"{'case':<26}{'policy':<14}{'seconds':>9}{'mean':>8}{'worst':>8}")
    for nodes in (8, 40):
        gpus = nodes * 8
        redundant = redundant_for(gpus)
        case = f"{nodes}x8 GPUs, {redundant} redundant"
        for policy in ("global", "hierarchical"):
            start = time.perf_counter()
            try:
                result = place_experts(loads, redundant, nodes, gpus, GROUPS, policy=policy)
            except PlacementError as exc:
                print(f"{case:<26}{policy:<14}  not applicable: {exc}")
                continue
            took = time.perf_counter() - start
            if policy == "global":
                b = result.imbalance_before
                print(f"{case:<26}{'none':<14}{'-':>9}{b.mean():>8.3f}{b.max():>8.3f}")
            a = result.imbalance_after
            print(f"{case:<26}{policy:<14}{took:>9.3f}{a.mean():>8.3f}{a.max():>8.3f}")


if __name__ == "__main__":
    main()
