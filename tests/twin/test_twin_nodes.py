"""The kwok nodes the twin runs the fleet on are the ones the spec's NodePools would launch
(twin/nodes.py derives them from infra/components/nodepools.py and infra/planning/capacity.py)."""

from __future__ import annotations

from collections import Counter

from infra import naming
from infra.components.nodepools import nodepool_manifest
from infra.planning.capacity import pool_capacity
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from twin.nodes import pool_nodes, stack_nodes


def test_prod_nodes_are_whole_gb200_racks_of_each_static_pool():
    spec = load_spec(stack_spec_path("prod"))
    decode = pool_nodes(spec, "decode")
    assert len(decode) == pool_capacity(spec, "decode").static_nodes == 54  # 3 racks of 18 nodes
    racks = Counter(n["metadata"]["labels"]["nvidia.com/gpu.clique"] for n in decode)
    assert sorted(racks.values()) == [18, 18, 18]
    node = decode[0]
    labels = node["metadata"]["labels"]
    assert labels[naming.ROLE_LABEL] == "decode"
    assert labels["kubernetes.io/arch"] == "arm64"
    assert labels["node.kubernetes.io/instance-type"] == "p6e-gb200.36xlarge"
    assert labels["karpenter.sh/capacity-type"] == "reserved"
    assert labels["karpenter.sh/nodepool"] == "pdstack-prod-decode"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
    assert node["status"]["capacity"]["vpc.amazonaws.com/efa"] == "4"
    assert node["status"]["capacity"]["memory"] == "960Gi"
    assert node["spec"]["taints"] == nodepool_manifest(spec, "decode", {})["spec"]["template"]["spec"]["taints"]


def test_dev_nodes_fill_each_dynamic_pool_to_its_gpu_limit():
    spec = load_spec(stack_spec_path("dev"))
    nodes = stack_nodes(spec)
    by_role = Counter(n["metadata"]["labels"].get(naming.ROLE_LABEL, "system") for n in nodes)
    assert by_role["prefill"] == pool_capacity(spec, "prefill").gpus // 8 == 2
    assert by_role["decode"] == 2
    assert all("nvidia.com/gpu.clique" not in n["metadata"]["labels"] for n in nodes)  # no supernode in dev
    assert all(n["metadata"]["labels"]["kubernetes.io/arch"] == "amd64" for n in nodes)
