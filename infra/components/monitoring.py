"""Monitoring layer: scrape configs, SLO alerts and a dashboard for every stage."""

from __future__ import annotations

import json

import pulumi

from infra import naming
from infra.components.balancers import ROUTER_LABELS
from infra.components.engines import ENGINE_PORT_NAME
from infra.components.k8s import Layer, LayerContext
from infra.render.metrics import ENGINE_METRICS, alert_rules, p99


def prometheus_rule(ctx: LayerContext) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": ctx.metadata("pdstack-alerts", "monitoring"),
        "spec": {"groups": [{"name": "pdstack-slo", "rules": [
            {"alert": r.name, "expr": r.expr, "for": r.for_, "labels": {"severity": r.severity},
             "annotations": {"summary": r.summary}}
            for r in alert_rules(ctx.spec)]}]},
    }


def dashboard(ctx: LayerContext) -> dict:
    m = ENGINE_METRICS[ctx.spec.engine.kind]
    roles = list(ctx.spec.deployment.pools())

    def panel(i: int, title: str, exprs: list[tuple[str, str]], unit: str) -> dict:
        return {"id": i, "type": "timeseries", "title": title, "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
                "fieldConfig": {"defaults": {"unit": unit}},
                "targets": [{"expr": e, "legendFormat": legend, "refId": chr(65 + j)} for j, (e, legend) in enumerate(exprs)]}

    role_sel = lambda role: f'{{{naming.ROLE_LABEL.replace(".", "_").replace("/", "_")}="{role}"}}'  # noqa: E731
    panels = [
        panel(0, "TTFT p99 by stage", [(p99(m.ttft_bucket, role_sel(r)), r) for r in roles], "s"),
        panel(1, "TPOT p99 by stage", [(p99(m.tpot_bucket, role_sel(r)), r) for r in roles], "s"),
        panel(2, "Queue depth per instance", [(f"sum by (pod) ({m.queue_depth})", "{{pod}}")], "short"),
        panel(3, "Running requests per instance (load spread)", [(f"sum by (pod) ({m.running})", "{{pod}}")], "short"),
        panel(4, "KV cache usage per instance", [(f"max by (pod) ({m.kv_cache_usage})", "{{pod}}")], "percentunit"),
        panel(5, "Prefix-cache hit rate", [(m.prefix_hit_ratio, "hit rate")], "percentunit"),
        panel(6, "KV transfer failures", [(f"sum(rate({m.kv_transfer_failures}[5m]))", "failures/s")], "short"),
        panel(7, "Router requests", [("sum(rate(smg_http_requests_total[5m]))", "req/s")], "reqps"),
    ]
    return {"title": f"pdstack {ctx.spec.environment.name}", "uid": f"pdstack-{ctx.spec.environment.name}",
            "schemaVersion": 39, "time": {"from": "now-6h", "to": "now"}, "panels": panels}


class Monitoring(Layer):
    layer = "monitoring"

    def __init__(self, name: str, ctx: LayerContext, router_metrics_port: int, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        roles = list(ctx.spec.deployment.pools())
        self.add({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": ctx.metadata("engines", "monitoring"),
            "spec": {
                # Group leaders only: in a multi-node group only rank 0 serves HTTP and /metrics.
                "selector": {"matchExpressions": [{"key": naming.ROLE_LABEL, "operator": "In", "values": roles}],
                             "matchLabels": {naming.LWS_WORKER_INDEX_LABEL: "0"}},
                "podMetricsEndpoints": [{"port": ENGINE_PORT_NAME, "path": "/metrics", "interval": f"{ctx.spec.observability.scrape_interval_seconds}s"}],
                "podTargetLabels": [naming.ROLE_LABEL, naming.RELEASE_LABEL],
            },
        })
        self.add({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": ctx.metadata(naming.ROUTER, "monitoring"),
            "spec": {"selector": {"matchLabels": ROUTER_LABELS}, "podTargetLabels": [naming.RELEASE_LABEL],
                     "endpoints": [{"port": "metrics", "interval": f"{ctx.spec.observability.scrape_interval_seconds}s"}]},
        })
        self.add(prometheus_rule(ctx))
        self.add({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {**ctx.metadata("pdstack-dashboard", "monitoring"),
                         "labels": {**ctx.metadata("x", "monitoring")["labels"], "grafana_dashboard": "1"}},
            "data": {"pdstack.json": json.dumps(dashboard(ctx), indent=1)},
        })
        self.register_outputs({})
