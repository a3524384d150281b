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


# --- the alerts fire on series shaped like the engine's (promtool test rules) --------------------

SCRAPE = {"namespace": "pdstack-prod", "pod": "engine-decode-0-1", "pdstack_io_role": "decode",
          "pdstack_io_release": "7", "leaderworkerset_sigs_k8s_io_group_index": "0",
          "leaderworkerset_sigs_k8s_io_worker_index": "1", "job": "engines", "instance": "10.0.0.7:30000"}
RANK = {"model_name": "deepseek-ai/DeepSeek-V3", "engine_type": "decode", "tp_rank": "9", "pp_rank": "0",
        "moe_ep_rank": "0", "dp_rank": "9", "is_streaming": "true", "forward_mode": "decode", "engine": "0",
        "finished_reason": "stop"}


def series(engine: str, name: str, values: str, **extra) -> dict:
    """An input series for `promtool test rules` carrying exactly the labels the pinned engine puts
    on it (its catalogue entry) and those the scrape adds."""
    metric, entry = exposed_series(engine)[name]
    labels = {**SCRAPE, **{k: RANK[k] for k in entry["labels"] if k != "le"}, **extra}
    body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{body}}}", "values": values}


def histogram(engine: str, name: str, per_minute: dict[str, int]) -> list[dict]:
    """Cumulative buckets of a histogram that gets `per_minute` observations per bucket bound."""
    total, out = 0, []
    for le, count in per_minute.items():
        total += count
        out.append(series(engine, f"{name}_bucket", f"0+{total}x60", le=le))
    return out + [series(engine, f"{name}_count", f"0+{total}x60"), series(engine, f"{name}_sum", f"0+{total}x60")]


def promtool_test(tmp_path, spec, input_series: list[dict], expected: dict[str, list[dict]]) -> subprocess.CompletedProcess:
    groups = [{"name": "pdstack-slo", "rules": [
        {"alert": r.name, "expr": r.expr, "for": r.for_, "labels": {"severity": r.severity}} for r in alert_rules(spec)]}]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    tests = [{"interval": "1m", "input_series": input_series,
              "alert_rule_test": [{"eval_time": "40m", "alertname": name, "exp_alerts": alerts}
                                  for name, alerts in expected.items()]}]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                        "tests": tests}))
    return subprocess.run([require_binary("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)


def test_sglang_alerts_fire_on_a_non_leader_ranks_series(tmp_path):
    """A decode rank on a non-leader node (worker-index 1) with a long queue, a full KV cache and
    failed transfers, as sglang 0.5.23 exports them (SchedulerMetricsCollector: gauges per rank,
    num_transfer_failed_reqs a Counter); slow first tokens from the tokenizer (histograms); expert
    balancedness at 0.5 (a Summary, reported with --expert-balancedness-report-mode prometheus)."""
    from infra.render.engine_check import variant_spec

    spec = variant_spec("prod", "sglang")
    at = {"namespace": SCRAPE["namespace"], "pod": SCRAPE["pod"]}
    inputs = [
        series("sglang", "sglang:num_queue_reqs", "100x60"),
        series("sglang", "sglang:token_usage", "0.99x60"),
        series("sglang", "sglang:cache_hit_rate", "0.1x60"),
        series("sglang", "sglang:num_transfer_failed_reqs_total", "0+1x60"),
        series("sglang", "sglang:eplb_balancedness_sum", "0+5x60"),
        series("sglang", "sglang:eplb_balancedness_count", "0+10x60"),
        *histogram("sglang", "sglang:time_to_first_token_seconds", {"0.5": 0, "1": 0, "2.5": 100, "+Inf": 0}),
    ]
    result = promtool_test(tmp_path, spec, inputs, {
        "PdstackQueueDepthHigh": [{"exp_labels": {**at, "severity": "warning"}}],
        "PdstackKVCacheFull": [{"exp_labels": {**at, "severity": "critical"}}],
        "PdstackKVCacheNearlyFull": [{"exp_labels": {**at, "severity": "warning"}}],
        "PdstackPrefixCacheHitRateLow": [{"exp_labels": {"severity": "warning"}}],
        "PdstackKVTransferErrors": [{"exp_labels": {"severity": "critical"}}],
        "PdstackExpertImbalance": [{"exp_labels": {"severity": "warning"}}],
        "PdstackTTFTp99Warning": [{"exp_labels": {"severity": "warning"}}],
        "PdstackTTFTp99Critical": [],
    })
    assert result.returncode == 0, result.stdout + result.stderr


def test_vllm_alerts_fire_on_the_leaders_series(tmp_path):
    """vllm 0.33.0: gauges and counters labelled model_name and engine (v1/metrics/loggers.py), the
    NIXL failures a Counter exposed as `_total` (kv_connector/v1/nixl/stats.py)."""
    from infra.render.engine_check import variant_spec

    spec = variant_spec("prod", "vllm")
    inputs = [series("vllm", "vllm:num_requests_waiting", "100x60"),
              series("vllm", "vllm:nixl_num_failed_transfers_total", "0+1x60"),
              series("vllm", "vllm:kv_cache_usage_perc", "0.95x60")]
    at = {"namespace": SCRAPE["namespace"], "pod": SCRAPE["pod"]}
    result = promtool_test(tmp_path, spec, inputs, {
        "PdstackQueueDepthHigh": [{"exp_labels": {**at, "severity": "warning"}}],
        "PdstackKVTransferErrors": [{"exp_labels": {"severity": "critical"}}],
        "PdstackKVCacheNearlyFull": [{"exp_labels": {**at, "severity": "warning"}}],
        "PdstackKVCacheFull": [],
    })
    assert result.returncode == 0, result.stdout + result.stderr


def test_catalogue_series_names_follow_prometheus_client():
    assert catalogue("sglang")["metrics"]["sglang:eplb_balancedness"]["type"] == "summary"
    assert {"sglang:eplb_balancedness_sum", "sglang:eplb_balancedness_count"} <= set(exposed_series("sglang"))
