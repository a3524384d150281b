"""The platform stack's Kubernetes part, applied for real on the cluster twin.

The test runs `pulumi up` of a platform spec for an existing cluster (`cloud: none`, the on-prem
path, in static node mode) that hosts dev: dev's nodes come as an operator's kubeadm nodes do,
with no pool label or taint, and the platform's NodePatches make them dev's pools. Its charts are rendered from their sources in the pinned modules
(`controllers.chart_source: pinned-modules`, infra/platform_stack/charts.py) by the Helm inside
the real pulumi-kubernetes provider (helm.v4.Chart, hooks disabled: pkg/provider/helm/v4/chart.go
at the pinned provider sets `DisableHooks = true`). Every object goes to the real API server
through the provider's server-side apply. The real DaemonSet controller and scheduler then place
the GPU DaemonSets onto the GPU nodes the platform has just tainted.

What stands in:
- kwok runs every controller's pods, so no image runs and no operator makes the DaemonSets it
  makes at run time. The GPU operator's device plugin, GFD and dcgm-exporter come from its
  ClusterPolicy and are not seen here. NFD's worker is rendered by the chart, and is seen.
- Rows the twin provides or cannot install are `user_installed`:
  - lws: the twin runs the real controller, its webhooks on loopback;
  - keda, the DRA driver and the EFA plugin: their charts are in no module the proxy serves,
    and the kwok nodes carry the GPU and EFA capacity the plugins would publish.
"""

from __future__ import annotations

import copy
import json

import pytest

from infra.components.nodepools import role_taints
from infra.platform_stack.catalog import controller
from infra import naming
from infra.platform_stack.program import Hosted, build_platform
from infra.rollout.preflight import HostEntry, Inventory
from infra.rollout.pulumi_cluster import PROJECT
from tests.engine import engine_project
from tests.test_platform import onprem_twin_spec
from tests.twin.conftest import FIGURES
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from tests.twin.placement import assert_every_pod_bound, delete_namespaces, remove_render
from twin import dra, fleet
from twin.cluster import kubectl
from twin.nodes import TWIN_LABEL, stack_nodes
from twin.paths import KUBECONFIG

STACK = "platform-twin"
USER_INSTALLED = ["lws", "keda", "nvidia-dra-driver-gpu", "aws-efa-k8s-device-plugin"]
NFD_WORKER = "gpu-operator-node-feature-discovery-worker"  # the gpu-operator release's NFD subchart


def twin_platform_spec():
    """platform-dev's spec, for dev's cluster taken as an existing one (no AWS part) whose GPU
    nodes the inventory names (static node mode)."""
    spec = onprem_twin_spec(chart_source="pinned-modules", user_installed=USER_INSTALLED)
    return spec.model_copy(update={"name": STACK, "nodes": spec.nodes.model_copy(update={"mode": "static"})})


def as_the_operator_has_them(spec, nodes: list[dict]) -> tuple[list[dict], list[HostEntry]]:
    """dev's twin nodes without what its pools put on them (role and environment labels, the
    clique label, the taints), and the inventory naming each GPU node's role and NVLink domain
    (what the operator writes in stacks/inventory/<env>.yaml)."""
    clique_label = spec.hardware.supernode.topology_label if spec.hardware.supernode else "nvidia.com/gpu.clique"
    bare, hosts = [], []
    for node in copy.deepcopy(nodes):
        labels = node["metadata"]["labels"]
        if labels.get(naming.ROLE_LABEL):
            hosts.append(HostEntry(name=node["metadata"]["name"], address="127.0.0.1", role=labels[naming.ROLE_LABEL],
                                   clique=labels.get(clique_label)))
        for key in (naming.ROLE_LABEL, "pdstack.io/environment", "karpenter.sh/nodepool", clique_label):
            labels.pop(key, None)
        node["spec"]["taints"] = []
        bare.append(node)
    return bare, hosts


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


