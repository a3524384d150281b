"""Monitoring layer: scrape configs, SLO alerts and a dashboard for every stage."""

from __future__ import annotations

import hashlib
import json

import pulumi

from infra import naming
from infra.components.balancers import ROUTER_LABELS
from infra.components.engines import ENGINE_PORT_NAME
from infra.components.k8s import Layer, LayerContext
from infra.components.kvcache import server_labels
from infra.render.engine_args import all_launches
from infra.render.kvcache_config import kv_cache_plan
from infra.render.metrics import (ENGINE_METRICS, GROUP_SERIES_LABEL, POD_TARGET_LABELS, ROLE_SERIES_LABEL,
                                  ROUTER_REQUESTS, alert_rules, p99, pools_selector, prefix_cache_roles,
                                  prefix_hit_ratio, series_label, ttft_pools, with_selector, workers_export_metrics)
from infra.tracks import namespaces_matcher


def leaders_only_roles(ctx: LayerContext) -> list[str]:
    """Pools whose non-leader pods serve no /metrics (vLLM's headless workers)."""
    kind = ctx.spec.engine.kind
    return [role for role, launch in all_launches(ctx.spec).items()
            if launch.multi_node and not workers_export_metrics(kind, [*launch.args, *" ".join(launch.prelude).split()])]


def engine_pod_monitor(ctx: LayerContext) -> dict:
    """Every engine pod that serves /metrics: each node of an SGLang group exports its own
    schedulers' load (infra/render/metrics.py says where each engine exports what). A pool whose
    workers serve nothing has its non-leader targets dropped, so no target is down by design."""
    roles = list(ctx.spec.deployment.pools())
    endpoint: dict = {"port": ENGINE_PORT_NAME, "path": "/metrics",
                      "interval": f"{ctx.spec.observability.scrape_interval_seconds}s"}
    leaders_only = leaders_only_roles(ctx)
    if leaders_only:
        meta = lambda k: f"__meta_kubernetes_pod_label_{series_label(k)}"  # noqa: E731
        endpoint["relabelings"] = [{
            "sourceLabels": [meta(naming.ROLE_LABEL), meta(naming.LWS_WORKER_INDEX_LABEL)],
            "regex": f"({'|'.join(leaders_only)});[1-9][0-9]*", "action": "drop"}]
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": ctx.metadata("engines", "monitoring"),
        "spec": {
            "selector": {"matchExpressions": [{"key": naming.ROLE_LABEL, "operator": "In", "values": roles}]},
            "podMetricsEndpoints": [endpoint],
            "podTargetLabels": list(POD_TARGET_LABELS),
        },
    }


def kv_cache_monitor(ctx: LayerContext) -> dict | None:
    """The KV cache server's own metrics where it serves them: the Mooncake master's
    --metrics_port (its Service's `metrics` port; the pinned wheel's mooncake_master answers GET
    /metrics there in Prometheus's text format, tests/twin/test_metrics_on_twin.py). LMCache's
    server serves none: no monitor."""
    plan = kv_cache_plan(ctx.spec)
    if "metrics" not in plan.ports:
        return None
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": ctx.metadata(plan.server_name, "monitoring"),
            "spec": {"selector": {"matchLabels": server_labels(plan)},
                     "endpoints": [{"port": "metrics", "interval": f"{ctx.spec.observability.scrape_interval_seconds}s"}]}}


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


# The label Grafana's dashboards sidecar (the platform's, infra/platform_stack/components/
# observability.py) finds dashboard ConfigMaps by, in every namespace.
GRAFANA_DASHBOARD_LABEL = ("grafana_dashboard", "1")
# Grafana refuses a dashboard uid over 40 characters (grafana pkg/util/shortid_generator.go,
# IsShortUIDTooLong), and keeps one dashboard per uid.
GRAFANA_UID_MAX = 40
NAMESPACE_VARIABLE = "$namespace"


def dashboard_uid(namespace: str) -> str:
    """One uid per namespace: release tracks render their dashboards side by side. A namespace too
    long for `pdstack-<namespace>` keeps its head and a digest of the whole, so two tracks differing
    only in their revision's last digits stay apart."""
    uid = f"pdstack-{namespace}"
    if len(uid) <= GRAFANA_UID_MAX:
        return uid
    digest = hashlib.sha256(namespace.encode()).hexdigest()[:10]
    return f"{uid[:GRAFANA_UID_MAX - len(digest) - 1]}-{digest}"


