"""The data path's controllers on the twin: each the upstream program built from its pinned Go
module (twin/build.py), run as its own ServiceAccount with the RBAC its project publishes at that
version (twin/identities.py), listening on 127.0.0.1 only.

  prometheus-operator  v0.93.0  cmd/operator, with the container args of the Deployment in its
                                bundle.yaml (what the platform stack installs), its web server
                                moved to 127.0.0.1; its ServiceAccount, ClusterRole and binding
                                from the same bundle.yaml

Each controller's RBAC objects are the platform stack's own (infra/platform_stack/components/
controllers.py moves them into the catalog row's namespace), renamed with TWIN_PREFIX and put in
a namespace of the twin's: tests/twin/test_platform_on_twin.py applies and destroys the platform
stack's copy, and its destroy must not take away a running controller's permissions.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from twin import build, identities

TWIN_PREFIX = "twin-"
NAMESPACE = "twin-dataplane"  # the controllers' ServiceAccounts (no pod of theirs runs anywhere)
_CLUSTER_SCOPED_RBAC = {"ClusterRole", "ClusterRoleBinding"}


def twin_copy(objects: list[dict], namespace: str = NAMESPACE) -> list[dict]:
    """The platform stack's RBAC objects for one controller as the twin's own: namespaced ones in
    `namespace`, cluster-wide ones renamed with TWIN_PREFIX, and the bindings' role references
    and ServiceAccount subjects following them."""
    out = []
    for obj in objects:
        obj = {**obj, "metadata": {**obj["metadata"]}}
        if obj["kind"] in _CLUSTER_SCOPED_RBAC:
            obj["metadata"]["name"] = TWIN_PREFIX + obj["metadata"]["name"]
        else:
            obj["metadata"]["namespace"] = namespace
        if obj.get("roleRef", {}).get("kind") == "ClusterRole":
            obj["roleRef"] = {**obj["roleRef"], "name": TWIN_PREFIX + obj["roleRef"]["name"]}
        if "subjects" in obj:
            obj["subjects"] = [{**s, "namespace": namespace} if s.get("kind") == "ServiceAccount" else s
                               for s in obj["subjects"]]
        out.append(obj)
    return out


# --- prometheus-operator ---------------------------------------------------------------------

def _bundle() -> tuple[list[dict], dict]:
    """prometheus-operator's bundle.yaml as the platform stack installs it, and where it came from."""
    from infra.platform_stack.catalog import controller
    from infra.platform_stack.components.controllers import manifest_documents
    from infra.platform_stack.modules import pin

    row = controller("prometheus-operator")
    origin = pin(row.manifests.module).origin(row.manifests.path)
    return manifest_documents(row.manifests, row.namespace), origin


def prometheus_operator_rbac() -> tuple[list[dict], list[dict]]:
    """The bundle's ServiceAccount, ClusterRole and ClusterRoleBinding (the twin's copy), and their origin."""
    docs, origin = _bundle()
    return twin_copy([d for d in docs if d["kind"] in identities.RBAC_KINDS]), [origin]


def prometheus_operator_args() -> list[str]:
    """The container args of the bundle's Deployment at the pinned version."""
    docs, _ = _bundle()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def start_prometheus_operator(supervisor, admin_kubeconfig: Path) -> None:
    kubeconfig = identities.start_as_own(prometheus_operator_rbac(), admin_kubeconfig)
    port = supervisor.ports.prometheus_operator
    # No --kubeconfig flag: the operator reads KUBECONFIG (pkg/k8s/k8s.go NewClusterConfig).
    supervisor.spawn("prometheus-operator", [
        str(build.program("prometheus-operator")), *prometheus_operator_args(),
        f"--web.listen-address=127.0.0.1:{port}"], env={"KUBECONFIG": str(kubeconfig)})
    supervisor.wait_until("prometheus-operator", lambda: _http_ok(port, "/healthz"))


def _http_ok(port: int, path: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return answer.status == 200


def start(supervisor, admin_kubeconfig: Path) -> None:
    """Every data-path controller, after the CRDs (called by twin/cluster.py's Supervisor)."""
    start_prometheus_operator(supervisor, admin_kubeconfig)
