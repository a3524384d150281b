"""Who the twin's controllers are: each its own ServiceAccount with the RBAC its project
publishes at the pinned version (twin/identities.py), never the admin certificate.

Where each RBAC file comes from (read from the module zip go.sum verifies, and recorded in
the twin's run/identities.json):
  kwok v0.8.0 (sigs.k8s.io/kwok): kustomize/rbac/{service_account,role,role_binding,flow_schema}.yaml
  LWS v0.9.0 (sigs.k8s.io/lws): config/rbac/*.yaml as config/default/kustomization.yaml builds them
    (namespace lws-system, namePrefix lws-)
  Karpenter v1.14.1 (sigs.k8s.io/karpenter): kwok/charts/templates/{serviceaccount,clusterrole,
    clusterrole-kwok,aggregate-clusterrole,role,rolebinding}.yaml, rendered by helm.sh/helm/v3
    v3.18.6 (the Helm engine/kubernetes/go.mod's provider embeds) for release `karpenter` in kube-system
"""

from __future__ import annotations

import json
import re
import stat
import uuid
from pathlib import Path

import pytest
import yaml

from twin import cluster, fleet, identities
from twin.api import kubectl
from twin.paths import RUN_DIR

ACCOUNTS = {  # component (as the supervisor names it) -> its ServiceAccount
    "kwok": "kube-system/kwok-controller",
    "lws-controller-manager": "lws-system/lws-controller-manager",
    "karpenter": "kube-system/karpenter",
}
MODULE_OF = {"kwok": "sigs.k8s.io/kwok", "lws-controller-manager": "sigs.k8s.io/lws",
             "karpenter": "sigs.k8s.io/karpenter"}


def _whoami(kubeconfig: str) -> str:
    done = kubectl("auth", "whoami", "-o", "json", kubeconfig_path=Path(kubeconfig))
    return json.loads(done.stdout)["status"]["userInfo"]["username"]


def _process_reads(pid: int) -> str:
    """The command line and environment of a component (where its kubeconfig is named)."""
    return "\0".join(Path(f"/proc/{pid}/{part}").read_bytes().decode(errors="replace")
                     for part in ("cmdline", "environ"))


@pytest.mark.parametrize("component", list(ACCOUNTS))
def test_each_controller_runs_as_its_own_account(twin, component):
    """The component is started with its own kubeconfig (0600, a TokenRequest token of its
    ServiceAccount; the API server says who it is) and never the admin's, and the RBAC it was
    given is its project's, read at the pinned version."""
    namespace, name = ACCOUNTS[component].split("/")
    entry = identities.recorded()[ACCOUNTS[component]]
    kubeconfig = Path(entry["kubeconfig"])
    assert stat.S_IMODE(kubeconfig.stat().st_mode) == 0o600
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    for where in (json.dumps(entry), (RUN_DIR / "supervisor.log").read_text(errors="replace")):
        assert token not in where  # the record and the log name the file, never the token
    if component == "karpenter":  # it reaches the API server through its network namespace's tunnel
        assert entry["kubeconfig"] in _process_reads(twin["components"][component])
    else:
        assert _whoami(entry["kubeconfig"]) == f"system:serviceaccount:{namespace}:{name}"
        assert f"--kubeconfig={kubeconfig}" in _process_reads(twin["components"][component])
    assert str(cluster.KUBECONFIG) not in _process_reads(twin["components"][component])
    assert {o["module"] for o in entry["read_from"]} == {MODULE_OF[component]}
    assert all(o["version"] and o["go_sum"].startswith("h1:") for o in entry["read_from"])


def _log_since(component: str, offset: int) -> str:
    return (RUN_DIR / "logs" / f"{component}.log").read_bytes()[offset:].decode(errors="replace")


def _forbidden_in_log(component: str, offset: int, about: str, account: str, verb: str, resource: str) -> str:
    """The controller's own words once the API server refused it its work on object `about`
    (polls its log; '' if never). Its logs quote with \\" (JSON or logr's key-values)."""
    refusal = re.compile(rf'{re.escape(about)}.*forbidden: User \\?"system:serviceaccount:{account.replace("/", ":")}'
                         rf'\\?" cannot {verb} resource \\?"{re.escape(resource)}\\?"')

    def said():
        lines = [line for line in _log_since(component, offset).splitlines() if refusal.search(line)]
        return lines[0] if lines else ""
    return fleet.wait_for(f"{component} refused", said, timeout=120, interval=1)


