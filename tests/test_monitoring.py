"""Alerts read only metrics the pinned engines export, and every rule passes promtool."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from infra.render.flagsets import flagset
from infra.render.metrics import DCGM_METRICS, ENGINE_METRICS, alert_rules, metric_names_in
from tests.conftest import shipped_run
from tests.servers import require_binary


def specs_for_both_engines():
    from infra.render.engine_check import variant_spec

    for engine in ("sglang", "vllm"):
        yield variant_spec("prod", engine)


def known(engine: str, name: str) -> bool:
    if name.startswith("DCGM_"):
        return name in DCGM_METRICS
    if name.startswith("smg_"):
        return flagset("sglang-router").has_metric(name)
    return flagset(engine).has_metric(name)


@pytest.mark.parametrize("spec", list(specs_for_both_engines()), ids=["sglang", "vllm"])
def test_every_alert_names_only_exported_metrics(spec):
    for rule in alert_rules(spec):
        names = metric_names_in(rule.expr)
        assert names, rule.name
        unknown = [n for n in names if not known(spec.engine.kind, n)]
        assert unknown == [], f"{rule.name}: {unknown}"


def test_metric_check_fails_for_a_made_up_metric():
    assert not known("sglang", "sglang:time_to_first_token_secs_bucket")
    assert known("sglang", "sglang:time_to_first_token_seconds_bucket")
    assert not known("vllm", "vllm:num_queue_reqs")


def test_engine_metric_tables_name_real_metrics():
    for engine, table in ENGINE_METRICS.items():
        for field, expr in vars(table).items():
            if expr:
                assert all(known(engine, n) for n in metric_names_in(expr)), (engine, field)


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
