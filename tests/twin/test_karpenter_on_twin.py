"""Karpenter provisions dev's GPU pools on the twin (its core, sigs.k8s.io/karpenter v1.14.1, with
the kwok cloud provider standing in for the AWS provider; twin/karpenter.py).

The kwok provider accepts only its own node class, so pdstack's NodePools are applied twice:
as rendered (naming the EC2NodeClass), which Karpenter leaves alone (no status, no node), and
with the node class swapped for a KWOKNodeClass (the only change), from which it
launches the nodes dev's pending engine pods need: no node is made by the test. Karpenter's
scheduling simulation is its own (pkg/controllers/provisioning/scheduling/scheduler.go); the
nodes it launches carry the pool template's labels and taints and the instance type's resources.
"""

from __future__ import annotations

import copy
import time

import pytest

from infra import naming
from infra.components.placement import gpu_scheduling
from infra.planning.capacity import pool_capacity
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from tests.twin.conftest import FIGURES
from tests.twin.test_fleet_on_twin import LWS_NAME_LABEL, remove_fleet
from twin import fleet
from twin.api import kubectl
from twin.karpenter import KWOK_NODE_CLASS, on_kwok_node_class
from twin.nodes import TWIN_LABEL, system_nodes


@pytest.fixture(scope="module")
def dev_on_karpenter(twin, tmp_path_factory):
    spec = load_spec(stack_spec_path("dev"))
    objects = fleet.render("dev", tmp_path_factory.mktemp("dev-karpenter"))
    pools = [o for o in objects if o["kind"] == "NodePool"]
    assert fleet.apply_each_pass(system_nodes(spec) + [KWOK_NODE_CLASS]).rejected == {}
    swapped = [on_kwok_node_class(p) if p["kind"] == "NodePool" else p for p in objects]
    result = fleet.apply_each_pass(swapped)
    assert result.rejected == {}, result.rejected
    yield spec, objects, pools
    remove_fleet(objects)
    kubectl("delete", "nodeclaims", "--all", "--wait=false")
    kubectl("delete", "kwoknodeclass", KWOK_NODE_CLASS["metadata"]["name"], "--ignore-not-found", "--wait=false")
    kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


def test_karpenter_launches_the_nodes_dev_needs(dev_on_karpenter):
    spec, objects, pools = dev_on_karpenter
    namespace = spec.environment.namespace
    sets = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    expected = sum(o["spec"].get("replicas", 1) * o["spec"]["leaderWorkerTemplate"].get("size", 1) for o in sets)

    def bound():
        pods = [p for p in fleet.get("pods", "-n", namespace) if LWS_NAME_LABEL in p["metadata"].get("labels", {})]
        return pods if len(pods) >= expected and all(p["spec"].get("nodeName") for p in pods) else None

    pods = fleet.wait_for("Karpenter's nodes", bound, timeout=420) or fleet.get("pods", "-n", namespace)
    launched = [n for n in fleet.get("nodes") if "karpenter.sh/nodepool" in n["metadata"].get("labels", {})
                and TWIN_LABEL not in n["metadata"]["labels"]]
    claims = fleet.get("nodeclaims")
    FIGURES.append(f"dev on Karpenter (kwok provider): {len(claims)} NodeClaims, {len(launched)} nodes launched "
                   f"({', '.join(sorted(n['metadata']['labels']['node.kubernetes.io/instance-type'] for n in launched))}); "
                   f"engine pods bound {sum(bool(p['spec'].get('nodeName')) for p in pods)}/{expected}")
    pending = [p for p in pods if not p["spec"].get("nodeName")]
    assert not pending, "pods left Pending:\n" + "\n".join(
        f"{p['metadata']['name']}: {'; '.join(fleet.scheduler_events(namespace, p['metadata']['name']))}"
        for p in pending)
    for node in launched:
        labels = node["metadata"]["labels"]
        role = labels[naming.ROLE_LABEL]
        assert labels["node.kubernetes.io/instance-type"] in spec.hardware.instance_types
        assert labels["karpenter.sh/capacity-type"] == spec.hardware.capacity_type
        assert labels["kubernetes.io/arch"] == spec.hardware.cpu_architecture
        assert {t["key"] for t in node["spec"].get("taints", [])} >= {naming.ROLE_LABEL, "nvidia.com/gpu"}
        assert int(node["status"]["capacity"]["nvidia.com/gpu"]) == spec.hardware.gpus_per_node
    for role in spec.deployment.pools():
        mine = [n for n in launched if n["metadata"]["labels"][naming.ROLE_LABEL] == role]
        assert 0 < len(mine) * spec.hardware.gpus_per_node <= pool_capacity(spec, role).gpus


def test_a_pool_on_the_ec2_node_class_is_left_alone_by_the_kwok_provider(dev_on_karpenter):
    """As rendered, a pool names the EC2NodeClass, which the kwok provider does not support:
    Karpenter treats it as not its own (sigs.k8s.io/karpenter v1.14.1, pkg/utils/nodepool/nodepool.go
    IsManaged, the predicate of every NodePool controller), so it writes no status and launches
    nothing for it, even with a pod pending that only it could take."""
    spec, objects, pools = dev_on_karpenter
    as_rendered = copy.deepcopy(pools[0])
    as_rendered["metadata"]["name"] += "-as-rendered"
    role = as_rendered["metadata"]["labels"][naming.ROLE_LABEL]
    pending = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "waits-for-the-ec2-pool", "namespace": spec.environment.namespace},
               "spec": {"nodeSelector": {"karpenter.sh/nodepool": as_rendered["metadata"]["name"]},
                        **{k: v for k, v in gpu_scheduling(spec, role, lws_group=False).items() if k == "tolerations"},
                        "containers": [{"name": "c", "image": "registry.invalid/none@sha256:" + "0" * 64}]}}
    assert fleet.apply_each_pass([as_rendered, pending]).rejected == {}
    try:
        time.sleep(30)  # several of Karpenter's provisioning batches (10 s at most each)
        pool = fleet.get("nodepools", f"--field-selector=metadata.name={as_rendered['metadata']['name']}")[0]
        claims = [c for c in fleet.get("nodeclaims")
                  if c["metadata"].get("labels", {}).get("karpenter.sh/nodepool") == as_rendered["metadata"]["name"]]
        FIGURES.append(f"dev NodePool as rendered (EC2NodeClass) on the kwok provider: status "
                       f"{pool.get('status', {}) or 'none'}, {len(claims)} NodeClaims for a pending pod")
        assert not pool.get("status", {}).get("conditions") and claims == []
    finally:
        kubectl("delete", "pod", "-n", spec.environment.namespace, "waits-for-the-ec2-pool", "--ignore-not-found",
                "--wait=false")
        kubectl("delete", "nodepool", as_rendered["metadata"]["name"], "--ignore-not-found", "--wait=false")
