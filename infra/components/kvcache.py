"""KV cache layer: the distributed store (Mooncake master or LMCache server) and its config."""

from __future__ import annotations

import pulumi

from infra.components.k8s import Layer, LayerContext
from infra.render.kvcache_config import KVCachePlan, kv_cache_plan

KVCACHE_CONFIGMAP = "kvcache-config"


def server_labels(plan: KVCachePlan) -> dict[str, str]:
    """What the KV cache server's pod and Service carry, and its Service and monitor select by."""
    return {"app.kubernetes.io/name": plan.server_name}


class KVCache(Layer):
    layer = "kvcache"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        plan = self.plan = kv_cache_plan(ctx.spec)
        labels = server_labels(plan)
        meta = ctx.metadata(plan.server_name, "kvcache", **labels)
        self.config = self.add({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": ctx.metadata(KVCACHE_CONFIGMAP, "kvcache"),
            "data": {
                **plan.files,
                "policy.txt": "\n".join([f"store: {plan.store}", *plan.notes]) + "\n",
            },
        })
        self.server = self.add({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": {**ctx.labels, **labels}},
                    "spec": {
                        "automountServiceAccountToken": False,  # the cache server never calls the API
                        "containers": [{
                            "name": plan.server_name,
                            "image": plan.image,
                            "command": plan.command,
                            "ports": [{"name": k, "containerPort": v} for k, v in plan.ports.items()],
                            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "8", "memory": "32Gi"}},
                            "readinessProbe": {"tcpSocket": {"port": plan.ports["rpc"]}, "periodSeconds": 5},
                        }],
                    },
                },
            },
        })
        self.service = self.add({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": labels, "ports": [{"name": k, "port": v, "targetPort": v} for k, v in plan.ports.items()]},
        })
        self.register_outputs({"store": plan.store})
