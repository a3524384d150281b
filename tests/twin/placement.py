"""Checks shared by the tests that apply a render to the twin: every pod bound where the
placement says, started by the twin's kubelet and Ready, and the removal of what a render
applied (tests/twin/test_fleet_on_twin.py, tests/twin/test_tracks_on_twin.py)."""

from __future__ import annotations

import calendar
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from infra import naming
from infra.planning.capacity import domain_placement
from infra.render.router_config import EPP_LEADER_ELECTION
from tests.twin.conftest import FIGURES
from twin import cluster, fleet, inventory, kubelet
from twin.api import kubectl
from twin.fleet import delete_namespaces
from twin.nodes import TWIN_LABEL

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
users_objects = fleet.users_objects  # the tests' name for twin/fleet.py's, which twin/live.py uses too


def remove_fleet(objects: list[dict]) -> None:
    """Delete what a render applied (namespaces take their contents with them) and the stack's nodes."""
    namespaces = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    cluster_scoped = [f"{o['kind'].lower()}.{o['apiVersion'].split('/')[0]}/{o['metadata']['name']}"
                      for o in objects if "namespace" not in o["metadata"] and o["kind"] != "Namespace"
                      and "/" in o["apiVersion"]]
    if cluster_scoped:
        kubectl("delete", "--ignore-not-found", "--wait=false", *cluster_scoped)
    delete_namespaces(namespaces)


def remove_render(spec, objects: list[dict], nodes: bool = True) -> None:
    """Everything an applied render left: its objects, the DRA stand-in's, its stack's nodes
    (unless `nodes` is False: the test still looks at them)."""
    remove_fleet(objects)
    for kind in ("resourceslices", "deviceclasses"):
        kubectl("delete", kind, "-l", "twin.pdstack.io/stands-in-for", "--ignore-not-found")
    if nodes:
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


def namespace_for_pods(namespace: str) -> None:
    """A namespace a test's own pods can be made in: made, and its default ServiceAccount there
    (the serviceaccount controller makes it; until then the API server refuses pods)."""
    assert fleet.apply_each_pass([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}]
                                 ).rejected == {}
    assert fleet.wait_for("the default ServiceAccount", lambda: kubectl(
        "get", "serviceaccount", "-n", namespace, "default", check=False).returncode == 0)


def pods_in(namespaces: set[str]) -> list[dict]:
    return [p for ns in sorted(namespaces) for p in fleet.get("pods", "-n", ns)]


def events_of(pod: dict) -> str:
    """What the scheduler and the twin's kubelet said about a pod."""
    return "; ".join(fleet.scheduler_events(pod["metadata"]["namespace"], pod["metadata"]["name"])) or "no event"


@dataclass
class Started:
    """Every bound pod after the twin's kubelet (twin/kubelet.py) has judged it."""
    pods: list[dict]

    def _condition(self, pod: dict, kind: str) -> dict:
        return kubelet.condition(pod, kind) or {}

    @property
    def failing(self) -> list[dict]:  # refused by the start checks: the kubelet's reason in the condition
        return [p for p in self.pods if self._condition(p, kubelet.CONDITION).get("status") == "False"]

    @property
    def running(self) -> list[dict]:
        return [p for p in self.pods if p.get("status", {}).get("phase") == "Running"]

    @property
    def ready(self) -> list[dict]:
        return [p for p in self.pods if self._condition(p, "Ready").get("status") == "True"]

    @property
    def unready(self) -> list[dict]:
        return [p for p in self.pods if p not in self.failing and p not in self.ready]

    def summary(self) -> str:
        return (f"started {len(self.running)}, ready {len(self.ready)}, "
                f"failing start checks {len(self.failing)}")

    def why(self) -> str:
        def name(p):
            return f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        return "\n".join(
            [f"{name(p)} fails its start checks: {self._condition(p, kubelet.CONDITION).get('message')}"
             for p in self.failing] +
            [f"{name(p)} not Ready ({p.get('status', {}).get('phase')}): "
             f"{self._condition(p, 'Ready').get('message') or 'no Ready condition'}; {events_of(p)}"
             for p in self.unready])


