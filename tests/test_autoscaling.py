"""Autoscaling, node capacity and tracing: the rendered scalers (under Pulumi mocks), the
pure scaling rules, and a day of load through them."""

from __future__ import annotations

import math
import subprocess

import pytest
import yaml

from infra.offline import run_spec
from infra.planning.autoscaling import Signal, desired_counts, hpa_desire, ratio_in_bounds, signals
from infra.planning.pd_ratio import Workload
from infra.planning.simulate import day_curve, simulate_day
from infra.render.manifests import manifests, validate_manifests
from infra.spec import REPO_ROOT
from infra.spec_checks import parse_spec
from tests.conftest import problems_of, shipped_run, stack_data


def by_name(run, kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in run.by_kind(kind)}


# --- the rendered scalers -------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_one_scaler_per_phase_with_the_specs_triggers_and_bounds(stack):
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path(stack))
    scalers = by_name(shipped_run(stack), "ScaledObject")
    assert set(scalers) == {"engine-prefill", "engine-decode"}
    for role in ("prefill", "decode"):
        s = scalers[f"engine-{role}"]["spec"]
        lo, hi = spec.deployment.pools()[role].bounds()
        assert (s["minReplicaCount"], s["maxReplicaCount"]) == (lo, hi)
        expected = {sig.name.replace("_", "-"): sig for sig in signals(spec, role)}
        assert {t["name"] for t in s["triggers"]} == set(expected)
        for t in s["triggers"]:
            sig = expected[t["name"]]
            assert t["type"] == "prometheus" and t["metricType"] == sig.metric_type
            assert t["metadata"] == {"serverAddress": spec.deployment.autoscaling.prometheus_url,
                                     "query": sig.query, "threshold": f"{sig.target:g}"}
        behavior = s["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == spec.deployment.autoscaling.scale_down_stabilization_seconds
        assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": max(300, spec.deployment.autoscaling.drain_seconds + 60)}]


def test_prod_triggers_follow_the_phase():
    scalers = by_name(shipped_run("prod"), "ScaledObject")
    names = lambda role: {t["name"] for t in scalers[f"engine-{role}"]["spec"]["triggers"]}  # noqa: E731
    assert names("prefill") == {"queue-depth", "ttft-p99-s", "ratio-floor"}
    assert names("decode") == {"generation-tokens-per-s", "kv-cache-usage", "running-requests", "tpot-p99-s", "ratio-floor"}
    (ttft,) = [t for t in scalers["engine-prefill"]["spec"]["triggers"] if t["name"] == "ttft-p99-s"]
    assert ttft["metadata"]["threshold"] == "1.2"  # 80% of the 1500 ms SLO
    assert "sglang:time_to_first_token_seconds_bucket" in ttft["metadata"]["query"]
    assert 'pdstack_io_role="prefill"' in ttft["metadata"]["query"]


def test_decode_scales_whole_groups_and_drains():
    run = shipped_run("prod")
    decode = by_name(run, "ScaledObject")["engine-decode"]["spec"]
    # The LeaderWorkerSet's scale subresource counts groups: one replica is one 64-GPU instance.
    assert decode["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                                        "name": "engine-decode"}
    group = by_name(run, "LeaderWorkerSet")["engine-decode"]
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 16
    behavior = decode["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    targets = {s["spec"]["scaleTargetRef"]["kind"] for s in run.by_kind("ScaledObject")}
    assert targets == {"LeaderWorkerSet"}  # never the per-group StatefulSets or single pods
    lws = [r for r in run.custom() if r.name == "leaderworkerset-engine-decode"][0]
    assert lws.ignore_changes == ("spec.replicas",)  # `pulumi up` leaves the scaler's count alone
    for tpl in ("leaderTemplate", "workerTemplate"):
        pod = group["spec"]["leaderWorkerTemplate"][tpl]["spec"]
        assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "sleep 180"
        assert pod["terminationGracePeriodSeconds"] > 180


def test_hpa_mode_renders_hpas_on_external_metrics():
    data = stack_data("prod")
    data["deployment"]["autoscaling"]["scaler"] = "hpa"
    run = run_spec(parse_spec(data))
    assert run.by_kind("ScaledObject") == []
    hpas = by_name(run, "HorizontalPodAutoscaler")
    assert set(hpas) == {"engine-prefill", "engine-decode"}
    metrics = {m["external"]["metric"]["name"] for m in hpas["engine-decode"]["spec"]["metrics"]}
    assert "pdstack_decode_kv_cache_usage" in metrics
    rules = by_name(run, "PrometheusRule")["pdstack-scaling-signals"]["spec"]["groups"][0]["rules"]
    assert {r["record"] for r in rules} >= {"pdstack:decode:kv_cache_usage", "pdstack:prefill:queue_depth"}
    adapter = yaml.safe_load(by_name(run, "ConfigMap")["prometheus-adapter-pdstack-rules"]["data"]["rules.yaml"])
    assert {r["name"]["as"] for r in adapter["externalRules"]} >= metrics
    report = validate_manifests(manifests(run), "1.33")
    assert report.ok, report.errors
    assert report.checked >= 2


# --- capacity checks in the spec (quota and NVLink domains: tests/test_capacity.py) --------------


def problems(data) -> str:
    return "\n".join(problems_of(data))


def test_ratio_bounds_that_a_maximum_cannot_follow_are_rejected():
    data = stack_data("prod")
    data["deployment"]["prefill"]["scaling"]["max_instances"] = 7  # 56 GPUs < 1/2 x 128
    assert "deployment.prefill.scaling.max_instances: at decode's maximum (128 GPUs) the ratio floor 1:2 needs 64" in problems(data)
    data = stack_data("prod")
    data["deployment"]["autoscaling"]["pd_ratio_bounds"] = {"min": "2:1", "max": "3:1"}
    assert "deployment.pd_ratio: 1:1 is outside deployment.autoscaling.pd_ratio_bounds [2:1, 3:1]" in problems(data)


# --- the pure rules -------------------------------------------------------------------------------


def test_hpa_arithmetic():
    avg = Signal("q", "", 2.0, "AverageValue", "")
    val = Signal("kv", "", 0.8, "Value", "")
    up = Signal("lat", "", 1.2, "Value", "", up_only=True)
    assert hpa_desire(avg, 9.0, current=3) == 5  # ceil(9 / 2)
    assert hpa_desire(val, 0.84, current=3) == 3  # within the 10% tolerance
    assert hpa_desire(val, 0.4, current=4) == 2  # ceil(4 x 0.5)
    assert hpa_desire(up, 1.0, current=4) == 0  # below target: asks for nothing
    assert hpa_desire(up, 1.8, current=4) == 6  # ceil(4 x 1.5)
    assert hpa_desire(val, math.nan, current=4) == 4  # no data: leave it


def test_ratio_floor_raises_the_lagging_side():
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path("prod"))
    quiet = {"prefill": {"queue_depth": 0.0, "ttft_p99_s": 0.2},
             "decode": {"generation_tokens_per_s": 60000.0, "kv_cache_usage": 0.3, "running_requests": 500.0, "tpot_p99_s": 0.02}}
    want = desired_counts(spec, quiet, {"prefill": 4, "decode": 1})
    assert want["decode"] == 2  # 60k tokens/s at 25k per instance -> 3, capped at the maximum of 2
    assert want["prefill"] == 8  # no prefill demand, but 1:2 of decode's 128 GPUs is 64 GPUs = 8 instances
    assert ratio_in_bounds(spec, want)


def test_a_day_of_load_meets_the_slo_shrinks_at_night_and_keeps_the_ratio():
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path("prod"))
    workload = Workload.model_validate(yaml.safe_load((REPO_ROOT / "stacks/workloads/prod-day.yaml").read_text()))
    curve = day_curve(workload.arrival_rate_rps, workload.day.valley_rps, workload.day.peak_hour)
    day = simulate_day(spec, workload, curve)
    assert len(day.minutes) == 1440
    peak = [m for m in day.minutes if 12 * 60 <= m.minute < 16 * 60]
    assert all(m.slo_met for m in peak), [m for m in peak if not m.slo_met][:3]
    assert all(m.slo_met for m in day.minutes)
    assert all(m.ratio_ok for m in day.minutes)
    at = lambda hour: day.minutes[hour * 60].asked  # noqa: E731
    assert at(3)["prefill"] < at(14)["prefill"] and at(3)["decode"] < at(14)["decode"]
    assert at(3) == {"prefill": 4, "decode": 1}  # the spec's minimums in the valley
    assert sum(day.gpu_hours.values()) < sum(day.fixed_fleet_gpu_hours.values())


# --- tracing --------------------------------------------------------------------------------------


def test_every_hop_sends_spans_to_one_collector_that_forwards_to_the_spec_backend():
    run = shipped_run("prod")
    collector = "otel-collector.pdstack-prod.svc.cluster.local:4317"
    assert set(by_name(run, "Deployment")) >= {"otel-collector"}
    service = by_name(run, "Service")["otel-collector"]
    assert {p["port"] for p in service["spec"]["ports"]} == {4317, 4318}
    config = yaml.safe_load(by_name(run, "ConfigMap")["otel-collector-config"]["data"]["config.yaml"])
    assert config["exporters"]["otlp"]["endpoint"] == "tempo-distributor.observability.svc.cluster.local:4317"
    assert config["processors"]["probabilistic_sampler"]["sampling_percentage"] == pytest.approx(5)
    launches = by_name(run, "ConfigMap")
    for name in ("engine-prefill-launch", "engine-decode-launch", "router-launch"):
        script = launches[name]["data"]["launch.sh"]
        assert "--enable-trace" in script and f"--otlp-traces-endpoint {collector}" in script, name
    (proxy,) = run.by_kind("EnvoyProxy")
    backend = proxy["spec"]["telemetry"]["tracing"]["provider"]["backendRefs"][0]
    assert (backend["name"], backend["port"]) == ("otel-collector", 4317)
    (gateway,) = run.by_kind("Gateway")
    assert gateway["spec"]["infrastructure"]["parametersRef"]["name"] == proxy["metadata"]["name"]


def test_no_collector_without_a_trace_backend():
    run = shipped_run("dev")
    assert "otel-collector" not in by_name(run, "Deployment")
    assert "--otlp-traces-endpoint" not in str(run.by_kind("ConfigMap"))


def test_hpa_signals_of_two_release_tracks_stay_apart(tmp_path):
    """Both tracks record `pdstack:<role>:<signal>`; each recorded series carries its track's
    namespace, and the adapter's namespaced rule (kubernetes-sigs/prometheus-adapter
    docs/externalmetrics.md: a namespace resource override puts the HPA's namespace into
    <<.LabelMatchers>>) reads one track's value. Evaluated by promtool's rule unit tests on
    series of both tracks."""
    from infra.offline import run_offline
    from infra.program import build_stack
    from infra.tracks import plan_tracks
    from tests.servers import require_binary

    data = stack_data("prod")
    data["deployment"]["autoscaling"]["scaler"] = "hpa"
    run = run_offline(lambda: build_stack(parse_spec(data), release="8",
                                          tracks=plan_tracks([(7, 95, data), (8, 5, data)])), stack="prod")
    files = []
    for rule in run.by_kind("PrometheusRule"):
        if rule["metadata"]["name"] == "pdstack-scaling-signals":
            path = tmp_path / f"{rule['metadata']['namespace']}.yaml"
            path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
            files.append(path.name)
    assert len(files) == 2
    adapters = {c["data"]["rules.yaml"] for c in run.by_kind("ConfigMap")
                if c["metadata"]["name"] == "prometheus-adapter-pdstack-rules"}
    assert len(adapters) == 1  # the same rules in every track: one adapter configuration serves all
    adapter = yaml.safe_load(adapters.pop())
    rule = next(r for r in adapter["externalRules"] if r["name"]["as"] == "pdstack_decode_kv_cache_usage")
    usage = {"pdstack-prod-r7": 0.5, "pdstack-prod-r8": 0.9}
    series = [{"series": f'sglang:token_usage{{namespace="{ns}",pdstack_io_role="decode",pod="{ns}-0"}}',
               "values": f"{value}x10"} for ns, value in usage.items()]
    tests = [{"interval": "15s", "input_series": series, "promql_expr_test": [
        {"expr": rule["metricsQuery"].replace("<<.Series>>", "pdstack:decode:kv_cache_usage")
                                     .replace("<<.LabelMatchers>>", f'namespace="{ns}"'),
         "eval_time": "1m", "exp_samples": [{"labels": "{}", "value": value}]}
        for ns, value in usage.items()]}]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": files, "evaluation_interval": "15s",
                                                        "tests": tests}))
    out = subprocess.run([require_binary("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
