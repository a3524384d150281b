"""The rendered fleet, applied to the cluster twin: a real kube-apiserver (v1.34.4) with the
upstream CRDs at their pinned versions, the real scheduler, and the LeaderWorkerSet controller
with its admission webhooks called by the API server.

What the API server checks here that the offline checks cannot: strict field validation
(`fieldValidation=Strict`: unknown and duplicate fields refused), the CRDs' CEL rules
(`x-kubernetes-validations`), defaulting, and LWS's own webhooks
(kubernetes-sigs/lws, pkg/webhooks/leaderworkerset_webhook.go and pod_webhook.go, at the
version twin/controllers/go.mod pins). What the scheduler checks: each pod's node selector,
tolerations, NVLink-domain affinities and GPU/EFA requests against the kwok nodes that stand in
for the pools' instances (twin/nodes.py derives them from the spec and the NodePools).
"""

from __future__ import annotations

import contextlib

import copy
import json

import pytest
import yaml

from infra import naming
from infra.planning.capacity import pool_capacity
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from tests.twin.conftest import FIGURES
from tests.twin.placement import (LWS_NAME_LABEL, assert_every_pod_bound, assert_runnable_pods_run, remove_fleet,
                                  remove_render, users_objects)
from twin import dra, fleet, pods
from twin.api import kubectl
from twin.nodes import stack_nodes

RENDERS = [("dev", None), ("dev", "vllm"), ("prod", None), ("prod", "vllm")]


def _label(stack: str, engine: str | None) -> str:
    return f"{stack}-{engine or 'sglang'}"


@pytest.fixture(scope="module", params=RENDERS, ids=[_label(*r) for r in RENDERS])
def applied_fleet(request, twin, tmp_path_factory):
    """One render applied to the twin, on nodes of its stack; removed afterwards."""
    stack, engine = request.param
    spec = load_spec(stack_spec_path(stack))
    objects = fleet.render(stack, tmp_path_factory.mktemp(_label(stack, engine)), engine)
    nodes = stack_nodes(spec)
    made = fleet.apply_each_pass(nodes)
    assert made.rejected == {}, made.rejected
    if spec.model.weights.access_mode() == "secret":
        users_objects(spec)  # dev's weights credentials, which its pods read and the user makes
    result = fleet.apply_each_pass(objects)
    # NVIDIA's DRA driver does not run on the twin: publish what it would (twin/dra.py).
    dra_stand_in = dra.stand_in(objects, nodes)
    assert fleet.apply_each_pass(dra_stand_in).rejected == {}
    yield spec, objects, result, _label(stack, engine)
    remove_render(spec, objects)


def test_every_rendered_object_is_accepted(applied_fleet):
    """0 rejections from the real API server, strict field validation and CEL included."""
    spec, objects, result, label = applied_fleet
    assert result.rejected == {}, "\n".join(f"{k}: {v}" for k, v in result.rejected.items())
    assert len(result.applied) == len({fleet.ident(o) for o in objects}) > 0


def test_groups_form_and_every_pod_is_bound_where_placement_says(applied_fleet):
    """Each LeaderWorkerSet's groups come up in full (the LWS controller makes the leader's
    StatefulSet and each group's workers), and the real scheduler binds every pod: GPU pods to
    nodes of their own role's pool, a placed group inside one NVLink domain (a decode group
    alone in its domain), and no node past its allocatable GPUs or EFA devices. A pod left
    Pending fails this test with what the scheduler said about it; so does a pod the twin's
    kubelet refuses to start (a Secret, ConfigMap or key it references missing) or that never
    turns Ready, with the kubelet's reason (twin/kubelet.py)."""
    assert_every_pod_bound(*applied_fleet)


@pytest.fixture(scope="module")
def pod_processes(twin):
    """The pod network and the engine checker, shared by every render of this module (SGLang is
    imported once); each render's processes are stopped after its test."""
    processes = pods.PodProcesses()  # in the twin's folder, where its kubelet probes them
    yield processes
    processes.stop()


