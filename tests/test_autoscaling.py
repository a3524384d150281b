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
    # An SGLang PD prefill times no first token: decode does, from the request's arrival.
    assert 'namespace="pdstack-prod",pdstack_io_role="decode"' in ttft["metadata"]["query"]


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


# --- each scaler's signals on a PD fleet's series, as the pinned engines export them ----------------

LOADED_FROM = 31  # minute from which the loaded role's series show its load (the first 30: healthy)
FAST, SLOW = {"0.5": 1000, "1": 0, "2.5": 0, "+Inf": 0}, {"0.5": 0, "1": 0, "2.5": 1000, "+Inf": 0}  # TTFT
STEADY, STALLED = {"0.02": 1000, "0.05": 0, "0.1": 0, "+Inf": 0}, {"0.02": 0, "0.05": 0, "0.1": 1000, "+Inf": 0}


def minutes(healthy: float, loaded: float, counter: bool) -> str:
    """A series' samples at minutes 0-60: a gauge at `healthy` then `loaded`; a counter growing by
    them each minute."""
    values, total = [], 0.0
    for minute in range(61):
        now = loaded if minute >= LOADED_FROM else healthy
        total += now if minute else 0
        values.append(total if counter else now)
    return " ".join(f"{v:g}" for v in values)


def loadable_series(pod, busy_role: str | None) -> list[dict]:
    """What one pod exports that the scalers read, shaped as the pinned engine exports it
    (tests/test_alerts_pd_fleet.py cites which pod exports what): healthy, then, from LOADED_FROM,
    with `busy_role` of its track loaded (None: none). A loaded prefill queues prompts and their first
    tokens come late: timed by SGLang's decode, from the request's arrival (sglang 0.5.23
    srt/managers/tokenizer_manager.py collect_metrics: PD prefill workers never observe TTFT), and by
    vLLM's prefill itself (vllm 0.33.0 v1/metrics/stats.py update_from_output: each instance from the
    request's arrival there; its decode's, from the KV pull on, do not change). A loaded decode fills
    its KV cache, runs more sequences and makes more tokens, each later."""
    from tests.test_alerts_pd_fleet import series

    own, prefill_busy = pod.role == busy_role, busy_role == "prefill"

    def gauge(name, healthy, busy, when=own):
        return series(pod, name, minutes(healthy, busy if when else healthy, False))

    def counter(name, healthy, busy, when=own):
        return series(pod, name, minutes(healthy, busy if when else healthy, True))

    def histogram(name, healthy: dict, busy: dict, when: bool):
        out, calm, late = [], 0, 0  # observations a minute at or below each bucket's bound
        for le in healthy:
            calm, late = calm + healthy[le], late + busy[le]
            out.append(series(pod, f"{name}_bucket", minutes(calm, late if when else calm, True), le=le))
        return out + [counter(f"{name}_count", 1000, 1000), counter(f"{name}_sum", 400, 2000, when)]

    sglang = pod.engine == "sglang"
    prefix = "sglang:" if sglang else "vllm:"
    out = [gauge("sglang:num_queue_reqs" if sglang else "vllm:num_requests_waiting", 2, 40),
           gauge("sglang:num_running_reqs" if sglang else "vllm:num_requests_running", 100, 1500),
           gauge("sglang:token_usage" if sglang else "vllm:kv_cache_usage_perc", 0.5, 0.95)]
    if pod.worker == 0:  # SGLang's tokenizer runs on the group's leader; a vLLM group exports from its leader only
        out.append(counter(f"{prefix}generation_tokens_total", 1000, 100000))
        if pod.role == "decode" or not sglang:
            late = prefill_busy and (sglang or pod.role == "prefill")
            out += histogram(f"{prefix}time_to_first_token_seconds", FAST, SLOW, late)
        if pod.role == "decode":
            out += histogram(f"{prefix}inter_token_latency_seconds", STEADY, STALLED, own)
    return out


def scaler_rules(track) -> list[dict]:
    """The queries each pool's scaler runs in this track: the KEDA triggers recorded as
    `keda:<role>:<trigger>` with the track's namespace, and the HPA path's own recording rules."""
    from infra.components.autoscaling import hpa_support, scaled_object
    from infra.components.k8s import LayerContext

    ctx = LayerContext(track.spec, track.namespace)
    keda = [{"record": f"keda:{role}:{t['name'].replace('-', '_')}", "expr": t["metadata"]["query"],
             "labels": {"namespace": track.namespace}}
            for role in track.spec.deployment.pools() for t in scaled_object(ctx, role)["spec"]["triggers"]]
    (hpa_rules, _) = hpa_support(ctx)
    return [{"name": "keda", "rules": keda}, *hpa_rules["spec"]["groups"]]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_scaler_reads_its_role_where_the_engine_exports_it_and_rises_when_it_is_loaded(tmp_path, engine, role):
    """Issue #37.7 follow-up: the prefill scaler's TTFT read prefill's own TTFT histogram, which an
    SGLang PD prefill never fills (see `loadable_series`): its query returned nothing (KEDA's `or
    vector(0)`: 0) however late the first tokens, and `plan --watch` saw NaN. On a two-track PD
    fleet of each engine, the serving track's `role` is loaded from minute 31: every load signal of
    that role's scaler (KEDA trigger and HPA recording rule) reads a value at minute 55 above the
    one it read at minute 30, in that track only; the other track's stays where it was. Evaluated
    by `promtool test rules` (the same PromQL engine as Prometheus)."""
    from infra.planning.autoscaling import signals
    from tests.servers import require_binary
    from tests.test_alerts_pd_fleet import CANARY, SERVING, pods, tracks

    both = tracks(engine)
    inputs = [s for pod in pods(engine) for s in loadable_series(pod, role if pod.revision == SERVING else None)]
    files = []
    for track in both:
        path = tmp_path / f"r{track.revision}.rules.yaml"
        path.write_text(yaml.safe_dump({"groups": scaler_rules(track)}))
        files.append(path.name)
    load_signals = [s.name for s in signals(both[0].spec, role) if s.name != "ratio_floor"]  # counts, not load
    assert (role != "prefill") or "ttft_p99_s" in load_signals
    checks = [{"expr": f"{series}{{namespace=\"{track.namespace}\"}} > bool {series}{{namespace=\"{track.namespace}\"}} offset 25m",
               "eval_time": "55m", "exp_samples": [{"labels": f'{{namespace="{track.namespace}"}}',
                                                     "value": 1 if track.revision == SERVING else 0}]}
              for track in both for name in load_signals
              for series in (f"keda:{role}:{name}", f"pdstack:{role}:{name}")]
    assert {t.revision for t in both} == {SERVING, CANARY}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": files, "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": checks}]}))
    done = subprocess.run([require_binary("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
