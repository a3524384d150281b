"""KEDA's metrics API server on the twin, reached by the API server as on a cluster without a flat
network: through the egress selector's `cluster` connection, an HTTP CONNECT proxy on a Unix socket
(twin/egress.py), into the pod network where the server runs (twin/dataplane.py).

The aggregator (k8s.io/kube-aggregator v0.34.4, the pinned k8s.io/kubernetes v1.34.4's) marks an
APIService Available once a discovery GET of its group version through its proxy transport answers
2xx (pkg/controllers/status/remote/remote_available_controller.go), and FailedDiscoveryCheck with
the dial's error otherwise; the proxy transport dials through the egress selector's `cluster`
connection when one is configured (pkg/apiserver/apiserver.go). With --enable-aggregator-routing it
dials the endpoint the Service's EndpointSlice names (k8s.io/apiserver pkg/util/proxy ResolveEndpoint).
"""

from __future__ import annotations

import json

import pytest

from tests.twin.conftest import FIGURES
from twin import dataplane, fleet
from twin.api import kubectl

API_SERVICE = "v1beta1.external.metrics.k8s.io"
GROUP_VERSION = "external.metrics.k8s.io/v1beta1"


def _available() -> dict:
    api_service = json.loads(kubectl("get", "apiservice", API_SERVICE, "-o", "json").stdout)
    return next((c for c in api_service.get("status", {}).get("conditions", []) if c["type"] == "Available"), {})


def _slice() -> dict:
    (endpoints,) = [o for o in dataplane.keda_metrics_server_objects() if o["kind"] == "EndpointSlice"]
    return endpoints


def test_the_external_metrics_api_is_served_by_kedas_metrics_server_through_the_egress_proxy(twin):
    """The APIService KEDA's config/metrics-server declares is Available, and the API server answers
    GET /apis/external.metrics.k8s.io/v1beta1 with KEDA's resource list: both only if the API server
    reached the server at its pod-network address. Fails on a twin without the egress proxy (the
    API server cannot route a pod address: FailedDiscoveryCheck) or without the metrics server (no
    APIService: NotFound)."""
    available = fleet.wait_for("the APIService Available", lambda: _available().get("status") == "True" and _available(),
                               timeout=120) or _available()
    assert available.get("status") == "True", available
    listed = json.loads(kubectl("get", "--raw", f"/apis/{GROUP_VERSION}").stdout)
    assert listed["kind"] == "APIResourceList" and listed["groupVersion"] == GROUP_VERSION, listed
    FIGURES.append(f"KEDA metrics API server v2.20.2 (real) at {dataplane.METRICS_SERVER_IP}:6443 in the pod network: "
                   f"APIService {API_SERVICE} Available ({available['reason']}), reached by the API server through "
                   "its egress selector (HTTP CONNECT over a Unix socket)")


@pytest.fixture
def endpoint_nowhere(twin):
    """The server's EndpointSlice pointed at a pod address nothing holds; put back afterwards."""
    moved = _slice()
    moved["endpoints"][0]["addresses"] = ["10.244.255.253"]
    assert fleet.apply_each_pass([moved]).rejected == {}
    yield
    assert fleet.apply_each_pass([_slice()]).rejected == {}
    fleet.wait_for("the APIService Available again", lambda: _available().get("status") == "True", timeout=120,
                   required=True)


def test_an_endpoint_no_pod_holds_fails_the_discovery_check_with_the_proxys_answer(endpoint_nowhere):
    """The deliberate break: the same APIService, its endpoint an address no pod holds. The aggregator's
    check goes through the egress proxy, which answers 502 for the dial it could not make, and the
    condition says so (egress_selector.go: "proxy error from <socket> while dialing <addr>, code 502")."""
    def failed():
        condition = _available()
        return condition if condition.get("status") == "False" and "10.244.255.253" in condition.get("message", "") else None

    condition = fleet.wait_for("the APIService not Available", failed, timeout=120) or _available()
    assert condition.get("reason") == "FailedDiscoveryCheck", condition
    assert "egress.sock" in condition["message"] and "502" in condition["message"], condition
