"""Service names and NetworkPolicies, read against how the controllers and components connect.

Connections are judged by tests/netpol.py, which encodes the NetworkPolicy semantics of
kubernetes.io/docs/concepts/services-networking/network-policies/.
"""

from __future__ import annotations

import pytest

from infra import naming
from infra.offline import run_spec
from infra.render.engine_args import ENGINE_PORT
from infra.spec_checks import parse_spec
from tests.conftest import shipped_run, stack_data, vllm_with_epp
from tests.netpol import Endpoint, connection_allowed


def test_lws_owns_the_service_named_after_each_leaderworkerset():
    """LWS creates a headless Service named after the LeaderWorkerSet only if none exists,
    selecting every pod of the set and publishing not-ready addresses, and makes it the pods'
    DNS subdomain; workers reach their leader through it before anything is Ready
    (kubernetes-sigs/lws v0.10.0, pkg/utils/controller/controller_utils.go
    CreateHeadlessServiceIfNotExists; pkg/controllers/leaderworkerset_controller.go
    reconcileHeadlessServices). A Service of ours with that name and a leaders-only, ready-only
    selector would take its place: workers could never resolve the leader."""
    for stack in ("dev", "prod"):
        run = shipped_run(stack)
        services = {s["metadata"]["name"]: s for s in run.by_kind("Service")}
        for group in run.by_kind("LeaderWorkerSet"):
            name = group["metadata"]["name"]
            assert name not in services, f"{stack}: Service {name} would shadow LWS's headless Service"
            leaders = services[f"{name}-http"]["spec"]
            role = group["metadata"]["labels"][naming.ROLE_LABEL]
            assert leaders["selector"] == {naming.ROLE_LABEL: role, naming.SERVES_API_LABEL: "true"}


def policies(run) -> list[dict]:
    return run.by_kind("NetworkPolicy")


def pod(namespace: str, **labels: str) -> Endpoint:
    return Endpoint(namespace, labels, {"pdstack.io/environment": "prod"})


API_SERVER = Endpoint(None, address="10.0.0.12")
ROUTER = {"app.kubernetes.io/name": naming.ROUTER}


def test_the_router_reaches_the_api_server_for_service_discovery():
    """The SGLang router's Kubernetes service discovery (--service-discovery, sgl-project/sglang
    sgl-model-gateway, src/service_discovery.rs: a kube client watching pods) and the endpoint
    picker (gateway-api-inference-extension: controller-runtime watches of pods and the
    InferencePool) talk to the API server, outside the pod network, after the `kubernetes`
    Service's DNAT to its endpoints (443 on EKS, 6443 on kubeadm). Default-deny egress must let
    them, and only them."""
    run = shipped_run("prod")
    ns = "pdstack-prod"
    for port in (443, 6443):
        assert connection_allowed(policies(run), pod(ns, **ROUTER), API_SERVER, port)
    assert not connection_allowed(policies(run), pod(ns, **{naming.ROLE_LABEL: "decode"}), API_SERVER, 6443)
    # Named API server addresses narrow it to them.
    data = stack_data("prod")
    data["environment"]["api_server_cidrs"] = ["10.0.0.12/32"]
    narrowed = policies(run_spec(parse_spec(data)))
    assert connection_allowed(narrowed, pod(ns, **ROUTER), API_SERVER, 443)
    assert not connection_allowed(narrowed, pod(ns, **ROUTER), Endpoint(None, address="192.0.2.1"), 443)


def test_inside_the_namespace_and_to_the_kv_store_everything_flows():
    run = shipped_run("prod")
    ns = "pdstack-prod"
    prefill, decode = pod(ns, **{naming.ROLE_LABEL: "prefill"}), pod(ns, **{naming.ROLE_LABEL: "decode"})
    assert connection_allowed(policies(run), prefill, decode, 12345)  # KV transfer, any port
    assert connection_allowed(policies(run), pod(ns, **ROUTER), prefill, ENGINE_PORT["sglang"])
    outsider = Endpoint("other", {}, {})
    assert not connection_allowed(policies(run), outsider, prefill, ENGINE_PORT["sglang"])


@pytest.mark.parametrize("implementation", ["sglang_router", "gateway_epp"])
def test_the_gateway_reaches_what_it_routes_to(implementation):
    """Routing to an InferencePool, the gateway connects straight to the endpoint the picker
    chose, on the pool's targetPorts (gateway-api-inference-extension, docs: endpoint picker
    protocol, `x-gateway-destination-endpoint`); routing to the router, it connects to the
    router only."""
    data = stack_data("prod")
    if implementation == "gateway_epp":
        vllm_with_epp(data)
    spec = parse_spec(data)
    run = run_spec(spec)
    ns = "pdstack-prod"
    envoy = Endpoint(spec.access.gateway_namespace, {"app.kubernetes.io/name": "envoy"}, {})
    leader = pod(ns, **{naming.ROLE_LABEL: "decode", naming.LWS_WORKER_INDEX_LABEL: "0", naming.SERVES_API_LABEL: "true"})
    worker = pod(ns, **{naming.ROLE_LABEL: "prefill", naming.LWS_WORKER_INDEX_LABEL: "1"})  # headless: serves nothing
    port = ENGINE_PORT[spec.engine.kind]
    assert connection_allowed(policies(run), envoy, leader, port) == (implementation == "gateway_epp")
    assert not connection_allowed(policies(run), envoy, worker, port)
    # The router, or for an InferencePool the endpoint picker the gateway calls (ext-proc).
    (router,) = [s for s in run.by_kind("Service") if s["metadata"]["name"] == naming.ROUTER]
    router_port = next(p["port"] for p in router["spec"]["ports"] if p["name"] == "http")
    assert connection_allowed(policies(run), envoy, pod(ns, **ROUTER), router_port)


def test_engines_reach_the_pod_identity_agent_for_their_weights_credentials():
    """Under EKS Pod Identity the AWS SDK in the weights fetch takes its credentials from the agent
    on the node's link-local address, port 80 (AWS_CONTAINER_CREDENTIALS_FULL_URI,
    docs.aws.amazon.com/eks/latest/userguide/pod-id-how-it-works.html); default-deny egress let
    the engines reach the bucket's port 443 only, so they would have had no credentials. Only
    the engines (what reads weights) may, and only where the spec uses Pod Identity."""
    run = shipped_run("prod")
    ns = "pdstack-prod"
    agent_v4, agent_v6 = Endpoint(None, address="169.254.170.23"), Endpoint(None, address="fd00:ec2::23")
    for role in ("prefill", "decode"):
        engine = pod(ns, **{naming.ROLE_LABEL: role})
        assert connection_allowed(policies(run), engine, agent_v4, 80)
        assert connection_allowed(policies(run), engine, agent_v6, 80)
        assert not connection_allowed(policies(run), engine, Endpoint(None, address="169.254.169.254"), 80)
    assert not connection_allowed(policies(run), pod(ns, **ROUTER), agent_v4, 80)
    data = stack_data("prod")
    data["model"]["weights"]["access"] = "irsa"  # STS over 443, which the bucket's rule already lets through
    irsa = policies(run_spec(parse_spec(data)))
    assert not connection_allowed(irsa, pod(ns, **{naming.ROLE_LABEL: "decode"}), agent_v4, 80)
