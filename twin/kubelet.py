"""The twin's kubelet: the checks a kubelet makes before it starts a pod's containers, and the
probes it runs after, for every pod bound to a kwok node. kwok starts no container; without
this, its stages marked every bound pod Running and Ready at once, whatever it referenced.

The rules are the kubelet's at the pinned Kubernetes (k8s.io/kubernetes v1.34.4):
- volumes, before any container (pkg/kubelet/kubelet.go SyncPod: WaitForAttachAndMount; a
  failure is a FailedMount event and the containers stay waiting, ContainerCreating, or
  PodInitializing when the pod has init containers, pkg/kubelet/kubelet_pods.go
  convertToAPIContainerStatuses): a secret volume's Secret and each item's key
  (pkg/volume/secret/secret.go SetUpAt, MakePayload), a configMap volume's ConfigMap and each
  item's key in data or binaryData (pkg/volume/configmap/configmap.go SetUpAt, MakePayload),
  each projected source the same way and a serviceAccountToken source's ServiceAccount (the
  token request fails without it), errors aggregated (pkg/volume/projected/projected.go
  collectData); a PVC that exists and is Bound (pkg/kubelet/volumemanager/populator/
  desired_state_of_world_populator.go getPVCExtractPV). `optional: true` excuses a missing
  object or key. The event reads "MountVolume.SetUp failed for volume ..." as
  pkg/volume/util/operationexecutor/operation_executor.go GenerateError writes it.
- each container's environment, init containers first and in order (pkg/kubelet/kubelet_pods.go
  makeEnvironmentVariables: envFrom's ConfigMap and Secret, then env's configMapKeyRef and
  secretKeyRef with their keys in `data`; pkg/kubelet/kuberuntime/kuberuntime_container.go
  startContainer: the error is the container's waiting message with the reason
  CreateContainerConfigError, and a `Failed` event "Error: ..."). A not-found reads as the
  kubelet's secret and configmap managers name it (`secret "x" not found`,
  pkg/kubelet/secret/secret_manager.go, pkg/kubelet/configmap/configmap_manager.go).
- imagePullSecrets: a missing one is only a FailedToRetrieveImagePullSecret warning, and the
  pod starts (pkg/kubelet/kubelet_pods.go getPullSecretsForPod).
A pod that fails stays Pending and not Ready, with the reason in its container statuses; the
checks run again every round, as a kubelet retries, so a Secret made later lets it start.

Gating: a pod that passes gets the condition CONDITION True, and kwok's own pod-ready stage is
narrowed to pods that carry it (`ready_stages`): kwok still writes Running and Ready, as
before, but never before these checks pass. A pod something really serves (annotated PROCESS
by what starts its process at the pod's address) gets kwok's Running with Ready False instead,
and readiness follows its rendered startupProbe and readinessProbe, each run by `Prober` with
its own period and thresholds (pkg/kubelet/prober). A pod with no process keeps kwok's Ready
once its start checks pass.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import ssl
import sys
import threading
import traceback
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from twin import netns
from twin.api import POD_CIDR
from twin.paths import RUN_DIR

CONDITION = "twin.pdstack.io/start-checks"  # a pod condition: the twin's kubelet's start checks passed
PROCESS = "twin.pdstack.dev/process"  # an annotation (twin/pods.py sets it): a process serves this pod
CONFIG_ERROR = "CreateContainerConfigError"
KIND_PATHS = {"secret": "secrets", "configmap": "configmaps", "persistentvolumeclaim": "persistentvolumeclaims",
              "serviceaccount": "serviceaccounts"}


# --- the start checks: pure functions of a pod and a lookup -----------------------------------

@dataclass(frozen=True)
class Failure:
    """One thing the kubelet would refuse. `container` is None for the pod's volumes."""
    container: str | None
    init: bool
    message: str

    @property
    def reason(self) -> str:
        return CONFIG_ERROR if self.container else "FailedMount"


@dataclass(frozen=True)
class Verdict:
    volumes: tuple[str, ...] = ()  # FailedMount event messages
    containers: tuple[Failure, ...] = ()  # the first init container that fails, or every regular one
    warnings: tuple[tuple[str, str], ...] = ()  # (event reason, message): the pod still starts

    @property
    def passed(self) -> bool:
        return not self.volumes and not self.containers

    def summary(self) -> str:
        """One line: the kubelet's reason and message, as the tests print it."""
        if self.volumes:
            return "ContainerCreating: FailedMount: " + "; ".join(self.volumes)
        return "; ".join(f"{'Init:' if f.init else ''}{CONFIG_ERROR} ({f.container}): {f.message}"
                         for f in self.containers)