def test_every_runnable_pod_runs_as_a_process_and_is_ready_by_its_own_probes(applied_fleet, pod_processes):
    """What a CPU can run, started as a kubelet would (twin/pods.py): the router, each engine pod's
    launch script with the stand-in behind the engine's own parser, the Mooncake master from the
    pinned wheel; each Ready by its rendered probes. A pod the twin does not run (a container with
    no command) is named with why. Every pod of every render runs, prod's 38 as dev's 4: no sample.
    The pools' autoscalers are set aside meanwhile: the real KEDA and HPA controller change a pool's
    groups (a pod deleted while its process starts), and the processes here are the render's pods."""
    spec, objects, result, label = applied_fleet
    namespaces = {o["metadata"]["namespace"] for o in objects if o["kind"] == "LeaderWorkerSet"}
    with contextlib.ExitStack() as aside:
        for lws in [o for o in objects if o["kind"] == "LeaderWorkerSet"]:
            aside.enter_context(autoscaler_set_aside(objects, lws))
        try:
            assert_runnable_pods_run(pod_processes, namespaces, label)
        finally:
            pod_processes.stop_pods()


@pytest.fixture(scope="module")
def prod_objects(twin, tmp_path_factory):
    """prod's render, its namespaces created (a namespaced object is judged inside its namespace)."""
    objects = fleet.render("prod", tmp_path_factory.mktemp("prod-broken"))
    namespaces = [o for o in objects if o["kind"] == "Namespace"]
    assert fleet.apply_each_pass(namespaces).rejected == {}
    yield objects
    remove_fleet(namespaces)


def _first(objects: list[dict], kind: str, where=lambda o: True) -> dict:
    return copy.deepcopy(next(o for o in objects if o["kind"] == kind and where(o)))


@pytest.mark.parametrize("kind, break_it, said", [
    # strict field validation: a field no schema has
    ("LeaderWorkerSet", lambda o: o["spec"]["leaderWorkerTemplate"].update(sizee=2),
     ".spec.leaderWorkerTemplate.sizee: field not declared in schema"),
    # a CEL rule of Karpenter's NodePool CRD (x-kubernetes-validations), evaluated by the API server
    ("NodePool", lambda o: o["spec"]["limits"].update(cpu="1000"), "only 'limits.nodes' is supported on static NodePools"),
    # a CEL rule on the requirements: Karpenter forbids the hostname label in a pool
    ("NodePool", lambda o: o["spec"]["template"]["spec"]["requirements"].append(
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["x"]}), "kubernetes.io/hostname"),
])
def test_a_broken_object_is_rejected(prod_objects, kind, break_it, said):
    """The same apply path refuses a broken object, with the API server's reason: the test bites."""
    broken = _first(prod_objects, kind, lambda o: kind != "NodePool" or "replicas" in o["spec"])
    break_it(broken)
    result = fleet.apply_each_pass([broken], dry_run=True)
    assert fleet.ident(broken) in result.rejected
    assert said in result.rejected[fleet.ident(broken)], result.rejected


def _scale(lws: dict, replicas: int) -> None:
    kubectl("scale", "leaderworkerset", lws["metadata"]["name"], "-n", lws["metadata"]["namespace"],
            f"--replicas={replicas}")


def _lws_pods(lws: dict) -> list[dict]:
    return [p for p in fleet.get("pods", "-n", lws["metadata"]["namespace"], "-l",
                                 f"{LWS_NAME_LABEL}={lws['metadata']['name']}")
            if "deletionTimestamp" not in p["metadata"]]


