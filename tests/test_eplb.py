"""Expert placement: properties over random loads and shapes, and the file formats."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.planning.eplb import PlacementError, gpu_loads, imbalance, load_loads, place_experts


@st.composite
def cases(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus_per_node = draw(st.sampled_from([1, 2, 4]))
    gpus = nodes * gpus_per_node
    groups = nodes * draw(st.sampled_from([1, 2]))
    experts = groups * draw(st.integers(1, 4)) * gpus // np.gcd(groups, gpus)
    redundant = gpus * draw(st.integers(0, 2))
    if experts + redundant < gpus:
        redundant = gpus
    layers = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    skew = draw(st.floats(0, 2))
    rng = np.random.default_rng(seed)
    loads = np.round(rng.pareto(1 + skew, (layers, experts)) * 100) + draw(st.sampled_from([0, 1]))
    policy = draw(st.sampled_from(["global", "hierarchical"]))
    return loads, redundant, nodes, gpus, groups, policy


@settings(max_examples=150, deadline=None)
@given(cases())
def test_placement_properties(case):
    loads, redundant, nodes, gpus, groups, policy = case
    experts = loads.shape[1]
    result = place_experts(loads, redundant, nodes, gpus, groups, policy=policy)
    p = result.phy2log
    # replicas equal slots, and every logical expert has at least one
    assert p.shape == (loads.shape[0], experts + redundant)
    for layer in p:
        assert set(layer.tolist()) == set(range(experts))
    # each GPU holds exactly its share of slots (slots are laid out GPU by GPU)
    assert p.shape[1] % gpus == 0
    # never worse than the engine's default layout
    assert (result.imbalance_after <= result.imbalance_before + 1e-9).all()
    assert np.allclose(result.imbalance_after, imbalance(gpu_loads(loads, p, gpus)))
    # hierarchical keeps each expert group on one node (unless the layer fell back)
    if policy == "hierarchical" and nodes > 1:
        group_size, per_node = experts // groups, p.shape[1] // nodes
        for layer_index, layer in enumerate(p):
            if np.array_equal(layer, np.arange(p.shape[1]) % experts):
                continue  # this layer kept the default layout
            for node in range(nodes):
                node_groups = {e // group_size for e in layer[node * per_node:(node + 1) * per_node]}
                assert len(node_groups) == groups // nodes, (layer_index, node, node_groups)


def test_redundancy_fixes_a_hot_expert():
    loads = np.ones((1, 8))
    loads[0, 3] = 100
    result = place_experts(loads, 8, 1, 8, 1, policy="global")
    # Default: 16 slots hold experts 0..7 twice; two GPUs carry half of expert 3 each:
    # peak 50.5 over a mean of 107 / 8 = 13.375.
    assert result.imbalance_before[0] == pytest.approx(50.5 / 13.375)
    # All 8 spare slots go to expert 3 (9 replicas of 100/9); one GPU must hold two.
    assert (result.phy2log[0] == 3).sum() == 9
    assert result.imbalance_after[0] == pytest.approx((200 / 9) / 13.375)


def test_bad_shapes_get_clear_errors():
    with pytest.raises(PlacementError, match="do not split over 3 GPUs"):
        place_experts(np.ones((2, 8)), 0, 1, 3)
    with pytest.raises(PlacementError, match="hierarchical needs the node count"):
        place_experts(np.ones((2, 8)), 0, 4, 8, num_groups=2, policy="hierarchical")


def test_load_files_json_and_csv(tmp_path):
    j = tmp_path / "loads.json"
    j.write_text(json.dumps({"logical_count": [[[1, 2], [3, 4]], [[1, 0], [0, 1]]]}))  # [ranks][layers][experts]
    assert load_loads(j).tolist() == [[2, 2], [3, 5]]
    c = tmp_path / "loads.csv"
    c.write_text("layer,expert,count\n0,0,5\n0,1,7\n1,1,2\n")
    assert load_loads(c).tolist() == [[5, 7], [0, 2]]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(PlacementError, match="logical_count"):
        load_loads(bad)


def test_pdctl_eplb_writes_placement_and_report(tmp_path):
    from infra.cli import main

    rng = np.random.default_rng(1)
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"logical_count": (rng.pareto(1.5, (48, 128)) * 100).round().tolist()}))
    out = tmp_path / "placement.json"
    assert main(["eplb", "--stack", "dev", "--role", "decode", "--loads", str(loads), "--out", str(out)]) == 0
    placement = json.loads(out.read_text())
    assert len(placement["physical_to_logical_map"]) == 48
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["imbalance_after"]["worst"] <= report["imbalance_before"]["worst"]