def _optional(ref: dict) -> bool:
    return bool(ref.get("optional"))


def _not_found(kind: str, name: str) -> str:
    return f'{kind} "{name}" not found'


def _keys_error(kind: str, obj: dict | None, items: list[dict], optional: bool) -> str | None:
    """A secret or configMap volume source's items against the object (MakePayload)."""
    keys = set((obj or {}).get("data") or {})
    if kind == "configmap":
        keys |= set((obj or {}).get("binaryData") or {})
    for item in items or ():
        if item["key"] not in keys and not optional:
            return (f"references non-existent secret key: {item['key']}" if kind == "secret"
                    else f"configmap references non-existent config key: {item['key']}")
    return None


def _source_error(kind: str, source: dict, name_field: str, namespace: str, get) -> str | None:
    name = source.get(name_field, "")
    obj = get(kind, namespace, name)
    if obj is None and not _optional(source):
        return _not_found(kind, name)
    return _keys_error(kind, obj, source.get("items"), _optional(source))


def volume_errors(pod: dict, get) -> tuple[str, ...]:
    """FailedMount messages, one per volume that cannot be set up."""
    namespace = pod["metadata"]["namespace"]
    out = []
    for volume in pod["spec"].get("volumes") or ():
        errors = []
        if "secret" in volume:
            errors.append(_source_error("secret", volume["secret"], "secretName", namespace, get))
        elif "configMap" in volume:
            errors.append(_source_error("configmap", volume["configMap"], "name", namespace, get))
        elif "projected" in volume:
            for source in volume["projected"].get("sources") or ():
                if "secret" in source:
                    errors.append(_source_error("secret", source["secret"], "name", namespace, get))
                elif "configMap" in source:
                    errors.append(_source_error("configmap", source["configMap"], "name", namespace, get))
                elif "serviceAccountToken" in source:
                    account = pod["spec"].get("serviceAccountName") or "default"
                    if get("serviceaccount", namespace, account) is None:
                        errors.append(f'serviceaccounts "{account}" not found')
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = get("persistentvolumeclaim", namespace, claim)
            why = (f"failed to fetch PVC from API server: persistentvolumeclaims \"{claim}\" not found"
                   if pvc is None else None if (pvc.get("status") or {}).get("phase") == "Bound"
                   else "PVC is not bound")
            if why:
                out.append(f"error processing PVC {namespace}/{claim}: {why}")
            continue
        errors = [e for e in errors if e]
        if errors:  # utilerrors.NewAggregate: one error as itself, several in brackets
            said = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            out.append(f'MountVolume.SetUp failed for volume "{volume["name"]}" : {said}')
    return tuple(out)


def env_error(pod: dict, container: dict, get) -> str | None:
    """makeEnvironmentVariables' error for one container, or None."""
    namespace = pod["metadata"]["namespace"]
    for source in container.get("envFrom") or ():
        for field_name, kind in (("configMapRef", "configmap"), ("secretRef", "secret")):
            ref = source.get(field_name)
            if ref is not None and get(kind, namespace, ref.get("name", "")) is None and not _optional(ref):
                return _not_found(kind, ref.get("name", ""))
    for env in container.get("env") or ():
        if env.get("value") or not env.get("valueFrom"):
            continue
        for field_name, kind, title in (("configMapKeyRef", "configmap", "ConfigMap"),
                                        ("secretKeyRef", "secret", "Secret")):
            ref = env["valueFrom"].get(field_name)
            if ref is None:
                continue
            obj = get(kind, namespace, ref.get("name", ""))
            if obj is None:
                if not _optional(ref):
                    return _not_found(kind, ref.get("name", ""))
            elif ref["key"] not in (obj.get("data") or {}) and not _optional(ref):
                return f"couldn't find key {ref['key']} in {title} {namespace}/{ref.get('name', '')}"
    return None