@contextlib.contextmanager
def autoscaler_set_aside(objects: list[dict], lws: dict):
    """The pool's ScaledObject, and the HPA KEDA's operator made of it, deleted while a test sets
    the pool's count by hand, and applied again after. The real operator runs on the twin, and
    the HPA controller scales a target above the HPA's maxReplicas down to it (k8s.io/kubernetes
    v1.34.4 pkg/controller/podautoscaler/horizontal.go, "Current number of replicas above
    Spec.MaxReplicas"), which the pool's maximum plus the rollout's surge is."""
    namespace, name = lws["metadata"]["namespace"], lws["metadata"]["name"]
    scalers = [o for o in objects if o["kind"] == "ScaledObject" and o["metadata"]["namespace"] == namespace
               and o["spec"]["scaleTargetRef"]["name"] == name]
    for scaler in scalers:
        kubectl("delete", "scaledobject", scaler["metadata"]["name"], "-n", namespace, "--ignore-not-found")
    for hpa in fleet.get("horizontalpodautoscalers", "-n", namespace):
        if hpa["spec"]["scaleTargetRef"]["name"] == name:
            kubectl("delete", "horizontalpodautoscaler", hpa["metadata"]["name"], "-n", namespace, "--ignore-not-found")
    try:
        yield
    finally:
        if scalers:
            assert fleet.apply_each_pass(scalers).rejected == {}


def test_each_pool_scales_to_its_reserve_and_one_group_more_is_refused(applied_fleet):
    """Scaled to its maximum plus the rollout surge (what infra/planning/capacity.py reserves), every
    group of a pool is bound; one group more stays Pending, and the scheduler says why."""
    spec, objects, result, label = applied_fleet
    for lws in [o for o in objects if o["kind"] == "LeaderWorkerSet"]:
        role = lws["metadata"]["labels"][naming.ROLE_LABEL]
        capacity = pool_capacity(spec, role)
        size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
        reserve = capacity.max_instances + capacity.surge_instances
        with autoscaler_set_aside(objects, lws):
            _scale_to_reserve_and_one_more(lws, role, size, reserve, label)


def _scale_to_reserve_and_one_more(lws: dict, role: str, size: int, reserve: int, label: str) -> None:
    try:
        _scale(lws, reserve)
        pods = fleet.wait_for(f"{role} at {reserve} groups", lambda: (
            lambda ps: ps if len(ps) == reserve * size and all(p["spec"].get("nodeName") for p in ps) else None
        )(_lws_pods(lws)), timeout=300) or _lws_pods(lws)
        unbound = [p["metadata"]["name"] for p in pods if not p["spec"].get("nodeName")]
        assert len(pods) == reserve * size and not unbound, (
            f"{label} {role} at {reserve} groups: {len(pods)} pods, unbound {unbound}: " + "; ".join(
                e for name in unbound[:2] for e in fleet.scheduler_events(lws["metadata"]["namespace"], name)))
        _scale(lws, reserve + 1)

        def refused():
            pending = [p for p in _lws_pods(lws) if not p["spec"].get("nodeName")]
            said = [e for p in pending for e in fleet.scheduler_events(p["metadata"]["namespace"],
                                                                       p["metadata"]["name"])]
            return [e for e in said if e.startswith("FailedScheduling")]
        said = fleet.wait_for(f"{role} group {reserve + 1} refused", refused, timeout=180)
        assert said, f"{label} {role}: group {reserve + 1} did not stay Pending with a scheduler event"
        FIGURES.append(f"{label} {role}: {reserve} groups bound; group {reserve + 1} refused: {said[0][:160]}")
    finally:
        _scale(lws, lws["spec"].get("replicas", 1))


def _can_i(verb: str, resource: str, group: str, account: str, namespace: str, subresource: str = "",
           account_namespace: str | None = None) -> bool:
    """A SubjectAccessReview for the ServiceAccount, answered by the twin's real RBAC authorizer
    (kube-apiserver --authorization-mode=Node,RBAC). Created as an object, not through `kubectl
    auth can-i`, which resolves the resource through discovery first and answers "no" for a type
    whose CRD is not installed (the picker's InferenceObjective)."""
    home = account_namespace or namespace  # where the account lives (a controller's: its own namespace)
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
        "user": f"system:serviceaccount:{home}:{account}",
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{home}", "system:authenticated"],
        "resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, "resource": resource,
                               "subresource": subresource}}}
    done = kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    return json.loads(done.stdout)["status"].get("allowed") is True


