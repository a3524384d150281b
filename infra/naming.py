"""Names and labels shared by the layers, so that a selector and its target cannot drift."""

from __future__ import annotations

ROLE_LABEL = "pdstack.io/role"  # node pools, taints and pods: prefill | decode | colocated
RELEASE_LABEL = "pdstack.io/release"  # pods: the release revision they run (canary gates read it)
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LWS; "0" is the leader
ROLE_TAINT_EFFECT = "NoSchedule"

ROUTER = "router"
ENCODER = "encoder"
GATEWAY = "gateway"
INFERENCE_POOL = "pdstack-pool"
MOONCAKE_MASTER = "mooncake-master"
LMCACHE_SERVER = "lmcache-server"
OTEL_COLLECTOR = "otel-collector"


def engine(role: str) -> str:
    """Name of a pool's LeaderWorkerSet. LWS also names its own headless Service (the pods' DNS
    subdomain, through which workers find their leader) after it: pdstack never uses this name
    for a Service of its own."""
    return f"engine-{role}"


def engine_http(role: str) -> str:
    """The Service over a pool's leaders, which serve HTTP (for operators and port-forwards;
    routers find engines through the Kubernetes API by label)."""
    return f"engine-{role}-http"


def service_dns(service: str, namespace: str) -> str:
    return f"{service}.{namespace}.svc.cluster.local"