def start_checks(pod: dict, get) -> Verdict:
    """What a kubelet finds before it starts this pod's containers. `get(kind, namespace, name)`
    returns the object (kind: secret, configmap, persistentvolumeclaim, serviceaccount) or None."""
    spec = pod["spec"]
    namespace = pod["metadata"]["namespace"]
    missing_pull = [ref["name"] for ref in spec.get("imagePullSecrets") or ()
                    if get("secret", namespace, ref["name"]) is None]
    warnings = ((("FailedToRetrieveImagePullSecret",
                  f"Unable to retrieve some image pull secrets ({', '.join(missing_pull)}); "
                  "attempting to pull the image may not succeed."),) if missing_pull else ())
    volumes = volume_errors(pod, get)
    if volumes:
        return Verdict(volumes=volumes, warnings=warnings)
    for container in spec.get("initContainers") or ():  # one at a time, in order
        said = env_error(pod, container, get)
        if said:
            return Verdict(containers=(Failure(container["name"], True, said),), warnings=warnings)
    failures = tuple(Failure(c["name"], False, said) for c in spec["containers"]
                     if (said := env_error(pod, c, get)))
    return Verdict(containers=failures, warnings=warnings)


def failed_status(pod: dict, verdict: Verdict, now: str) -> dict:
    """The status a kubelet reports for a pod it cannot start (a strategic merge patch)."""
    spec = pod["spec"]
    has_init = bool(spec.get("initContainers"))
    waiting_default = "PodInitializing" if has_init else "ContainerCreating"
    failing = {f.container: f for f in verdict.containers}
    init_failed = any(f.init for f in verdict.containers)

    def status_of(container: dict, init: bool) -> dict:
        failure = failing.get(container["name"])
        if failure:
            state = {"waiting": {"reason": CONFIG_ERROR, "message": failure.message}}
        elif verdict.containers and not init and not init_failed:  # the kubelet started the others
            return {"name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                    "restartCount": 0, "started": True, "state": {"running": {"startedAt": now}}}
        elif init and verdict.containers and not init_failed:  # the init containers completed
            state = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}}
        else:
            state = {"waiting": {"reason": waiting_default}}
        return {"name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                "restartCount": 0, "started": False, "state": state}

    not_ready = [c["name"] for c in spec["containers"]]
    reason = verdict.volumes and "FailedMount" or CONFIG_ERROR
    conditions = [
        {"type": CONDITION, "status": "False", "reason": reason, "message": verdict.summary(),
         "lastTransitionTime": now},
        {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady",
         "message": f"containers with unready status: [{' '.join(not_ready)}]", "lastTransitionTime": now},
        {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
         "message": f"containers with unready status: [{' '.join(not_ready)}]", "lastTransitionTime": now}]
    if has_init:
        pending = [c["name"] for c in spec["initContainers"]] if (verdict.volumes or init_failed) else []
        conditions.append({"type": "Initialized", "status": "False" if pending else "True", "lastTransitionTime": now,
                           **({"reason": "ContainersNotInitialized",
                               "message": f"containers with incomplete status: [{' '.join(pending)}]"}
                              if pending else {})})
    status = {"phase": "Pending", "conditions": conditions,
              "containerStatuses": [status_of(c, False) for c in spec["containers"]]}
    if has_init:
        status["initContainerStatuses"] = [status_of(c, True) for c in spec["initContainers"]]
    return {"status": status}


def passed_status(now: str) -> dict:
    """The gate kwok's narrowed pod-ready stage waits for; the waiting statuses written while the
    pod failed are dropped (null deletes in a strategic merge patch), so kwok's running ones replace them."""
    return {"status": {"conditions": [{"type": CONDITION, "status": "True", "reason": "StartChecksPassed",
                                       "lastTransitionTime": now}],
                       "containerStatuses": None, "initContainerStatuses": None}}


def condition(pod: dict, kind: str) -> dict | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or () if c.get("type") == kind), None)


# --- the gate in kwok's stages -----------------------------------------------------------------

