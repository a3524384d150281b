"""platform-prod's Kubernetes part on prod's nodes (#38 "What must show", #39 item 3).

platform-prod's objects (twin/platform_prod.py platform_render: what the program registers
itself, each chart rendered from its pinned source with the values the program gives it by the
Helm the pinned provider embeds, the GPU operator's operand DaemonSets from its assets, and
stand-ins for the two rows whose chart no pinned module carries) are applied to the twin's real
API server, onto kwok nodes made from prod's spec: one GB200 node per NVLink domain of each pool
(p6e-gb200.36xlarge, the pool's labels and taints, Karpenter's, NFD's and the GPU operator's
labels) and the system node group (m7i.2xlarge, pdstack.io/role=system). The real DaemonSet
controller makes each DaemonSet's pods and the real scheduler binds them and every Deployment's.

Not Available on the twin, and why (printed by the first test): a pod whose start checks fail
(twin/kubelet.py), e.g. a volume from a Secret that cert-manager (not running) would issue.
No image runs: a pod that passes its start checks reads Ready (kwok).
"""

from __future__ import annotations

import copy
import json

import pytest

from infra.platform_stack.catalog import ENVOY_GATEWAY_CERTGEN_SECRETS, controller
from infra.platform_stack.spec import load_platform_spec
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from tests.twin.conftest import FIGURES
from twin import fleet
from twin.api import kubectl
from twin.nodes import TWIN_LABEL
from twin.platform_prod import (DRA_DRIVER, EFA_PLUGIN, NODES_LABEL_VALUE, apply_on_twin, daemonset_problems,
                                deployment_problems, dra_driver_stand_in, efa_plugin_stand_in, ident,
                                not_ready_reason, platform_render, prod_gpu_nodes, prod_system_nodes,
                                remove_from_twin, why_not_on)

# The DaemonSets a GPU node needs: NFD's worker, the GPU operator's device plugin, GFD and
# dcgm-exporter, the EFA device plugin and the DRA driver's kubelet plugin.
GPU_DAEMONSETS = {"gpu-operator-node-feature-discovery-worker", "nvidia-device-plugin-daemonset",
                  "gpu-feature-discovery", "nvidia-dcgm-exporter", EFA_PLUGIN, f"{DRA_DRIVER}-kubelet-plugin"}
# Rows whose controller runs on the twin as a process of its own (README "Cluster twin"); their
# Deployments as the charts render them must also be Available. KEDA's chart is not rendered.
RUN_ON_TWIN = {("kube-system", "karpenter"), ("lws-system", "lws-controller-manager"),
               ("envoy-gateway-system", "envoy-gateway"), ("monitoring", "prometheus-operator")}


class Landed:
    def __init__(self, rendered, on_twin, gpu_nodes, system_nodes):
        self.rendered, self.on_twin, self.gpu_nodes, self.system_nodes = rendered, on_twin, gpu_nodes, system_nodes

    def live(self, kind: str) -> list[dict]:
        mine = {ident(o) for o in self.on_twin.applied if o["kind"] == kind}
        return [o for o in fleet.get(kind, "-A") if ident(o) in mine]


def events(namespace: str, pod: str) -> list[str]:
    return fleet.scheduler_events(namespace, pod)


@pytest.fixture(scope="module")
def platform_prod(twin):
    platform = load_platform_spec("stacks/platform-prod.yaml")
    serving = load_spec(stack_spec_path("prod"))
    gpu, system = prod_gpu_nodes(serving, platform), prod_system_nodes(platform)
    rendered = platform_render(platform)
    assert fleet.apply_each_pass(gpu + system).rejected == {}
    on_twin = None
    try:
        on_twin = apply_on_twin(rendered)
        yield Landed(rendered, on_twin, gpu, system)
    finally:
        if on_twin is not None:
            remove_from_twin(on_twin)
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={NODES_LABEL_VALUE}", "--wait=false")