def dashboard(ctx: LayerContext) -> dict:
    """The namespace's dashboard. Every panel reads one namespace, the `namespace` variable's: the
    dashboard's own, or, for an environment's (the platform's Grafana shows one per environment),
    any of its release tracks (`<namespace>-r<revision>`), picked from those exporting series."""
    spec = ctx.spec
    m = ENGINE_METRICS[spec.engine.kind]
    roles = list(spec.deployment.pools())
    lb = spec.deployment.load_balancer.implementation
    namespace = spec.environment.namespace

    def panel(i: int, title: str, exprs: list[tuple[str, str]], unit: str) -> dict:
        return {"id": i, "type": "timeseries", "title": title, "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
                "fieldConfig": {"defaults": {"unit": unit}},
                "targets": [{"expr": e, "legendFormat": legend, "refId": chr(65 + j)} for j, (e, legend) in enumerate(exprs)]}

    pools = lambda of: pools_selector(NAMESPACE_VARIABLE, of)  # noqa: E731
    every_pool, this_namespace = pools(roles), f'{{namespace="{NAMESPACE_VARIABLE}"}}'
    per_instance = f"{{{{{ROLE_SERIES_LABEL}}}}} {{{{{GROUP_SERIES_LABEL}}}}}"
    panels = [
        # Where each engine times first tokens (an SGLang PD prefill times none: decode's are the client's).
        panel(0, "TTFT p99 by stage", [(p99(m.ttft_bucket, pools([r])), r) for r in ttft_pools(spec)], "s"),
        panel(1, "TPOT p99 by stage", [(p99(m.tpot_bucket, pools([r])), r) for r in roles if r != "prefill"], "s"),
        # An instance is a group: every node of an SGLang group exports its own schedulers.
        panel(2, "Queue depth per instance",
              [(f"sum by (namespace, {GROUP_SERIES_LABEL}, {ROLE_SERIES_LABEL}) ({with_selector(m.queue_depth, every_pool)})",
                per_instance)], "short"),
        panel(3, "Running requests per instance (load spread)",
              [(f"sum by (namespace, {GROUP_SERIES_LABEL}, {ROLE_SERIES_LABEL}) ({with_selector(m.running, every_pool)})",
                per_instance)], "short"),
        panel(4, "KV cache usage per instance",
              [(f"max by (namespace, pod) ({with_selector(m.kv_cache_usage, every_pool)})", "{{pod}}")], "percentunit"),
        panel(5, "Prefix-cache hit rate",
              [(prefix_hit_ratio(spec, NAMESPACE_VARIABLE), f"{{{{{ROLE_SERIES_LABEL}}}}}")]
              if prefix_cache_roles(spec) else [], "percentunit"),
        panel(6, "KV transfer failures",
              [(f"sum(rate({with_selector(m.kv_transfer_failures, every_pool)}[5m]))", "failures/s")], "short"),
        # The router's series carry its pods' namespace (the ServiceMonitor's, the track's).
        panel(7, "Router requests",
              [(f"sum(rate({with_selector(ROUTER_REQUESTS[lb], this_namespace)}[5m]))", "req/s")], "reqps"),
    ]
    choices = f"label_values({with_selector(m.running, f'{{{namespaces_matcher(namespace)}}}')}, namespace)"
    variable = {"name": "namespace", "label": "namespace", "type": "query", "query": choices, "definition": choices,
                "refresh": 2, "sort": 1, "multi": False, "includeAll": False}
    return {"title": f"pdstack {spec.environment.name} ({namespace})", "uid": dashboard_uid(namespace),
            "schemaVersion": 39, "time": {"from": "now-6h", "to": "now"}, "templating": {"list": [variable]},
            "panels": panels}


class Monitoring(Layer):
    layer = "monitoring"

    def __init__(self, name: str, ctx: LayerContext, router_metrics_port: int, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        self.add(engine_pod_monitor(ctx))
        self.add({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": ctx.metadata(naming.ROUTER, "monitoring"),
            "spec": {"selector": {"matchLabels": ROUTER_LABELS}, "podTargetLabels": [naming.RELEASE_LABEL],
                     "endpoints": [{"port": "metrics", "interval": f"{ctx.spec.observability.scrape_interval_seconds}s"}]},
        })
        kv_cache = kv_cache_monitor(ctx)
        if kv_cache:
            self.add(kv_cache)
        self.add(prometheus_rule(ctx))
        self.add({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {**ctx.metadata("pdstack-dashboard", "monitoring"),
                         "labels": {**ctx.metadata("x", "monitoring")["labels"],
                                    GRAFANA_DASHBOARD_LABEL[0]: GRAFANA_DASHBOARD_LABEL[1]}},
            "data": {"pdstack.json": json.dumps(dashboard(ctx), indent=1)},
        })
        self.register_outputs({})
