"""How the twin's API server reaches pod addresses: kube-apiserver's egress selector, its `cluster`
traffic sent over HTTP CONNECT on a Unix socket (Konnectivity's protocol), served here.

Pods live in network namespaces of their own behind the pod network's hub (twin/pods.py); the API
server runs on the machine's loopback, from which no pod address is routed. A cluster without a
flat network gives the API server the same problem, and kube-apiserver's answer is its egress
selector (`--egress-selector-config-file`, EgressSelectorConfiguration apiserver.k8s.io/v1beta1):
each connection of a kind is dialled through a proxy. The twin configures one selection, `cluster`,
with `proxyProtocol: HTTPConnect` over `transport.uds`; `tunnel()` below is that proxy's side.

What uses the `cluster` selection, at the pinned k8s.io/kubernetes v1.34.4 (k8s.io/apiserver and
k8s.io/kube-aggregator v0.34.4):
  - the aggregator's proxy and its APIService availability checks (kube-aggregator
    pkg/apiserver/apiserver.go: `EgressSelector.Lookup(egressselector.Cluster.AsNetworkContext())`
    becomes proxyTransportDial, which pkg/controllers/status/remote/remote_available_controller.go
    dials with): KEDA's metrics API server (twin/dataplane.py) is reached this way;
  - admission and conversion webhooks named by a Service (k8s.io/apiserver pkg/util/webhook/
    authentication.go ClientConfigForServiceFunc); webhooks named by a URL (LWS's, on 127.0.0.1)
    use the `controlplane` selection, which the twin leaves direct;
  - the API server's connections to kubelets (pkg/kubelet/client/kubelet_client.go): kwok's, on
    the machine's loopback.
So a target is either a pod address (through the hub, as the twin's kubelet dials its probes:
twin/kubelet.py `dial`) or a loopback address (dialled directly, as before). Any other target is
refused: a Service's ClusterIP routes nowhere on the twin (no kube-proxy), which is why the API
server runs with `--enable-aggregator-routing` (it proxies to an endpoint's address from the
Service's EndpointSlices, k8s.io/apiserver pkg/util/proxy ResolveEndpoint, instead of the
ClusterIP, ResolveCluster).

The client's side (k8s.io/apiserver v0.34.4 pkg/server/egressselector/egress_selector.go
tunnelHTTPConnect): it writes `CONNECT <host>:<port> HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n`,
reads one HTTP response with http.ReadResponse, needs status 200, and refuses the connection if
any byte follows the response's head before it speaks (TLS, client first).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path

import yaml

from twin import kubelet, netns
from twin.api import POD_CIDR

SELECTION = "cluster"
MAX_HEAD = 8192  # bytes of the CONNECT request's head; the API server's is under 100
DIAL_TIMEOUT = 10.0  # the hub's word that the pod's port accepted (twin/kubelet.py dial)
_POD_NETWORK = ipaddress.ip_network(POD_CIDR, strict=False)


def configuration(socket_path: Path) -> dict:
    """The EgressSelectorConfiguration: the `cluster` selection through the proxy at socket_path.
    Its schema: k8s.io/apiserver v0.34.4 pkg/apis/apiserver/v1beta1/types.go (EgressSelection,
    Connection, Transport, UDSTransport); validated by pkg/server/egressselector/config.go."""
    return {"apiVersion": "apiserver.k8s.io/v1beta1", "kind": "EgressSelectorConfiguration",
            "egressSelections": [{"name": SELECTION, "connection": {
                "proxyProtocol": "HTTPConnect", "transport": {"uds": {"udsName": str(socket_path)}}}}]}


def refusal(target: str) -> str | None:
    """Why the proxy does not dial `target` ("<ip>:<port>"), or None when it does: a pod address
    (the hub reaches it) or a loopback one (the machine's, where kwok serves its nodes' kubelet
    API). Pure."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{target!r} is not <address>:<port>"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"{host!r} is not an address (the twin has no cluster DNS; the API server dials endpoint addresses)"
    if address in _POD_NETWORK or address.is_loopback:
        return None
    return (f"{address} is neither a pod address ({_POD_NETWORK}) nor loopback: nothing routes it on the twin "
            "(a Service's ClusterIP has no kube-proxy behind it; the API server runs with --enable-aggregator-routing)")


def _answer(client: socket.socket, status: str, why: str = "") -> None:
    body = (why + "\n").encode() if why else b""
    client.sendall(f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                   "Connection: close\r\n\r\n".encode() + body)


def _read_head(client: socket.socket) -> tuple[bytes, bytes] | None:
    """The request's head (to its blank line) and whatever followed it; None if the client closed
    or sent more than MAX_HEAD without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = client.recv(4096)
        if not got or len(data) + len(got) > MAX_HEAD:
            return None
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def tunnel(client: socket.socket, dial=kubelet.dial) -> None:
    """Serve one CONNECT on `client`: answer 200 and pipe both ways to the target, or answer why not
    (400 a malformed request, 405 another method, 403 a target the twin does not route, 502 one
    that refused) and close."""
    try:
        got = _read_head(client)
        if got is None:
            _answer(client, "400 Bad Request", f"no request head within {MAX_HEAD} bytes")
            return client.close()
        head, rest = got
        method, _, target = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        target = target.rsplit(" ", 1)[0] if target.endswith(("HTTP/1.1", "HTTP/1.0")) else ""
        if method != "CONNECT" or not target:
            _answer(client, "405 Method Not Allowed" if target else "400 Bad Request",
                    "only CONNECT <address>:<port> HTTP/1.1 is served")
            return client.close()
        if why := refusal(target):
            _answer(client, "403 Forbidden", why)
            return client.close()
        host, _, port = target.rpartition(":")
        try:
            upstream = dial(host.strip("[]"), int(port), DIAL_TIMEOUT)
            upstream.settimeout(None)
        except OSError as exc:
            _answer(client, "502 Bad Gateway", f"dial tcp {target}: {exc}")
            return client.close()
    except OSError:
        return client.close()
    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")  # nothing else before the client speaks
    if rest:
        upstream.sendall(rest)
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=netns._pipe, args=(a, b), daemon=True).start()


def serve(socket_path: Path, dial=kubelet.dial) -> socket.socket:
    """The proxy on a Unix socket only its owner may use (0600): a daemon thread per connection.
    The returned listener stops it when closed."""
    socket_path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    socket_path.chmod(0o600)
    listener.listen(64)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=tunnel, args=(client, dial), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def start(folder: Path) -> tuple[list[str], socket.socket]:
    """The proxy serving `folder`/egress.sock, its configuration written beside it, and the API
    server's flags that use them."""
    socket_path = folder / "egress.sock"
    config = folder / "egress-selector.yaml"
    config.write_text(yaml.safe_dump(configuration(socket_path)))
    listener = serve(socket_path)
    return [f"--egress-selector-config-file={config}", "--enable-aggregator-routing=true"], listener