def disagreements(daemonsets: list[dict]) -> list[str]:
    """Each DaemonSet whose controller has not (yet) counted and made pods for the nodes the rule
    (why_not_on) admits over every node of the cluster: desiredNumberScheduled and
    currentNumberScheduled at its current generation."""
    nodes, out = fleet.get("nodes"), []
    for ds in daemonsets:
        live = json.loads(kubectl("get", "daemonset", "-n", ds["metadata"]["namespace"], ds["metadata"]["name"],
                                  "-o", "json").stdout)
        status = live.get("status") or {}
        want = sum(why_not_on(live["spec"]["template"]["spec"], n) is None for n in nodes)
        if status.get("observedGeneration") != live["metadata"]["generation"] or \
                status.get("desiredNumberScheduled") != want or status.get("currentNumberScheduled") != want:
            out.append(f"DaemonSet {ds['metadata']['namespace']}/{ds['metadata']['name']}: the rule admits {want} "
                       f"nodes, its controller says desired {status.get('desiredNumberScheduled')}, current "
                       f"{status.get('currentNumberScheduled')}")
    return out


def until(what: str, compute, done):
    """compute() until done(its value) (fleet.wait_for's bound), and its last value."""
    found = fleet.wait_for(what, lambda: (lambda value: (value,) if done(value) else None)(compute()))
    return found[0] if found else compute()


def gpu_daemonset_problems(daemonsets: list[dict], gpu_nodes: list[dict]) -> list[str]:
    """The DaemonSet controller agrees with the rule (or the test fails saying where not), then
    daemonset_problems once every pod it made is bound or the wait ends."""
    disagree = until("the DaemonSet controller's count", lambda: disagreements(daemonsets), lambda found: not found)
    assert disagree == [], "\n".join(disagree)
    return until("every admitted pod bound",
                 lambda: daemonset_problems(daemonsets, gpu_nodes, fleet.get("pods", "-A"), events),
                 lambda found: not any("is not bound" in p or "made no pod" in p for p in found))


def test_platform_prods_daemonsets_run_on_every_gpu_node_and_every_controller_is_bound(platform_prod):
    """Every object of platform-prod is accepted by the real API server (strict validation); each
    DaemonSet a GPU node needs has a pod bound on every GPU node (the real DaemonSet controller and
    scheduler), and where it has none on a node the DaemonSet controller's own rule says why;
    every controller Deployment's pods are bound, and those of controllers the twin runs are
    Available."""
    landed = platform_prod
    assert landed.on_twin.rejected == {}, landed.on_twin.rejected
    daemonsets = landed.live("DaemonSet")
    assert {d["metadata"]["name"] for d in daemonsets} == GPU_DAEMONSETS, sorted(d["metadata"]["name"] for d in daemonsets)
    problems = gpu_daemonset_problems(daemonsets, landed.gpu_nodes)
    deployments = landed.live("Deployment")
    problems += until("every Deployment's pods bound",
                      lambda: deployment_problems(deployments, fleet.get("pods", "-A"), events), lambda found: not found)
    assert problems == [], "\n".join(problems)

    # The rule agrees with the real controller: a DaemonSet's pods are on exactly the prod nodes it admits.
    pods = fleet.get("pods", "-A")
    mine = landed.gpu_nodes + landed.system_nodes
    for ds in daemonsets:
        admitted = {n["metadata"]["name"] for n in mine if why_not_on(ds["spec"]["template"]["spec"], n) is None}
        placed = {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName") in {n["metadata"]["name"] for n in mine}
                  and any(o["uid"] == ds["metadata"]["uid"] for o in p["metadata"].get("ownerReferences") or [])}
        assert placed == admitted, (ds["metadata"]["name"], sorted(placed), sorted(admitted))

    # The chart's certgen hook (which the provider never runs) is a Job the stack makes: the twin's
    # kubelet runs it, and the Secrets it makes are there for the controller's pod to mount.
    eg = controller("envoy-gateway").namespace
    job = fleet.wait_for("the certgen Job Complete", lambda: [c for c in (json.loads(kubectl(
        "get", "job", "-n", eg, "envoy-gateway-certgen", "-o", "json").stdout).get("status") or {}).get(
        "conditions", []) if c["type"] == "Complete" and c["status"] == "True"])
    assert job, _why_unavailable_job(eg, "envoy-gateway-certgen")
    secrets = {o["metadata"]["name"] for o in fleet.get("secrets", "-n", eg)}
    assert set(ENVOY_GATEWAY_CERTGEN_SECRETS) <= secrets, sorted(secrets)

    available = {}
    for dep in deployments:
        key = (dep["metadata"]["namespace"], dep["metadata"]["name"])
        conditions = {c["type"]: c for c in (dep.get("status") or {}).get("conditions", [])}
        available[key] = conditions.get("Available", {}).get("status") == "True"
    wanted = {k for k in RUN_ON_TWIN if k in available}
    assert wanted == RUN_ON_TWIN, sorted(RUN_ON_TWIN - wanted)
    ready = fleet.wait_for("the twin's controllers' Deployments Available", lambda: all(
        _available(*k) for k in RUN_ON_TWIN))
    assert ready, "not Available: " + "; ".join(f"{ns}/{name}: {_why_unavailable(ns, name)}"
                                                 for ns, name in sorted(RUN_ON_TWIN) if not _available(ns, name))
    not_available = {f"{ns}/{name}": _why_unavailable(ns, name) for ns, name in sorted(available)
                     if not _available(ns, name)}
    FIGURES.append(
        f"platform-prod on prod's nodes ({len(landed.gpu_nodes)} p6e-gb200.36xlarge, one per NVLink domain of each pool, "
        f"{len(landed.system_nodes)} system): objects applied {len(landed.on_twin.applied)}, rejected 0, the twin's own "
        f"left {len(landed.on_twin.twins_own)}; not rendered: {', '.join(sorted(landed.rendered.not_rendered))}; "
        f"{len(daemonsets)} DaemonSets on {len(landed.gpu_nodes)}/{len(landed.gpu_nodes)} GPU nodes each; "
        f"Deployments bound {len(deployments)}/{len(deployments)}, Available {len(available) - len(not_available)} "
        f"(the twin's controllers {len(RUN_ON_TWIN)}/{len(RUN_ON_TWIN)}); not Available: "
        + ("; ".join(f"{k} ({v})" for k, v in not_available.items()) or "none"))


