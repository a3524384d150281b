"""Live traffic on the twin: an environment's release tracks served by processes at their pods'
addresses, scraped by a real Prometheus in the pod network, and a client that sends requests
throughout, as the access path routes them.

- `TrackProcesses`: what a kubelet does for the tracks' pods, continuously. Every runnable pod
  (twin/pods.py runs_as) of the environment's namespace and of its release tracks'
  (`<namespace>-r<revision>`) is started as a process once it has its IP, and its process is
  ended once the pod is gone (a retired track), so a rollout's new track serves as it comes up.
  The engines' token timing follows the fleet model per engine build (PodProcesses.token_timing:
  image -> TTFT and ITL), so a revision that names a slow build is slow.
- `PodPrometheus`: the real Prometheus (the machine's `prometheus`, as tests/servers.py runs it) at an
  address of the pod network, scraping the engine pods each namespace's rendered PodMonitor
  selects, on its endpoint's port and path, with the series labels prometheus-operator gives a
  PodMonitor's targets (namespace, pod, container, endpoint, job `podMonitor/<ns>/<name>/0`, and each
  of its podTargetLabels as a label: prometheus-operator v0.93.0 pkg/prometheus/promcfg.go). The
  targets are a file_sd file this module writes from the started pods, not Kubernetes service
  discovery: the twin's own choice, until twin/monitoring.py runs the operator's generated config.
  Its API is forwarded to 127.0.0.1, where `pdctl rollout --prometheus` reads it.
- `LiveClient`: the access path's entry as the twin has it. No Envoy proxy runs on the twin (README,
  "Cluster twin"), so the client does what Envoy's weighted backends would: each request goes to
  one of the live HTTPRoute's backendRefs, chosen by weight (read from the API server every
  ROUTE_POLL_SECONDS, a stand-in for Envoy Gateway's push), then to a ready endpoint of that
  track's router Service (its EndpointSlices, as kube-proxy would pick one), through the pod
  network. Each answer is recorded with the track it was sent to and the track whose prefill
  served it (the SGLang decode names the prefill whose bootstrap server handed it the room).

`share_back` and `shares` read the client's records: pure.
"""

from __future__ import annotations

import ipaddress
import json
import random
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra import naming
from infra.render.metrics import series_label
from infra.rollout.pulumi_cluster import traffic_from_route
from twin import pods
from twin.api import POD_CIDR, TwinError, kubectl

ROUTE_POLL_SECONDS = 0.3
PROMETHEUS_IP = str(ipaddress.ip_network(POD_CIDR, strict=False).broadcast_address - 1)  # above every address kwok gives out
PROMETHEUS_PORT = 9090
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


# --- the scrape ---------------------------------------------------------------------------------

def monitor_targets(pod_monitor: dict, running: list[tuple[pods.Started, dict]]) -> list[dict]:
    """file_sd target groups for the pods `pod_monitor` (as rendered and applied) selects, with the
    labels prometheus-operator gives its targets. Pure."""
    meta, spec = pod_monitor["metadata"], pod_monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    groups = []
    for started, pod in running:
        labels = pod["metadata"].get("labels", {})
        if pod["metadata"]["namespace"] != meta["namespace"] or not _selects(spec["selector"], labels):
            continue
        container, port = next(((c["name"], p["containerPort"]) for c in pod["spec"]["containers"]
                                for p in c.get("ports", []) if p.get("name") == endpoint["port"]), (None, None))
        if port is None:
            continue
        target = {"namespace": meta["namespace"], "pod": pod["metadata"]["name"], "container": container,
                  "endpoint": endpoint["port"], "job": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
                  "__metrics_path__": endpoint.get("path", "/metrics")}
        target.update({series_label(k): labels[k] for k in spec.get("podTargetLabels", []) if k in labels})
        groups.append({"targets": [f"{started.ip}:{port}"], "labels": target})
    return groups


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present, value = expression["key"] in labels, labels.get(expression["key"])
        operator = expression["operator"]
        if (operator == "In" and value not in expression["values"]) or \
           (operator == "NotIn" and value in expression["values"]) or \
           (operator == "Exists" and not present) or (operator == "DoesNotExist" and present):
            return False
    return True


