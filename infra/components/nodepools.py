"""GPU node pools: one Karpenter NodePool per role, labelled and tainted by role."""

from __future__ import annotations

import pulumi

from infra import naming
from infra.components.k8s import Layer, LayerContext
from infra.spec import StackSpec


def pool_gpu_limit(spec: StackSpec, role: str) -> int:
    """GPUs the pool may grow to: the largest instance count times GPUs per instance."""
    return spec.deployment.pools()[role].max_gpus()


def nodepool_manifest(spec: StackSpec, role: str, labels: dict[str, str]) -> dict:
    hw = spec.hardware
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": f"{spec.environment.namespace}-{role}", "labels": {**labels, naming.ROLE_LABEL: role}},
        "spec": {
            "template": {
                "metadata": {"labels": {naming.ROLE_LABEL: role, "pdstack.io/environment": spec.environment.name}},
                "spec": {
                    "nodeClassRef": hw.node_class.model_dump(),
                    "requirements": [
                        {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(hw.instance_types)},
                        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                    ],
                    "taints": [
                        {"key": naming.ROLE_LABEL, "value": role, "effect": naming.ROLE_TAINT_EFFECT},
                        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                    ],
                    # GPU nodes hold weights and warm caches: never expire them on a timer.
                    "expireAfter": "Never",
                },
            },
            "limits": {"nvidia.com/gpu": str(pool_gpu_limit(spec, role))},
            "disruption": {
                "consolidationPolicy": "WhenEmpty",
                "consolidateAfter": "10m",
                "budgets": [{"nodes": hw.disruption_budget}],
            },
        },
    }


class NodePools(Layer):
    layer = "nodepools"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        self.pools = {
            role: self.add(nodepool_manifest(ctx.spec, role, ctx.labels)) for role in ctx.spec.deployment.pools()
        }
        self.register_outputs({})
