"""GPU node pools: one Karpenter NodePool per role, labelled and tainted by role.

How much each pool holds and whether Karpenter launches its nodes on demand or keeps a fixed
set (a static pool, for pods placed by NVLink domain) is infra/planning/capacity.py's call.
"""

from __future__ import annotations

import pulumi

from infra import naming
from infra.components.k8s import Layer, LayerContext
from infra.planning.capacity import pool_capacity
from infra.spec import StackSpec


def role_taints(role: str) -> list[dict]:
    """The taints every GPU node of a role carries, whatever made it (a NodePool, a managed
    node group, a NodePatch): engine pods tolerate them, and so must every DaemonSet that has to
    run on GPU nodes (infra/platform_stack/taints.py derives those tolerations from here)."""
    return [
        {"key": naming.ROLE_LABEL, "value": role, "effect": naming.ROLE_TAINT_EFFECT},
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
    ]


def node_class_name(spec: StackSpec, role: str) -> str:
    """Each role launches from its own node class (<family>-<role>): its capacity reservations
    are its own, so prefill can never take the racks decode and the rollout surge need."""
    return f"{spec.hardware.node_class.name}-{role}"


def nodepool_manifest(spec: StackSpec, role: str, labels: dict[str, str]) -> dict:
    hw = spec.hardware
    capacity = pool_capacity(spec, role)
    pool = {
        "template": {
            "metadata": {"labels": {naming.ROLE_LABEL: role, "pdstack.io/environment": spec.environment.name}},
            "spec": {
                "nodeClassRef": {**hw.node_class.model_dump(), "name": node_class_name(spec, role)},
                "requirements": [
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(hw.instance_types)},
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [hw.capacity_type]},
                    {"key": "kubernetes.io/arch", "operator": "In", "values": [hw.cpu_architecture]},
                ],
                "taints": role_taints(role),
                # GPU nodes hold weights and warm caches: never expire them on a timer.
                "expireAfter": "Never",
            },
        },
        "disruption": {"budgets": [{"nodes": hw.disruption_budget}]},
    }
    if capacity.static:
        # Karpenter keeps this many nodes whatever is pending (StaticCapacity feature gate);
        # a static pool accepts only a node limit, and ignores consolidation.
        pool["replicas"] = capacity.static_nodes
        pool["limits"] = {"nodes": str(capacity.static_nodes)}
        pool["disruption"]["consolidateAfter"] = "Never"
    else:
        pool["limits"] = {"nvidia.com/gpu": str(capacity.gpus)}
        pool["disruption"].update({"consolidationPolicy": "WhenEmpty", "consolidateAfter": "10m"})
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": f"{spec.environment.namespace}-{role}", "labels": {**labels, naming.ROLE_LABEL: role}},
        "spec": pool,
    }


class NodePools(Layer):
    layer = "nodepools"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        self.pools = {
            role: self.add(nodepool_manifest(ctx.spec, role, ctx.labels)) for role in ctx.spec.deployment.pools()
        }
        self.register_outputs({})
