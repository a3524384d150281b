"""The twin's egress proxy (twin/egress.py): the HTTP CONNECT proxy kube-apiserver's egress selector
dials over a Unix socket for its `cluster` traffic, and the configuration that tells it so.

The client side these tests play is kube-apiserver's, k8s.io/apiserver v0.34.4 (the version
k8s.io/kubernetes v1.34.4 pins), pkg/server/egressselector/egress_selector.go tunnelHTTPConnect:
it writes `CONNECT <addr> HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n`, reads one response with
http.ReadResponse, needs status 200, and fails the connection when any byte is buffered after the
response's head before it speaks.
"""

from __future__ import annotations

import socket
import threading

import pytest

from twin import dataplane, egress

APISERVER_REQUEST = "CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # egress_selector.go tunnelHTTPConnect


@pytest.fixture
def echo_server():
    """A loopback TCP server that echoes one read back; its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(conn.recv(1024))

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def proxy(tmp_path):
    """The proxy on a Unix socket in tmp_path, dialling with the twin's own dial; its socket path."""
    path = tmp_path / "egress.sock"
    listener = egress.serve(path)
    yield path
    listener.close()


def _connect(path, target: str) -> tuple[socket.socket, bytes]:
    """What the API server does: the CONNECT, then the response's head, read to its blank line."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(30)
    client.connect(str(path))
    client.sendall(APISERVER_REQUEST.format(target=target).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        got = client.recv(1)
        if not got:
            break
        head += got
    return client, head


def test_the_api_servers_connect_to_a_loopback_address_is_tunnelled_with_nothing_after_the_200(proxy, echo_server):
    """A kubelet's address (kwok serves its nodes' kubelet API on 127.0.0.1) is dialled directly:
    200, no byte after the head (egress_selector.go refuses buffered data), then bytes flow both ways."""
    client, head = _connect(proxy, f"127.0.0.1:{echo_server}")
    with client:
        assert head.startswith(b"HTTP/1.1 200 "), head
        client.setblocking(False)
        with pytest.raises(BlockingIOError):
            client.recv(1)  # nothing buffered after the response's head
        client.setblocking(True)
        client.sendall(b"hello through the tunnel")
        assert client.recv(1024) == b"hello through the tunnel"


def test_a_pod_address_is_dialled_as_the_twins_kubelet_dials_it(tmp_path, echo_server):
    """A pod address goes to the dial the proxy is given (twin/kubelet.py dial: through the pod
    network's hub), with the address and port the CONNECT named."""
    asked = []

    def dial(host, port, timeout):
        asked.append((host, port))
        return socket.create_connection(("127.0.0.1", echo_server), timeout=timeout)

    listener = egress.serve(tmp_path / "egress.sock", dial)
    try:
        client, head = _connect(tmp_path / "egress.sock", "10.244.255.254:6443")
        with client:
            assert head.startswith(b"HTTP/1.1 200 "), head
            client.sendall(b"tls client hello")
            assert client.recv(1024) == b"tls client hello"
    finally:
        listener.close()
    assert asked == [("10.244.255.254", 6443)]


@pytest.mark.parametrize("target,status,says", [
    ("10.96.0.10:443", b"403", b"--enable-aggregator-routing"),  # a ClusterIP: no kube-proxy on the twin
    ("192.0.2.7:443", b"403", b"neither a pod address"),
    ("keda-metrics-apiserver.keda.svc:443", b"403", b"no cluster DNS"),
    ("10.244.0.3", b"403", b"not <address>:<port>"),
])
def test_a_target_the_twin_does_not_route_is_refused_saying_why(proxy, target, status, says):
    client, head = _connect(proxy, target)
    with client:
        body = client.recv(4096)
    assert head.split()[1] == status and says in body, (head, body)


def test_a_port_that_refuses_is_a_502_naming_it(proxy):
    unused = socket.create_server(("127.0.0.1", 0))
    port = unused.getsockname()[1]
    unused.close()  # nothing listens there now
    client, head = _connect(proxy, f"127.0.0.1:{port}")
    with client:
        body = client.recv(4096)
    assert head.startswith(b"HTTP/1.1 502 ") and f"127.0.0.1:{port}".encode() in body, (head, body)


def test_anything_but_connect_is_refused(proxy):
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(30)
    client.connect(str(proxy))
    with client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 405 ")


def test_the_configuration_names_the_cluster_selection_over_http_connect_on_the_socket(tmp_path):
    """EgressSelectorConfiguration apiserver.k8s.io/v1beta1 (k8s.io/apiserver v0.34.4
    pkg/apis/apiserver/v1beta1/types.go): the `cluster` selection, HTTPConnect, transport.uds.udsName."""
    flags, listener = egress.start(tmp_path)
    listener.close()
    assert f"--egress-selector-config-file={tmp_path / 'egress-selector.yaml'}" in flags
    assert "--enable-aggregator-routing=true" in flags
    import yaml
    config = yaml.safe_load((tmp_path / "egress-selector.yaml").read_text())
    assert config["kind"] == "EgressSelectorConfiguration" and config["apiVersion"] == "apiserver.k8s.io/v1beta1"
    assert config["egressSelections"] == [{"name": "cluster", "connection": {
        "proxyProtocol": "HTTPConnect", "transport": {"uds": {"udsName": str(tmp_path / "egress.sock")}}}}]
    assert (tmp_path / "egress.sock").stat().st_mode & 0o077 == 0  # the API server's (and the twin's) only


def test_keda_metrics_server_rbac_keeps_the_clusters_own_roles_and_accounts_in_kube_system():
    """config/metrics-server/role_binding.yaml of github.com/kedacore/keda/v2 v2.20.2 binds kube-system's
    extension-apiserver-authentication-reader Role (a RoleBinding there) and grants the HPA controller
    (kube-system/horizontal-pod-autoscaler) the external metrics: the twin's copy keeps both in
    kube-system; the server's own account follows the twin's namespace."""
    objects, origins = dataplane.keda_metrics_server_rbac()
    reader = next(o for o in objects if o["kind"] == "RoleBinding")
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    assert reader["subjects"] == [{"kind": "ServiceAccount", "name": "keda-operator", "namespace": dataplane.NAMESPACE}]
    hpa = next(o for o in objects if o.get("roleRef", {}).get("name") == dataplane.TWIN_PREFIX + "keda-external-metrics-reader")
    assert hpa["subjects"] == [{"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler", "namespace": "kube-system"}]
    assert all(o["module"] == dataplane.KEDA and o["version"] == "v2.20.2" for o in origins)


def test_keda_metrics_servers_apiservice_names_its_service_whose_endpoint_is_where_it_runs():
    service, endpoints, api_service = dataplane.keda_metrics_server_objects()
    assert api_service["spec"]["service"] == {"name": service["metadata"]["name"], "namespace": dataplane.NAMESPACE}
    assert "selector" not in service["spec"]  # no Pod object stands for it: the twin writes its endpoints
    assert endpoints["metadata"]["labels"]["kubernetes.io/service-name"] == service["metadata"]["name"]
    assert endpoints["endpoints"][0]["addresses"] == [dataplane.METRICS_SERVER_IP]
    assert {p["name"]: p["port"] for p in endpoints["ports"]}["https"] == 6443  # the Service's targetPort
