"""The data path's controllers, running for real on the cluster twin (twin/dataplane.py): their
verdict on what pdstack renders is the status they write and the objects they make from it.

prometheus-operator v0.93.0 (cmd/operator, github.com/prometheus-operator/prometheus-operator,
built from twin/prometheus-operator/go.mod, run with its bundle.yaml Deployment's args as the
ServiceAccount and ClusterRole of that bundle.yaml): the platform stack's Prometheus
(infra/platform_stack/components/observability.py) and dev's rendered PodMonitor, ServiceMonitor
and PrometheusRule. What it writes, per its source at that version: the Prometheus's
`Reconciled` and `Available` conditions (pkg/prometheus/server/operator.go, pkg/operator
status), the StatefulSet `prometheus-<name>`, the Secret `prometheus-<name>` holding the
generated configuration gzipped under `prometheus.yaml.gz` (pkg/prometheus/promcfg.go: one scrape
job `podMonitor/<namespace>/<name>/<endpoint index>` per PodMonitor endpoint, `serviceMonitor/...`
alike) and the ConfigMap `prometheus-<name>-rulefiles-0` with one file per PrometheusRule
(`<namespace>-<name>-<uid>.yaml`, pkg/operator/rules.go); a rule file Prometheus's own parser
refuses is left out, with a Warning event `InvalidConfiguration` on the PrometheusRule.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json

import pytest
import yaml

from infra.platform_stack.components.observability import PROMETHEUS, prometheus_manifests
from infra.platform_stack.spec import load_platform_spec
from tests.twin.conftest import FIGURES
from tests.twin.placement import delete_namespaces
from twin import fleet
from twin.cluster import kubectl
from twin.paths import ROOT

MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")


def _condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def _events(namespace: str, kind: str, name: str) -> list[str]:
    return [f"{e['reason']}: {e['message']}" for e in fleet.get("events", "-n", namespace, "--field-selector",
                                                                   f"involvedObject.kind={kind},involvedObject.name={name}")]


@pytest.fixture(scope="module")
def monitored_dev(twin, tmp_path_factory):
    """The platform's Prometheus (platform-dev's spec) and dev's rendered monitors and rules, applied."""
    platform = load_platform_spec(ROOT / "stacks" / "platform-dev.yaml")
    rendered = fleet.render("dev", tmp_path_factory.mktemp("dev-monitoring"))
    monitors = [o for o in rendered if o["kind"] in MONITORING_KINDS]
    namespaces = [o for o in rendered if o["kind"] == "Namespace"] + [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": platform.monitoring_namespace}}]
    prometheus = prometheus_manifests(platform)
    result = fleet.apply_each_pass([*namespaces, *prometheus, *monitors])
    assert result.rejected == {}, result.rejected
    yield platform, monitors
    cluster_wide = [f"{o['kind'].lower()}.rbac.authorization.k8s.io/{o['metadata']['name']}"
                    for o in prometheus if o["kind"].startswith("Cluster")]
    kubectl("delete", "--ignore-not-found", *cluster_wide)
    delete_namespaces([o["metadata"]["name"] for o in namespaces])


def _reconciled(platform) -> dict | None:
    found = fleet.get("prometheus", "-n", platform.monitoring_namespace, f"--field-selector=metadata.name={PROMETHEUS}")
    if found and (_condition(found[0], "Reconciled") or {}).get("status") == "True":
        return found[0]
    return None


def _generated_config(platform) -> dict:
    secret = json.loads(kubectl("get", "secret", f"prometheus-{PROMETHEUS}", "-n", platform.monitoring_namespace,
                                "-o", "json").stdout)
    return yaml.safe_load(gzip.decompress(base64.b64decode(secret["data"]["prometheus.yaml.gz"])))


def _rule_files(platform) -> dict[str, str]:
    configmap = json.loads(kubectl("get", "configmap", f"prometheus-{PROMETHEUS}-rulefiles-0", "-n",
                                   platform.monitoring_namespace, "-o", "json").stdout)
    return configmap.get("data", {})


def _expected_jobs(monitors: list[dict]) -> set[str]:
    jobs = set()
    for m in monitors:
        endpoints = {"PodMonitor": "podMetricsEndpoints", "ServiceMonitor": "endpoints"}.get(m["kind"])
        if endpoints:
            kind = m["kind"][0].lower() + m["kind"][1:]
            jobs |= {f"{kind}/{m['metadata']['namespace']}/{m['metadata']['name']}/{i}"
                     for i in range(len(m["spec"][endpoints]))}
    return jobs


def test_prometheus_operator_reconciles_the_platforms_prometheus_with_devs_monitors(monitored_dev):
    """The real operator takes the platform's Prometheus and dev's monitors: Reconciled, its
    StatefulSet made, a scrape job for every endpoint of every rendered PodMonitor and
    ServiceMonitor in the configuration it generates, and each rendered PrometheusRule's groups in
    its rule files. Fails with no operator running (nothing writes the status)."""
    platform, monitors = monitored_dev
    prometheus = fleet.wait_for("the Prometheus reconciled", lambda: _reconciled(platform), timeout=120)
    assert prometheus, f"no Reconciled condition on Prometheus {PROMETHEUS}: {fleet.get('prometheus', '-A')}"
    statefulset = json.loads(kubectl("get", "statefulset", f"prometheus-{PROMETHEUS}", "-n",
                                     platform.monitoring_namespace, "-o", "json").stdout)
    assert statefulset["spec"]["replicas"] == prometheus["spec"]["replicas"]

    expected = _expected_jobs(monitors)
    config = fleet.wait_for("every monitor's scrape job", lambda: (lambda c: c if expected <= {
        j["job_name"] for j in c.get("scrape_configs", [])} else None)(_generated_config(platform)), timeout=60)
    jobs = {j["job_name"] for j in (config or _generated_config(platform)).get("scrape_configs", [])}
    assert expected and expected <= jobs, f"scrape jobs {sorted(jobs)}, the rendered monitors ask for {sorted(expected)}"

    rules = [m for m in monitors if m["kind"] == "PrometheusRule"]
    files = _rule_files(platform)
    for rule in rules:
        prefix = f"{rule['metadata']['namespace']}-{rule['metadata']['name']}-"
        written = [yaml.safe_load(text) for name, text in files.items() if name.startswith(prefix)]
        assert written and written[0]["groups"] == rule["spec"]["groups"], f"{prefix}*: {list(files)}"
    available = _condition(prometheus, "Available") or {}
    said = (available.get("message") or "").splitlines()[:1]
    FIGURES.append(f"prometheus-operator v0.93.0 (real) on dev's monitors: Prometheus Reconciled, Available "
                   f"{available.get('status')} ({available.get('reason')}: {said[0] if said else ''}); "
                   f"scrape jobs {len(expected)}/{len(expected)}, rule files {len(rules)}/{len(rules)}")


def test_prometheus_operator_refuses_a_rule_prometheus_cannot_parse(monitored_dev):
    """A PrometheusRule the CRD's schema accepts but whose expression Prometheus's parser refuses
    (the operator validates each rule file with github.com/prometheus/prometheus/model/rulefmt,
    pkg/operator/rules.go at v0.93.0) is left out of the rule files, with the operator's reason
    as a Warning event: the verdict is the operator's, not the API server's."""
    platform, monitors = monitored_dev
    rule = copy.deepcopy(next(m for m in monitors if m["kind"] == "PrometheusRule"))
    rule["metadata"] = {"name": "broken-expression", "namespace": rule["metadata"]["namespace"],
                        "labels": rule["metadata"]["labels"]}
    rule["spec"]["groups"][0]["rules"][0]["expr"] = "sum(rate(x[5m]) by"
    assert fleet.apply_each_pass([rule]).rejected == {}  # the API server takes it
    said = fleet.wait_for("the operator's verdict", lambda: [
        e for e in _events(rule["metadata"]["namespace"], "PrometheusRule", "broken-expression")
        if e.startswith("InvalidConfiguration")], timeout=120)
    assert said and "invalid rule" in said[0], said
    assert not [n for n in _rule_files(platform) if "broken-expression" in n]
