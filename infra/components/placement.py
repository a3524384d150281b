"""Where GPU pods may run: their role's node pool, and for wide EP one NVLink domain. Pure.

Each role's Karpenter pool labels and taints its nodes with `pdstack.io/role=<role>`, so
a GPU pod must both select and tolerate its role, and nothing else lands there. A decode
instance that spans nodes is one LeaderWorkerSet group; LWS's exclusive-topology
annotation puts the whole group inside one value of the topology label the GPU operator
publishes for the NVLink domain (`nvidia.com/gpu.clique`), and one group per domain.
"""

from __future__ import annotations

from infra import naming
from infra.spec import StackSpec, all_to_all_needs_nvlink_domain

LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"


def gpu_scheduling(spec: StackSpec, role: str, lws_group: bool = True) -> dict:
    """Pod spec fragment: select the role's pool and the nodes' architecture, tolerate its taints.

    A multi-node group whose all-to-all runs over NVLink (DeepEP on EFA, which has no IBGDA)
    must keep all its pods in one NVLink domain. Decode gets that from LWS's exclusive
    topology (one group per domain); any other such group gets a pod affinity on the domain
    label, scoped to its own group by matchLabelKeys on LWS's per-group label (the scheduler
    copies the key's value from the incoming pod: Kubernetes 1.33, MatchLabelKeysInPodAffinity).
    """
    fragment: dict = {
        "nodeSelector": {naming.ROLE_LABEL: role, "kubernetes.io/arch": spec.hardware.cpu_architecture},
        "tolerations": [
            {"key": naming.ROLE_LABEL, "operator": "Equal", "value": role, "effect": naming.ROLE_TAINT_EFFECT},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }
    phase = spec.deployment.pools().get(role)
    in_one_domain = (phase is not None and spec.hardware.supernode is not None
                     and all_to_all_needs_nvlink_domain(spec, phase))
    if lws_group and in_one_domain and not needs_supernode(spec, role):
        fragment["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {naming.ROLE_LABEL: role}},
            "matchLabelKeys": [LWS_GROUP_KEY_LABEL],
            "topologyKey": spec.hardware.supernode.topology_label,
        }]}}
    return fragment


def needs_supernode(spec: StackSpec, role: str) -> bool:
    """Only a multi-node decode (or colocated) instance gets an NVLink domain to itself.

    Prefill's medium EP tolerates the inter-node fabric where DeepEP can use it (IBGDA):
    its all-to-all runs once per prompt, not once per token. Where it cannot (EFA), prefill
    groups share domains but each stays inside one (gpu_scheduling).
    """
    phase = spec.deployment.pools()[role]
    multi_node = phase.nodes_per_instance(spec.hardware.gpus_per_node) > 1
    return multi_node and role in ("decode", "colocated") and spec.hardware.supernode is not None


def group_annotations(spec: StackSpec, role: str) -> dict[str, str]:
    if not needs_supernode(spec, role):
        return {}
    return {LWS_EXCLUSIVE_TOPOLOGY: spec.hardware.supernode.topology_label}
