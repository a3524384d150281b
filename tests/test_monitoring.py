"""Alerts read only metrics the pinned engines export, and every rule passes promtool."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from infra.render.flagsets import flagset
from infra.render.metrics import alert_rules, catalogue, exposed_series, metric_names_in
from infra.render.query_check import query_problems
from tests.conftest import shipped_run
from tests.servers import require_binary


def specs_for_both_engines():
    from infra.render.engine_check import variant_spec

    for engine in ("sglang", "vllm"):
        yield variant_spec("prod", engine)


@pytest.mark.parametrize("spec", list(specs_for_both_engines()), ids=["sglang", "vllm"])
def test_every_alert_reads_series_the_pinned_engine_exposes(spec):
    """Names, types and labels from the wheels (tests/test_metrics_contract.py checks every other
    query the same way)."""
    for rule in alert_rules(spec):
        assert metric_names_in(rule.expr), rule.name
        assert query_problems(rule.expr, spec.engine.kind) == [], rule.name


def test_router_panel_reads_the_balancer_that_runs():
    """sglang-router 0.3.2 declares smg_http_requests_total (its wheel); the endpoint picker counts
    inference_objective_request_total (gateway-api-inference-extension v1.4.0
    pkg/epp/metrics/metrics.go), and exports no smg_ series."""
    import json

    from infra.components.k8s import LayerContext
    from infra.components.monitoring import dashboard
    from tests.test_endpoint_picker import epp_spec

    assert flagset("sglang-router").has_metric("smg_http_requests_total")
    spec = epp_spec("prod")
    (panel,) = [p for p in dashboard(LayerContext(spec, spec.environment.namespace))["panels"]
                if p["title"] == "Router requests"]
    assert "inference_objective_request_total" in json.dumps(panel)


def test_alert_rules_pass_promtool(tmp_path):
    promtool = require_binary("promtool")
    for stack in ("dev", "prod"):
        (rule,) = shipped_run(stack).by_kind("PrometheusRule")
        severities = {r["labels"]["severity"] for g in rule["spec"]["groups"] for r in g["rules"]}
        assert severities == {"warning", "critical"}
        path = tmp_path / f"{stack}.rules.yaml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout


def test_promtool_rejects_a_broken_expression(tmp_path):
    promtool = require_binary("promtool")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "sum(rate(x[5m]"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


def test_dashboard_has_a_panel_per_stage_latency_and_load_spread():
    import json

    (cm,) = [c for c in shipped_run("prod").by_kind("ConfigMap") if c["metadata"]["name"] == "pdstack-dashboard"]
    board = json.loads(cm["data"]["pdstack.json"])
    titles = [p["title"] for p in board["panels"]]
    assert "TTFT p99 by stage" in titles and "Running requests per instance (load spread)" in titles
    ttft = board["panels"][0]["targets"]
    assert [t["legendFormat"] for t in ttft] == ["prefill", "decode"]


# The alerts fire on series shaped as the engines export them: tests/test_alerts_pd_fleet.py.


def test_catalogue_series_names_follow_prometheus_client():
    assert catalogue("sglang")["metrics"]["sglang:eplb_balancedness"]["type"] == "summary"
    assert {"sglang:eplb_balancedness_sum", "sglang:eplb_balancedness_count"} <= set(exposed_series("sglang"))
