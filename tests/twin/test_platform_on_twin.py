"""`make up` and `make down` (scripts/up.py) on the cluster twin: the platform stack's Kubernetes
part and dev's serving stack, both applied by the real Pulumi engine, the serving stack reading
the platform's real outputs through the real StackReference, with one file backend for both.

The platform spec is platform-dev's for dev's cluster taken as an existing one (`cloud: none`,
the on-prem path, in static node mode): dev's nodes come as an operator's kubeadm nodes do,
with no pool label or taint, and the platform's NodePatches make them dev's pools. Its charts
are rendered from their sources in the pinned modules (`controllers.chart_source:
pinned-modules`, infra/platform_stack/charts.py) by the Helm inside the real pulumi-kubernetes
provider (helm.v4.Chart, hooks disabled: pkg/provider/helm/v4/chart.go at the pinned provider
sets `DisableHooks = true`). Every object goes to the real API server through the provider's
server-side apply. The real DaemonSet controller and scheduler then place the GPU DaemonSets
onto the GPU nodes the platform has just tainted, and dev's pods onto the nodes of their pools.

What stands in:
- kwok runs every controller's pods, so no image runs and no operator makes the DaemonSets it
  makes at run time. The GPU operator's device plugin, GFD and dcgm-exporter come from its
  ClusterPolicy and are not seen here. NFD's worker is rendered by the chart, and is seen.
- Rows the twin provides or cannot install are `user_installed` (scripts/up.py USER_INSTALLED):
  - lws: the twin runs the real controller, its webhooks on loopback;
  - keda, the DRA driver and the EFA plugin: their charts are in no module the proxy serves,
    and the kwok nodes carry the GPU and EFA capacity the plugins would publish.
- pulumi-random's provider is engine/provider-standins' (its module is not served).
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from infra import naming
from infra.components.nodepools import role_taints
from infra.platform_stack.catalog import controller
from infra.platform_stack.spec import load_platform_spec
from infra.spec import REPO_ROOT, stack_spec_path
from infra.spec_checks import load_spec
from scripts import up
from tests.engine import require_engine
from tests.twin.conftest import FIGURES
from tests.twin.placement import delete_namespaces
from twin import fleet
from twin.api import kubectl
from twin.nodes import TWIN_LABEL, stack_nodes
from twin.onprem import as_the_operator_has_them

NFD_WORKER = "gpu-operator-node-feature-discovery-worker"  # the gpu-operator release's NFD subchart


def gpu_nodes(env: str) -> set[str]:
    return {n["metadata"]["name"] for n in fleet.get("nodes", "-l", f"{TWIN_LABEL}={env}")
            if n["spec"].get("taints")}


def get_one(kind: str, namespace: str, name: str) -> dict:
    return json.loads(kubectl("get", kind, "-n", namespace, name, "-o", "json").stdout)


def daemonset_pods_by_node(namespace: str, name: str) -> dict[str, str]:
    """node -> pod, for the bound pods of one DaemonSet."""
    out = {}
    for pod in fleet.get("pods", "-n", namespace):
        owners = pod["metadata"].get("ownerReferences") or []
        if any(o["kind"] == "DaemonSet" and o["name"] == name for o in owners) and pod["spec"].get("nodeName"):
            out[pod["spec"]["nodeName"]] = pod["metadata"]["name"]
    return out



def untolerated_copy_places(namespace: str, gpu: set[str]) -> set[str]:
    """The bite: the NFD worker DaemonSet without the platform's tolerations, on the nodes the
    DaemonSet controller gives it (then removed)."""
    worker = get_one("daemonset", namespace, NFD_WORKER)
    bite = {"twin.pdstack.io/bite": "untolerated"}
    name = f"{NFD_WORKER}-untolerated"
    untolerated = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": namespace},
                   "spec": {"selector": {"matchLabels": bite}, "template": {
                       "metadata": {"labels": bite}, "spec": {**worker["spec"]["template"]["spec"], "tolerations": []}}}}
    assert fleet.apply_each_pass([untolerated]).rejected == {}
    untainted = {n["metadata"]["name"] for n in fleet.get("nodes") if not n["spec"].get("taints")}

    def ready() -> dict | None:
        status = get_one("daemonset", namespace, name)["status"]
        return status if status.get("numberReady") == len(untainted) else None

    status = fleet.wait_for("the untolerated DaemonSet's pods", ready)
    placed = set(daemonset_pods_by_node(namespace, name))
    kubectl("delete", "daemonset", "-n", namespace, name)
    assert status and status["desiredNumberScheduled"] == len(untainted), status
    assert placed == untainted, (sorted(placed), sorted(untainted))
    return placed


def test_make_up_applies_the_platform_and_serving_stacks_linked_by_their_stack_reference_and_make_down_removes_them(
        twin):
    """`up` (scripts/up.py, what `make up` runs, reusing the session's twin): `pulumi up` of the
    platform stack creates every object on the real API server, the charts' included, and its
    NodePatches give each GPU node the inventory names its role label and taints (a taint another
    manager put on one is kept: Node.spec.taints is atomic, the patch is forced); the NFD worker
    DaemonSet gets a pod on every one of them, and the same DaemonSet without the platform's
    tolerations gets none there (the test bites). Then `pulumi up` of dev: its StackReference
    resolves the platform stack in the same backend, and what it read is the platform's outputs
    exactly; every pod is bound and Ready, each GPU pod on a node the platform patched for its
    role. `down` destroys dev and then the platform: its CRDs stay, the patched labels and taints
    go (pulumi-kubernetes pkg/ssa Relinquish), the operator's nodes stay."""
    require_engine()
    dev = load_spec(stack_spec_path("dev"))
    env, namespace = dev.environment.name, dev.environment.namespace
    bare, hosts = as_the_operator_has_them(dev, stack_nodes(dev))
    platform_spec = up.onprem_platform_spec(dev, "unused.yaml", "unused.yaml")
    namespaces = sorted({controller(n).namespace for n in ("cert-manager", "envoy-gateway", "gpu-operator",
                                                           "prometheus-operator")}
                        | {platform_spec.monitoring_namespace, namespace})
    said = io.StringIO()
    progress = up.Progress(Console(file=said, width=200))
    foreign = {"key": "example.com/maintenance", "value": "disk", "effect": "PreferNoSchedule"}
    downed = False
    try:
        # The operator's nodes, one with a taint another manager put on it (PreferNoSchedule: the
        # GPU DaemonSets need not tolerate it); `up` makes only the nodes that are missing.
        next(n for n in bare if n["metadata"]["name"] == hosts[0].name)["spec"]["taints"] = [foreign]
        assert fleet.apply_each_pass(bare).rejected == {}
        deployed = up.up(progress=progress)

        taints = next(n for n in fleet.get("nodes") if n["metadata"]["name"] == hosts[0].name)["spec"]["taints"]
        assert taints == [foreign] + role_taints(hosts[0].role), taints
        objects = [r for r in deployed.platform_resources if r["type"].startswith("kubernetes:")
                   and not r["type"].startswith(("kubernetes:helm.sh", "pulumi:providers"))]
        kinds = {r["type"].split(":")[-1] for r in objects}
        assert {"CustomResourceDefinition", "Deployment", "DaemonSet", "GatewayClass", "Prometheus"} <= kinds, kinds
        from_charts = [r for r in objects if "kubernetes:helm.sh/v4:Chart" in r.get("parent", "")]
        assert from_charts, "no chart rendered an object"

        # No stand-in between the stacks: the serving stack's StackReference is the engine's
        # read of the platform stack of the same backend, and holds its outputs as they are.
        refs = [r for r in deployed.serving_resources if r["type"] == "pulumi:pulumi:StackReference"]
        assert [r["inputs"]["name"] for r in refs] == [up.PLATFORM_STACK], refs
        assert refs[0]["outputs"]["outputs"] == deployed.platform_outputs
        assert deployed.platform_outputs["nodes_mode"] == "static"
        assert "kubeconfig" not in deployed.platform_outputs  # an existing cluster's: the serving stack's own context
        written = load_spec(REPO_ROOT / up.SPECS_DIR / "dev.yaml").platform
        assert load_platform_spec(REPO_ROOT / written.spec).cloud.provider == "none"

        gpu = gpu_nodes(env)  # tainted: by the platform's NodePatches, nothing else
        assert gpu == {h.name for h in hosts}, (sorted(gpu), [h.name for h in hosts])
        roles = {n["metadata"]["name"]: n["metadata"]["labels"].get(naming.ROLE_LABEL)
                 for n in fleet.get("nodes", "-l", f"{TWIN_LABEL}={env}")}
        assert all(roles[h.name] == h.role for h in hosts), roles
        ns = controller("gpu-operator").namespace
        on_nodes = fleet.wait_for("the NFD worker on every GPU node",
                                  lambda: gpu <= set(daemonset_pods_by_node(ns, NFD_WORKER)) and
                                  daemonset_pods_by_node(ns, NFD_WORKER))
        missing = gpu - set(on_nodes or {})
        if missing:
            pending = [q["metadata"]["name"] for q in fleet.get("pods", "-n", ns) if not q["spec"].get("nodeName")]
            pytest.fail(f"no {NFD_WORKER} pod on {sorted(missing)}; pending: " + "; ".join(
                f"{name}: {fleet.scheduler_events(ns, name)}" for name in pending))
        placed = untolerated_copy_places(ns, gpu)
        assert not placed & gpu, sorted(placed & gpu)

        # dev's pods, every one bound and Ready (up waited for it), each GPU pod on a node of its role.
        on_gpus = [p for p in deployed.pods if any("nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
                                                   for c in p["spec"]["containers"])]
        assert on_gpus and {p["spec"]["nodeName"] for p in on_gpus} <= gpu
        for pod in on_gpus:
            assert roles[pod["spec"]["nodeName"]] == pod["metadata"]["labels"][naming.ROLE_LABEL], pod["metadata"]["name"]
        # one request through the router pod's process, answered by prefill and decode (twin/pods.py)
        assert deployed.why_no_request is None and "[prefill " in (deployed.answer or ""), deployed.answer
        FIGURES.append(f"{up.PLATFORM_STACK} (make up: pulumi up, charts from pinned modules): objects applied "
                       f"{len(objects)} ({len(from_charts)} rendered by charts), rejected 0; {NFD_WORKER}: pods on "
                       f"{len(gpu & set(on_nodes))}/{len(gpu)} tainted GPU nodes; without tolerations: "
                       f"{len(placed & gpu)}/{len(gpu)}")
        FIGURES.append(f"dev (make up: pulumi up, StackReference to {up.PLATFORM_STACK}): pods bound and Ready "
                       f"{len(deployed.pods)}, {len(on_gpus)} on the platform's patched GPU nodes; one request answered "
                       f"through the router: {deployed.answer[:80]}")

        up.down(stop_twin=False, progress=progress)
        downed = True
        assert not fleet.get("namespaces", f"--field-selector=metadata.name={namespace}"), "dev's namespace stayed"
        crds = {c["metadata"]["name"] for c in fleet.get("crd")}
        assert {"clusterpolicies.nvidia.com", "gateways.gateway.networking.k8s.io", "prometheuses.monitoring.coreos.com",
                "certificates.cert-manager.io"} <= crds, "a CRD went with the stack"
        assert not fleet.get("deployment", "-n", controller("cert-manager").namespace)
        nodes = fleet.get("nodes", "-l", f"{TWIN_LABEL}={env}")
        assert len(nodes) == len(bare), "down removed an operator's node"
        kept = [n["metadata"]["name"] for n in nodes
                if naming.ROLE_LABEL in n["metadata"]["labels"] or n["spec"].get("taints")]
        # the forced taint list goes whole with the patch (the provider relinquishes it), the foreign taint too
        assert kept == [], f"destroy left a role label or taint on {kept}"
    finally:
        if not downed:
            try:
                up.down(stop_twin=False, progress=progress)
            except Exception:  # noqa: BLE001 - the namespaces below still go; the test has failed already
                delete_namespaces(namespaces)
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={env}", "--wait=false")
        print(said.getvalue())
