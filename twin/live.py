"""Live traffic on the twin: an environment's release tracks served by processes at their pods'
addresses, scraped by the fleet's Prometheus in the pod network, and a client that sends requests
throughout, as the access path routes them; and dev's scenario on it (`live_dev`), shared by
tests/twin/test_live_rollout_on_twin.py and scripts/bench_rollback.py --twin.

- `TrackProcesses`: what a kubelet does for the tracks' pods, continuously. Every runnable pod
  (twin/pods.py runs_as) of the environment's namespace and of its release tracks'
  (`<namespace>-r<revision>`) is started as a process once it has its IP, and its process is
  ended once the pod is gone (a retired track), so a rollout's new track serves as it comes up.
  The engines' token timing follows the fleet model per engine build (PodProcesses.token_timing:
  image -> TTFT and ITL), so a revision that names a slow build is slow.
- The scrape: the Prometheus prometheus-operator makes of the platform's Prometheus and each
  track's rendered monitors, at its pod address among the tracks' (twin/monitoring.py
  fleet_prometheus); its API forwarded to 127.0.0.1, where `pdctl rollout --prometheus` reads it.
- `LiveClient`: the access path's entry as the twin has it. No Envoy proxy runs on the twin (README,
  "Cluster twin"), so the client does what Envoy's weighted backends would: each request goes to
  one of the live HTTPRoute's backendRefs, chosen by weight (read from the API server every
  ROUTE_POLL_SECONDS, a stand-in for Envoy Gateway's push), then to a ready endpoint of that
  track's router Service (its EndpointSlices, as kube-proxy would pick one), through the pod
  network. Each answer is recorded with the track it was sent to and the track whose prefill
  served it (the SGLang decode names the prefill whose bootstrap server handed it the room).
- `live_dev`: dev (SGLang) on the twin with all of the above, `pdctl rollout --pulumi-stack dev` and
  `pdctl rollback` run by the real Pulumi engine (twin/engine.py) against it. What stands in:
  twin/standins.py writes the status Envoy Gateway and Karpenter's AWS provider would; the platform
  stack is twin/engine.py's stand-in.

The fleet model per engine build (PodProcesses.token_timing): the revision's engine image decides its
stand-ins' token timing. The stack's pinned build answers with TTFT GOOD_TTFT_MS and ITL GOOD_ITL_MS,
each in the middle of a wide bucket of SGLang 0.5.23's histograms (TTFT (1, 2] s, ITL (0.4, 0.6] s),
so that a busy two-core machine's delays (a first run saw ITL p99 136 ms for 16 ms asked) stay in
it: the gate's p99 of two healthy tracks is then the same bucket's edge, and "vs serving" compares
like with like. dev's TPOT SLO (50 ms) is raised to TWIN_TPOT_SLO_MS for that (and its tokens per
second per user to what that allows); its TTFT SLO (2 s) stays. `slow_build` names another digest of
the same image, whose stand-ins take SLOW_TTFT_MS to the first token, above that SLO. The monitors'
and Prometheus's intervals are SCRAPE_INTERVAL (dev's spec field observability.scrape_interval_seconds,
the platform Prometheus's own fields), so a stage's window holds enough samples.

`share_back` and `shares` read the client's records: pure.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from infra import naming
from infra.rollout.pulumi_cluster import traffic_from_route
from infra.rollout.releases import ReleaseStore
from infra.spec import REPO_ROOT, stack_spec_path
from twin import engine, fleet, monitoring, pods
from twin.api import TwinError, kubectl
from twin.build import program
from twin.clients import ThreadClient
from twin.nodes import TWIN_LABEL, stack_nodes
from twin.paths import KUBECONFIG
from twin.standins import controllers_status

ROUTE_POLL_SECONDS = 0.3
# A worker's pause after a failed request: SGLang's router answers 503 within a millisecond while its
# circuit to every prefill is open, and six workers asking again at once kept a loaded two-core machine
# busy with 14,000 refusals in two minutes (one run, load average 65).
FAILED_PAUSE_SECONDS = 0.5
ANSWERED_BY = re.compile(r"prefill (\d+\.\d+\.\d+\.\d+):")


def track_of(namespace: str, environment_namespace: str) -> int | None:
    """The revision a namespace serves (0: the environment's own, deployed without tracks)."""
    if namespace == environment_namespace:
        return 0
    match = re.fullmatch(re.escape(environment_namespace) + r"-r(\d+)", namespace)
    return int(match.group(1)) if match else None


class TrackProcesses:
    """The environment's and its tracks' runnable pods, kept running as processes (see the module)."""

    def __init__(self, environment_namespace: str, token_timing: dict[str, dict[str, str]] | None = None,
                 folder: Path | None = None):
        self.namespace = environment_namespace
        self.processes = pods.PodProcesses(folder=folder)
        self.processes.token_timing.update(token_timing or {})
        self.by_uid: dict[str, tuple[pods.Started, dict]] = {}
        self.lock = threading.Lock()
        self.failed: list[str] = []  # a process that exited while its pod still existed, with its reason
        self.refused: set[str] = set()  # pods whose process could not be started (in `failed`)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TrackProcesses:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)
        self.processes.stop()

    def _loop(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                self.sync()
            except TwinError:  # the API server busy: the next round
                pass

    def sync(self) -> None:
        listed = json.loads(kubectl("get", "pods", "--all-namespaces", "-o", "json").stdout)["items"]
        mine = {p["metadata"]["uid"]: p for p in listed if track_of(p["metadata"]["namespace"], self.namespace)
                is not None and "deletionTimestamp" not in p["metadata"]}
        with self.lock:
            for uid in [u for u in self.by_uid if u not in mine]:
                started, _ = self.by_uid.pop(uid)
                self.processes.stop_pod(started)
            for uid, pod in mine.items():
                if uid in self.by_uid or uid in self.refused or not pods.runs_as(pod) \
                        or not pod.get("status", {}).get("podIP"):
                    continue
                try:
                    self.by_uid[uid] = (self.processes.start_pod(pod), pod)
                except TwinError as exc:  # what a kubelet would not start either: said, not retried
                    self.refused.add(uid)
                    self.failed.append(f"{pod['metadata']['namespace']}/{pod['metadata']['name']} not started: {exc}")
            for started, _ in self.by_uid.values():
                if started.process.poll() is not None:
                    reason = f"{started.namespace}/{started.name} exited: {pods._tail(started.log, 5)}"
                    if reason not in self.failed:
                        self.failed.append(reason)

    def check(self) -> None:
        """Raise if a started process has exited while its pod is there, with its reason."""
        if self.failed:
            raise TwinError("; ".join(self.failed))

    def running(self) -> list[tuple[pods.Started, dict]]:
        with self.lock:
            return list(self.by_uid.values())

    def namespace_of(self, ip: str) -> str | None:
        return next((s.namespace for s, _ in self.running() if s.ip == ip), None)


# --- the client -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    started: float  # time.monotonic()
    finished: float
    sent_to: int | None  # the track (revision) the route's weights chose; None: no route yet
    answered_by: int | None  # the track whose prefill served it
    ok: bool
    detail: str = ""


class LiveClient(ThreadClient):
    """Requests sent throughout by `workers` threads, each to the track the live route's weights
    pick (see the module), and one thread following the route; every answer kept in `answers`."""

    def __init__(self, tracks: TrackProcesses, model: str, workers: int = 3):
        super().__init__([self._poll_route] + [functools.partial(self._send, n) for n in range(workers)],
                         join_seconds=90)
        self.tracks, self.model = tracks, model
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.routes: tuple[dict[int, int], dict[int, list[tuple[str, int]]]] = ({}, {})
        self.route_changes: list[tuple[float, dict[int, int]]] = []  # (when the client saw it, the weights)

    def _poll_route(self) -> None:
        namespace = self.tracks.namespace
        while not self.stopping.is_set():
            try:
                got = kubectl("get", "httproute", naming.GATEWAY, "-n", namespace, "-o", "json", check=False)
                route = json.loads(got.stdout) if got.returncode == 0 else {}
                weights = traffic_from_route(route, namespace) if route else {}
                endpoints = {}
                for rule in route.get("spec", {}).get("rules", []):
                    for ref in rule.get("backendRefs", []):
                        revision = track_of(ref.get("namespace", namespace), namespace)
                        if revision in weights:
                            endpoints[revision] = service_endpoints(ref.get("namespace", namespace), ref["name"],
                                                                    ref["port"])
                self.routes = (weights, endpoints)
                if not self.route_changes or self.route_changes[-1][1] != weights:
                    self.route_changes.append((time.monotonic(), weights))
            except (TwinError, ValueError, KeyError):
                pass
            self.stopping.wait(ROUTE_POLL_SECONDS)

    def _send(self, n: int) -> None:
        chooser = random.Random(n)
        body = {"model": self.model, "messages": [{"role": "user", "content": "Say hello from the twin."}],
                "max_tokens": 2}  # a first token and one more: TTFT and one inter-token latency each
        while not self.stopping.is_set():
            weights, endpoints = self.routes
            live = {r: w for r, w in weights.items() if endpoints.get(r)}
            if not live:  # nothing routed yet (before the first rollout opens access): not a request
                self.stopping.wait(0.2)
                continue
            revision = chooser.choices(list(live), weights=list(live.values()))[0]
            ip, port = chooser.choice(endpoints[revision])
            started = time.monotonic()
            try:
                status, text = self.tracks.processes.request(ip, port, "/v1/chat/completions", body, timeout=60)
                found = ANSWERED_BY.search(text) if status == 200 else None
                namespace = self.tracks.namespace_of(found.group(1)) if found else None
                by = track_of(namespace, self.tracks.namespace) if namespace else None
                answer = Answer(started, time.monotonic(), revision, by, status == 200,
                                "" if status == 200 else f"{status} {text[:200]}")
            except OSError as exc:
                answer = Answer(started, time.monotonic(), revision, None, False, str(exc))
            with self.lock:
                self.answers.append(answer)
            if not answer.ok:  # a router refusing at once (no worker: 503) is not to become a busy loop
                self.stopping.wait(FAILED_PAUSE_SECONDS)

    def since(self, moment: float) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if a.started >= moment]

    def while_routed(self, weights: dict[int, int]) -> list[Answer]:
        """The answers to requests sent while the route the client followed had `weights`."""
        changes = self.route_changes + [(float("inf"), {})]
        spans = [(at, changes[i + 1][0]) for i, (at, seen) in enumerate(changes[:-1]) if seen == weights]
        with self.lock:
            return [a for a in self.answers if any(start <= a.started < end for start, end in spans)]

    def wait_for(self, what: str, done, timeout: float = 120) -> None:
        """Until `done(answers)` holds for the answers so far (TwinError naming `what` if not, or a
        track's process that exited)."""
        fleet.wait_for(f"the client's answers showing {what}", lambda: self.tracks.check() or done(self.since(0)),
                       timeout, 0.2, required=True)


def service_endpoints(namespace: str, service: str, port: int) -> list[tuple[str, int]]:
    """The ready (address, port) pairs behind `service`'s port `port`: its EndpointSlices, as
    kube-proxy reads them (the Service's port name picks the slice's port)."""
    svc = json.loads(kubectl("get", "service", service, "-n", namespace, "-o", "json").stdout)
    name = next((p.get("name", "") for p in svc["spec"]["ports"] if p["port"] == port), None)
    if name is None:
        return []
    slices = json.loads(kubectl("get", "endpointslices", "-n", namespace, "-l",
                                f"kubernetes.io/service-name={service}", "-o", "json").stdout)["items"]
    found = []
    for piece in slices:
        number = next((p["port"] for p in piece.get("ports") or [] if p.get("name", "") == name), None)
        found += [(address, number) for e in piece.get("endpoints") or [] if number is not None
                  and e.get("conditions", {}).get("ready") for address in e["addresses"]]
    return found


# --- reading the answers (pure) --------------------------------------------------------------------

def shares(answers: list[Answer]) -> dict[int | None, float]:
    """The part of the answers each track served."""
    served = [a.answered_by for a in answers if a.ok]
    return {track: served.count(track) / len(served) for track in sorted(set(served), key=str)} if served else {}


def share_back(answers: list[Answer], revision: int, since: float) -> float | None:
    """Seconds from `since` until the client's share on `revision` was back at 100%: until the start
    of the first request after which every answered request was answered by `revision` (the
    requests started before it may still have gone elsewhere). None if the last answer is not
    `revision`'s (not back yet)."""
    ordered = sorted((a for a in answers if a.ok and a.started >= since), key=lambda a: a.started)
    if not ordered or ordered[-1].answered_by != revision:
        return None
    others = [i for i, a in enumerate(ordered) if a.answered_by != revision]
    first_all = ordered[others[-1] + 1] if others else ordered[0]
    return first_all.started - since



# --- dev's scenario: rollouts and rollbacks on live traffic -----------------------------------------

# SGLang 0.5.23's buckets (twin/engine_standin.py BUCKETS): TTFT 1.2 s in (1, 2], ITL 0.5 s in (0.4, 0.6],
# the slow build's TTFT 3 s in (2, 4]
GOOD_TTFT_MS, GOOD_ITL_MS, SLOW_TTFT_MS, TWIN_TPOT_SLO_MS = 1200, 500, 3000, 1000
SCRAPE_INTERVAL_SECONDS = 1
# A stage's window holds only that stage's traffic, and enough of it that one slow KV transfer on a busy
# machine is not the p99 of the canary's few (a window of 25 s with 4 clients failed r2 on it once).
GATES = ["--bake", "45", "--window", "40s"]


def pdctl(args: list[str], tracks: TrackProcesses, environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pdctl <args>` (with `environment` added to this process's), ended (and the failure raised) if
    one of the tracks' processes exits meanwhile."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = subprocess.Popen([sys.executable, "-m", "infra.cli", *args], cwd=REPO_ROOT, stdout=out, stderr=err,
                                   text=True, env={**os.environ, **(environment or {})})
        try:
            while command.poll() is None:
                tracks.check()
                time.sleep(1)
        finally:
            if command.poll() is None:
                command.kill()
                command.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command.args, command.returncode, out.read(), err.read())


@dataclass
class LiveDev:
    spec_data: dict  # dev's deployable spec (placeholder images pinned to stand-in digests)
    folder: Path
    base_spec: Path  # the Pulumi project's spec file
    target: list[str]  # --pulumi-stack, --pulumi-project, --releases
    prometheus: str
    store: ReleaseStore
    tracks: TrackProcesses
    client: LiveClient

    def spec_file(self, name: str, change=lambda data: None) -> Path:
        """dev's spec as a revision to roll out: `change(data)` edits a copy of it."""
        data = yaml.safe_load(yaml.safe_dump(self.spec_data))
        change(data)
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def rollout(self, spec_file: Path, stages: str, environment: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
        """`pdctl rollout` of `spec_file`, judged by the fleet's Prometheus (GATES); `environment`:
        added to pdctl's (e.g. infra/rollout/faultpoints.py's PDSTACK_FAULT_AT)."""
        return pdctl(["rollout", "--spec", str(spec_file), *self.target, "--prometheus", self.prometheus,
                      "--stages", stages, *GATES], self.tracks, environment)

    def abort(self) -> subprocess.CompletedProcess:
        return pdctl(["rollout", "--spec", str(self.base_spec), *self.target, "--abort"], self.tracks)

    def rollback(self, *to: str) -> subprocess.CompletedProcess:
        return pdctl(["rollback", "--spec", str(self.base_spec), *self.target, *to], self.tracks)


def retuned_router(data: dict) -> None:
    """A good revision: only the router's cache-aware threshold changes."""
    data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = 0.6


def slow_build(data: dict) -> None:
    """The engine image rebuilt: another digest of the same reference (the fleet model makes it slow)."""
    image = data["images"]["engines"][data["engine"]["kind"]]
    ref = image["image"].split("@")[0]
    digest = "sha256:" + hashlib.sha256(f"{ref} slow build".encode()).hexdigest()
    old = image["image"].split("@")[1]
    image["image"] = f"{ref}@{digest}"
    data["images"]["platforms"][digest] = data["images"]["platforms"][old]


def engine_image(data: dict) -> str:
    return data["images"]["engines"][data["engine"]["kind"]]["image"]


def twin_spec(data: dict) -> None:
    """dev's spec as the twin serves it (the module's docstring): the TPOT SLO the healthy stand-ins'
    ITL meets on a busy machine, and the monitors' interval a stage's window holds samples of."""
    data["slo"].update(tpot_p99_ms=TWIN_TPOT_SLO_MS, tokens_per_second_per_user=1000 // TWIN_TPOT_SLO_MS)
    data["observability"]["scrape_interval_seconds"] = SCRAPE_INTERVAL_SECONDS


@contextmanager
def live_dev(folder: Path, workers: int = 6) -> Iterator[LiveDev]:
    """dev's nodes, user objects and Pulumi project on the twin (the twin must be up), the platform's
    Prometheus run by prometheus-operator at its pod address, dev's tracks' pods kept running and the
    client sending requests; everything removed afterwards. TwinError if the engine is not built."""
    from infra.platform_stack.spec import load_platform_spec
    from infra.spec_checks import load_spec
    from infra.tracks import track_namespace

    missing = engine.missing_engine()
    if missing:
        raise TwinError(missing)
    spec = engine.stand_in_pins(load_spec(stack_spec_path("dev")))  # deployable: the policy pack refuses placeholders
    platform = load_platform_spec(REPO_ROOT / spec.platform.spec)
    env_ns = spec.environment.namespace
    namespaces = [env_ns, *[track_namespace(env_ns, r) for r in range(1, 12)]]
    fleet.delete_namespaces(namespaces)  # what an earlier run of dev left, so that this one starts from nothing
    nodes = fleet.apply_each_pass(stack_nodes(spec))
    if nodes.rejected:
        raise TwinError(f"dev's nodes refused: {nodes.rejected}")
    fleet.users_objects(spec)
    project = engine.engine_project(folder, "dev", KUBECONFIG)
    data = yaml.safe_load(project.spec_file.read_text())
    twin_spec(data)
    project.spec_file.write_text(yaml.safe_dump(data))
    slow = yaml.safe_load(yaml.safe_dump(data))
    slow_build(slow)
    timing = {engine_image(data): {"TWIN_STANDIN_TTFT_MS": str(GOOD_TTFT_MS), "TWIN_STANDIN_ITL_MS": str(GOOD_ITL_MS)},
              engine_image(slow): {"TWIN_STANDIN_TTFT_MS": str(SLOW_TTFT_MS), "TWIN_STANDIN_ITL_MS": str(GOOD_ITL_MS)}}
    releases = folder / "releases"
    target = ["--pulumi-stack", "dev", "--pulumi-project", str(project.work_dir), "--releases", str(releases)]
    # pdctl's kubectl: the twin's
    environment = {**project.environment,
                   "PATH": str(program("kubectl").parent) + os.pathsep + project.environment["PATH"]}
    try:
        with engine.environment(environment):
            engine.platform_stand_in(project)
            engine.program_stack(project, engine.serving_program(folder))  # `pulumi stack init dev`: the rollout selects it
            with controllers_status(env_ns, spec.environment.name), \
                    monitoring.platform_prometheus(platform, f"{SCRAPE_INTERVAL_SECONDS}s"), \
                    TrackProcesses(env_ns, timing) as tracks, \
                    monitoring.fleet_prometheus(tracks.processes, platform.monitoring_namespace) as prometheus, \
                    LiveClient(tracks, spec.model.name, workers) as client:
                yield LiveDev(data, folder, project.spec_file, target, prometheus, ReleaseStore("dev", releases),
                              tracks, client)
    finally:
        fleet.delete_namespaces(namespaces)
        kubectl("delete", "nodepools.karpenter.sh", "-l", f"pdstack.io/environment={spec.environment.name}",
                "--ignore-not-found", "--wait=false")
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


def timed_rollback(env: LiveDev, to: int, *args: str, after: int = 20) -> tuple[float, float, list[Answer]]:
    """`pdctl rollback` (with `args`) to revision `to`, timed from the command's start to the client's
    share on `to` back at 100% (share_back), with `after` answers more once the command returned to
    show it stays there. (command seconds, share-back seconds, the answers since the command);
    TwinError if the command fails or the share is not back."""
    started = time.monotonic()
    done = env.rollback(*args)
    command = time.monotonic() - started
    if done.returncode:
        raise TwinError(f"pdctl rollback to r{to} failed ({done.returncode}): {done.stderr[-3000:]}")
    returned = time.monotonic()
    env.client.wait_for(f"{after} answers after the rollback to r{to}",
                        lambda answers: sum(a.started > returned for a in answers) >= after)
    answers = env.client.since(started)
    back = share_back(answers, to, started)
    if back is None:
        raise TwinError(f"the client's share is not back on r{to}: {shares(answers)}")
    return command, back, answers
