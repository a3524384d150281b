"""Tracing layer: an OpenTelemetry Collector (Deployment and Service) that receives the
spans of every hop (gateway, router, prefill, decode) and forwards a sample of whole traces
to the backend in `observability.otlp_endpoint`. Absent when no endpoint is set.
"""

from __future__ import annotations

import pulumi
import yaml

from infra import naming
from infra.components.k8s import Layer, LayerContext, disruption_budget
from infra.render import tracing

COLLECTOR_LABELS = {"app.kubernetes.io/name": naming.OTEL_COLLECTOR}
CONFIG_PATH = "/etc/otelcol"


def collector_manifests(ctx: LayerContext) -> list[dict]:
    spec = ctx.spec
    meta = lambda: ctx.metadata(naming.OTEL_COLLECTOR, "tracing", **COLLECTOR_LABELS)  # noqa: E731
    container = {
        "name": "otel-collector",
        "image": spec.images.otel_collector,
        "args": [f"--config={CONFIG_PATH}/config.yaml"],
        "ports": [{"name": "otlp-grpc", "containerPort": tracing.OTLP_GRPC_PORT},
                  {"name": "otlp-http", "containerPort": tracing.OTLP_HTTP_PORT},
                  {"name": "health", "containerPort": tracing.COLLECTOR_HEALTH_PORT}],
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
        "readinessProbe": {"httpGet": {"path": "/", "port": tracing.COLLECTOR_HEALTH_PORT}, "periodSeconds": 10},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_PATH, "readOnly": True}],
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta(), "name": f"{naming.OTEL_COLLECTOR}-config"},
         "data": {"config.yaml": yaml.safe_dump(tracing.collector_config(spec), sort_keys=False)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(), "spec": {
            "replicas": 2,
            "selector": {"matchLabels": COLLECTOR_LABELS},
            "template": {"metadata": {"labels": ctx.pod_labels(**COLLECTOR_LABELS)}, "spec": {
                "automountServiceAccountToken": False,
                "containers": [container],
                "volumes": [{"name": "config", "configMap": {"name": f"{naming.OTEL_COLLECTOR}-config"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(), "spec": {
            "selector": COLLECTOR_LABELS,
            "ports": [{"name": "otlp-grpc", "port": tracing.OTLP_GRPC_PORT, "targetPort": tracing.OTLP_GRPC_PORT},
                      {"name": "otlp-http", "port": tracing.OTLP_HTTP_PORT, "targetPort": tracing.OTLP_HTTP_PORT}]}},
        disruption_budget(ctx, naming.OTEL_COLLECTOR, "tracing", COLLECTOR_LABELS, max_unavailable=1),
        # default-deny blocks egress: let the collector reach the trace backend, and the
        # gateway's proxies (in their own namespace) reach the collector.
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
         "metadata": ctx.metadata("allow-tracing", "tracing"), "spec": {
             "podSelector": {"matchLabels": COLLECTOR_LABELS}, "policyTypes": ["Ingress", "Egress"],
             "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {
                 "kubernetes.io/metadata.name": spec.access.gateway_namespace}}}],
                 "ports": [{"protocol": "TCP", "port": tracing.OTLP_GRPC_PORT}]}],
             "egress": [{"ports": [{"protocol": "TCP", "port": tracing.backend_port(spec)}]}]}},
    ]


class Tracing(Layer):
    layer = "tracing"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        for manifest in collector_manifests(ctx):
            self.add(manifest)
        self.register_outputs({"collector": f"{tracing.collector_host(ctx.spec)}:{tracing.OTLP_GRPC_PORT}"})
