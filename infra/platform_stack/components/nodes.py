"""Static node mode (on-prem, kubeadm): the GPU nodes exist; each environment's inventory
names them per role, and each becomes one NodePatch: its role label, its role's taints (the
same as a NodePool's, infra/components/nodepools.py role_taints) and, where the inventory gives
one, its NVLink domain's clique label. Server-side apply: only those fields are ours.

Node.spec.taints is an atomic list (k8s.io/api v0.34.4 core/v1/types.go: `+listType=atomic`),
so server-side apply owns it whole: a node another manager had tainted (kubectl taint, an
operator, the kubelet's --register-with-taints) refused a NodePatch carrying only our taints
(a conflict on .spec.taints). The patch is forced (the provider's `pulumi.com/patchForce`,
pulumi-kubernetes provider pkg/metadata/annotations.go AnnotationPatchForce) and carries the
taints the node has that are not ours, read from the live node, so forcing takes over the list
without dropping them. At `pulumi destroy` the provider relinquishes the patch (pkg/ssa
Relinquish: an apply of the bare identity under our field manager), and a field owned only by
that manager is removed: the whole list, so the foreign taints read at the last `pulumi up`
go too; re-apply them (or `pulumi state delete` the NodePatch to keep everything) if they must
stay. Taints added by another manager after that `pulumi up` are its own and are not touched
by `up` again until the next read."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from infra import naming
from infra.components.nodepools import role_taints
from infra.platform_stack.components.base import PlatformLayer
from infra.rollout.preflight import HostEntry, Inventory
from infra.spec import StackSpec

# The provider's annotation asking a Patch resource's server-side apply to take over fields
# another manager owns (pulumi-kubernetes provider pkg/metadata/annotations.go).
PATCH_FORCE = "pulumi.com/patchForce"


def node_taints(role: str, live: list[dict]) -> list[dict]:
    """The taints a node of `role` is patched to: those it has that are not ours (any pdstack
    role taint, whatever role it had before, and any with the key and effect of one of ours,
    which a taint's identity is), then the role's own."""
    ours = role_taints(role)
    mine = {(t["key"], t["effect"]) for t in ours}
    foreign = [t for t in live if t["key"] != naming.ROLE_LABEL and (t["key"], t.get("effect")) not in mine]
    return foreign + ours


def node_patch(spec: StackSpec, host: HostEntry, live_taints: list[dict]) -> dict:
    hw = spec.hardware
    clique_label = hw.supernode.topology_label if hw.supernode else "nvidia.com/gpu.clique"
    labels = {naming.ROLE_LABEL: host.role, "pdstack.io/environment": spec.environment.name}
    if host.clique:
        labels[clique_label] = host.clique
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": host.name, "labels": labels, "annotations": {PATCH_FORCE: "true"}},
            "spec": {"taints": node_taints(host.role, live_taints)}}


def node_patches(spec: StackSpec, inventory: Inventory, live_taints: dict[str, list[dict]] | None = None) -> list[dict]:
    """One patch per inventory host with a role; `live_taints`: each node's taints as read."""
    return [node_patch(spec, host, (live_taints or {}).get(host.name, []))
            for host in inventory.hosts if host.role is not None]


def _taint_dicts(node_spec) -> list[dict]:
    """A read Node's taints (the provider's output types) as the API's dicts."""
    out = []
    for t in (node_spec.taints if node_spec is not None and node_spec.taints else []):
        taint = {"key": t.key, "effect": t.effect}
        if t.value:
            taint["value"] = t.value
        if t.time_added:
            taint["timeAdded"] = t.time_added
        out.append(taint)
    return out


class StaticNodes(PlatformLayer):
    layer = "nodes"

    def __init__(self, name: str, hosted: list[tuple[StackSpec, Inventory]], opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, opts)
        child = pulumi.ResourceOptions(parent=self)
        for spec, inventory in hosted:
            for host in inventory.hosts:
                if host.role is None:
                    continue
                live = k8s.core.v1.Node.get(f"live-{host.name}", host.name, opts=child)
                patch = node_patch(spec, host, [])
                self.objects.append(patch)
                k8s.core.v1.NodePatch(
                    f"node-{host.name}", metadata=patch["metadata"],
                    spec=live.spec.apply(lambda s, spec=spec, host=host: node_patch(spec, host, _taint_dicts(s))["spec"]),
                    opts=child)
        self.register_outputs({})
