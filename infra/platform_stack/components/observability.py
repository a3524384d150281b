"""Prometheus selecting every hosted environment's monitors and rules, and Grafana with
pdstack's dashboard of each environment."""

from __future__ import annotations

import json

import pulumi

from infra.components.k8s import LayerContext
from infra.components.monitoring import dashboard
from infra.platform_stack.components.base import PlatformLayer
from infra.platform_stack.spec import PlatformSpec
from infra.policy.rules import IMAGES_FROM_SPEC
from infra.spec import StackSpec

PROMETHEUS = "pdstack"
GRAFANA = "grafana"


def prometheus_url(spec: PlatformSpec) -> str:
    # prometheus-operator's governing Service of every Prometheus (pkg/prometheus/server: prometheus-operated)
    return f"http://prometheus-operated.{spec.monitoring_namespace}.svc:9090"


def prometheus_manifests(spec: PlatformSpec) -> list[dict]:
    ns, c = spec.monitoring_namespace, spec.controllers
    meta = lambda name: {"name": name, "namespace": ns}  # noqa: E731
    select = {"matchLabels": dict(spec.prometheus_selector)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(f"prometheus-{PROMETHEUS}")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"prometheus-{PROMETHEUS}"},
         "rules": [{"apiGroups": [""], "resources": ["nodes", "nodes/metrics", "services", "endpoints", "pods"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]},
                   {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"prometheus-{PROMETHEUS}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"prometheus-{PROMETHEUS}"},
         "subjects": [{"kind": "ServiceAccount", "name": f"prometheus-{PROMETHEUS}", "namespace": ns}]},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus", "metadata": meta(PROMETHEUS), "spec": {
            "serviceAccountName": f"prometheus-{PROMETHEUS}",
            "replicas": 2,
            "retention": c.prometheus_retention,
            "scrapeInterval": f"{c.prometheus_scrape_interval_seconds}s",
            # every namespace: the environments' and each release track's
            "podMonitorSelector": select, "podMonitorNamespaceSelector": {},
            "serviceMonitorSelector": select, "serviceMonitorNamespaceSelector": {},
            "ruleSelector": select, "ruleNamespaceSelector": {},
            "storage": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": f"{c.prometheus_storage_gib}Gi"}}}}}}},
    ]


def grafana_manifests(spec: PlatformSpec, serving: list[StackSpec]) -> list[dict]:
    ns = spec.monitoring_namespace
    labels = {"app.kubernetes.io/name": GRAFANA, "app.kubernetes.io/part-of": "pdstack-platform"}
    dashboards = {f"pdstack-{s.environment.name}.json": json.dumps(
        dashboard(LayerContext(spec=s, namespace=s.environment.namespace)), indent=1) for s in serving}
    provisioning = {
        "datasources.yaml": json.dumps({"apiVersion": 1, "datasources": [
            {"name": "Prometheus", "type": "prometheus", "access": "proxy", "url": prometheus_url(spec),
             "isDefault": True}]}),
        "dashboards.yaml": json.dumps({"apiVersion": 1, "providers": [
            {"name": "pdstack", "type": "file", "options": {"path": "/var/lib/grafana/dashboards"}}]}),
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "grafana-provisioning", "namespace": ns},
         "data": provisioning},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "grafana-dashboards", "namespace": ns},
         "data": dashboards},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": GRAFANA, "namespace": ns, "labels": labels,
                                                                   "annotations": {IMAGES_FROM_SPEC: "true"}},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
          "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 472, "fsGroup": 472},
                   "containers": [{
                       "name": GRAFANA, "image": spec.images.grafana,
                       "ports": [{"name": "http", "containerPort": 3000}],
                       "readinessProbe": {"httpGet": {"path": "/api/health", "port": 3000}, "timeoutSeconds": 5},
                       "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
                       "volumeMounts": [
                           {"name": "provisioning", "mountPath": "/etc/grafana/provisioning/datasources/pdstack.yaml",
                            "subPath": "datasources.yaml"},
                           {"name": "provisioning", "mountPath": "/etc/grafana/provisioning/dashboards/pdstack.yaml",
                            "subPath": "dashboards.yaml"},
                           {"name": "dashboards", "mountPath": "/var/lib/grafana/dashboards"}]}],
                   "volumes": [{"name": "provisioning", "configMap": {"name": "grafana-provisioning"}},
                               {"name": "dashboards", "configMap": {"name": "grafana-dashboards"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": GRAFANA, "namespace": ns, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 3000, "targetPort": "http"}]}},
    ]


class Observability(PlatformLayer):
    layer = "observability"

    def __init__(self, name: str, spec: PlatformSpec, serving: list[StackSpec], after: list[pulumi.Resource],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, opts)
        for manifest in prometheus_manifests(spec) + grafana_manifests(spec, serving):
            self.add(manifest, after)
        self.register_outputs({"prometheus_url": prometheus_url(spec)})
