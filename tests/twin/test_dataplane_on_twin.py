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
from http.server import BaseHTTPRequestHandler

import pytest
import yaml

from infra.platform_stack.components.observability import PROMETHEUS, prometheus_manifests
from infra.platform_stack.spec import load_platform_spec
from tests.twin.conftest import FIGURES
from tests.twin.placement import delete_namespaces
from twin import fleet
from twin.api import kubectl
from twin.paths import ROOT

MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")


def _condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def _events(namespace: str, kind: str, name: str) -> list[str]:
    return [f"{e['reason']}: {e['message']}" for e in fleet.get("events", "-n", namespace, "--field-selector",
                                                                   f"involvedObject.kind={kind},involvedObject.name={name}")]


@pytest.fixture(scope="module")
def applied_dev(twin, tmp_path_factory):
    """dev's render, with what the platform stack gives it (platform-dev's Prometheus, its
    GatewayClass and the class's EnvoyProxy) and the listener's TLS Secret the user provides;
    removed afterwards."""
    from infra.platform_stack.components.gateway import gateway_class_manifests
    from infra.platform_stack.program import ENVOY_GATEWAY_NAMESPACE

    platform = load_platform_spec(ROOT / "stacks" / "platform-dev.yaml")
    rendered = fleet.render("dev", tmp_path_factory.mktemp("dev"))
    provided = prometheus_manifests(platform) + gateway_class_manifests(platform, ENVOY_GATEWAY_NAMESPACE, {})
    namespaces = [o for o in rendered if o["kind"] == "Namespace"] + [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        for name in (platform.monitoring_namespace, ENVOY_GATEWAY_NAMESPACE)]
    gateway = next(o for o in rendered if o["kind"] == "Gateway")
    secrets = [_tls_secret(ref["name"], gateway["metadata"]["namespace"], listener["hostname"],
                           tmp_path_factory.mktemp("listener-ca"))
               for listener in gateway["spec"]["listeners"] for ref in listener.get("tls", {}).get("certificateRefs", [])]
    result = fleet.apply_each_pass([*namespaces, *provided, *secrets, *rendered])
    assert result.rejected == {}, result.rejected
    yield platform, provided, rendered
    # namespaces first: Envoy Gateway keeps its finalizer on the GatewayClass while a Gateway uses it
    delete_namespaces([o["metadata"]["name"] for o in namespaces])
    kubectl("delete", "--ignore-not-found", "--timeout=120s", *(
        f"{o['kind'].lower()}.{o['apiVersion'].split('/')[0]}/{o['metadata']['name']}"
        for o in provided if "namespace" not in o["metadata"]))


@pytest.fixture(scope="module")
def monitored_dev(applied_dev):
    platform, _, rendered = applied_dev
    return platform, [o for o in rendered if o["kind"] in MONITORING_KINDS]


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


# --- Envoy Gateway -----------------------------------------------------------------------------
# Envoy Gateway v1.9.0 (cmd/envoy-gateway `server`, github.com/envoyproxy/gateway, built from
# twin/envoy-gateway/go.mod, with its chart's configuration and RBAC and the certificates its
# certgen makes; twin/dataplane.py). Its verdict is the Gateway API status it writes: the
# GatewayClass's and Gateway's conditions, each HTTPRoute's per parent (status.parents), each
# policy's per ancestor (status.ancestors), with the Gateway API's condition types and reasons
# (sigs.k8s.io/gateway-api apis/v1, as internal/gatewayapi/status at that version sets them).

ACCESS_KINDS = ("Gateway", "HTTPRoute", "SecurityPolicy", "BackendTrafficPolicy", "EnvoyProxy")


def _tls_secret(name: str, namespace: str, hostname: str, folder) -> dict:
    """The listener's certificate, which stays the user's (README "Objects that stay the user's"):
    one from a throwaway CA, as a kubernetes.io/tls Secret."""
    from twin.pki import Authority

    pair = Authority(folder).issue("listener", hostname, server_names=(hostname,))
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": namespace},
            "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                     "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}}


@pytest.fixture(scope="module")
def gatewayed_dev(applied_dev):
    platform, provided, rendered = applied_dev
    return platform, [o for o in provided if o["apiVersion"].startswith("gateway")], rendered


def _status_of(obj: dict) -> dict:
    kind, meta = obj["kind"], obj["metadata"]
    where = ["-n", meta["namespace"]] if meta.get("namespace") else []
    return json.loads(kubectl("get", f"{kind.lower()}.{obj['apiVersion'].split('/')[0]}", meta["name"], *where,
                              "-o", "json").stdout).get("status", {})