def _why_unavailable_job(namespace: str, name: str) -> str:
    pods = fleet.get("pods", "-n", namespace, "-l", f"job-name={name}")
    return f"Job {namespace}/{name} not Complete: " + ("; ".join(
        f"{p['metadata']['name']}: {not_ready_reason(p)}" for p in pods) or "no pod")


def _deployment(namespace: str, name: str) -> dict:
    return json.loads(kubectl("get", "deployment", "-n", namespace, name, "-o", "json").stdout)


def _available(namespace: str, name: str) -> bool:
    conditions = (_deployment(namespace, name).get("status") or {}).get("conditions", [])
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def _why_unavailable(namespace: str, name: str) -> str:
    selector = _deployment(namespace, name)["spec"]["selector"].get("matchLabels") or {}
    pods = fleet.get("pods", "-n", namespace, "-l", ",".join(f"{k}={v}" for k, v in selector.items()))
    return "; ".join(f"{p['metadata']['name']}: {not_ready_reason(p)}"
                     + "".join(f" ({e})" for e in events(namespace, p["metadata"]["name"]) if "FailedMount" in e)
                     for p in pods) or "no pod"


def test_a_gpu_pool_taint_the_daemonsets_do_not_tolerate_fails_the_check(platform_prod):
    """The bite: a GPU node of a pool the platform's tolerations were not made for (colocated:
    pdstack.io/role=colocated:NoSchedule; prod has no such pool, so the GPU DaemonSets tolerate
    prefill and decode only). The real DaemonSet controller makes no pod there, and the check
    fails naming each DaemonSet, the node and the taint."""
    landed = platform_prod
    bite = copy.deepcopy(landed.gpu_nodes[0])
    name = f"{NODES_LABEL_VALUE}-colocated-bite"
    bite["metadata"]["name"] = name
    bite["metadata"]["labels"].update({"kubernetes.io/hostname": name, "pdstack.io/role": "colocated"})
    bite["spec"]["taints"] = [t if t["key"] != "pdstack.io/role" else {**t, "value": "colocated"}
                              for t in bite["spec"]["taints"]]
    assert fleet.apply_each_pass([bite]).rejected == {}
    try:
        problems = gpu_daemonset_problems(landed.live("DaemonSet"), [bite])
    finally:
        kubectl("delete", "node", name, "--wait=false")
    assert sorted(p.split(":")[0] for p in problems) == sorted(
        f"DaemonSet {d['metadata']['namespace']}/{d['metadata']['name']}" for d in landed.live("DaemonSet")
        if d["metadata"]["name"] in GPU_DAEMONSETS), problems
    assert all(f"no pod on GPU node {name}: untolerated taint pdstack.io/role=colocated:NoSchedule" in p
               for p in problems), problems