def test_each_account_may_do_what_its_program_does_and_no_more(applied_fleet):
    """The router's ServiceAccount may make every call its program makes with the rendered flags
    (infra/render/pinned/rbac-needs.json, each need citing its source at the pinned version:
    sglang-router 0.3.2 sglang_router/router.py lists and watches pods; the endpoint picker's
    manager caches, gateway-api-inference-extension pkg/epp/server/controller_manager.go),
    checked by SubjectAccessReview against the RBAC objects applied to the twin. It may not
    delete pods or read Secrets, and the engines' account may not list pods: the test bites."""
    from infra.render import rbac
    from tests.test_rbac import launched_args

    spec, objects, result, label = applied_fleet

    class Rendered:  # what launched_args reads, from the applied objects
        @staticmethod
        def by_kind(kind: str) -> list[dict]:
            return [o for o in objects if o["kind"] == kind]

    (router,) = [o for o in Rendered.by_kind("Deployment") if o["metadata"]["name"] == naming.ROUTER]
    namespace = router["metadata"]["namespace"]
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    args = launched_args(Rendered, router)
    component = "endpoint_picker" if router["spec"]["template"]["spec"]["containers"][0].get("args") else "sglang_router"
    needs = [n for n in rbac.needs_for(component, args) if n.scope == "namespace"]
    assert needs, f"{label}: {component} makes no call"
    refused = [f"{v} {n.resource}.{n.api_group}" for n in needs for v in n.verbs
               if not _can_i(v, n.resource, n.api_group, account, namespace)]
    assert refused == [], f"{label}: {account} may not {refused}"
    assert not _can_i("delete", "pods", "", account, namespace)
    assert not _can_i("get", "secrets", "", account, namespace)
    engine_accounts = {o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].get("serviceAccountName", "default")
                       for o in Rendered.by_kind("LeaderWorkerSet")}
    for engine_account in engine_accounts:
        assert not _can_i("list", "pods", "", engine_account, namespace), f"{label}: {engine_account} lists pods"
    FIGURES.append(f"{label} rbac: {account} ({component}) may {sum(len(n.verbs) for n in needs)} calls; "
                   "delete pods, get secrets refused")


KEDA_MODULE = "github.com/kedacore/keda/v2"  # twin/crds/go.mod pins it, as the platform's KEDA row does


def test_the_scalers_may_scale_each_pool_they_target(applied_fleet):
    """Each ScaledObject's target has a scale subresource the API server serves (LWS's CRD,
    sigs.k8s.io/lws config/crd: `subresources.scale`), at the replicas the render asks for; and the
    accounts that scale it may: KEDA's operator, with the RBAC KEDA's source declares at the
    pinned version (github.com/kedacore/keda/v2 v2.20.2 config/rbac/role.yaml, generated from its
    `+kubebuilder:rbac` markers: get/list/watch/patch/update on `*/scale`), read from the module
    zip go.sum verifies and applied to the twin; and the HPA controller KEDA's HPA hands the
    scaling to (kubernetes v1.34.4 plugin/pkg/auth/authorizer/rbac/bootstrappolicy/
    controller_policy.go, horizontal-pod-autoscaler: get/update on `*/scale`; the twin's
    controller-manager runs with --use-service-account-credentials). Neither may delete the
    pool: the test bites."""
    from twin.crds import module

    spec, objects, result, label = applied_fleet
    keda = module("crds", KEDA_MODULE)
    rbac_objects = [o for name in ("role.yaml", "role_binding.yaml")
                    for o in yaml.safe_load_all(keda.file(f"config/rbac/{name}").read_text())
                    if o and o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert {o["kind"] for o in rbac_objects} == {"ClusterRole", "ClusterRoleBinding"}
    assert fleet.apply_each_pass(rbac_objects).rejected == {}
    (binding,) = [o for o in rbac_objects if o["kind"] == "ClusterRoleBinding"]
    (operator,) = binding["subjects"]
    scalers = [o for o in objects if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert scalers, f"{label}: no scaler rendered"
    plurals = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c["spec"]["names"]["plural"]
               for c in fleet.get("customresourcedefinitions")}
    for scaler in scalers:
        target, namespace = scaler["spec"]["scaleTargetRef"], scaler["metadata"]["namespace"]
        group = target["apiVersion"].split("/")[0]
        plural = plurals[(group, target["kind"])]
        scale = json.loads(kubectl("get", "--raw", f"/apis/{target['apiVersion']}/namespaces/{namespace}/{plural}/"
                                   f"{target['name']}/scale").stdout)
        (rendered,) = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
                       and o["metadata"]["namespace"] == namespace]
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == rendered["spec"].get("replicas", 1)
        who = {"KEDA's operator": (operator["name"], operator["namespace"], ("get", "patch", "update")),
               "the HPA controller": ("horizontal-pod-autoscaler", "kube-system", ("get", "update"))}
        for name, (account, home, verbs) in who.items():
            refused = [v for v in verbs if not _can_i(v, plural, group, account, namespace, "scale", home)]
            assert refused == [], f"{label}: {name} may not {refused} {plural}/scale"
            assert not _can_i("delete", plural, group, account, namespace, account_namespace=home), name
    FIGURES.append(f"{label} scalers: {len(scalers)} targets with a scale subresource; KEDA's operator and the "
                   "HPA controller may scale them, not delete them")
    kubectl("delete", "--ignore-not-found", *[f"{o['kind'].lower()}.rbac.authorization.k8s.io/{o['metadata']['name']}"
                                              for o in rbac_objects])