def ready_stages(pod_ready: dict) -> list[dict]:
    """kwok's pod-ready stage (read from its module, twin/crds.py kwok_stages) as two: for pods
    that passed the start checks (CONDITION True), the stage as kwok publishes it for pods no
    process serves, and for pods a process serves (annotation PROCESS) the same Running status
    with Ready and ContainersReady False and no container ready, which the prober then sets."""
    gate = {"key": f'.status.conditions.[] | select( .type == "{CONDITION}" ) | .status',
            "operator": "In", "values": ["True"]}
    served = {"key": f'.metadata.annotations["{PROCESS}"]', "operator": "Exists"}
    plain = yaml.safe_load(yaml.safe_dump(pod_ready))
    plain["spec"]["selector"]["matchExpressions"] += [gate, {**served, "operator": "DoesNotExist"}]
    probed = yaml.safe_load(yaml.safe_dump(pod_ready))
    probed["metadata"]["name"] = pod_ready["metadata"]["name"] + "-probed"
    probed["spec"]["selector"]["matchExpressions"] += [gate, served]
    template = probed["spec"]["next"]["statusTemplate"]
    containers, init = template.split("initContainerStatuses:", 1)
    edits = [('status: "True"\ntype: Ready', 'status: "False"\ntype: Ready'),  # lines, compared stripped
             ('status: "True"\ntype: ContainersReady', 'status: "False"\ntype: ContainersReady'),
             ("ready: true", "ready: false")]
    for old, new in edits:
        flat = "\n".join(line.strip() for line in containers.splitlines())
        if flat.count(old) != 1:
            raise RuntimeError(f"kwok's pod-ready stage changed: {old!r} is not once in its statusTemplate "
                               "(twin/kubelet.py ready_stages)")
        containers = _replace_ignoring_indent(containers, old, new)
    probed["spec"]["next"]["statusTemplate"] = containers + "initContainerStatuses:" + init
    return [plain, probed]


def _replace_ignoring_indent(text: str, old: str, new: str) -> str:
    """Replace the lines `old` (compared stripped) with `new`, each keeping its line's indent."""
    lines, old_lines, new_lines = text.splitlines(keepends=True), old.split("\n"), new.split("\n")
    for i in range(len(lines) - len(old_lines) + 1):
        if [line.strip() for line in lines[i:i + len(old_lines)]] == old_lines:
            for j, replacement in enumerate(new_lines):
                line = lines[i + j]
                indent = line[:len(line) - len(line.lstrip())]
                lines[i + j] = indent + replacement + ("\n" if line.endswith("\n") else "")
            return "".join(lines)
    raise RuntimeError(f"{old!r} not found")


# --- probes ------------------------------------------------------------------------------------

def _port(value, container: dict) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or ():
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"no container port named {value!r}")


POD_NETWORK_SOCKET = RUN_DIR / "pods" / "pod-network.sock"  # twin/pods.py's hub, where its pods run
CONNECTED = b"+"  # the hub's word that the pod's port accepted a connection asked for with "?" (twin/pods.py)


def dial(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to host:port. A pod address is reached through the pod network's hub when
    processes run there (twin/pods.py: its pods live in network namespaces of their own; the hub's
    client socket takes "?<ip>:<port>\\n", answers CONNECTED once the pod's port accepted the
    connection or closes the stream when it refused, then pipes the stream); any other address
    directly. The hub's word is awaited within `timeout`: how soon it comes says nothing."""
    if POD_NETWORK_SOCKET.exists() and ipaddress.ip_address(host) in ipaddress.ip_network(POD_CIDR, strict=False):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(POD_NETWORK_SOCKET))
            sock.sendall(f"?{host}:{port}\n".encode())
            if sock.recv(len(CONNECTED)) != CONNECTED:
                raise ConnectionRefusedError(f"dial tcp {host}:{port}: connect: connection refused")
        except BaseException:
            sock.close()
            raise
        return sock
    return socket.create_connection((host, port), timeout=timeout)


class _ProbeConnection(http.client.HTTPConnection):
    """HTTP or HTTPS (certificates not verified, as the kubelet's prober) over `dial`."""

    def __init__(self, host: str, port: int, timeout: float, tls: bool):
        super().__init__(host, port, timeout=timeout)
        self.tls = tls

    def connect(self):
        self.sock = dial(self.host, self.port, self.timeout)
        if self.tls:
            self.sock = ssl._create_unverified_context().wrap_socket(self.sock, server_hostname=self.host)


