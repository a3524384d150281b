"""The Automation API adapter's own logic: what a step targets (from the tracks the release
store records), the readiness commands, the live route it reads, the fenced route patch and
the cluster every kubectl call is pointed at. The Pulumi CLI and an API server are not
installed here, so `up` is a recording stand-in and kubectl's answers come from a stand-in
that keeps one HTTPRoute the way kube-apiserver does: a merge patch (RFC 7386) applied to the
stored object, refused with 409 Conflict when the patch's metadata.resourceVersion is not the
stored one (kubernetes staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go,
Store.Update; handlers/patch.go applies patches through it), every write moving the
resourceVersion on. Everything the adapter sends is computed by the real code; the cluster
twin is where it meets the real API server."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest

from infra.inputs import InputError
from infra.rollout.cluster import FenceRefused
from infra.rollout.pulumi_cluster import (FENCE_ANNOTATION, KubeTarget, PulumiCluster, kube_target, traffic_from_route,
                                          wait_command)
from infra.rollout.releases import ReleaseStore
from infra.rollout.steps import plan_steps
from infra.offline import run_spec
from infra.spec_checks import parse_spec
from tests.conftest import stack_data

CONFLICT = ('Error from server (Conflict): Operation cannot be fulfilled on httproutes.gateway.networking.k8s.io '
            '"gateway": the object has been modified; please apply your changes to the latest version and try again')


class RecordingStack:
    """Stands in for pulumi.automation.Stack (up)."""

    def __init__(self):
        self.ups: list[dict] = []

    def up(self, **kwargs):
        self.ups.append(kwargs)


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch, what `kubectl patch --type=merge` sends."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class StandInApiServer:
    """One HTTPRoute, kept as kube-apiserver keeps it; answers kubectl command lines."""

    def __init__(self, route: dict | None):
        self.route, self.version, self.commands = route, 1, []
        self.writes_between_read_and_patch: list[dict] = []  # other writers (a controller, a new holder)
        if route is not None:
            route.setdefault("metadata", {})["resourceVersion"] = "1"

    def _write(self, route: dict) -> None:
        self.version += 1
        self.route = {**route, "metadata": {**route["metadata"], "resourceVersion": str(self.version)}}

    def run(self, cmd: list[str]) -> int:  # kubectl wait / get namespace
        self.commands.append(cmd)
        return 0

    def read(self, cmd: list[str]) -> str:
        self.commands.append(cmd)
        verb = cmd[cmd.index("--context") + 2 + (2 if "--kubeconfig" in cmd else 0)]
        if self.route is None:
            raise subprocess.CalledProcessError(1, cmd, "", 'Error from server (NotFound): httproutes "gateway" not found')
        if verb == "get":
            return json.dumps(self.route)
        assert verb == "patch" and "--type=merge" in cmd
        if self.writes_between_read_and_patch:
            self._write(merge_patch(self.route, self.writes_between_read_and_patch.pop(0)))
        patch = json.loads(cmd[cmd.index("-p") + 1])
        if patch["metadata"]["resourceVersion"] != self.route["metadata"]["resourceVersion"]:
            raise subprocess.CalledProcessError(1, cmd, "", CONFLICT)
        self._write(merge_patch(self.route, patch))
        return "httproute.gateway.networking.k8s.io/gateway patched"


def route_of(weights: dict[int, int], fence: int | None = None) -> dict:
    annotations = {} if fence is None else {"annotations": {FENCE_ANNOTATION: str(fence)}}
    return {"metadata": {"name": "gateway", "namespace": "pdstack-prod", **annotations},
            "spec": {"rules": [{"backendRefs": [{"name": "router", "namespace": f"pdstack-prod-r{r}", "weight": w}
                                                for r, w in weights.items()]}]}}


def adapter(store: ReleaseStore, api: StandInApiServer, **kwargs) -> PulumiCluster:
    c = PulumiCluster("prod", store, on_output=lambda line: None, run_command=api.run, read_command=api.read, **kwargs)
    c._stack = RecordingStack()
    return c


@pytest.fixture
def cluster(tmp_path):
    store = ReleaseStore("prod", tmp_path)
    for threshold in (0.5, 0.6):
        data = stack_data("prod")
        data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = threshold
        store.create(parse_spec(data))
    api = StandInApiServer(route_of({1: 100}))
    c = adapter(store, api)
    c.api = api
    return c


def steps():
    spec = parse_spec(stack_data("prod"))
    return {s.name: s for s in plan_steps(spec, run_spec(spec).resources)}


def test_the_live_route_is_read_as_traffic_per_revision():
    """Backends as infra/components/access.py renders them: the track's router Service (or its
    InferencePool) in `<namespace>-r<revision>`, weight per Gateway API HTTPBackendRef
    (gateway-api apis/v1/httproute_types.go: weight defaults to 1)."""
    route = {"spec": {"rules": [{"backendRefs": [
        {"name": "router", "namespace": "pdstack-prod-r7", "port": 8000, "weight": 95},
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool",
         "namespace": "pdstack-prod-r8", "weight": 5}]}]}}
    assert traffic_from_route(route, "pdstack-prod") == {7: 95, 8: 5}
    assert traffic_from_route({"spec": {"rules": [{"backendRefs": [{"name": "router"}]}]}}, "pdstack-prod") == {0: 1}


def test_wait_commands():
    assert wait_command("LeaderWorkerSet/engine-decode condition=Available", "pdstack-prod-r2") == [
        "wait", "leaderworkerset/engine-decode", "--for=condition=Available", "--timeout=1s", "-n", "pdstack-prod-r2"]
    assert "-n" not in wait_command("NodePool/pdstack-prod-decode condition=Ready", "x")
    # The environment's entry point is read in its own namespace, not the revision's.
    assert wait_command("Gateway/gateway condition=Programmed in pdstack-prod", "pdstack-prod-r2") == [
        "wait", "gateway/gateway", "--for=condition=Programmed", "--timeout=1s", "-n", "pdstack-prod"]


def test_a_step_targets_its_revisions_resources_and_keeps_secrets_out_of_logs(cluster):
    with pytest.raises(ValueError, match="record it first"):  # the program would not deploy it
        cluster.apply(2, steps()["deploy decode"], fence=1)
    cluster.store.intend({1: 100, 2: 0})
    cluster.apply(2, steps()["deploy decode"], fence=1)
    (up,) = cluster._stack.ups
    names = {urn.rsplit("::", 1)[1] for urn in up["target"]}
    objects = {"r2-leaderworkerset-engine-decode", "r2-service-engine-decode-http", "r2-configmap-engine-decode-launch",
               "r2-poddisruptionbudget-engine-decode", "r2-computedomain-engine-decode-nvlink"}
    # and the track's components above them: the real engine refuses to create a resource
    # whose parent is neither in its state nor targeted (tests/test_engine.py shows it)
    components = names - objects
    assert objects <= names and components and all(name.startswith("prod-r2-") for name in components)
    assert all("pdstack:" in urn.split("::")[2].rsplit("$", 1)[-1] for urn in up["target"]
               if urn.rsplit("::", 1)[1] in components)
    assert all(urn.startswith("urn:pulumi:prod::pdstack::") for urn in up["target"])
    assert up["show_secrets"] is False and up["policy_packs"][0].endswith("/policy/run-pack")
    assert cluster.ready(2, steps()["deploy decode"])
    assert cluster.api.commands[-1][-2:] == ["-n", "pdstack-prod-r2"]


def test_a_step_with_nothing_to_apply_runs_no_update(cluster):
    """"verify" applies no resource. An empty target list reaches the Automation API as no
    --target at all, and the whole stack would be updated, the route's weights and fence
    rewritten (found on the real engine: tests/test_engine.py rendered one object too many)."""
    cluster.store.intend({1: 100, 2: 0})
    cluster.apply(2, steps()["verify"], fence=1)
    assert cluster._stack.ups == []


def test_traffic_moves_by_one_fenced_patch_of_the_route_as_the_program_renders_it(cluster):
    cluster.store.intend({1: 100, 2: 0})
    with pytest.raises(ValueError, match="not what the release store records"):
        cluster.set_traffic({1: 95, 2: 5}, fence=3)
    cluster.store.intend({1: 95, 2: 5})
    cluster.set_traffic({1: 95, 2: 5}, fence=3)
    assert cluster._stack.ups == []  # one PATCH, no `pulumi up`
    patch = json.loads(cluster.api.commands[-1][-1])
    assert patch["metadata"] == {"resourceVersion": "1", "annotations": {FENCE_ANNOTATION: "3"}}
    backends = patch["spec"]["rules"][0]["backendRefs"]  # the program's own rendering (access.py)
    assert [(b["namespace"], b["weight"]) for b in backends] == [("pdstack-prod-r1", 95), ("pdstack-prod-r2", 5)]
    assert cluster.traffic() == {1: 95, 2: 5}  # read back from the live route
    assert cluster.api.route["metadata"]["annotations"][FENCE_ANNOTATION] == "3"
    with pytest.raises(ValueError, match="still takes traffic"):
        cluster.retire(1, fence=3)


def test_a_change_carrying_an_older_fence_than_the_route_is_refused_and_changes_nothing(cluster):
    """The issue's paused holder: its lease (fence 4) was taken over by fence 5, which the
    new holder wrote on the route first. Every kind of change it tries is refused."""
    cluster.api.route = route_of({1: 100}, fence=5)
    cluster.api.route["metadata"]["resourceVersion"] = "1"
    before = copy.deepcopy(cluster.api.route)
    cluster.store.intend({1: 50, 2: 50})
    with pytest.raises(FenceRefused, match="carries fence 4.*under fence 5"):
        cluster.set_traffic({1: 50, 2: 50}, fence=4)
    with pytest.raises(FenceRefused):
        cluster.apply(2, steps()["deploy decode"], fence=4)
    with pytest.raises(FenceRefused):
        cluster.raise_fence(4)
    assert cluster.api.route == before and cluster._stack.ups == []
    cluster.raise_fence(6)  # a newer holder raises it, with the resourceVersion it read
    assert cluster.api.route["metadata"]["annotations"][FENCE_ANNOTATION] == "6"


def test_a_route_written_between_read_and_patch_is_read_again_and_its_fence_compared_again(cluster):
    """The resourceVersion precondition makes compare-and-patch one step: a status write of
    the gateway controller in between only costs a retry; a newer holder's fence in between
    refuses the patch."""
    cluster.store.intend({1: 50, 2: 50})
    cluster.api.writes_between_read_and_patch = [{"status": {"parents": []}}]
    cluster.set_traffic({1: 50, 2: 50}, fence=3)
    assert cluster.traffic() == {1: 50, 2: 50}
    cluster.store.intend({2: 100, 1: 0})
    cluster.api.writes_between_read_and_patch = [{"metadata": {"annotations": {FENCE_ANNOTATION: "4"}}}]
    with pytest.raises(FenceRefused, match="carries fence 3.*under fence 4"):
        cluster.set_traffic({2: 100}, fence=3)
    assert cluster.traffic() == {1: 50, 2: 50}


def test_the_first_route_is_created_by_pulumi_and_then_fenced(tmp_path):
    store = ReleaseStore("prod", tmp_path)
    store.create(parse_spec(stack_data("prod")))
    api = StandInApiServer(None)
    c = adapter(store, api)
    store.intend({1: 100})

    def create_route(**kwargs):  # what the targeted up does: the route as the program renders it
        c._stack.ups.append(kwargs)
        api.route = route_of({1: 100})
        api.route["metadata"]["resourceVersion"] = "7"
    c._stack.up = create_route
    c.set_traffic({1: 100}, fence=2)
    assert [u.rsplit("::", 1)[1] for u in c._stack.ups[0]["target"]] == ["httproute-gateway"]
    assert api.route["metadata"]["annotations"][FENCE_ANNOTATION] == "2"


def test_every_kubectl_command_names_the_stacks_context_and_kubeconfig(cluster, tmp_path):
    """Pulumi.prod.yaml pins kubernetes:context: pdstack-prod. Every command line the adapter
    builds (reads, waits, the patch) carries it, so a rollback never patches the cluster the
    operator's current context happens to point at."""
    cluster.store.intend({1: 100, 2: 0})
    cluster.raise_fence(2)
    cluster.apply(2, steps()["deploy decode"], fence=2)
    cluster.ready(2, steps()["deploy decode"])
    cluster.healthy(2)
    cluster.store.intend({1: 0, 2: 100})
    cluster.set_traffic({2: 100}, fence=2)
    cluster.traffic()
    cluster.store.intend({2: 100})
    cluster.retire(1, fence=2)
    verbs = {cmd[3] for cmd in cluster.api.commands}
    assert verbs == {"get", "wait", "patch"}
    assert all(cmd[:3] == ["kubectl", "--context", "pdstack-prod"] for cmd in cluster.api.commands)

    kubeconfig = tmp_path / "prod.kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    (tmp_path / "Pulumi.prod.yaml").write_text(
        "config:\n  kubernetes:context: pdstack-prod\n  kubernetes:kubeconfig: prod.kubeconfig\n")
    target = kube_target("prod", tmp_path)
    assert target == KubeTarget("pdstack-prod", str(kubeconfig))
    api = StandInApiServer(route_of({1: 100}))
    with_file = adapter(cluster.store, api, kube=target)
    with_file.traffic()
    with_file.healthy(1)
    assert api.commands and all(cmd[:5] == ["kubectl", "--context", "pdstack-prod", "--kubeconfig", str(kubeconfig)]
                                for cmd in api.commands)


