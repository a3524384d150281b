"""A serving stack's twin nodes as an on-prem operator has them, before the platform stack runs.
Pure: spec and Node objects in, Node objects and the inventory out.

On an existing cluster (the platform's `cloud: none`, `nodes.mode: static`) the GPU nodes come
as kubeadm makes them, with no pool label or taint; the operator names each GPU node's role (and
NVLink domain) in the inventory (stacks/inventory/<env>.yaml), and the platform stack's
NodePatches make them the stack's pools. The twin's nodes (twin/nodes.py) carry what the pools
put on them; here that is taken off again, and the inventory written from it.
"""

from __future__ import annotations

import copy

from infra import naming
from infra.rollout.preflight import HostEntry, Inventory
from infra.spec import StackSpec

# The kwok nodes have no SSH: `pdctl preflight` cannot check them, and the platform stack reads
# only the hosts' names, roles and cliques.
NO_SSH = "/dev/null"


def clique_label(spec: StackSpec) -> str:
    return spec.hardware.supernode.topology_label if spec.hardware.supernode else "nvidia.com/gpu.clique"


def as_the_operator_has_them(spec: StackSpec, nodes: list[dict]) -> tuple[list[dict], list[HostEntry]]:
    """`nodes` without what the spec's pools put on them (role and environment labels, the clique
    label, the taints), and the inventory's entry for each GPU node: its role and NVLink domain."""
    bare, hosts = [], []
    clique = clique_label(spec)
    for node in copy.deepcopy(nodes):
        labels = node["metadata"]["labels"]
        if labels.get(naming.ROLE_LABEL):
            hosts.append(HostEntry(name=node["metadata"]["name"], address="127.0.0.1", role=labels[naming.ROLE_LABEL],
                                   clique=labels.get(clique)))
        for key in (naming.ROLE_LABEL, "pdstack.io/environment", "karpenter.sh/nodepool", clique):
            labels.pop(key, None)
        node["spec"]["taints"] = []
        bare.append(node)
    return bare, hosts


def inventory(hosts: list[HostEntry]) -> Inventory:
    return Inventory(key_file=NO_SSH, known_hosts=NO_SSH, hosts=hosts)