def test_the_platform_stack_installs_for_real_and_its_gpu_daemonsets_land_on_the_tainted_nodes(
        twin, tmp_path, monkeypatch):
    """`pulumi up` creates every object of the platform stack on the real API server, the charts'
    included, and its NodePatches give each GPU node the inventory names its role label and
    taints; the NFD worker DaemonSet gets a pod bound on every one of them; the same DaemonSet
    without the platform's tolerations gets none there (the test bites); dev's serving stack, as
    it renders under a static platform (no NodePool: nothing else could make a node), then applies
    on that cluster with every GPU pod bound to a patched node of its pool; and `pulumi destroy`
    removes the platform stack, the patched labels and taints with it, but keeps its CRDs."""
    from pulumi import automation as auto

    dev = load_spec(stack_spec_path("dev"))
    env = dev.environment.name
    bare, hosts = as_the_operator_has_them(dev, stack_nodes(dev))
    inventory = Inventory(key_file="unused", known_hosts="unused", hosts=hosts)
    project = engine_project(tmp_path, monkeypatch, twin=KUBECONFIG, platform_stand_in_stack=False)
    # The state file is written once, at the end, instead of after every step: with the CRDs'
    # schemas in it (megabytes), the steps' checkpoints took two thirds of the run (305 s against
    # 117 s here). What this test judges is the cluster, not the state's crash safety, which the
    # rollout's SIGKILL row on the twin tests with checkpoints on.
    monkeypatch.setenv("PULUMI_SKIP_CHECKPOINTS", "true")
    spec = twin_platform_spec()
    stack = auto.create_or_select_stack(stack_name=STACK, project_name=PROJECT,
                                        program=lambda: build_platform(spec, [Hosted(dev, "dev", inventory)]),
                                        opts=auto.LocalWorkspaceOptions(work_dir=str(project.work_dir)))
    stack.set_config("pdstack:specFile", auto.ConfigValue("stacks/platform-dev.yaml"))  # Pulumi.yaml asks for it
    log: list[str] = []
    destroyed = False
    namespaces = sorted({controller(n).namespace for n in ("cert-manager", "envoy-gateway", "gpu-operator",
                                                           "prometheus-operator")} | {spec.monitoring_namespace})
    try:
        # One GPU node comes with a taint another manager put on it: Node.spec.taints is atomic,
        # so the platform's patch takes the list over (forced) and must carry that taint
        # (PreferNoSchedule: the GPU DaemonSets below need not tolerate it).
        foreign = {"key": "example.com/maintenance", "value": "disk", "effect": "PreferNoSchedule"}
        foreign_node = next(n for n in bare if n["metadata"]["name"] == hosts[0].name)
        foreign_node["spec"]["taints"] = [foreign]
        assert hosts and fleet.apply_each_pass(bare).rejected == {}
        result = stack.up(on_output=log.append, color="never")
        assert result.summary.result == "succeeded", "\n".join(log[-40:])
        taints = next(n for n in fleet.get("nodes") if n["metadata"]["name"] == hosts[0].name)["spec"]["taints"]
        assert taints == [foreign] + role_taints(hosts[0].role), taints
        resources = stack.export_stack().deployment["resources"]
        objects = [r for r in resources if r["type"].startswith("kubernetes:")
                   and not r["type"].startswith(("kubernetes:helm.sh", "pulumi:providers"))]
        kinds = {r["type"].split(":")[-1] for r in objects}
        assert {"CustomResourceDefinition", "Deployment", "DaemonSet", "GatewayClass", "Prometheus"} <= kinds, kinds
        from_charts = [r for r in objects if "kubernetes:helm.sh/v4:Chart" in r.get("parent", "")]
        assert from_charts, "no chart rendered an object"

        gpu = gpu_nodes(env)  # tainted: by the platform's NodePatches, nothing else
        assert gpu == {h.name for h in hosts}, (sorted(gpu), [h.name for h in hosts])
        for node in fleet.get("nodes", "-l", f"{TWIN_LABEL}={env}"):
            host = next((h for h in hosts if h.name == node["metadata"]["name"]), None)
            assert host is None or node["metadata"]["labels"].get(naming.ROLE_LABEL) == host.role
        ns = controller("gpu-operator").namespace
        on_nodes = fleet.wait_for("the NFD worker on every GPU node",
                                  lambda: gpu <= set(daemonset_pods_by_node(ns, NFD_WORKER)) and
                                  daemonset_pods_by_node(ns, NFD_WORKER))
        missing = gpu - set(on_nodes or {})
        if missing:
            pending = [q["metadata"]["name"] for q in fleet.get("pods", "-n", ns) if not q["spec"].get("nodeName")]
            pytest.fail(f"no {NFD_WORKER} pod on {sorted(missing)}; pending: " + "; ".join(
                f"{name}: {fleet.scheduler_events(ns, name)}" for name in pending))

        # The bite: the same DaemonSet without the platform's tolerations is kept off every
        # tainted node by the DaemonSet controller, and goes to the untainted ones only.
        worker = get_one("daemonset", ns, NFD_WORKER)
        bite = {"twin.pdstack.io/bite": "untolerated"}
        untolerated = {"apiVersion": "apps/v1", "kind": "DaemonSet",
                       "metadata": {"name": f"{NFD_WORKER}-untolerated", "namespace": ns},
                       "spec": {"selector": {"matchLabels": bite}, "template": {
                           "metadata": {"labels": bite},
                           "spec": {**worker["spec"]["template"]["spec"], "tolerations": []}}}}
        assert fleet.apply_each_pass([untolerated]).rejected == {}
        untainted = {n["metadata"]["name"] for n in fleet.get("nodes") if not n["spec"].get("taints")}

        def untolerated_ready() -> dict | None:
            status = get_one("daemonset", ns, untolerated["metadata"]["name"])["status"]
            return status if status.get("numberReady") == len(untainted) else None

        status = fleet.wait_for("the untolerated DaemonSet's pods", untolerated_ready)
        placed = set(daemonset_pods_by_node(ns, untolerated["metadata"]["name"]))
        assert status and status["desiredNumberScheduled"] == len(untainted), status
        assert placed == untainted and not placed & gpu, sorted(placed)
        kubectl("delete", "daemonset", "-n", ns, untolerated["metadata"]["name"])

        FIGURES.append(f"{STACK} (pulumi up, charts from pinned modules): objects applied {len(objects)} "
                       f"({len(from_charts)} rendered by charts), rejected 0; {NFD_WORKER}: pods on "
                       f"{len(gpu & set(on_nodes))}/{len(gpu)} tainted GPU nodes; without tolerations: "
                       f"{len(placed & gpu)}/{len(gpu)}")

        # Then the serving stack on the cluster the platform made ready: dev as `pdctl render`
        # writes it, every object accepted and every pod bound within the GPU nodes' GPUs and
        # EFA devices (the kwok nodes carry what the device plugins would publish; twin/dra.py
        # stands in for the DRA driver's slices).
        serving = [o for o in fleet.render("dev", tmp_path / "dev-render")
                   if o["kind"] not in ("NodePool", "EC2NodeClass")]
        try:
            applied = fleet.apply_each_pass(serving)
            assert applied.rejected == {}, "\n".join(f"{k}: {v}" for k, v in applied.rejected.items())
            assert fleet.apply_each_pass(dra.stand_in(serving, fleet.get("nodes", "-l", f"{TWIN_LABEL}={env}"))
                                         ).rejected == {}
            assert_every_pod_bound(dev, serving, applied, f"dev on {STACK}'s static nodes")
            on_gpus = {p["spec"]["nodeName"] for p in fleet.get("pods", "-n", dev.environment.namespace)
                       if any("nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
                              for c in p["spec"]["containers"])}
            assert on_gpus and on_gpus <= gpu, sorted(on_gpus - gpu)
        finally:
            remove_render(dev, serving, nodes=False)

        stack.destroy(on_output=log.append, color="never")
        destroyed = True
        crds = {c["metadata"]["name"] for c in fleet.get("crd")}
        assert {"clusterpolicies.nvidia.com", "gateways.gateway.networking.k8s.io", "prometheuses.monitoring.coreos.com",
                "certificates.cert-manager.io"} <= crds, "a CRD went with the stack"
        assert not fleet.get("deployment", "-n", controller("cert-manager").namespace)
        kept = [n["metadata"]["name"] for n in fleet.get("nodes", "-l", f"{TWIN_LABEL}={env}")
                if naming.ROLE_LABEL in n["metadata"]["labels"] or n["spec"].get("taints")]
        # the nodes, the operator's, stay; the forced taint list goes whole with the patch (the
        # provider relinquishes it: pulumi-kubernetes provider pkg/ssa Relinquish), the foreign taint too
        assert kept == [], f"destroy left a role label or taint on {kept}"
    finally:
        if not destroyed:
            try:
                stack.destroy(on_output=log.append, color="never")
            except Exception:  # noqa: BLE001 - the namespaces below still go; the test has failed already
                delete_namespaces(namespaces)
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={env}", "--wait=false")
