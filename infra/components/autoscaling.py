"""Autoscaling layer: one scaler per engine pool, on the signals of
infra/planning/autoscaling.py, targeting the pool's LeaderWorkerSet (so a wide-EP decode
instance is added or removed as a whole group, never pod by pod).

- scaler: keda -> a KEDA ScaledObject with one Prometheus trigger per signal.
- scaler: hpa  -> an autoscaling/v2 HPA on External metrics, fed by recording rules
  (`pdstack:<role>:<signal>`) that prometheus-adapter serves under the names in
  `external_metric_name` (its rules are rendered into a ConfigMap for the adapter to load).
  Release tracks record the same names, so every recorded series carries its namespace and
  the adapter's rules are namespaced: an HPA reads only its own namespace's value
  (kubernetes-sigs/prometheus-adapter docs/externalmetrics.md: with a namespace resource
  override, <<.LabelMatchers>> holds the HPA's namespace). The rules are the same in every
  namespace, so one adapter configuration serves all tracks.

Scale-down is slow and gentle: a stabilisation window, one instance per period, and each
stopping engine pod drains for `drain_seconds` first (see infra/components/engines.py).
"""

from __future__ import annotations

import pulumi
import yaml

from infra import naming
from infra.components.k8s import Layer, LayerContext
from infra.planning.capacity import claims_whole_domain
from infra.planning.autoscaling import Signal, scale_up_policies, signals
from infra.spec import StackSpec

LWS_API = "leaderworkerset.x-k8s.io/v1"


def behavior(spec: StackSpec, role: str) -> dict:
    auto = spec.deployment.autoscaling
    return {
        "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_stabilization_seconds, "selectPolicy": "Max",
                    "policies": scale_up_policies(claims_whole_domain(spec, role))},
        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds, "selectPolicy": "Min",
                      # One instance per period, and a period outlasts the drain of the last one.
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": max(300, auto.drain_seconds + 60)}]},
    }


def _target(role: str) -> dict:
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": naming.engine(role)}


def scaled_object(ctx: LayerContext, role: str) -> dict:
    spec = ctx.spec
    auto = spec.deployment.autoscaling
    lo, hi = spec.deployment.pools()[role].bounds()
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": ctx.metadata(naming.engine(role), "autoscaling", **{naming.ROLE_LABEL: role}),
        "spec": {
            "scaleTargetRef": _target(role),
            "pollingInterval": auto.polling_interval_seconds,
            "minReplicaCount": lo,
            "maxReplicaCount": hi,
            "advanced": {"horizontalPodAutoscalerConfig": {"name": naming.engine(role), "behavior": behavior(spec, role)}},
            "triggers": [
                {"type": "prometheus", "name": s.name.replace("_", "-"), "metricType": s.metric_type,
                 "metadata": {"serverAddress": auto.prometheus_url, "query": s.query, "threshold": f"{s.target:g}"}}
                for s in signals(spec, role)],
        },
    }


def recorded_series(role: str, signal: Signal) -> str:
    return f"pdstack:{role}:{signal.name}"


def external_metric_name(role: str, signal: Signal) -> str:
    return f"pdstack_{role}_{signal.name}"


def horizontal_pod_autoscaler(ctx: LayerContext, role: str) -> dict:
    spec = ctx.spec
    lo, hi = spec.deployment.pools()[role].bounds()

    def metric(s: Signal) -> dict:
        target = {"type": "AverageValue", "averageValue": f"{s.target:g}"} if s.metric_type == "AverageValue" \
            else {"type": "Value", "value": f"{s.target:g}"}
        return {"type": "External", "external": {"metric": {"name": external_metric_name(role, s)}, "target": target}}

    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": ctx.metadata(naming.engine(role), "autoscaling", **{naming.ROLE_LABEL: role}),
        "spec": {"scaleTargetRef": _target(role), "minReplicas": max(1, lo), "maxReplicas": hi,
                 "metrics": [metric(s) for s in signals(spec, role)], "behavior": behavior(spec, role)},
    }


def hpa_support(ctx: LayerContext) -> list[dict]:
    """Recording rules for every signal, and prometheus-adapter rules that serve them."""
    pools = list(ctx.spec.deployment.pools())
    rules = [{"record": recorded_series(role, s),
              "expr": f'label_replace({s.query}, "namespace", "{ctx.namespace}", "", "")'}
             for role in pools for s in signals(ctx.spec, role)]
    adapter = {"externalRules": [
        {"seriesQuery": f'{{__name__="{recorded_series(role, s)}",namespace!=""}}',
         "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
         "name": {"matches": f"^{recorded_series(role, s)}$", "as": external_metric_name(role, s)},
         "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>})"}
        for role in pools for s in signals(ctx.spec, role)]}
    return [
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
         "metadata": ctx.metadata("pdstack-scaling-signals", "autoscaling"),
         "spec": {"groups": [{"name": "pdstack-scaling", "interval": f"{ctx.spec.deployment.autoscaling.polling_interval_seconds}s",
                              "rules": rules}]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": ctx.metadata("prometheus-adapter-pdstack-rules", "autoscaling"),
         "data": {"rules.yaml": yaml.safe_dump(adapter, sort_keys=False)}},
    ]


class Autoscaling(Layer):
    layer = "autoscaling"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        auto = ctx.spec.deployment.autoscaling
        self.scalers = {}
        if auto.enabled:
            make = scaled_object if auto.scaler == "keda" else horizontal_pod_autoscaler
            if auto.scaler == "hpa":
                for manifest in hpa_support(ctx):
                    self.add(manifest)
            for role in ctx.spec.deployment.pools():
                self.scalers[role] = self.add(make(ctx, role))
        self.register_outputs({})
