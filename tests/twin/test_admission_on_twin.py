"""Admission as a cluster runs it: the twin's kube-apiserver (v1.34.4) runs its default
admission plugins plus NodeRestriction, as kubeadm sets it up (kubeadm's static pod manifest
sets --enable-admission-plugins=NodeRestriction), with API priority and fairness on.

Sources: k8s.io/kubernetes v1.34.4 pkg/kubeapiserver/options/plugins.go (AllOrderedPlugins,
DefaultOffAdmissionPlugins: NodeRestriction is off unless enabled);
plugin/pkg/admission/noderestriction/admission.go (a node may modify only its own Node object:
"node %q is not allowed to modify node %q"); staging/src/k8s.io/apiserver
pkg/server/filters/priority-and-fairness.go (with APF on, every response names the FlowSchema
and priority level that classified it: X-Kubernetes-PF-FlowSchema-UID, X-Kubernetes-PF-PriorityLevel-UID).
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.request
import uuid

from twin import crds, fleet
from twin.api import kubectl
from twin.paths import RUN_DIR
from twin.pki import Authority


def _node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"pdstack.io/probe": "admission"}}}


def _patch_labels_as(pair, port: int, node: str, labels: dict) -> tuple[int, str]:
    """A merge patch of a Node's labels sent as a kubelet sends its own (a PATCH, no GET first:
    kubectl's label and patch read the object first, which the Node authorizer already refuses
    for another node's)."""
    pki = RUN_DIR / "pki"
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pair.cert), str(pair.key))
    request = urllib.request.Request(f"https://127.0.0.1:{port}/api/v1/nodes/{node}", method="PATCH",
                                     data=json.dumps({"metadata": {"labels": labels}}).encode(),
                                     headers={"Content-Type": "application/merge-patch+json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return answer.status, ""
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())["message"]


def test_a_node_may_not_change_another_nodes_labels(twin, tmp_path):
    """A kubelet's identity (user system:node:<name>, group system:nodes, a client certificate from
    the twin's CA) may label its own Node and not another's: the Node authorizer lets a node
    patch nodes, NodeRestriction narrows that to its own (without it, the patch is applied)."""
    own, other = (f"hp-admission-{uuid.uuid4().hex[:6]}-{n}" for n in ("a", "b"))
    assert fleet.apply_each_pass([_node(own), _node(other)]).rejected == {}
    try:
        pair = Authority.existing(RUN_DIR / "pki", tmp_path / "pki").issue(
            "node", f"system:node:{own}", groups=("system:nodes",), client=True)
        port = twin["ports"]["apiserver"]
        assert _patch_labels_as(pair, port, own, {"example.com/probe": "own"}) == (200, "")
        code, said = _patch_labels_as(pair, port, other, {"example.com/probe": "other"})
        assert (code, said) == (403, f'nodes "{other}" is forbidden: node "{own}" is not allowed to modify node "{other}"')
        labels = fleet.get("nodes", f"--field-selector=metadata.name={other}")[0]["metadata"]["labels"]
        assert "example.com/probe" not in labels
    finally:
        kubectl("delete", "node", own, other, "--wait=false")


def test_api_priority_and_fairness_classifies_every_request(twin):
    """With APF on, the API server answers each request with the FlowSchema and priority level
    it was classified by (the admin's: `exempt`, as system:masters is)."""
    pki = RUN_DIR / "pki"
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    url = f"https://127.0.0.1:{twin['ports']['apiserver']}/api/v1/namespaces/default"
    with urllib.request.urlopen(url, context=context, timeout=10) as answer:
        assert answer.headers.get("X-Kubernetes-PF-FlowSchema-UID"), dict(answer.headers)
        assert answer.headers.get("X-Kubernetes-PF-PriorityLevel-UID"), dict(answer.headers)


def _default_on_admission_plugins() -> set[str]:
    """kube-apiserver's default-on admission plugins, read from the pinned source: the packages
    DefaultOffAdmissionPlugins keeps on, named as AllOrderedPlugins names them (`pkg.PluginName, // Name`)."""
    source = crds.module("kube", "k8s.io/kubernetes").file("pkg/kubeapiserver/options/plugins.go").read_text()
    ordered = source[source.index("var AllOrderedPlugins"):source.index("func registerAllAdmissionPluginFlags")]
    name_of = dict(re.findall(r"(\w+)\.PluginName,\s*// (\w+)", ordered))
    default_on = source[source.index("defaultOnPlugins := sets.New("):source.index("return sets.New(AllOrderedPlugins")]
    return {name_of[package] for package in re.findall(r"(\w+)\.PluginName", default_on)}


def test_the_admission_plugins_are_the_defaults_and_node_restriction(twin):
    """What the API server says it loaded at start (its log: "Loaded N mutating/validating
    admission controller(s) ... in the following order") is exactly v1.34.4's default-on
    plugins (pkg/kubeapiserver/options/plugins.go, DefaultOffAdmissionPlugins) plus NodeRestriction."""
    log = (RUN_DIR / "logs" / "kube-apiserver.log").read_text(errors="replace")
    loaded = set()
    for line in log.splitlines():
        if "admission controller(s) successfully in the following order" in line:
            loaded |= {p.strip(' ".') for p in line.rsplit("order:", 1)[1].split(",")}
    default_on = _default_on_admission_plugins()
    assert len(default_on) >= 20 and "NodeRestriction" not in default_on
    assert loaded == default_on | {"NodeRestriction"}, loaded ^ (default_on | {"NodeRestriction"})