def _accepted(obj: dict) -> list[str]:
    """What is not accepted about one object: its own conditions (GatewayClass, Gateway), or each
    parent's (routes) or ancestor's (policies); [] when every one says Accepted=True."""
    status = _status_of(obj)
    if obj["kind"] in ("GatewayClass", "Gateway"):
        blocks = [("", status.get("conditions", []))]
    else:
        entries = status.get("parents", status.get("ancestors", []))
        blocks = [(json.dumps(e.get("parentRef", e.get("ancestorRef"))), e.get("conditions", [])) for e in entries]
    if not blocks or not any(c for _, c in blocks):
        return [f"{fleet.ident(obj)}: no status yet"]
    wrong = []
    for where, conditions in blocks:
        for c in conditions:
            if c["type"] in ("Accepted", "ResolvedRefs") and c["status"] != "True":
                wrong.append(f"{fleet.ident(obj)} {where}: {c['type']} {c['status']} {c['reason']}: {c['message']}")
        if not any(c["type"] == "Accepted" for c in conditions):
            wrong.append(f"{fleet.ident(obj)} {where}: no Accepted condition")
    return wrong


def test_envoy_gateway_accepts_devs_access_layer(gatewayed_dev):
    """The real Envoy Gateway accepts the platform's GatewayClass and every route and policy of
    dev's render: Accepted (and ResolvedRefs, where set) True on the class, the Gateway, the
    HTTPRoute per parent and each SecurityPolicy and BackendTrafficPolicy per ancestor; the
    EnvoyProxy's verdict is the Gateway's own (EG refuses a Gateway whose parametersRef it
    rejects: InvalidParameters). Fails with no Envoy Gateway running (no status is written)."""
    platform, classes, rendered = gatewayed_dev
    judged = [o for o in classes if o["kind"] == "GatewayClass"] + [
        o for o in rendered if o["kind"] in ACCESS_KINDS and o["kind"] != "EnvoyProxy"]

    def every_one_accepted():
        return [w for o in judged for w in _accepted(o)] or True

    verdict = fleet.wait_for("Envoy Gateway's verdict", lambda: every_one_accepted() is True, timeout=120)
    wrong = [] if verdict else every_one_accepted()
    assert not wrong, "\n".join(wrong)
    programmed = next((c for c in _status_of(next(o for o in rendered if o["kind"] == "Gateway")).get("conditions", [])
                       if c["type"] == "Programmed"), {})
    FIGURES.append(f"Envoy Gateway v1.9.0 (real) on dev's access layer: {len(judged)} objects Accepted "
                   f"({', '.join(sorted({o['kind'] for o in judged}))}); Gateway Programmed "
                   f"{programmed.get('status')} ({programmed.get('reason')}: no Envoy proxy or load balancer on the twin)")


def test_envoy_gateway_rejects_a_route_to_a_listener_the_gateway_lacks(gatewayed_dev):
    """An HTTPRoute the schema accepts whose parentRef names a listener the Gateway has not is
    refused by Envoy Gateway, with the Gateway API's reason (NoMatchingParent)."""
    platform, classes, rendered = gatewayed_dev
    route = copy.deepcopy(next(o for o in rendered if o["kind"] == "HTTPRoute"))
    route["metadata"] = {"name": "broken-parent", "namespace": route["metadata"]["namespace"]}
    route["spec"]["parentRefs"] = [{**route["spec"]["parentRefs"][0], "sectionName": "no-such-listener"}]
    assert fleet.apply_each_pass([route]).rejected == {}  # the API server takes it
    said = fleet.wait_for("Envoy Gateway's verdict", lambda: [w for w in _accepted(route) if "no status" not in w],
                          timeout=120)
    assert said and "Accepted False NoMatchingParent" in said[0], said


# --- KEDA ----------------------------------------------------------------------------------------
# KEDA's operator v2.20.2 (cmd/operator, github.com/kedacore/keda/v2, built from twin/keda/go.mod,
# run with its config/manager args as its config/rbac account; twin/dataplane.py). Its verdict on
# a ScaledObject: the HPA it makes (pkg/scaling/resolver, controllers/keda/hpa.go: named by
# advanced.horizontalPodAutoscalerConfig.name, else keda-hpa-<name>; the ScaledObject's replica
# bounds and target; one External metric per trigger) and the ScaledObject's Ready and Active
# conditions (Active: some trigger's value above its activation threshold, read from the trigger's
# Prometheus at each polling interval).


def _metrics_handler(text: str):
    """Answers /metrics with `text` (Prometheus exposition format)."""
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):  # Prometheus scrapes it every second
            pass

    return Metrics


