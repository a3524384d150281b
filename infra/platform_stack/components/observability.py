"""Prometheus selecting every hosted environment's monitors and rules, and Grafana showing the
dashboards the serving stacks publish, behind a generated admin password."""

from __future__ import annotations

import json

import pulumi
import pulumi_random as random

from infra.components.monitoring import GRAFANA_DASHBOARD_LABEL
from infra.platform_stack.components.base import PlatformLayer
from infra.platform_stack.spec import PlatformSpec
from infra.policy.rules import IMAGES_FROM_SPEC

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


# Grafana's dashboards come from the serving stacks: each renders its namespace's dashboard as a
# ConfigMap labelled GRAFANA_DASHBOARD_LABEL (infra/components/monitoring.py), so each serving
# `pulumi up` (a release track's too) updates its own. A sidecar watches every namespace for them
# and writes each into the folder Grafana's file provider reads: kiwigrid/k8s-sidecar, the one the
# grafana chart runs (its README, "Configuration Environment Variables": LABEL, LABEL_VALUE,
# FOLDER, NAMESPACE=ALL, RESOURCE; UNIQUE_FILENAMES, since every namespace's data key is the same).
DASHBOARDS_FOLDER = "/var/lib/grafana/dashboards"
# Grafana's environment names for its [security] admin_user and admin_password (Grafana docs,
# "Configure Grafana", "Override configuration with environment variables": GF_<SECTION>_<KEY>).
GRAFANA_ADMIN_ENV = {"GF_SECURITY_ADMIN_USER": "admin-user", "GF_SECURITY_ADMIN_PASSWORD": "admin-password"}
GRAFANA_ADMIN_SECRET = "grafana-admin"


def grafana_manifests(spec: PlatformSpec, admin_password: pulumi.Input[str] | str) -> list[dict]:
    """Grafana, its dashboards sidecar and the Secret of its admin login (`admin_password`: a
    generated secret, never a default: Grafana's own is admin/admin)."""
    ns = spec.monitoring_namespace
    labels = {"app.kubernetes.io/name": GRAFANA, "app.kubernetes.io/part-of": "pdstack-platform"}
    provisioning = {
        "datasources.yaml": json.dumps({"apiVersion": 1, "datasources": [
            {"name": "Prometheus", "type": "prometheus", "access": "proxy", "url": prometheus_url(spec),
             "isDefault": True}]}),
        # Read again every 30 s: a dashboard the sidecar writes, changes or removes follows.
        "dashboards.yaml": json.dumps({"apiVersion": 1, "providers": [
            {"name": "pdstack", "type": "file", "disableDeletion": False, "updateIntervalSeconds": 30,
             "allowUiUpdates": False, "options": {"path": DASHBOARDS_FOLDER}}]}),
    }
    label, value = GRAFANA_DASHBOARD_LABEL
    reader = f"{GRAFANA}-dashboards"
    return [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": GRAFANA_ADMIN_SECRET, "namespace": ns},
         "stringData": {"admin-user": "admin", "admin-password": admin_password}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "grafana-provisioning", "namespace": ns},
         "data": provisioning},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": GRAFANA, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": reader},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": reader},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader},
         "subjects": [{"kind": "ServiceAccount", "name": GRAFANA, "namespace": ns}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": GRAFANA, "namespace": ns, "labels": labels,
                                                                   "annotations": {IMAGES_FROM_SPEC: "true"}},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
          "spec": {"serviceAccountName": GRAFANA,
                   "securityContext": {"runAsNonRoot": True, "runAsUser": 472, "fsGroup": 472},
                   "containers": [{
                       "name": GRAFANA, "image": spec.images.grafana,
                       "ports": [{"name": "http", "containerPort": 3000}],
                       "env": [{"name": env, "valueFrom": {"secretKeyRef": {"name": GRAFANA_ADMIN_SECRET, "key": key}}}
                               for env, key in GRAFANA_ADMIN_ENV.items()],
                       "readinessProbe": {"httpGet": {"path": "/api/health", "port": 3000}, "timeoutSeconds": 5},
                       "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
                       "volumeMounts": [
                           {"name": "provisioning", "mountPath": "/etc/grafana/provisioning/datasources/pdstack.yaml",
                            "subPath": "datasources.yaml"},
                           {"name": "provisioning", "mountPath": "/etc/grafana/provisioning/dashboards/pdstack.yaml",
                            "subPath": "dashboards.yaml"},
                           {"name": "dashboards", "mountPath": DASHBOARDS_FOLDER, "readOnly": True}]},
                       {"name": "dashboards", "image": spec.images.grafana_sidecar,
                        "env": [{"name": "LABEL", "value": label}, {"name": "LABEL_VALUE", "value": value},
                                {"name": "FOLDER", "value": DASHBOARDS_FOLDER}, {"name": "NAMESPACE", "value": "ALL"},
                                {"name": "RESOURCE", "value": "configmap"}, {"name": "UNIQUE_FILENAMES", "value": "true"}],
                        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                        "volumeMounts": [{"name": "dashboards", "mountPath": DASHBOARDS_FOLDER}]}],
                   "volumes": [{"name": "provisioning", "configMap": {"name": "grafana-provisioning"}},
                               {"name": "dashboards", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": GRAFANA, "namespace": ns, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 3000, "targetPort": "http"}]}},
    ]


class Observability(PlatformLayer):
    layer = "observability"

    def __init__(self, name: str, spec: PlatformSpec, after: list[pulumi.Resource],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, opts)
        password = random.RandomPassword(f"{GRAFANA}-admin", length=32, special=False,
                                         opts=pulumi.ResourceOptions(parent=self))
        for manifest in prometheus_manifests(spec) + grafana_manifests(spec, pulumi.Output.secret(password.result)):
            self.add(manifest, after)
        self.register_outputs({"prometheus_url": prometheus_url(spec)})
