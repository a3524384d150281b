"""Karpenter on the twin: its core at the pinned version with the kwok cloud provider.

The kwok provider stands in for the AWS provider: it "launches" an instance by creating a Node
object that kwok runs, from an instance-type list (kwok/cloudprovider/helpers.go,
InstanceTypeOptions, read from INSTANCE_TYPES_FILE_PATH). EC2NodeClass behaviour (AMIs,
subnets, capacity reservations, EC2's answers) is not simulated, and the provider accepts only
its own node class (KWOKNodeClass, karpenter.kwok.sh/v1alpha1): a NodePool that names an
EC2NodeClass is reported not ready and provisions nothing. So a test that wants Karpenter to
launch a pool's nodes applies pdstack's NodePool with its nodeClassRef pointed at a
KWOKNodeClass, and says so.

The instance types are the ones the shipped specs name, with the resources twin/nodes.py gives
their nodes (one function for both), offered on demand. Reserved capacity (prod's GB200
Capacity Blocks) is left out: Karpenter learns of reservations from the EC2NodeClass, which
the kwok provider does not simulate, so prod's static pools are not provisioned by it here.
"""

from __future__ import annotations

import copy

from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from twin.nodes import pool_nodes

KWOK_NODE_CLASS = {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass",
                   "metadata": {"name": "twin-stands-in-for-ec2nodeclass"}}
SHIPPED_STACKS = ("dev", "prod")


def instance_types_file(stacks: tuple[str, ...] = SHIPPED_STACKS) -> list[dict]:
    seen: dict[str, dict] = {}
    for stack in stacks:
        spec = load_spec(stack_spec_path(stack))
        for role in spec.deployment.pools():
            for node in pool_nodes(spec, role)[:1]:
                labels = node["metadata"]["labels"]
                if labels["karpenter.sh/capacity-type"] != "on-demand":
                    continue
                name = labels["node.kubernetes.io/instance-type"]
                seen.setdefault(name, {
                    "name": name, "architecture": labels["kubernetes.io/arch"], "operatingSystems": ["linux"],
                    "resources": dict(node["status"]["capacity"]),
                    "offerings": [{"Price": 1.0, "Available": True, "Requirements": [
                        {"key": "karpenter.sh/capacity-type", "operator": "In",
                         "values": [labels["karpenter.sh/capacity-type"]]},
                        {"key": "topology.kubernetes.io/zone", "operator": "In",
                         "values": [labels["topology.kubernetes.io/zone"]]}]}]})
    return list(seen.values())


def on_kwok_node_class(nodepool: dict) -> dict:
    """pdstack's NodePool, its node class swapped for the kwok provider's (the only change)."""
    pool = copy.deepcopy(nodepool)
    pool["spec"]["template"]["spec"]["nodeClassRef"] = {
        "group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": KWOK_NODE_CLASS["metadata"]["name"]}
    return pool