def started_pods(namespaces: set[str], timeout: float = 300, refused_for: float = 10) -> Started:
    """Wait until every pod in `namespaces` is Ready or refused by the twin's kubelet's start
    checks for `refused_for` seconds. The kubelet retries each second, so a refusal that lasts
    is not a race with what is still being made (the controller manager publishes each new
    namespace's kube-root-ca.crt, which every pod's token volume mounts, a moment after it)."""
    def settled():
        now = Started([p for p in pods_in(namespaces) if "deletionTimestamp" not in p["metadata"]])
        since = [kubelet.condition(p, kubelet.CONDITION).get("lastTransitionTime") for p in now.failing]
        lasting = all(t and time.time() - calendar.timegm(time.strptime(t, "%Y-%m-%dT%H:%M:%SZ")) >= refused_for
                      for t in since)
        return now if not now.unready and lasting else None
    return fleet.wait_for("every pod Ready or refused", settled, timeout=timeout) or Started(
        [p for p in pods_in(namespaces) if "deletionTimestamp" not in p["metadata"]])


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
    started = [] if pending else started_pods(namespaces)
    if started:  # the later look: a Deployment's pod may have come after the LeaderWorkerSets' were bound
        pods = started.pods
    FIGURES.append(f"{label}: objects applied {len(result.applied)}, rejected {len(result.rejected)}; "
                   f"pods bound {sum(bool(p['spec'].get('nodeName')) for p in pods)}, pending {len(pending)}; "
                   f"{started.summary() if started else 'not started'}; "
                   f"LeaderWorkerSet pods {sum(LWS_NAME_LABEL in p['metadata'].get('labels', {}) for p in pods)}"
                   f"/{expected}; {inventory.summary(*inventory.running_controllers(cluster.running() or {}))}")
    assert not pending, "pods left Pending:\n" + "\n".join(
        f"{p['metadata']['namespace']}/{p['metadata']['name']}: {events_of(p)}" for p in pending)
    assert not started.failing and not started.unready, started.why()
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


def assert_runnable_pods_run(processes, namespaces: set[str], label: str, timeout: float = 300) -> None:
    """Every bound pod of `namespaces` that the twin can run (twin/pods.py not_runnable) started as a
    process at its address from its rendered command, and Ready by its own probes: its rendered
    startupProbe and readinessProbe pass against it, judged as the twin's kubelet judges them
    (ProbeJudge) over the wait's rounds, and the kubelet has it Ready. All of them, prod's 38 pods as
    dev's: a bound pod neither started nor named not runnable fails the test by name (no sample). A
    process that exits fails the test, naming the pod and the end of its program's log
    (PodProcesses.check). Each pod the twin does not run is named with why; the figure line says how
    many of each. The verdict is the one of the round that ended the wait, not a fresh look after it:
    a look of its own would judge a leader handover or a probe's one slow answer at one instant.
    `timeout` counts from the last pod's start; what it must cover after that is the last pods'
    (the pickers', started last) first probes and their leader's election or a handover: a standby
    takes an expired lease within LeaseDuration + RetryPeriod (15 s + 2 s, controller-runtime's
    defaults, which gateway-api-inference-extension v1.4.0 pkg/epp/server/controller_manager.go
    keeps), the old leader counts unready after failureThreshold x periodSeconds (3 x 2 s, the
    rendered readinessProbe) and the new one Ready after one period: about 25 s at idle, so 300 s
    holds at ten times that on a loaded machine."""
    for namespace in sorted(namespaces):
        processes.start(namespace)
    started = {p.name: p for p in processes.started}
    bound = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods_in(namespaces)
             if p["spec"].get("nodeName") and "deletionTimestamp" not in p["metadata"]]
    not_started = sorted(set(bound) - {f"{p.namespace}/{p.name}" for p in processes.started}
                         - set(processes.not_runnable))

    def exited():
        return [p for p in processes.started if p.process.poll() is not None]

    judge, last = ProbeJudge(), {}

    def settled():
        last["verdicts"] = probe_verdicts(processes, namespaces, judge)
        return exited() or not last["verdicts"][0]
    fleet.wait_for("every started pod Ready by its own probes, or one exited", settled, timeout=timeout, interval=1)
    (left, standing_by), failing = last["verdicts"], exited()
    roles = Counter(p.role for p in started.values())
    FIGURES.append(f"{label} processes: bound {len(bound)}, started {len(started)} ("
                   + ", ".join(f"{role} x{n}" if n > 1 else role for role, n in sorted(roles.items())) + "), "
                   f"not runnable {len(processes.not_runnable)}"
                   + "".join(f" ({name}: {why})" for name, why in sorted(processes.not_runnable.items()))
                   + f", not started {len(not_started)}, failing {len(failing)}; "
                   f"Ready by their own probes {len(started) - len(left) - len(standing_by)}/{len(started)}"
                   + (f", standing by {len(standing_by)} (leader-electing picker replicas, not the leader)"
                      if standing_by else ""))
    processes.check()  # a process that exited: its pod and the end of its program's log
    assert not not_started, f"bound pods the twin runs but did not start: {', '.join(not_started)}"
    assert not left, "started pods not Ready by their own probes:\n" + "\n".join(left)


