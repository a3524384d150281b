"""The twin's kubelet (twin/kubelet.py) without a cluster: its start checks against the rules of
the kubelet at the pinned Kubernetes, kwok's pod-ready stage gated on them, and its probes run
against a loopback HTTP server.

The rules and messages come from k8s.io/kubernetes v1.34.4 (read in the module cache):
pkg/kubelet/kubelet_pods.go makeEnvironmentVariables and getPullSecretsForPod,
pkg/kubelet/kuberuntime/kuberuntime_container.go startContainer (CreateContainerConfigError),
pkg/volume/secret/secret.go and pkg/volume/configmap/configmap.go MakePayload,
pkg/volume/projected/projected.go collectData, pkg/kubelet/volumemanager/populator/
desired_state_of_world_populator.go getPVCExtractPV, pkg/volume/util/operationexecutor/
operation_executor.go GenerateError, pkg/kubelet/secret/secret_manager.go (not-found names),
pkg/probe/http/http.go (200..399 succeeds), pkg/kubelet/prober/worker.go (thresholds, startup first).
"""

from __future__ import annotations

import http.server
import threading

import pytest
import yaml

from tests.servers import free_port
from twin import kubelet

NS = "pdstack-dev-r1"


def lookup(objects: dict):
    """get(kind, namespace, name) over {(kind, name): object}."""
    return lambda kind, namespace, name: objects.get((kind, name)) if namespace == NS else None


def pod(containers, volumes=(), init=(), **spec) -> dict:
    return {"metadata": {"name": "p", "namespace": NS, "uid": "u"},
            "spec": {"containers": [{"image": "i", **c} for c in containers],
                     **({"initContainers": [{"image": "i", **c} for c in init]} if init else {}),
                     "volumes": list(volumes), **spec}}


SECRET = {"data": {"AWS_ACCESS_KEY_ID": "eA=="}}
CONFIG = {"data": {"config.yaml": "a: 1"}, "binaryData": {"blob": "AA=="}}


def test_a_missing_secret_in_env_from_is_create_container_config_error_unless_optional():
    """envFrom secretRef: the kubelet's secret manager's NotFound, as the container's waiting
    message (`secret "x" not found`), reason CreateContainerConfigError; optional: starts."""
    p = pod([{"name": "fetch", "envFrom": [{"secretRef": {"name": "weights-s3-credentials"}}]}])
    verdict = kubelet.start_checks(p, lookup({}))
    assert not verdict.passed
    assert [(f.container, f.reason, f.message) for f in verdict.containers] == [
        ("fetch", "CreateContainerConfigError", 'secret "weights-s3-credentials" not found')]
    assert kubelet.start_checks(p, lookup({("secret", "weights-s3-credentials"): SECRET})).passed
    p["spec"]["containers"][0]["envFrom"][0]["secretRef"]["optional"] = True
    assert kubelet.start_checks(p, lookup({})).passed


@pytest.mark.parametrize("ref, objects, said", [
    ({"secretKeyRef": {"name": "s", "key": "TOKEN"}}, {("secret", "s"): SECRET},
     f"couldn't find key TOKEN in Secret {NS}/s"),
    ({"configMapKeyRef": {"name": "c", "key": "blob"}}, {("configmap", "c"): CONFIG},  # env reads data only
     f"couldn't find key blob in ConfigMap {NS}/c"),
    ({"configMapKeyRef": {"name": "c", "key": "x"}}, {}, 'configmap "c" not found'),
])
def test_a_missing_key_or_object_in_env_value_from(ref, objects, said):
    p = pod([{"name": "app", "env": [{"name": "X", "valueFrom": ref}]}])
    assert [f.message for f in kubelet.start_checks(p, lookup(objects)).containers] == [said]
    next(iter(ref.values()))["optional"] = True
    assert kubelet.start_checks(p, lookup(objects)).passed