def test_a_rolling_update_of_decode_completes(applied_fleet):
    """A changed decode template (what a new config hash does) rolls through every group: the
    real LWS controller replaces the groups within maxSurge/maxUnavailable and reports the
    update done (status.updatedReplicas == replicas, Available), every new pod bound. The
    update starts from a formed pool (Available), as a rollout's would."""
    spec, objects, result, label = applied_fleet
    lws = next((o for o in objects if o["kind"] == "LeaderWorkerSet"
                and o["metadata"]["labels"][naming.ROLE_LABEL] in ("decode", "colocated")), None)
    assert lws is not None, f"{label}: no decode pool"
    name, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]

    def live_status():
        (live,) = fleet.get("leaderworkerset", "-n", namespace, f"--field-selector=metadata.name={name}")
        status = live.get("status", {})
        available = any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", []))
        return live, status, available
    def formed() -> bool:  # Available, and nothing of an earlier scale-down still holding nodes
        terminating = [p for p in fleet.get("pods", "-n", namespace, "-l", f"{LWS_NAME_LABEL}={name}")
                       if "deletionTimestamp" in p["metadata"]]
        return live_status()[2] and not terminating
    assert fleet.wait_for(f"{label} decode formed", formed, timeout=600), f"{label}: {name} not formed"
    marked = {"metadata": {"annotations": {"twin.pdstack.io/rolled": "1"}}}
    templates = {"workerTemplate": marked, **({"leaderTemplate": marked}
                                              if "leaderTemplate" in lws["spec"]["leaderWorkerTemplate"] else {})}
    kubectl("patch", "leaderworkerset", name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"leaderWorkerTemplate": templates}}))

    def rolled():
        live, status, available = live_status()
        replicas = live["spec"].get("replicas", 1)
        pods = _lws_pods(lws)
        new = [p for p in pods if (p["metadata"].get("annotations") or {}).get("twin.pdstack.io/rolled") == "1"]
        done = (status.get("updatedReplicas") == replicas and available and len(new) == len(pods) > 0
                and all(p["spec"].get("nodeName") for p in new))
        return live if done else None
    live = fleet.wait_for(f"{label} decode rolled", rolled, timeout=600)
    assert live, f"{label}: the rolling update of {name} did not complete: " + "; ".join(
        e for p in _lws_pods(lws)[:2] for e in fleet.scheduler_events(namespace, p["metadata"]["name"]))
    FIGURES.append(f"{label} decode: rolling update of {live['spec'].get('replicas', 1)} group(s) completed")