def run_probe(probe: dict, host: str, container: dict) -> tuple[bool, str]:
    """One probe, as the kubelet's prober runs it (pkg/probe/http/http.go DoHTTPProbe: a status
    from 200 to 399 succeeds, another fails "with statuscode"; pkg/probe/tcp/tcp.go: a connection
    succeeds; pkg/probe/grpc/grpc.go: the health service says SERVING), with its timeoutSeconds
    (default 1). Returns (success, what was seen). Exec probes are not run: there is no container
    to run them in, and the machine is not one."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = (get.get("scheme") or "HTTP").upper()
            target, port, path = get.get("host") or host, _port(get["port"], container), get.get("path") or "/"
            conn = _ProbeConnection(target, port, timeout, scheme == "HTTPS")
            try:
                conn.request("GET", path, headers={"User-Agent": "kube-probe/1.34", "Accept": "*/*",
                                                   **{h["name"]: h["value"] for h in get.get("httpHeaders") or ()}})
                code = conn.getresponse().status
            finally:
                conn.close()
            if 200 <= code < 400:
                return True, f"HTTP probe {scheme.lower()}://{target}:{port}{path}: {code}"
            return False, f"HTTP probe failed with statuscode: {code}"
        if "tcpSocket" in probe:
            port = _port(probe["tcpSocket"]["port"], container)
            with dial(probe["tcpSocket"].get("host") or host, port, timeout):
                return True, f"TCP probe port {port}: connected"
        if "grpc" in probe:
            return _grpc_probe(host, int(probe["grpc"]["port"]), probe["grpc"].get("service") or "", timeout)
        if "exec" in probe:
            return False, "exec probes are not run by the twin (no container to run them in)"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, f"probe failed: {exc}"
    return False, "a probe with no handler"


GRPC_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class _GrpcChannels:
    """One gRPC channel per probed address, kept between probes. The kubelet's prober dials afresh
    within each probe's timeout (pkg/probe/grpc/grpc.go: DialContext with the timeout's context), a
    Go dial on the node that costs well under a millisecond; here a new channel costs a Python
    gRPC channel, a loopback listener and its thread and the pod network's hub, which on CI's
    loaded two cores took 1 to 4 s (measured at load 100, where the picker itself used 1% of a
    core), so a 1 s probe judged the twin, not the pod. A kept channel leaves the probe's timeout
    to the pod's answer; one whose call failed is closed and dropped, so the next probe dials
    afresh, as the kubelet does, and never waits out gRPC's reconnect back-off."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], tuple[socket.socket, object]] = {}

    def get(self, host: str, port: int, timeout: float):
        import grpc  # the Pulumi SDK's dependency, in the project's virtualenv
        with self._lock:
            if (host, port) not in self._open:
                # gRPC dials by itself: a loopback listener forwards its connections over `dial`
                listener = socket.create_server(("127.0.0.1", 0))
                threading.Thread(target=netns._serve, args=(listener, lambda: dial(host, port, timeout)),
                                 daemon=True).start()
                channel = grpc.insecure_channel(f"127.0.0.1:{listener.getsockname()[1]}")
                self._open[(host, port)] = (listener, channel)
            return self._open[(host, port)][1]

    def drop(self, host: str, port: int) -> None:
        with self._lock:
            listener, channel = self._open.pop((host, port), (None, None))
        if channel is not None:
            channel.close()
            listener.close()


_GRPC_CHANNELS = _GrpcChannels()


def _grpc_probe(host: str, port: int, service: str, timeout: float) -> tuple[bool, str]:
    """The gRPC health protocol's Check (grpc.health.v1.Health), as pkg/probe/grpc/grpc.go calls
    it: SERVING succeeds. The messages are encoded by hand (HealthCheckRequest: field 1, the
    service; HealthCheckResponse: field 1, the status enum) to need no generated code."""
    import grpc
    name = service.encode()
    request = b"\x0a" + bytes([len(name)]) + name if name else b""
    check = _GRPC_CHANNELS.get(host, port, timeout).unary_unary("/grpc.health.v1.Health/Check")
    try:
        answer = check(request, timeout=timeout)
    except grpc.RpcError as exc:
        _GRPC_CHANNELS.drop(host, port)
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return False, ("error: this server does not implement the grpc health protocol "
                           f"(grpc.health.v1.Health): {exc.details()}")
        return False, f"error: health rpc probe failed: {exc.code().name}: {exc.details()}"
    status = answer[1] if len(answer) >= 2 and answer[0] == 0x08 else 0
    if status != 1:
        return False, f'service unhealthy (responded with "{GRPC_STATUS.get(status, status)}")'
    return True, "service healthy"


@dataclass
class ProbeState:
    """One probe of one container: its consecutive results and when it runs next."""
    probe: dict
    next_at: float
    successes: int = 0
    failures: int = 0
    result: bool = False  # readiness and startup both start as failure (pkg/kubelet/prober/worker.go)
    said: str = ""

    def record(self, ok: bool, said: str, now: float) -> None:
        self.said = said
        self.next_at = now + float(self.probe.get("periodSeconds") or 10)
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold") or 1):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.probe.get("failureThreshold") or 3):
                self.result = False