def test_a_missing_config_map_key_in_a_volume_is_a_failed_mount():
    """A configMap volume's item whose key is in neither data nor binaryData: FailedMount, the
    containers waiting in ContainerCreating (pkg/volume/configmap/configmap.go MakePayload)."""
    volume = {"name": "launch", "configMap": {"name": "router-launch", "items": [{"key": "config.yaml",
                                                                                  "path": "config.yaml"}]}}
    p = pod([{"name": "router"}], [volume])
    verdict = kubelet.start_checks(p, lookup({("configmap", "router-launch"): {"data": {"other": ""}}}))
    assert verdict.volumes == ('MountVolume.SetUp failed for volume "launch" : '
                               "configmap references non-existent config key: config.yaml",)
    status = kubelet.failed_status(p, verdict, "now")["status"]
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "ContainerCreating"}}
    assert kubelet.condition({"status": status}, "Ready")["status"] == "False"
    assert kubelet.start_checks(p, lookup({("configmap", "router-launch"): CONFIG})).passed
    assert not kubelet.start_checks(p, lookup({})).passed  # the ConfigMap itself missing


def test_projected_sources_aggregate_and_the_token_needs_the_service_account():
    volume = {"name": "api", "projected": {"sources": [
        {"secret": {"name": "s", "items": [{"key": "k", "path": "k"}]}},
        {"serviceAccountToken": {"path": "token"}}]}}
    p = pod([{"name": "app"}], [volume], serviceAccountName="engine")
    assert kubelet.start_checks(p, lookup({("secret", "s"): SECRET})).volumes == (
        'MountVolume.SetUp failed for volume "api" : [references non-existent secret key: k, '
        'serviceaccounts "engine" not found]',)
    assert kubelet.start_checks(p, lookup({("secret", "s"): {"data": {"k": ""}},
                                           ("serviceaccount", "engine"): {}})).passed


def test_a_claim_must_exist_and_be_bound():
    p = pod([{"name": "app"}], [{"name": "d", "persistentVolumeClaim": {"claimName": "c"}}])
    assert kubelet.start_checks(p, lookup({})).volumes == (
        f'error processing PVC {NS}/c: failed to fetch PVC from API server: persistentvolumeclaims "c" not found',)
    assert kubelet.start_checks(p, lookup({("persistentvolumeclaim", "c"): {"status": {"phase": "Pending"}}})
                                ).volumes == (f"error processing PVC {NS}/c: PVC is not bound",)
    assert kubelet.start_checks(p, lookup({("persistentvolumeclaim", "c"): {"status": {"phase": "Bound"}}})).passed


def test_an_init_container_runs_first_and_alone():
    """The first init container that cannot start is the only one reported (Init:...), the
    regular containers wait in PodInitializing and Initialized is False."""
    p = pod([{"name": "app", "envFrom": [{"secretRef": {"name": "other"}}]}],
            init=[{"name": "fetch", "envFrom": [{"secretRef": {"name": "weights-s3-credentials"}}]}])
    verdict = kubelet.start_checks(p, lookup({}))
    assert [(f.container, f.init) for f in verdict.containers] == [("fetch", True)]
    assert verdict.summary() == ('Init:CreateContainerConfigError (fetch): secret "weights-s3-credentials" '
                                 "not found")
    status = kubelet.failed_status(p, verdict, "now")["status"]
    assert status["initContainerStatuses"][0]["state"]["waiting"]["reason"] == "CreateContainerConfigError"
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert kubelet.condition({"status": status}, "Initialized")["status"] == "False"


def test_a_missing_image_pull_secret_is_only_a_warning():
    """getPullSecretsForPod: the kubelet warns and tries the pull anyway."""
    verdict = kubelet.start_checks(pod([{"name": "app"}], imagePullSecrets=[{"name": "regcred"}]), lookup({}))
    assert verdict.passed
    assert verdict.warnings == (("FailedToRetrieveImagePullSecret", "Unable to retrieve some image pull secrets "
                                 "(regcred); attempting to pull the image may not succeed."),)