@contextmanager
def pod_prometheus(tracks: TrackProcesses, folder: Path, scrape_seconds: float = 1.0):
    """A real Prometheus at PROMETHEUS_IP in the pod network, scraping what the tracks' PodMonitors
    select (targets rewritten every second); yields its API's URL on 127.0.0.1."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise TwinError("prometheus is not installed: run `make test` (scripts/install-system-deps installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    targets = folder / "targets.json"
    targets.write_text("[]")
    config = {"global": {"scrape_interval": f"{scrape_seconds:g}s", "evaluation_interval": f"{scrape_seconds:g}s"},
              "scrape_configs": [{"job_name": "podmonitors", "honor_labels": False,
                                  "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    network = tracks.processes.network
    holder = network.attach(PROMETHEUS_IP, folder / "netns.log")
    log = open(folder / "prometheus.log", "ab")
    server = subprocess.Popen(["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--", binary,
                               f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                               f"--web.listen-address={PROMETHEUS_IP}:{PROMETHEUS_PORT}"],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    listener, port = pods.forward(network.client_socket, PROMETHEUS_IP, PROMETHEUS_PORT)
    stopping = threading.Event()

    def write_targets() -> None:
        while not stopping.wait(1.0):
            try:
                monitors = [m for m in json.loads(kubectl("get", "podmonitors.monitoring.coreos.com",
                                                          "--all-namespaces", "-o", "json").stdout)["items"]
                            if track_of(m["metadata"]["namespace"], tracks.namespace) is not None]
                groups = [g for m in monitors for g in monitor_targets(m, tracks.running())]
                scratch = targets.with_suffix(".tmp")
                scratch.write_text(json.dumps(groups))
                scratch.replace(targets)  # Prometheus reads the whole file or none of it
            except (TwinError, ValueError):
                pass

    writer = threading.Thread(target=write_targets, daemon=True)
    writer.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if pods.request(network.client_socket, PROMETHEUS_IP, PROMETHEUS_PORT, "/-/ready", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise TwinError(f"Prometheus did not start at {PROMETHEUS_IP}: {pods._tail(folder / 'prometheus.log')}")
            time.sleep(0.5)
        yield url
    finally:
        stopping.set()
        writer.join(timeout=30)
        listener.close()
        pods._stop(server)
        pods._stop(holder)
        log.close()


# --- the client -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    started: float  # time.monotonic()
    finished: float
    sent_to: int | None  # the track (revision) the route's weights chose; None: no route yet
    answered_by: int | None  # the track whose prefill served it
    ok: bool
    detail: str = ""


class LiveClient:
    """Requests sent throughout by `workers` threads, each to the track the live route's weights
    pick (see the module); every answer kept in `answers`."""

    def __init__(self, tracks: TrackProcesses, model: str, workers: int = 3):
        self.tracks, self.model, self.workers = tracks, model, workers
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.routes: tuple[dict[int, int], dict[int, list[tuple[str, int]]]] = ({}, {})
        self.route_changes: list[tuple[float, dict[int, int]]] = []  # (when the client saw it, the weights)
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._poll_route, daemon=True)] + [
            threading.Thread(target=self._send, args=(n,), daemon=True) for n in range(workers)]

    def __enter__(self) -> LiveClient:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)

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
        """Until `done(answers)` holds for the answers so far (TwinError naming `what` if not)."""
        deadline = time.monotonic() + timeout
        while not done(self.since(0)):
            self.tracks.check()
            if time.monotonic() > deadline:
                raise TwinError(f"the client's answers never showed {what} within {timeout:.0f} s")
            time.sleep(0.2)


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

