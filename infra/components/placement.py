"""Where GPU pods may run: their role's node pool, and for wide EP one NVLink domain. Pure.

Each role's Karpenter pool labels and taints its nodes with `pdstack.io/role=<role>`, so
a GPU pod must both select and tolerate its role, and nothing else lands there. A decode
instance that spans nodes is one LeaderWorkerSet group; LWS's exclusive-topology
annotation puts the whole group inside one value of the topology label the GPU operator
publishes for the NVLink domain (`nvidia.com/gpu.clique`), and one group per domain.
"""

from __future__ import annotations

from infra import naming
from infra.spec import StackSpec

LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"


def gpu_scheduling(role: str) -> dict:
    """Pod spec fragment: select the role's pool and tolerate its taints."""
    return {
        "nodeSelector": {naming.ROLE_LABEL: role},
        "tolerations": [
            {"key": naming.ROLE_LABEL, "operator": "Equal", "value": role, "effect": naming.ROLE_TAINT_EFFECT},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }


def needs_supernode(spec: StackSpec, role: str) -> bool:
    """Only a multi-node decode (or colocated) instance must sit in one NVLink domain.

    Prefill's medium EP tolerates the inter-node fabric: its all-to-all runs once per
    prompt, not once per token.
    """
    phase = spec.deployment.pools()[role]
    multi_node = phase.nodes_per_instance(spec.hardware.gpus_per_node) > 1
    return multi_node and role in ("decode", "colocated") and spec.hardware.supernode is not None


def group_annotations(spec: StackSpec, role: str) -> dict[str, str]:
    if not needs_supernode(spec, role):
        return {}
    return {LWS_EXCLUSIVE_TOPOLOGY: spec.hardware.supernode.topology_label}