@dataclass
class Prober:
    """The startup and readiness probes of one pod's containers (pkg/kubelet/prober/worker.go):
    a startup probe runs until it succeeds, the readiness probe only after; a container with
    no readiness probe is ready once started. `run` is called often; each probe runs on its
    own period after initialDelaySeconds."""
    pod: dict
    started_at: float
    probes: dict[tuple[str, str], ProbeState] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (container, event message) of the last run

    def __post_init__(self):
        for container in self.pod["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe"):
                if container.get(kind):
                    delay = float(container[kind].get("initialDelaySeconds") or 0)
                    self.probes[(container["name"], kind)] = ProbeState(container[kind], self.started_at + delay)

    def run(self, host: str, now: float, probe=run_probe) -> dict[str, tuple[bool, str]]:
        """Run what is due; each container's (ready, what its probes last said). The failures of
        this run are left in `failed`, as the kubelet's Unhealthy events word them
        (pkg/kubelet/prober/prober.go runProbeWithRetries' caller: "<Kind> probe failed: <output>")."""
        out, self.failed = {}, []
        for container in self.pod["spec"]["containers"]:
            name = container["name"]
            startup, readiness = self.probes.get((name, "startupProbe")), self.probes.get((name, "readinessProbe"))
            for state in (startup, readiness):
                if state is None or (state is readiness and startup is not None and not startup.result):
                    continue
                if state is startup and state.result:
                    continue  # a startup probe stops once it has succeeded
                if now >= state.next_at:
                    ok, said = probe(state.probe, host, container)
                    state.record(ok, said, now)
                    if not ok:
                        kind = "Startup" if state is startup else "Readiness"
                        self.failed.append((name, f"{kind} probe failed: {said}"))
            started = startup is None or startup.result
            ready = started and (readiness is None or readiness.result)
            out[name] = (ready, "; ".join(s.said for s in (startup, readiness) if s and s.said))
        return out


# --- the loop that runs beside kwok ---------------------------------------------------------

# Who the twin's kubelet is: a ServiceAccount of its own bound to the kubelet's own ClusterRole,
# `system:node`, as the pinned API server's bootstrap policy makes it (k8s.io/kubernetes v1.34.4
# plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go NodeRules: secrets and configmaps
# get/list/watch, persistentvolumeclaims and serviceaccounts get, pods/status patch, events
# create). A real kubelet is also held by the Node authorizer to its own node's pods; this one
# stands in for every kwok node, so it has the role without that narrowing.
ACCOUNT, ACCOUNT_NAMESPACE = "twin-kubelet", "kube-system"
RBAC = [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "twin-kubelet"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
         "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": ACCOUNT_NAMESPACE}]}]
RBAC_ORIGIN = {"module": "k8s.io/kubernetes", "version": "v1.34.4",
               "path": "plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go (ClusterRole system:node)"}


class Api:
    """The API server, as the kubeconfig's user (a bearer token, or a client certificate)."""

    def __init__(self, kubeconfig: Path):
        config = yaml.safe_load(kubeconfig.read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        url = urllib.parse.urlsplit(cluster["server"])
        self.host, self.port = url.hostname, url.port
        self.server, self.cafile = cluster["server"], cluster["certificate-authority"]
        self.context = ssl.create_default_context(cafile=self.cafile)
        self.auth = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
        if not self.auth:
            self.context.load_cert_chain(user["client-certificate"], user["client-key"])

    def call(self, method: str, path: str, body: dict | None = None,
             content_type: str = "application/json") -> dict | None:
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=30)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": content_type, "Accept": "application/json", **self.auth})
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        if answer.status == 404:
            return None
        if answer.status >= 300:
            raise OSError(f"{method} {path}: {answer.status} {data[:300]!r}")
        return json.loads(data)

    def items(self, path: str) -> list[dict]:
        return (self.call("GET", path) or {}).get("items", [])

    def patch_status(self, pod: dict, patch: dict) -> None:
        meta = pod["metadata"]
        self.call("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", patch,
                  "application/strategic-merge-patch+json")

    def event(self, pod: dict, kind: str, reason: str, message: str, now: str) -> None:
        meta = pod["metadata"]
        self.call("POST", f"/api/v1/namespaces/{meta['namespace']}/events", {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"],
                               "name": meta["name"], "uid": meta["uid"]},
            "type": kind, "reason": reason, "message": message, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "kubelet", "host": pod["spec"].get("nodeName", "")}})


