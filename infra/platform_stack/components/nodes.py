"""Static node mode (on-prem, kubeadm): the GPU nodes exist; each environment's inventory
names them per role, and each becomes one NodePatch: its role label, its role's taints (the
same as a NodePool's, infra/components/nodepools.py role_taints) and, where the inventory gives
one, its NVLink domain's clique label. Server-side apply: only those fields are ours."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from infra import naming
from infra.components.nodepools import role_taints
from infra.platform_stack.components.base import PlatformLayer
from infra.rollout.preflight import Inventory
from infra.spec import StackSpec


def node_patches(spec: StackSpec, inventory: Inventory) -> list[dict]:
    hw = spec.hardware
    clique_label = hw.supernode.topology_label if hw.supernode else "nvidia.com/gpu.clique"
    out = []
    for host in inventory.hosts:
        if host.role is None:
            continue
        labels = {naming.ROLE_LABEL: host.role, "pdstack.io/environment": spec.environment.name}
        if host.clique:
            labels[clique_label] = host.clique
        out.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": host.name, "labels": labels},
                    "spec": {"taints": role_taints(host.role)}})
    return out


class StaticNodes(PlatformLayer):
    layer = "nodes"

    def __init__(self, name: str, hosted: list[tuple[StackSpec, Inventory]], opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, opts)
        for spec, inventory in hosted:
            for patch in node_patches(spec, inventory):
                self.objects.append(patch)
                k8s.core.v1.NodePatch(f"node-{patch['metadata']['name']}", metadata=patch["metadata"],
                                      spec=patch["spec"], opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({})