def _keda_verdict(scaled: dict) -> tuple[dict | None, dict]:
    meta = scaled["metadata"]
    hpa_name = scaled["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get(
        "name", f"keda-hpa-{meta['name']}")
    hpas = fleet.get("hpa", "-n", meta["namespace"], f"--field-selector=metadata.name={hpa_name}")
    return (hpas[0] if hpas else None), {"status": _status_of(scaled)}


def test_keda_makes_each_scaled_objects_hpa_and_reads_its_prometheus(applied_dev, tmp_path):
    """The real KEDA operator takes dev's ScaledObjects: each gets its HPA (the LeaderWorkerSet as
    target, the ScaledObject's replica bounds, an External metric per trigger) and Ready=True;
    with the triggers' Prometheus (a real one on 127.0.0.1, scraping the series the decode pool's
    first trigger reads above its threshold; the rendered address, the platform's in-cluster
    Service, resolves nowhere on the twin) the decode ScaledObject reads Active=True, and the HPA
    controller reads every trigger's External metric from KEDA's metrics API server (ScalingActive
    True, ValidMetricFound). Fails with no KEDA running (no HPA, no conditions), and without the
    metrics API server or the API server's way to it (ScalingActive False, FailedGetExternalMetric)."""
    from tests.servers import prometheus_server, serving

    _, _, rendered = applied_dev
    scaled = [copy.deepcopy(o) for o in rendered if o["kind"] == "ScaledObject"]
    decode = next(o for o in scaled if o["metadata"]["labels"].get("pdstack.io/role") == "decode")
    first = decode["spec"]["triggers"][0]["metadata"]
    namespace = decode["metadata"]["namespace"]
    series = first["query"].split("(", 1)[1].rsplit(")", 1)[0]  # avg(<series>): the series itself
    above = float(first["threshold"]) + 0.1
    with serving(_metrics_handler(f"{series} {above}\n")) as engine, \
            prometheus_server(tmp_path, [{"job_name": "engines", "static_configs": [
                {"targets": [engine.removeprefix("http://")]}]}]) as url:
        for obj in scaled:
            for trigger in obj["spec"]["triggers"]:
                trigger["metadata"]["serverAddress"] = url
        assert fleet.apply_each_pass(scaled).rejected == {}

        def judged():
            verdicts = {o["metadata"]["name"]: _keda_verdict(o) for o in scaled}
            ready = all(hpa and (_condition(status, "Ready") or {}).get("status") == "True"
                        for hpa, status in verdicts.values())
            hpa, status = verdicts[decode["metadata"]["name"]]
            active = (_condition(status, "Active") or {}).get("status") == "True"
            reads = (_condition(hpa or {}, "ScalingActive") or {}).get("status") == "True"
            return verdicts if ready and active and reads else None

        verdicts = fleet.wait_for("KEDA's verdict", judged, timeout=180) or {
            o["metadata"]["name"]: _keda_verdict(o) for o in scaled}
    for obj in scaled:
        hpa, status = verdicts[obj["metadata"]["name"]]
        assert hpa, f"no HPA for ScaledObject {namespace}/{obj['metadata']['name']}: {status}"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == obj["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
        assert hpa["spec"]["scaleTargetRef"]["name"] == obj["spec"]["scaleTargetRef"]["name"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
            obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"])
        assert len([m for m in hpa["spec"]["metrics"] if m["type"] == "External"]) == len(obj["spec"]["triggers"])
        assert (_condition(status, "Ready") or {}).get("status") == "True", status
    decode_hpa, decode_status = verdicts[decode["metadata"]["name"]]
    active = _condition(decode_status, "Active")
    assert active and active["status"] == "True", active
    # the HPA controller reads the triggers' External metrics from KEDA's metrics API server, through
    # the aggregator and the egress proxy (tests/twin/test_keda_metrics_on_twin.py): ScalingActive
    # True, "the HPA was able to successfully calculate a replica count" (ValidMetricFound)
    reads = _condition(decode_hpa, "ScalingActive")
    assert reads and reads["status"] == "True" and reads["reason"] == "ValidMetricFound", decode_hpa.get("status")
    values = [m["external"]["current"] for m in decode_hpa["status"].get("currentMetrics", []) if m["type"] == "External"]
    assert len(values) == len(decode["spec"]["triggers"]), decode_hpa["status"]
    FIGURES.append(f"KEDA operator v2.20.2 (real) on dev's {len(scaled)} ScaledObjects: an HPA each, Ready; decode "
                   f"Active ({active['reason']}) from a real Prometheus on 127.0.0.1; its HPA reads {len(values)} "
                   f"External metrics from KEDA's metrics API server (ScalingActive {reads['reason']}), desired "
                   f"replicas {decode_hpa['status'].get('desiredReplicas')}")