@pytest.fixture
def broken_rbac(twin):
    """break_(objects, kind, name, resource, verb): grant a controller's RBAC without one rule;
    what its project publishes is granted again after the test."""
    granted = []

    def break_(objects: list[dict], *rule) -> None:
        granted.append(objects)
        identities.grant(identities.without(objects, *rule))
    yield break_
    for objects in granted:
        identities.grant(objects)


def test_kwok_without_its_node_status_rule_cannot_make_a_node_ready(broken_rbac):
    """Drop `patch` on nodes/status from kwok's ClusterRole: kwok's patch of a new node's status
    is refused, to its ServiceAccount, and the node is not Ready. The break bites."""
    broken_rbac(identities.kwok_rbac()[0], "ClusterRole", "kwok-controller", "nodes/status", "patch")
    offset = (RUN_DIR / "logs" / "kwok.log").stat().st_size
    name = f"hp-rbac-probe-{uuid.uuid4().hex[:6]}"
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "annotations": {"kwok.x-k8s.io/node": "fake"}, "labels": {"type": "kwok"}},
        "spec": {"taints": [{"key": "hp-rbac-probe", "effect": "NoSchedule"}]}}
    assert fleet.apply_each_pass([node]).rejected == {}
    try:
        said = _forbidden_in_log("kwok", offset, name, ACCOUNTS["kwok"], "patch", "nodes/status")
        assert said, _log_since("kwok", offset)[-3000:]
        conditions = fleet.get("nodes", f"--field-selector=metadata.name={name}")[0]["status"].get("conditions", [])
        assert not any(c["type"] == "Ready" and c["status"] == "True" for c in conditions), conditions
    finally:
        kubectl("delete", "node", name, "--wait=false")


def test_lws_without_its_statefulset_rule_cannot_form_a_group(broken_rbac):
    """Drop `create` on statefulsets from LWS's manager ClusterRole: its reconcile of a new
    LeaderWorkerSet is refused, to its ServiceAccount. The break bites."""
    broken_rbac(identities.lws_rbac()[0], "ClusterRole", "lws-manager-role", "statefulsets", "create")
    offset = (RUN_DIR / "logs" / "lws-controller-manager.log").stat().st_size
    name = f"hp-rbac-probe-{uuid.uuid4().hex[:6]}"
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": name, "namespace": "default"},
           "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": {
               "containers": [{"name": "c", "image": "registry.invalid/none:1"}]}}}}}
    assert fleet.apply_each_pass([lws]).rejected == {}
    try:
        said = _forbidden_in_log("lws-controller-manager", offset, name, ACCOUNTS["lws-controller-manager"],
                                 "create", "statefulsets")
        assert said, _log_since("lws-controller-manager", offset)[-3000:]
        assert fleet.get("statefulsets", "-n", "default", f"--field-selector=metadata.name={name}") == []
    finally:
        kubectl("delete", "leaderworkerset", name, "-n", "default", "--wait=false")


def _can(account: str, verb: str, resource: str) -> bool:
    """The real RBAC authorizer's answer (SubjectAccessReview, kubectl auth can-i --as)."""
    namespace, name = account.split("/")
    done = kubectl("auth", "can-i", verb, resource, f"--as=system:serviceaccount:{namespace}:{name}",
                           check=False)
    return done.stdout.strip() == "yes"


def test_karpenter_without_its_nodeclaim_rule_may_not_launch(broken_rbac):
    """Karpenter launches by creating a NodeClaim; its chart's core ClusterRole grants that.
    Dropped, the authorizer refuses its ServiceAccount (tests/twin/test_karpenter_on_twin.py
    shows the launch itself with the rule)."""
    account = ACCOUNTS["karpenter"]
    assert _can(account, "create", "nodeclaims.karpenter.sh")
    broken_rbac(identities.karpenter_rbac("kube-system")[0], "ClusterRole", "karpenter-core", "nodeclaims", "create")
    assert not _can(account, "create", "nodeclaims.karpenter.sh")