def test_an_efa_plugin_chart_that_does_not_list_the_instance_type_fails_the_check(platform_prod):
    """Fault #3 as the twin shows it: the EFA device plugin's chart at v0.5.6 lists no
    p6e-gb200.36xlarge (infra/platform_stack/efa.py: listed from v0.5.14, aws/eks-charts #1236),
    so its DaemonSet's required instance-type affinity admits no prod GPU node and the check fails
    on every one, naming the affinity."""
    landed = platform_prod
    row = controller(EFA_PLUGIN)
    (live,) = [d for d in landed.live("DaemonSet") if d["metadata"]["name"] == EFA_PLUGIN]
    values = {"tolerations": live["spec"]["template"]["spec"].get("tolerations", [])}
    (old,) = efa_plugin_stand_in(row, live["metadata"]["namespace"], values, version="v0.5.6")
    old["metadata"]["name"] = old["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = \
        old["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = f"{EFA_PLUGIN}-v0-5-6"
    assert fleet.apply_each_pass([old]).rejected == {}
    try:
        applied = json.loads(kubectl("get", "daemonset", "-n", old["metadata"]["namespace"], old["metadata"]["name"],
                                     "-o", "json").stdout)
        problems = gpu_daemonset_problems([applied], landed.gpu_nodes)
    finally:
        kubectl("delete", "daemonset", "-n", old["metadata"]["namespace"], old["metadata"]["name"], "--wait=false")
    assert len(problems) == len(landed.gpu_nodes), problems
    assert all("required node affinity matches no term: node.kubernetes.io/instance-type In" in p
               and "p6e-gb200.36xlarge" not in p.split("In", 1)[1] for p in problems), problems


def test_the_dra_controller_with_its_charts_control_plane_affinity_is_not_bound(platform_prod):
    """Fault #2 as the twin shows it: the DRA driver's controller with its chart's default
    affinity (a control-plane node, which EKS never shows; prod's nodes have none) stays Pending,
    and the check fails naming the Deployment, its pod and the scheduler's FailedScheduling."""
    landed = platform_prod
    row = controller(DRA_DRIVER)
    (live,) = [d for d in landed.live("Deployment") if d["metadata"]["name"] == f"{DRA_DRIVER}-controller"]
    (default, _) = dra_driver_stand_in(row, live["metadata"]["namespace"], {})
    name = f"{DRA_DRIVER}-controller-chart-default"
    default["metadata"]["name"] = default["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = \
        default["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = name
    assert fleet.apply_each_pass([default]).rejected == {}
    ns = default["metadata"]["namespace"]
    try:
        applied = json.loads(kubectl("get", "deployment", "-n", ns, name, "-o", "json").stdout)

        problems = until("the scheduler's verdict on the DRA controller",
                         lambda: deployment_problems([applied], fleet.get("pods", "-n", ns), events),
                         lambda found: found and "FailedScheduling" in found[0])
    finally:
        kubectl("delete", "deployment", "-n", ns, name, "--wait=false")
    assert problems and problems[0].startswith(f"Deployment {ns}/{name}: 0/1 pods bound; "), problems
    assert "didn't match Pod's node affinity/selector" in problems[0], problems
