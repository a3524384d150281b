"""Where GPU pods may run: their role's node pool, and for multi-node groups NVLink domains. Pure.

Each role's Karpenter pool labels and taints its nodes with `pdstack.io/role=<role>`, so a
GPU pod must both select and tolerate its role, and nothing else lands there.

NVLink domains (infra/planning/capacity.py decides which pools use them) are values of the
label the GPU operator publishes on each node (`nvidia.com/gpu.clique`):
- every pod of one group goes to one domain: pod affinity to its own group, scoped by
  matchLabelKeys on LWS's per-group label (the API server copies the key's value from the
  incoming pod; Kubernetes 1.33 GA, MatchLabelKeysInPodAffinity). LWS's webhook sets that
  label on every group's pods (kubernetes-sigs/lws v0.10.0, pkg/webhooks/pod_webhook.go).
- a decode (or colocated) group takes its domain to itself: pod anti-affinity against the
  same role's other groups in every namespace of the environment, release tracks included
  (mismatchLabelKeys on the group label excludes its own group).
LWS's own exclusive-topology annotation is not used: its anti-affinity matches every LWS pod
of the namespace (any group key), so it would keep prefill out of decode domains too, and it
does not reach the other tracks' namespaces (same file, SetExclusiveAffinities).
"""

from __future__ import annotations

from infra import naming
from infra.planning.capacity import domain_placement
from infra.spec import StackSpec

LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
ENVIRONMENT_LABEL = "pdstack.io/environment"


def gpu_scheduling(spec: StackSpec, role: str, lws_group: bool = True) -> dict:
    """Pod spec fragment: select the role's pool and the nodes' architecture, tolerate its
    taints, and keep a multi-node group inside NVLink domains as its pool's placement says
    (`lws_group=False` for single pods on the role's nodes, e.g. the encoder)."""
    fragment: dict = {
        "nodeSelector": {naming.ROLE_LABEL: role, "kubernetes.io/arch": spec.hardware.cpu_architecture},
        "tolerations": [
            {"key": naming.ROLE_LABEL, "operator": "Equal", "value": role, "effect": naming.ROLE_TAINT_EFFECT},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }
    placement = domain_placement(spec, role)
    if placement == "none" or not lws_group:
        return fragment
    domain = spec.hardware.supernode.topology_label
    fragment["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {naming.ROLE_LABEL: role}},
        "matchLabelKeys": [LWS_GROUP_KEY_LABEL],
        "topologyKey": domain,
    }]}}
    if placement == "exclusive":
        fragment["affinity"]["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {naming.ROLE_LABEL: role}},
            "mismatchLabelKeys": [LWS_GROUP_KEY_LABEL],
            "namespaceSelector": {"matchLabels": {ENVIRONMENT_LABEL: spec.environment.name}},
            "topologyKey": domain,
        }]}
    return fragment