# Job pods the twin runs to completion, as a kubelet runs their container: the program the
# container's command names, built by the twin from the module the image is built from
# (twin/build.py PROGRAMS). Today the platform's Envoy Gateway certgen hook (its Job's command
# `envoy-gateway certgen`, infra/platform_stack/catalog.py envoy_gateway_certgen), whose Secret
# the controller's pod mounts: without it that pod never starts.
RUN_TO_COMPLETION = {"envoy-gateway": "envoy-gateway"}


def job_container(pod: dict) -> dict | None:
    """The container of a Job's pod the twin can run to completion, or None."""
    if not any(o.get("kind") == "Job" for o in pod["metadata"].get("ownerReferences") or ()):
        return None
    containers = pod["spec"]["containers"]
    command = (containers[0].get("command") or []) if len(containers) == 1 else []
    return containers[0] if command and command[0] in RUN_TO_COMPLETION else None


def _env(container: dict, pod: dict) -> dict[str, str]:
    fields = {"metadata.namespace": pod["metadata"]["namespace"], "metadata.name": pod["metadata"]["name"]}
    return {e["name"]: e["value"] if "value" in e else fields.get(e.get("valueFrom", {}).get("fieldRef", {})
                                                                  .get("fieldPath"), "")
            for e in container.get("env") or ()}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Kubelet:
    """Each second, every bound Pending pod is checked (again) and, in a loop of its own, every
    Running pod a process serves is probed."""

    def __init__(self, api: Api):
        self.api = api
        self.said: dict[str, str] = {}  # pod uid -> the last verdict written (events once per change)
        self.probers: dict[str, Prober] = {}

    def lookup(self):
        """get(kind, namespace, name) for one round: Secrets and ConfigMaps listed once per
        namespace, claims and accounts read one by one (system:node may only get those)."""
        listed: dict[tuple[str, str], dict[str, dict]] = {}
        read: dict[tuple[str, str, str], dict | None] = {}

        def get(kind: str, namespace: str, name: str) -> dict | None:
            path = f"/api/v1/namespaces/{namespace}/{KIND_PATHS[kind]}"
            if kind in ("secret", "configmap"):
                if (kind, namespace) not in listed:
                    listed[(kind, namespace)] = {o["metadata"]["name"]: o for o in self.api.items(path)}
                return listed[(kind, namespace)].get(name)
            if (kind, namespace, name) not in read:
                read[(kind, namespace, name)] = self.api.call("GET", f"{path}/{name}")
            return read[(kind, namespace, name)]
        return get

    def check_round(self) -> None:
        get = self.lookup()
        for pod in self.api.items("/api/v1/pods?fieldSelector=status.phase%3DPending"):
            if not pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
                continue
            gate = condition(pod, CONDITION)
            if gate and gate["status"] == "True":
                continue  # passed: kwok's stage takes it from here
            self.each(self.check, pod, get)

    def probe_round(self) -> None:
        live = set()
        for pod in self.api.items("/api/v1/pods?fieldSelector=status.phase%3DRunning"):
            if PROCESS in (pod["metadata"].get("annotations") or {}) and not pod["metadata"].get("deletionTimestamp"):
                live.add(pod["metadata"]["uid"])
                self.each(self.probe, pod)
        self.probers = {uid: p for uid, p in self.probers.items() if uid in live}

    @staticmethod
    def each(step, pod: dict, *args) -> None:
        """One pod's step; a refusal (its namespace going, the pod gone) does not stop the others'."""
        try:
            step(pod, *args)
        except OSError as exc:
            print(f"twin kubelet: {pod['metadata']['namespace']}/{pod['metadata']['name']}: {exc}",
                  file=sys.stderr, flush=True)

    def check(self, pod: dict, get) -> None:
        verdict = start_checks(pod, get)
        uid, now, line = pod["metadata"]["uid"], _now(), verdict.summary()
        if self.said.get(uid) == line and not verdict.passed:
            return  # written once per change, its events with it (the kubelet's recorder aggregates repeats)
        self.said[uid] = line
        container = job_container(pod) if verdict.passed else None
        if container is not None:
            self.run_to_completion(pod, container)
            return
        self.api.patch_status(pod, passed_status(now) if verdict.passed else failed_status(pod, verdict, now))
        for reason, message in verdict.warnings:
            self.api.event(pod, "Warning", reason, message, now)
        for message in verdict.volumes:
            self.api.event(pod, "Warning", "FailedMount", message, now)
        for failure in verdict.containers:
            self.api.event(pod, "Warning", "Failed", f"Error: {failure.message}", now)

    def run_to_completion(self, pod: dict, container: dict) -> None:
        """Run a Job pod's container as its ServiceAccount (a TokenRequest token bound to the pod, as
        the kubelet's projected token is), then write the phase the exit code gives."""
        import subprocess
        import tempfile

        from twin import build

        meta = pod["metadata"]
        token = self.api.call("POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/"
                                      f"{pod['spec'].get('serviceAccountName', 'default')}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}})
        with tempfile.TemporaryDirectory(prefix="twin-job-") as folder:
            kubeconfig = Path(folder) / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "pod",
                "clusters": [{"name": "pod", "cluster": {"server": self.api.server,
                                                         "certificate-authority": self.api.cafile}}],
                "users": [{"name": "pod", "user": {"token": token["status"]["token"]}}],
                "contexts": [{"name": "pod", "context": {"cluster": "pod", "user": "pod",
                                                         "namespace": meta["namespace"]}}]}))
            kubeconfig.chmod(0o600)
            program = build.program(RUN_TO_COMPLETION[container["command"][0]])
            done = subprocess.run([str(program), *container["command"][1:], *container.get("args", [])],
                                  env={**build.go_env(), **_env(container, pod), "KUBECONFIG": str(kubeconfig)},
                                  capture_output=True, text=True, timeout=300)
        now, ok = _now(), done.returncode == 0
        self.api.patch_status(pod, {"status": {
            "phase": "Succeeded" if ok else "Failed",
            "containerStatuses": [{"name": container["name"], "ready": False, "restartCount": 0,
                                   "image": container.get("image", ""), "imageID": "",
                                   "state": {"terminated": {"exitCode": done.returncode, "startedAt": now,
                                                            "finishedAt": now,
                                                            "reason": "Completed" if ok else "Error",
                                                            "message": done.stderr[-500:]}}}]}})

    def probe(self, pod: dict) -> None:
        uid, host = pod["metadata"]["uid"], pod["status"].get("podIP")
        if not host:
            return
        prober = self.probers.setdefault(uid, Prober(pod, time.monotonic()))
        results = prober.run(host, time.monotonic())
        for container, message in prober.failed:  # one event per distinct failure (the recorder aggregates)
            if self.said.get(f"{uid}/{container}") != message:
                self.said[f"{uid}/{container}"] = message
                self.api.event(pod, "Warning", "Unhealthy", message, _now())
        statuses = {c["name"]: c for c in pod["status"].get("containerStatuses") or ()}
        if all(statuses.get(name, {}).get("ready") == ready for name, (ready, _) in results.items()):
            return
        now, all_ready = _now(), all(ready for ready, _ in results.values())
        unready = " ".join(name for name, (ready, _) in results.items() if not ready)
        ready_condition = {"status": "True" if all_ready else "False", "lastTransitionTime": now,
                           **({} if all_ready else {"reason": "ContainersNotReady",
                                                   "message": f"containers with unready status: [{unready}]"})}
        self.api.patch_status(pod, {"status": {
            "conditions": [{"type": "Ready", **ready_condition}, {"type": "ContainersReady", **ready_condition}],
            "containerStatuses": [{"name": name, "ready": ready, "started": True}
                                  for name, (ready, _) in results.items()]}})


