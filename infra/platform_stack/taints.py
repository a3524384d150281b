"""Tolerations of the DaemonSets that must run on GPU nodes, derived from the nodes' taints.

The device plugin, GPU feature discovery (the clique label placement selects on), dcgm-exporter,
the DRA driver's kubelet plugin (IMEX channels) and the fabric's device plugin must run on every
GPU node; each of those nodes carries its role's taints (infra/components/nodepools.py
`role_taints`, whatever made the node), so each DaemonSet tolerates exactly those.
"""

from __future__ import annotations

from infra.components.nodepools import role_taints
from infra.spec import StackSpec


def gpu_node_taints(serving: list[StackSpec]) -> list[dict]:
    """Every taint a GPU node of any hosted environment's pools carries, once each."""
    seen: dict[tuple, dict] = {}
    for spec in serving:
        for role in spec.deployment.pools():
            for taint in role_taints(role):
                seen.setdefault((taint["key"], taint.get("value"), taint["effect"]), taint)
    return [seen[k] for k in sorted(seen, key=lambda k: (k[0], str(k[1]), k[2]))]


def tolerations_for(taints: list[dict]) -> list[dict]:
    """A toleration matching each taint exactly (key, value and effect: operator Equal)."""
    return [{"key": t["key"], "operator": "Equal", "value": t["value"], "effect": t["effect"]} for t in taints]


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' rule (k8s.io/api core/v1 toleration.go ToleratesTaint): an empty effect
    matches every effect, operator Exists matches any value, an empty key with Exists matches all."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if not t.get("key") and t.get("operator") == "Exists":
            return True
        if t.get("key") != taint["key"]:
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False
