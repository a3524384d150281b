"""Is one connection allowed by a set of NetworkPolicies? The semantics of
kubernetes.io/docs/concepts/services-networking/network-policies/ (networking.k8s.io/v1):

- a pod is isolated for ingress (egress) if any policy selects it with that policy type;
  a pod no policy selects for a direction allows everything in that direction;
- an isolated pod allows what the union of its selecting policies' rules allows; a rule
  with no `from`/`to` matches every peer, one with no `ports` matches every port;
- a peer is a podSelector (the policy's namespace unless a namespaceSelector is given), a
  namespaceSelector, both (pods in matching namespaces), or an ipBlock (addresses outside
  the cluster's pods: here, an endpoint given by address only);
- a connection needs the sender's egress and the receiver's ingress both to allow it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    namespace: str | None  # None: outside the cluster's pods (an address only)
    labels: dict[str, str] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)
    address: str | None = None


def selects(selector: dict, labels: dict[str, str]) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _ns_labels(ep: Endpoint) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": ep.namespace, **ep.namespace_labels} if ep.namespace else {}


def _peer_matches(peer: dict, policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.address is None:
            return False
        block = peer["ipBlock"]
        addr = ipaddress.ip_address(other.address)
        return addr in ipaddress.ip_network(block["cidr"]) and not any(
            addr in ipaddress.ip_network(e) for e in block.get("except", []))
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer and not selects(peer["namespaceSelector"], _ns_labels(other)):
        return False
    if "namespaceSelector" not in peer and other.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def _port_matches(ports: list[dict] | None, port: int) -> bool:
    return not ports or any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in ports)


def _allowed(policies: list[dict], me: Endpoint, other: Endpoint, port: int, direction: str) -> bool:
    if me.namespace is None:
        return True  # outside the cluster: no policy applies
    kind, peers_key = ("Ingress", "from") if direction == "ingress" else ("Egress", "to")
    selecting = [p for p in policies if p["metadata"]["namespace"] == me.namespace
                 and kind in p["spec"].get("policyTypes", ["Ingress"]) and selects(p["spec"]["podSelector"], me.labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(direction, []):
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(peer, policy["metadata"]["namespace"], other) for peer in peers)) \
                    and _port_matches(rule.get("ports"), port):
                return True
    return False


def connection_allowed(policies: list[dict], source: Endpoint, target: Endpoint, port: int) -> bool:
    return (_allowed(policies, source, target, port, "egress")
            and _allowed(policies, target, source, port, "ingress"))
