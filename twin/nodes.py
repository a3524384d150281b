"""kwok Nodes that stand in for the GPU nodes a spec's pools hold. Pure: spec in, Node objects out.

Each node is what Karpenter would launch for one of pdstack's own NodePools
(infra/components/nodepools.py): the pool template's labels and taints, the single value of
each requirement (instance type, capacity type, architecture), the `karpenter.sh/nodepool`
label, and the resources the instance has: the spec's GPUs, fabric devices and memory, and the
instance's vCPUs. How many: what infra/planning/capacity.py reserves (a static pool's nodes, or
a dynamic pool's GPU limit in whole nodes). Pools placed by NVLink domain get the domain label
(`hardware.supernode.topology_label`) with one value per rack of `supernode.gpus` GPUs, as the
GPU operator publishes it (`<cluster uuid>.<clique id>`).

The nodes carry kwok's annotation so the kwok controller (and no kubelet) runs them, plus a
twin label so a test can remove exactly the nodes it made.
"""

from __future__ import annotations

from infra.components.nodepools import nodepool_manifest
from infra.planning.capacity import nodes_per_domain, pool_capacity
from infra.spec import StackSpec

KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}
TWIN_LABEL = "twin.pdstack.io/stack"
# vCPUs of the instance types the specs name: the spec carries GPUs and memory but not the CPU
# count (AWS, "Amazon EC2 instance type specifications", accelerated computing).
INSTANCE_VCPUS = {"p5.48xlarge": 192, "p5en.48xlarge": 192, "p6-b200.48xlarge": 192, "p6e-gb200.36xlarge": 144}
MAX_PODS = 110  # the kubelet's default --max-pods
# Nodes for the pods that need no GPU (router, KV cache master, collectors, endpoint picker): the
# platform's general-purpose node group, which no pdstack NodePool describes.
SYSTEM_NODES = 3
SYSTEM_NODE_RESOURCES = {"cpu": "64", "memory": "256Gi", "pods": str(MAX_PODS), "ephemeral-storage": "500Gi"}


class TwinNodeError(ValueError):
    pass


def _requirement_values(pool: dict) -> dict[str, str]:
    """Labels a launched node gets from the pool's requirements: the first allowed value of each."""
    return {r["key"]: r["values"][0] for r in pool["spec"]["template"]["spec"]["requirements"]
            if r["operator"] == "In" and r["values"]}


def pool_nodes(spec: StackSpec, role: str) -> list[dict]:
    hw = spec.hardware
    pool = nodepool_manifest(spec, role, {})
    capacity = pool_capacity(spec, role)
    count = capacity.static_nodes if capacity.static else capacity.gpus // hw.gpus_per_node
    labels = {**pool["spec"]["template"]["metadata"]["labels"], **_requirement_values(pool),
              "karpenter.sh/nodepool": pool["metadata"]["name"], "kubernetes.io/os": "linux",
              "topology.kubernetes.io/zone": "twin-a", TWIN_LABEL: spec.environment.name}
    instance_type = labels["node.kubernetes.io/instance-type"]
    if instance_type not in INSTANCE_VCPUS:
        raise TwinNodeError(f"hardware.instance_types: the twin does not know the vCPUs of {instance_type!r}. "
                            f"Fix: add it to twin/nodes.py INSTANCE_VCPUS (known: {', '.join(INSTANCE_VCPUS)})")
    resources = {"cpu": str(INSTANCE_VCPUS[instance_type]), "memory": f"{hw.node_memory_gib}Gi",
                 "nvidia.com/gpu": str(hw.gpus_per_node), "pods": str(MAX_PODS), "ephemeral-storage": "7000Gi"}
    if hw.fabric is not None:
        resources[hw.fabric.resource] = str(hw.fabric.per_node)
    per_domain = nodes_per_domain(spec) if capacity.placement != "none" else 0
    nodes = []
    for index in range(count):
        name = f"{pool['metadata']['name']}-{index:03d}"
        node_labels = {**labels, "kubernetes.io/hostname": name, "kubernetes.io/arch": labels["kubernetes.io/arch"]}
        if per_domain:
            rack = index // per_domain
            node_labels[hw.supernode.topology_label] = f"twin-{spec.environment.name}-{role}-rack{rack}.{rack}"
        nodes.append(_node(name, node_labels, pool["spec"]["template"]["spec"]["taints"], resources))
    return nodes


def system_nodes(spec: StackSpec) -> list[dict]:
    """The general-purpose nodes, untainted, of the spec's architecture."""
    arch = spec.hardware.cpu_architecture
    return [_node(f"{spec.environment.name}-system-{i}",
                  {"kubernetes.io/arch": arch, "kubernetes.io/os": "linux", "kubernetes.io/hostname":
                   f"{spec.environment.name}-system-{i}", "topology.kubernetes.io/zone": "twin-a",
                   "node.kubernetes.io/instance-type": "system", TWIN_LABEL: spec.environment.name},
                  [], SYSTEM_NODE_RESOURCES) for i in range(SYSTEM_NODES)]


def stack_nodes(spec: StackSpec) -> list[dict]:
    """Every node the spec's fleet runs on: each pool's reserved nodes and the system nodes."""
    return [n for role in spec.deployment.pools() for n in pool_nodes(spec, role)] + system_nodes(spec)


def _node(name: str, labels: dict, taints: list, resources: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels, "annotations": dict(KWOK_ANNOTATION)},
            "spec": {"taints": taints},
            # kwok's node-initialize stage copies capacity to allocatable and marks the node Ready.
            "status": {"capacity": resources, "allocatable": resources}}