def test_kwoks_pod_ready_stage_waits_for_the_start_checks():
    """kwok v0.8.0's own kustomize/stage/pod/fast/pod-ready.yaml (from its module), narrowed: both
    variants select only pods whose start-checks condition is True; the one for pods a process
    serves writes Running with Ready False and no container ready."""
    from twin.crds import module
    stage = yaml.safe_load(module("controllers", "sigs.k8s.io/kwok").file(
        "kustomize/stage/pod/fast/pod-ready.yaml").read_text())
    plain, probed = kubelet.ready_stages(stage)
    for variant in (plain, probed):
        assert {"key": f'.status.conditions.[] | select( .type == "{kubelet.CONDITION}" ) | .status',
                "operator": "In", "values": ["True"]} in variant["spec"]["selector"]["matchExpressions"]
    assert plain["spec"]["next"] == stage["spec"]["next"]
    template = probed["spec"]["next"]["statusTemplate"]
    containers = template.split("initContainerStatuses:")[0]
    assert "ready: true" not in containers and 'status: "False"\n  type: Ready' in containers


class Health(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []

    def do_GET(self):
        self.send_response(self.answers.pop(0) if self.answers else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_readiness_follows_the_probes_own_thresholds(health):
    """A readiness probe (successThreshold 2, failureThreshold 2, periodSeconds 5) against a real
    HTTP server on 127.0.0.1: ready only after two successes in a row, not ready after two
    failures; a 503 fails and a 200 succeeds (pkg/probe/http/http.go). Time is the caller's
    clock, so the periods are exact."""
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "successThreshold": 2,
             "failureThreshold": 2}
    p = pod([{"name": "engine", "ports": [{"name": "http", "containerPort": health}], "readinessProbe": probe}])
    prober = kubelet.Prober(p, started_at=0)
    Health.answers[:] = [503, 200, 200, 503, 503]
    seen, failed = [], []
    for t in (0, 1, 5, 10, 15, 20, 25):
        seen.append(prober.run("127.0.0.1", t)["engine"])
        failed.append(prober.failed)
    # t=0: 503; t=1 not due; t=5: 200 (1 of 2); t=10: 200 -> ready; t=15: 503 (1 of 2); t=20: 503 -> not; t=25: 200
    assert [ready for ready, _ in seen] == [False, False, False, True, True, False, False]
    assert seen[5][1] == "HTTP probe failed with statuscode: 503"
    assert [bool(f) for f in failed] == [True, False, False, False, True, True, False]
    assert failed[5] == [("engine", "Readiness probe failed: HTTP probe failed with statuscode: 503")]


def test_a_startup_probe_comes_first_and_a_closed_port_fails(health):
    """Readiness is not probed until the startup probe succeeds (pkg/kubelet/prober/worker.go);
    a TCP probe to a port nothing listens on fails (pkg/probe/tcp/tcp.go)."""
    calls = []

    def probe(spec, host, container):
        calls.append(next(iter(k for k in spec if k.endswith(("Get", "Socket")))))
        return kubelet.run_probe(spec, host, container)

    import socket
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    p = pod([{"name": "engine", "startupProbe": {"tcpSocket": {"port": port}, "failureThreshold": 30},
              "readinessProbe": {"httpGet": {"path": "/", "port": health}}}])
    prober = kubelet.Prober(p, started_at=0)
    ready, said = prober.run("127.0.0.1", 0, probe)["engine"]
    assert (ready, calls) == (False, ["tcpSocket"]) and "probe failed" in said
    p["spec"]["containers"][0]["startupProbe"]["tcpSocket"]["port"] = health
    prober = kubelet.Prober(p, started_at=0)
    calls.clear()
    assert prober.run("127.0.0.1", 0, probe)["engine"][0] is True
    assert calls == ["tcpSocket", "httpGet"]


def _health_server(check):
    """A real gRPC server on 127.0.0.1 whose grpc.health.v1.Health/Check is `check`; started."""
    from concurrent import futures

    import grpc
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_grpc_probe_asks_the_health_service():
    """The picker's readiness probe is gRPC (service `readiness`): the health protocol's Check
    against a real gRPC server on 127.0.0.1; SERVING succeeds, NOT_SERVING fails with the
    kubelet's words (pkg/probe/grpc/grpc.go), and a server without the service fails."""
    asked, answer = [], [b"\x08\x02"]

    def check(request, context):
        asked.append(request)
        return answer[0]

    server, port = _health_server(check)
    try:
        probe = {"grpc": {"port": port, "service": "readiness"}, "timeoutSeconds": 5}
        assert kubelet.run_probe(probe, "127.0.0.1", {}) == (
            False, 'service unhealthy (responded with "NOT_SERVING")')
        assert asked == [b"\x0a\x09readiness"]
        answer[0] = b"\x08\x01"
        assert kubelet.run_probe(probe, "127.0.0.1", {}) == (True, "service healthy")
    finally:
        server.stop(None)
    ok, said = kubelet.run_probe(probe, "127.0.0.1", {})
    assert not ok and said.startswith("error: health rpc probe failed: UNAVAILABLE"), said


def test_grpc_probes_of_one_address_share_a_connection_until_one_fails(monkeypatch):
    """The twin keeps one gRPC channel per probed address (twin/kubelet.py _GrpcChannels): a new
    one per probe cost 1 to 4 s of the twin's own Python on CI's loaded machine, which the picker's
    1 s probe (GIE v1.4.0's chart default) counted against the pod, and its leader read not Ready.
    Three probes of a healthy server open one connection; a failed call drops it, so the probe
    after it dials afresh, as the kubelet's prober does each time (pkg/probe/grpc/grpc.go), and a
    restarted server is probed on a new connection, not through gRPC's reconnect back-off."""
    import socket
    import threading

    import grpc

    from twin import netns
    answer = [b"\x08\x01"]

    def check(request, context):
        if answer[0] is None:
            context.abort(grpc.StatusCode.INTERNAL, "broken on purpose")
        return answer[0]

    server, port = _health_server(check)
    connections = []  # each TCP connection the probes open, through a counting forwarder
    forwarder = socket.create_server(("127.0.0.1", 0))

    def connect():
        connections.append(port)
        return socket.create_connection(("127.0.0.1", port))

    threading.Thread(target=netns._serve, args=(forwarder, connect), daemon=True).start()
    probe = {"grpc": {"port": forwarder.getsockname()[1]}, "timeoutSeconds": 30}
    try:
        for _ in range(3):
            assert kubelet.run_probe(probe, "127.0.0.1", {}) == (True, "service healthy")
        assert len(connections) == 1
        answer[0] = None
        ok, said = kubelet.run_probe(probe, "127.0.0.1", {})
        assert not ok and "INTERNAL" in said, said
        answer[0] = b"\x08\x01"
        assert kubelet.run_probe(probe, "127.0.0.1", {}) == (True, "service healthy")
        assert len(connections) == 2
    finally:
        server.stop(None)
        forwarder.close()


def test_a_pod_address_is_probed_through_the_pod_networks_hub(health, tmp_path, monkeypatch):
    """Where twin/pods.py runs a pod's process, the pod's address lives in a network namespace of
    its own, reached through its hub's client socket ("?<ip>:<port>\\n", its word, then the stream). A stand-in
    hub here takes the pod address to a server on 127.0.0.1: an HTTP probe of the pod address
    reaches it, and a port the hub cannot connect (it closes the stream) fails a TCP probe."""
    import socket

    from twin import netns
    hub_socket = tmp_path / "pod-network.sock"
    monkeypatch.setattr(kubelet, "POD_NETWORK_SOCKET", hub_socket)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(hub_socket))
    listener.listen(8)
    asked = []

    def hub():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            line = b""
            while not line.endswith(b"\n"):
                line += client.recv(1)
            asked.append(line.decode().strip())
            try:
                upstream = socket.create_connection(("127.0.0.1", int(line.decode().rsplit(":", 1)[1])))
            except OSError:
                client.close()
                continue
            if line.startswith(b"?"):  # asked to say the connection opened
                client.sendall(kubelet.CONNECTED)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=netns._pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=hub, daemon=True).start()
    closed_port = free_port()  # nothing listens there
    try:
        Health.answers[:] = []
        assert kubelet.run_probe({"httpGet": {"path": "/health", "port": health}}, "10.244.0.5", {}) == (
            True, f"HTTP probe http://10.244.0.5:{health}/health: 200")
        ok, said = kubelet.run_probe({"tcpSocket": {"port": closed_port}}, "10.244.0.5", {})
        assert not ok and "connection refused" in said, said
        assert asked == [f"?10.244.0.5:{health}", f"?10.244.0.5:{closed_port}"]
    finally:
        listener.close()


