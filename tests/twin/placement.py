"""Checks shared by the tests that apply a render to the twin: every pod bound where the
placement says, and the removal of what a render applied (tests/twin/test_fleet_on_twin.py,
tests/twin/test_tracks_on_twin.py)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from infra import naming
from infra.planning.capacity import domain_placement
from tests.twin.conftest import FIGURES
from twin import fleet
from twin.cluster import kubectl
from twin.nodes import TWIN_LABEL

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"


def remove_fleet(objects: list[dict]) -> None:
    """Delete what a render applied (namespaces take their contents with them) and the stack's nodes."""
    namespaces = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    cluster_scoped = [f"{o['kind'].lower()}.{o['apiVersion'].split('/')[0]}/{o['metadata']['name']}"
                      for o in objects if "namespace" not in o["metadata"] and o["kind"] != "Namespace"
                      and "/" in o["apiVersion"]]
    if cluster_scoped:
        kubectl("delete", "--ignore-not-found", "--wait=false", *cluster_scoped)
    delete_namespaces(namespaces)


def delete_namespaces(namespaces: list[str]) -> None:
    """Delete namespaces and wait until the namespace controller has removed them and their
    contents. The next test may create the same names: a namespace still Terminating refuses
    new objects ("namespaces ... not found" from the API server) and keeps the old route and
    its fence, which a fresh rollout then meets as another holder's."""
    if namespaces:
        kubectl("delete", "namespace", "--ignore-not-found", "--timeout=300s", *namespaces)


def remove_render(spec, objects: list[dict], nodes: bool = True) -> None:
    """Everything an applied render left: its objects, the DRA stand-in's, its stack's nodes
    (unless `nodes` is False: the test still looks at them)."""
    remove_fleet(objects)
    for kind in ("resourceslices", "deviceclasses"):
        kubectl("delete", kind, "-l", "twin.pdstack.io/stands-in-for", "--ignore-not-found")
    if nodes:
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


def pods_in(namespaces: set[str]) -> list[dict]:
    return [p for ns in sorted(namespaces) for p in fleet.get("pods", "-n", ns)]


def assert_every_pod_bound(spec, objects: list[dict], result: fleet.Applied, label: str) -> None:
    """The checks above, on one applied render (its figure line goes to the run's summary)."""
    namespaces = {o["metadata"]["namespace"] for o in objects if o["kind"] == "LeaderWorkerSet"}
    sets = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    expected = sum(o["spec"].get("replicas", 1) * o["spec"]["leaderWorkerTemplate"].get("size", 1) for o in sets)

    def all_bound():
        pods = [p for p in pods_in(namespaces) if "deletionTimestamp" not in p["metadata"]]
        lws_pods = [p for p in pods if LWS_NAME_LABEL in p["metadata"].get("labels", {})]
        if len(lws_pods) >= expected and all(p["spec"].get("nodeName") for p in pods):
            return pods
        return None

    pods = fleet.wait_for("every pod bound", all_bound, timeout=300) or pods_in(namespaces)
    pending = [p for p in pods if not p["spec"].get("nodeName")]
    FIGURES.append(f"{label}: objects applied {len(result.applied)}, rejected {len(result.rejected)}; "
                   f"pods bound {len(pods) - len(pending)}, pending {len(pending)}; "
                   f"LeaderWorkerSet pods {sum(LWS_NAME_LABEL in p['metadata'].get('labels', {}) for p in pods)}"
                   f"/{expected}")
    assert not pending, "pods left Pending:\n" + "\n".join(
        f"{p['metadata']['namespace']}/{p['metadata']['name']}: "
        f"{'; '.join(fleet.scheduler_events(p['metadata']['namespace'], p['metadata']['name'])) or 'no event'}"
        for p in pending)
    lws_pods = [p for p in pods if LWS_NAME_LABEL in p["metadata"].get("labels", {})]
    assert len(lws_pods) == expected, f"{len(lws_pods)} LeaderWorkerSet pods, the sets ask for {expected}"

    nodes = {n["metadata"]["name"]: n for n in fleet.get("nodes")}
    used: dict[str, Counter] = defaultdict(Counter)
    domain_label = spec.hardware.supernode.topology_label if spec.hardware.supernode else None
    domains_of_group: dict[tuple, set] = defaultdict(set)
    for pod in pods:
        node = nodes[pod["spec"]["nodeName"]]
        role = pod["metadata"].get("labels", {}).get(naming.ROLE_LABEL)
        for container in pod["spec"]["containers"]:
            for resource, amount in container.get("resources", {}).get("limits", {}).items():
                if resource.startswith(("nvidia.com/", "vpc.amazonaws.com/", "rdma/")):
                    used[node["metadata"]["name"]][resource] += int(amount)
        wants_gpu = any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in pod["spec"]["containers"])
        if wants_gpu and role:
            assert node["metadata"]["labels"].get(naming.ROLE_LABEL) == role, (
                f"{pod['metadata']['name']} ({role}) is on {node['metadata']['name']}, a "
                f"{node['metadata']['labels'].get(naming.ROLE_LABEL)} node")
        group = pod["metadata"].get("labels", {}).get(GROUP_KEY_LABEL)
        if group and role and domain_label and domain_placement(spec, role) != "none":
            domains_of_group[(pod["metadata"]["namespace"], role, group)].add(node["metadata"]["labels"][domain_label])
    for name, counts in used.items():
        allocatable = nodes[name]["status"]["allocatable"]
        for resource, amount in counts.items():
            assert amount <= int(allocatable.get(resource, 0)), f"{name}: {amount} {resource} bound, " \
                                                                f"{allocatable.get(resource, 0)} allocatable"
    for (_, role, group), domains in domains_of_group.items():
        assert len(domains) == 1, f"{role} group {group} spans NVLink domains {sorted(domains)}"
    for lws in sets:
        role = lws["metadata"]["labels"].get(naming.ROLE_LABEL)
        if domain_label and domain_placement(spec, role) != "none":
            groups = {g for (ns, r, g) in domains_of_group if (ns, r) == (lws["metadata"]["namespace"], role)}
            assert len(groups) == lws["spec"].get("replicas", 1), f"{role}: groups seen {groups}"
    claims = [c for ns in sorted(namespaces) for c in fleet.get("resourceclaims", "-n", ns)]
    assert all(c.get("status", {}).get("allocation") for c in claims), "a ResourceClaim is not allocated"
    assert len(claims) == sum(bool(p["spec"].get("resourceClaims")) for p in lws_pods)
    for role in spec.deployment.pools():
        if domain_label and domain_placement(spec, role) == "exclusive":
            taken = [next(iter(d)) for (_, r, _), d in domains_of_group.items() if r == role]
            assert len(taken) == len(set(taken)), f"two {role} groups share an NVLink domain: {taken}"


def users_objects(spec) -> None:
    """What the user makes before the first rollout (README, "Objects that stay the user's"): dev's
    weights credentials Secret (`access: secret`) in the environment's namespace, which each
    release track's Storage reads to copy into its own (the values are the twin's, no real key)."""
    namespace = spec.environment.namespace
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": spec.model.weights.credentials_secret,
                                                            "namespace": namespace},
         "stringData": {"AWS_ACCESS_KEY_ID": "twin", "AWS_SECRET_ACCESS_KEY": "twin"}}]}))