def unready_by_probes(processes, namespaces: set[str]) -> list[str]:
    """Each pod of `namespaces` with a started process that is not Ready by its own probes, each
    probe run once now (probe_verdicts' first list, with a judge of its own)."""
    return probe_verdicts(processes, namespaces)[0]


@dataclass
class ProbeJudge:
    """The started pods' own probes, judged as the kubelet judges them across runs (k8s.io/kubernetes
    v1.34.4 pkg/kubelet/prober/worker.go, twin/kubelet.py Prober: each probe on its own period, a
    result that turns only after successThreshold successes or failureThreshold failures in a row;
    readiness and startup start as failure, liveness as success). One judge for the rounds of one
    wait: one slow answer of a Ready pod (the picker's gRPC health has timeoutSeconds 1, the
    default) does not make it unready, as it does not for a kubelet; a fresh judge is a one-shot look."""
    probers: dict = field(default_factory=dict)  # pod uid -> kubelet.Prober (startup, readiness)
    liveness: dict = field(default_factory=dict)  # pod uid -> kubelet.ProbeState

    def run(self, pod: dict, now: float) -> tuple[bool, str, bool, str]:
        """(ready by its probes, what they last said, live, what readiness last said) for the pod's
        first container, running what is due (kubelet.run_probe, as the twin's kubelet runs each)."""
        probe = kubelet.run_probe
        uid, container, ip = pod["metadata"]["uid"], pod["spec"]["containers"][0], pod["status"]["podIP"]
        if uid not in self.probers:
            # every probe due at the first look: the process started before it, initialDelaySeconds ago or more
            self.probers[uid] = kubelet.Prober({**pod, "spec": {**pod["spec"], "containers": [container]}}, now)
            for state in self.probers[uid].probes.values():
                state.next_at = now
            if container.get("livenessProbe"):
                self.liveness[uid] = kubelet.ProbeState(container["livenessProbe"], now, result=True)
        prober, liveness = self.probers[uid], self.liveness.get(uid)
        ready, said = prober.run(ip, now, probe)[container["name"]]
        if liveness and now >= liveness.next_at:
            liveness.record(*probe(liveness.probe, ip, container), now)
        readiness = prober.probes.get((container["name"], "readinessProbe"))
        return ready, said, bool(liveness and liveness.result), readiness.said if readiness else ""


def probe_verdicts(processes, namespaces: set[str], judge: ProbeJudge | None = None,
                   now=time.monotonic) -> tuple[list[str], list[str]]:
    """(unready, standing by) among the pods of `namespaces` with a started process, by `judge`
    (ProbeJudge; a fresh one: each probe run once now). Unready: its name, what its rendered
    startupProbe and readinessProbe last said against its address and its Ready condition. Standing
    by: a replica of an endpoint picker whose replicas elect a leader (EPP_LEADER_ELECTION) that is
    not the leader, which by design is Ready on no probe (gateway-api-inference-extension v1.4.0
    cmd/epp/runner/health.go: "readiness" is SERVING only on the leader, "liveness" on every
    replica): it stands by when it is live and its readiness last said NOT_SERVING, and its
    Deployment must then have exactly one Ready replica, the leader, or that is unready too."""
    judge = judge or ProbeJudge()
    started = {(p.namespace, p.name) for p in processes.started}
    unready, standing_by = [], []
    electing: dict[tuple, list[bool]] = defaultdict(list)  # (namespace, owners) -> each replica Ready
    for pod in pods_in(namespaces):
        meta = pod["metadata"]
        if (meta["namespace"], meta["name"]) not in started:
            continue
        container = pod["spec"]["containers"][0]
        by_probes, said, live, readiness_said = judge.run(pod, now())
        ready = by_probes and (kubelet.condition(pod, "Ready") or {}).get("status") == "True"
        if EPP_LEADER_ELECTION in (container.get("args") or ()):
            owners = (meta["namespace"], *sorted(o["name"] for o in meta.get("ownerReferences") or ()))
            if ready or (live and '"NOT_SERVING"' in readiness_said):
                electing[owners].append(ready)
                if not ready:
                    standing_by.append(meta["name"])
                continue
        if not ready:
            unready.append(f"{meta['name']}: {said or 'no probe'}; Ready "
                           f"{(kubelet.condition(pod, 'Ready') or {}).get('status')}")
    unready += [f"{'/'.join(owners)}: {sum(replicas)} of its {len(replicas)} leader-electing replicas Ready "
                "(the elected leader alone should be)" for owners, replicas in electing.items() if sum(replicas) != 1]
    return unready, standing_by