def every_second(step, rounds: int | None = None) -> None:
    """`step` once a second, for ever (or `rounds` times). A round that fails is logged with its
    traceback and the next one tries again, as the kubelet's pod workers retry a failed sync
    (k8s v1.34.4 pkg/kubelet/pod_workers.go): the API server busy or restarting, an answer cut
    short under load (http.client.IncompleteRead is no OSError), a pod changed under the round.
    This process exiting would stop the whole twin (its supervisor stops every component when
    one exits: twin/cluster.py), and every test after it would fail on "connection refused"."""
    done = 0
    while rounds is None or done < rounds:
        try:
            step()
        except OSError as exc:  # said in one line: the API server busy or restarting
            print(f"twin kubelet: {exc}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - any other failure of one round: logged whole, retried
            print(f"twin kubelet: a round failed, the next one tries again:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
        done += 1
        time.sleep(1)


def main(argv: list[str]) -> int:
    """python -m twin.kubelet <kubeconfig>: run until killed (the supervisor owns this process)."""
    kubelet = Kubelet(Api(Path(argv[0])))
    # probes in a loop of their own: a slow one (timeoutSeconds up to 25 in the renders) never
    # holds back another pod's start checks
    threading.Thread(target=every_second, args=(kubelet.probe_round,), daemon=True).start()
    every_second(kubelet.check_round)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