@pytest.mark.parametrize("config, says", [
    ("config:\n  pdstack:specFile: stacks/x.yaml\n", "kubernetes:context is not set"),
    ("config:\n  kubernetes:context: ''\n", "kubernetes:context is not set"),
    ("config:\n  kubernetes:context: c\n  kubernetes:kubeconfig:\n    secure: AAAB\n", "is a secret value"),
    ("config:\n  kubernetes:context: c\n  kubernetes:kubeconfig: |\n    apiVersion: v1\n    users: []\n",
     "credentials in plain text"),
    ("config:\n  kubernetes:context: c\n  kubernetes:kubeconfig: nowhere.yaml\n", "no such file"),
])
def test_a_stack_that_does_not_pin_its_cluster_is_refused(tmp_path, config, says):
    """Without a context kubectl uses its current one, whatever cluster that is: refused, not
    guessed (Pulumi's provider would fall back the same way, so both would agree on the wrong
    cluster). A kubeconfig's contents in the stack file is a credential in plain text."""
    (tmp_path / "Pulumi.x.yaml").write_text(config)
    with pytest.raises(InputError, match=says):
        kube_target("x", tmp_path)


def test_pdctl_refuses_a_stack_file_that_does_not_exist(tmp_path, capsys):
    from infra.cli import main

    code = main(["rollback", "--stack", "dev", "--pulumi-stack", "staging", "--releases", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "Pulumi.staging.yaml does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_object_of_two_tracks_is_applied_by_exactly_one_step_of_its_revision(tmp_path, stack):
    """Found on the real engine (tests/test_engine.py): steps matched by name against the
    untracked plan never targeted a track's own namespace (`r1-namespace-pdstack-dev-r1`), its
    ReferenceGrant, or, with tracks, the environment's gateway, keys and policies, so a
    rollout's targeted ups would never create them. With two tracks recorded, every custom
    resource of the program's run is targeted by exactly one step of its revision (the
    environment's own by revision 1's steps), except the route, which set_traffic creates."""
    from infra.rollout.pulumi_cluster import ROUTE_RESOURCE, TRACK_NAME, engine_urn, step_targets

    store = ReleaseStore(stack, tmp_path / "releases")
    spec = parse_spec(stack_data(stack))
    store.create(spec)
    store.create(spec)
    store.intend({1: 90, 2: 10})
    cluster = PulumiCluster(stack, store, work_dir=tmp_path, kube=KubeTarget(f"pdstack-{stack}"))
    run = cluster._program_run(store.tracks())
    objects = {engine_urn(r.urn) for r in run.custom() if not r.type.startswith("pulumi:providers:")}
    targeted: dict[str, int] = {}
    for revision in (1, 2):
        for step in plan_steps(spec, run_spec(spec).resources):
            for urn in step_targets(run, step, revision):
                name = urn.rsplit("::", 1)[1]
                if urn in objects and (name.startswith(f"r{revision}-") or (revision == 1 and not TRACK_NAME.match(name))):
                    targeted[urn] = targeted.get(urn, 0) + 1
    (route,) = [u for u in objects if u.endswith("::" + ROUTE_RESOURCE)]
    assert objects - set(targeted) == {route}
    assert {u: n for u, n in targeted.items() if n != 1} == {}
    assert any("::r2-namespace-" in u for u in objects) and any("::r1-referencegrant-" in u for u in objects)
