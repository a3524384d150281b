"""Expert placement: which experts to replicate and where each replica goes. Pure numpy.

Our own implementation of the published EPLB algorithm (deepseek-ai/EPLB):
- replicate: give each extra slot to the expert with the highest load per replica;
- pack: greedy balanced packing, heaviest first, into the lightest pack with room;
- hierarchical policy (when the node count divides the expert-group count): pack whole
  expert groups onto nodes first, so a token's group-limited routing stays on one node,
  then replicate within each node and pack replicas onto that node's GPUs;
- global policy: replicate over all slots and pack onto all GPUs.

A replicated expert's load is assumed to split evenly over its replicas. Placement is
never worse than no balancing: for any layer where the algorithm's result has a higher
peak GPU load than the engine's default layout (`default_layout`), that layer keeps the
default.

Load input (documented format), per layer and logical expert, token counts:
- JSON: {"logical_count": [[c_0_0, c_0_1, ...], ...]} — what SGLang's expert distribution
  recorder dumps (`--expert-distribution-recorder-mode stat`); a leading per-rank axis
  ([ranks][layers][experts]) is summed away.
- CSV: header `layer,expert,count`, one row per pair (missing pairs count 0).
Output: {"physical_to_logical_map": [[...], ...]} for SGLang's `--init-expert-location`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

Policy = Literal["auto", "hierarchical", "global"]


class PlacementError(ValueError):
    pass


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n items per row into num_packs packs of n/num_packs items, balancing weight.

    Returns (pack_index, rank_in_pack), each shaped like weight. Vectorised over rows.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    if per_pack == 1:
        order = np.argsort(-weight, axis=1, kind="stable")
        np.put_along_axis(pack_index, order, np.arange(n)[None, :].repeat(rows, 0), axis=1)
        rank_in_pack[:] = 0
        return pack_index, rank_in_pack
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_weight = np.zeros((rows, num_packs))
    pack_count = np.zeros((rows, num_packs), dtype=np.int64)
    r = np.arange(rows)
    for j in range(n):
        item = order[:, j]
        candidate = np.where(pack_count < per_pack, pack_weight, np.inf)
        pack = np.argmin(candidate, axis=1)
        pack_index[r, item] = pack
        rank_in_pack[r, item] = pack_count[r, pack]
        pack_weight[r, pack] += weight[r, item]
        pack_count[r, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give each extra slot to the expert with the highest load per replica.

    Returns (phy2log, replica_rank, logcnt): [rows, num_physical], [rows, num_physical], [rows, n].
    """
    rows, n = weight.shape
    phy2log = np.empty((rows, num_physical), dtype=np.int64)
    rank = np.zeros((rows, num_physical), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    logcnt = np.ones((rows, n), dtype=np.int64)
    r = np.arange(rows)
    for i in range(n, num_physical):
        heaviest = np.argmax(weight / logcnt, axis=1)
        phy2log[:, i] = heaviest
        rank[:, i] = logcnt[r, heaviest]
        logcnt[r, heaviest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.arange(perm.shape[1])[None, :].repeat(perm.shape[0], 0), axis=1)
    return inv


def rebalance_hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log [layers, num_physical], logcnt [layers, experts]), slots in GPU order."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    # 1. Whole expert groups onto nodes.
    tokens_per_group = weight.reshape(layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
                + np.arange(group_size)[None, None, :]).reshape(layers, num_logical)
    mlog2log = _inverse(log2mlog)
    # 2. Replicate within each node ("mlog": logical experts renumbered node by node).
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, num_logical // num_nodes)
    phy2mlog, _, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)
    # 3. Pack each node's physical experts onto its GPUs.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=1)
    pack, rank = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    node_offset = np.arange(0, num_logical, num_logical // num_nodes)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1) + node_offset).reshape(layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, axis=1)
    return phy2log, logcnt


def default_layout(num_logical: int, num_physical: int) -> np.ndarray:
    """The engine's layout without balancing (SGLang's `trivial`): slot i holds expert
    i mod num_logical, so experts sit in order and spare slots repeat the first ones."""
    return np.arange(num_physical, dtype=np.int64) % num_logical


def gpu_loads(weight: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """[layers, gpus] load, each expert's weight split evenly over its replicas."""
    layers, num_logical = weight.shape
    counts = np.zeros((layers, num_logical))
    np.add.at(counts, (np.arange(layers)[:, None], phy2log), 1)
    per_slot = np.take_along_axis(weight / np.maximum(counts, 1), phy2log, axis=1)
    return per_slot.reshape(layers, num_gpus, -1).sum(-1)


def imbalance(loads: np.ndarray) -> np.ndarray:
    """max over mean GPU load, per layer (1.0 is perfect; an idle layer counts as 1.0)."""
    mean = loads.mean(axis=1)
    return np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


@dataclass(frozen=True)
class Placement:
    policy: str
    phy2log: np.ndarray  # [layers, physical slots], slots ordered GPU by GPU
    imbalance_before: np.ndarray  # per layer, the engine's default layout
    imbalance_after: np.ndarray
    num_gpus: int
    fallback_layers: tuple[int, ...] = ()  # layers that kept the engine's default layout

    def engine_file(self, num_layers: int | None = None) -> dict:
        """SGLang's --init-expert-location JSON (sglang/srt/eplb/expert_location.py, init_by_mapping):
        one row per hidden layer of the model (ModelConfigForExpertLocation.num_layers is
        num_hidden_layers, dense layers included). Load files cover the MoE layers, which come
        after the dense ones (DeepSeek's first_k_dense_replace), so dense rows get the default layout."""
        rows = self.phy2log
        if num_layers is not None and num_layers > rows.shape[0]:
            dense = default_layout(int(rows.max()) + 1 if rows.size else 0, rows.shape[1])
            rows = np.vstack([np.repeat(dense[None, :], num_layers - rows.shape[0], axis=0), rows])
        return {"physical_to_logical_map": rows.tolist()}

    def report(self) -> dict:
        policy = self.policy
        if self.policy == "hierarchical" and self.fallback_layers:
            policy = (f"hierarchical, except {len(self.fallback_layers)} layers that kept the engine's default layout "
                      "(group locality broken there)")
        return {
            "policy": policy,
            "fallback_layers": list(self.fallback_layers),
            "gpus": self.num_gpus,
            "slots": int(self.phy2log.shape[1]),
            "imbalance_before": {"mean": float(self.imbalance_before.mean()), "worst": float(self.imbalance_before.max()),
                                 "per_layer": [round(float(x), 4) for x in self.imbalance_before]},
            "imbalance_after": {"mean": float(self.imbalance_after.mean()), "worst": float(self.imbalance_after.max()),
                                "per_layer": [round(float(x), 4) for x in self.imbalance_after]},
        }


def place_experts(weight: np.ndarray, num_redundant: int, num_nodes: int, num_gpus: int,
                  num_groups: int = 1, policy: Policy = "auto") -> Placement:
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2:
        raise PlacementError(f"loads must be [layers, experts], got shape {weight.shape}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise PlacementError("loads must be finite, non-negative token counts (found NaN, Inf or a negative)")
    layers, num_logical = weight.shape
    num_physical = num_logical + num_redundant
    checks = [
        (num_gpus % num_nodes == 0, f"{num_gpus} GPUs do not split over {num_nodes} nodes"),
        (num_physical % num_gpus == 0, f"{num_logical} experts + {num_redundant} redundant do not split over {num_gpus} GPUs"),
        (num_physical >= num_gpus, f"{num_physical} slots leave GPUs empty on {num_gpus} GPUs: add redundant experts"),
        (num_logical % num_groups == 0, f"{num_logical} experts do not split into {num_groups} groups"),
    ]
    for ok, message in checks:
        if not ok:
            raise PlacementError(message)
    hierarchical_ok = num_groups % num_nodes == 0 and num_groups >= num_nodes
    if policy == "hierarchical" and not hierarchical_ok:
        raise PlacementError(f"hierarchical needs the node count ({num_nodes}) to divide the group count ({num_groups})")
    use_hierarchical = policy == "hierarchical" or (policy == "auto" and hierarchical_ok and num_nodes > 1)
    if use_hierarchical:
        phy2log, _ = rebalance_hierarchical(weight, num_physical, num_groups, num_nodes, num_gpus)
    else:
        phy2log, _ = rebalance_hierarchical(weight, num_physical, 1, 1, num_gpus)
    baseline = default_layout(num_logical, num_physical)
    before = imbalance(gpu_loads(weight, baseline[None, :].repeat(layers, 0), num_gpus))
    after = imbalance(gpu_loads(weight, phy2log, num_gpus))
    worse = after > before + 1e-12
    if worse.any():
        phy2log[worse] = baseline
        after = imbalance(gpu_loads(weight, phy2log, num_gpus))
    return Placement("hierarchical" if use_hierarchical else "global", phy2log, before, after, num_gpus,
                     fallback_layers=tuple(int(i) for i in np.flatnonzero(worse)))


def load_loads(path: str | Path, num_experts: int | None = None) -> np.ndarray:
    """Read a load file (JSON or CSV, see the module docstring) into [layers, experts].

    Every problem names the file (and the CSV line): a bad index would otherwise wrap (numpy
    reads expert -1 as the last expert) and a NaN would poison the whole placement."""
    from infra.inputs import load_json, read_text

    path = Path(path)
    if path.suffix == ".csv":
        rows = list(csv.DictReader(read_text(path, "load").splitlines()))
        if not rows or set(rows[0]) != {"layer", "expert", "count"}:
            raise PlacementError(f"{path}: expected a CSV header 'layer,expert,count' and at least one row")
        cells = []
        for line, r in enumerate(rows, start=2):
            try:
                layer, expert, count = int(r["layer"]), int(r["expert"]), float(r["count"])
            except (TypeError, ValueError):
                raise PlacementError(f"{path} line {line}: layer and expert must be whole numbers and count a number "
                                     f"(got {r['layer']!r}, {r['expert']!r}, {r['count']!r})") from None
            if layer < 0 or expert < 0 or (num_experts is not None and expert >= num_experts):
                bound = f"0..{num_experts - 1}" if num_experts else "0 or more"
                raise PlacementError(f"{path} line {line}: layer {layer}, expert {expert} is out of range "
                                     f"(experts are {bound}, layers 0 or more)")
            cells.append((layer, expert, count))
        loads = np.zeros((max(c[0] for c in cells) + 1, num_experts or max(c[1] for c in cells) + 1))
        for layer, expert, count in cells:
            loads[layer, expert] += count
    else:
        data = load_json(path, "load")
        if not isinstance(data, dict) or "logical_count" not in data:
            raise PlacementError(f"{path}: expected a JSON object with 'logical_count' [layers][experts]")
        try:
            loads = np.asarray(data["logical_count"], dtype=np.float64)
        except (TypeError, ValueError):
            raise PlacementError(f"{path}: logical_count must be rows of numbers of equal length "
                                 "([layers][experts])") from None
        if loads.ndim == 3:
            loads = loads.sum(axis=0)
    if loads.ndim != 2 or 0 in loads.shape:
        raise PlacementError(f"{path}: loads must be [layers][experts], got shape {list(loads.shape)}")
    if not np.isfinite(loads).all() or (loads < 0).any():
        raise PlacementError(f"{path}: loads must be finite, non-negative token counts (found NaN, Inf or a negative)")
    return loads