def test_a_tcp_probe_of_a_pod_address_waits_for_the_hubs_word_on_the_connection(tmp_path, monkeypatch):
    """pkg/probe/tcp/tcp.go: a TCP probe succeeds when the connection opens, and only then. Through
    the pod network's hub (twin/pods.py _serve_clients, run here with the pod network taken as
    127.0.0.0/8) the probe cannot see the pod's port itself: it must wait for the hub to say the
    connection opened, however long the hub takes. Here the hub's connect is held back (a refusal
    that comes late, as on a loaded machine) past the probe's own timeout: the probe fails, where
    it used to take a hub silent for 0.2 s as connected."""
    import contextlib
    import ipaddress
    import socket

    from twin import pods
    hub_socket = tmp_path / "pod-network.sock"
    monkeypatch.setattr(kubelet, "POD_NETWORK_SOCKET", hub_socket)
    monkeypatch.setattr(kubelet, "POD_CIDR", "127.0.0.0/8")
    monkeypatch.setattr(pods, "POD_NETWORK", ipaddress.ip_network("127.0.0.0/8"))
    released = threading.Event()
    refuse = socket.create_connection

    def late_refusal(address, timeout=None):
        released.wait(30)
        return refuse(address, timeout)
    monkeypatch.setattr(pods.socket, "create_connection", late_refusal)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(hub_socket))
    listener.listen(8)

    def hub():
        with contextlib.suppress(OSError):  # its listener closed at the end
            pods._serve_clients(listener)
    threading.Thread(target=hub, daemon=True).start()
    closed_port = free_port()  # nothing listens there
    try:
        ok, said = kubelet.run_probe({"tcpSocket": {"port": closed_port}, "timeoutSeconds": 1}, "127.0.0.2", {})
        assert not ok, said
    finally:
        released.set()
        listener.close()
    ok, said = kubelet.run_probe({"tcpSocket": {"port": closed_port}}, "127.0.0.2", {})
    assert (ok, said) == (False, f"probe failed: dial tcp 127.0.0.2:{closed_port}: connect: connection refused")


def test_a_failed_round_is_logged_and_the_next_one_runs(monkeypatch, capsys):
    """The twin's kubelet keeps going after a round fails for any reason, as the kubelet's pod
    workers retry a failed sync (k8s v1.34.4 pkg/kubelet/pod_workers.go): only an OSError was
    caught, so an answer cut short under load (http.client.IncompleteRead, an HTTPException) or a
    pod changed under the round ended the process, and with it the whole twin (its supervisor stops
    every component when one exits), failing every later test on "connection refused"."""
    import http.client

    from twin import kubelet

    monkeypatch.setattr(kubelet.time, "sleep", lambda _: None)
    failures = [http.client.IncompleteRead(b"{\"items\": ["), KeyError("podIP"), None]
    ran = []

    def step():
        ran.append(1)
        failure = failures[len(ran) - 1]
        if failure is not None:
            raise failure

    kubelet.every_second(step, rounds=3)
    assert len(ran) == 3
    log = capsys.readouterr().err
    assert "IncompleteRead" in log and "KeyError: 'podIP'" in log and log.count("a round failed") == 2
