"""Every query pdstack runs reads series the pinned engine really exposes, with labels they carry.

The catalogue (infra/render/pinned/<engine>-<version>-metrics.json) is read from the wheels'
source by scripts/extract_engine_metrics.py: sglang 0.5.23 srt/observability/metrics_collector.py
(SchedulerMetricsCollector, TokenizerMetricsCollector), vllm 0.33.0 v1/metrics/loggers.py
(PrometheusStatLogger) and distributed/kv_transfer/kv_connector/v1/nixl/stats.py. Series are
named as prometheus_client 0.x exposes them (Counter -> `_total`, Histogram -> `_bucket`,
`_sum`, `_count`; Summary -> `_sum`, `_count`).
"""

from __future__ import annotations

import json
import warnings

import pytest

from infra.cli.plan import watch_queries
from infra.components.autoscaling import hpa_support
from infra.components.k8s import LayerContext
from infra.components.monitoring import dashboard
from infra.planning.autoscaling import signals
from infra.render import metrics
from infra.render.engine_check import variant_spec
from infra.render.metrics import ENGINE_METRICS, alert_rules, balancedness_roles, catalogue, exposed_series
from infra.render.query_check import query_problems
from infra.rollout.canary import gate_queries
from infra.validation.health import fleet_queries, held_batch_query, kv_usage_query, queue_depth_query

SPECS = [(stack, engine) for stack in ("dev", "prod") for engine in ("sglang", "vllm")]


def spec_of(stack: str, engine: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return variant_spec(stack, engine)


def every_query(spec) -> dict[str, str]:
    """Alerts, scaler signals (KEDA triggers and the HPA path's recording rules), canary gates,
    validate-deployment's fleet gates and profile sweep, plan --watch's figures and the dashboard's panels."""
    engine, ns = spec.engine.kind, spec.environment.namespace
    roles = list(spec.deployment.pools())
    queries = {f"alert {r.name}": r.expr for r in alert_rules(spec)}
    for role in roles:
        queries |= {f"scaler {role} {s.name}": s.query for s in signals(spec, role)}
    ctx = LayerContext(spec, ns)
    (rules, _) = hpa_support(ctx)
    queries |= {f"recording {r['record']}": r["expr"] for r in rules["spec"]["groups"][0]["rules"]}
    queries |= {f"canary {k}": q for k, q in gate_queries(spec, 7, "5m").items()}
    queries |= {f"fleet {k}": q for k, q in fleet_queries(engine, ns, "10m", roles, balancedness_roles(spec)).items()}
    queries |= {f"plan --watch {k}": q for k, q in watch_queries(spec).items()}
    queries |= {f"profile {f.__name__} {role}": f(engine, ns, role, 60) for role in roles
                for f in (held_batch_query, kv_usage_query, queue_depth_query)}
    for panel in dashboard(ctx)["panels"]:
        queries |= {f"panel {panel['title']} {t['refId']}": t["expr"] for t in panel["targets"]}
    return queries


@pytest.mark.parametrize("stack,engine", SPECS)
def test_every_query_reads_series_the_pinned_engine_exposes(stack, engine):
    spec = spec_of(stack, engine)
    problems = {name: p for name, q in every_query(spec).items() if (p := query_problems(q, engine))}
    assert problems == {}


def test_the_check_bites_on_what_used_to_be_rendered():
    """What the alert, the fleet gate and the KV-failure queries read before: a Summary has no
    bare series (sglang:eplb_balancedness is a Summary, metrics_collector.py), a vLLM Counter is
    exposed only with `_total` (nixl/stats.py), and request_success's label is finished_reason."""
    assert query_problems("min(sglang:eplb_balancedness) < 0.6", "sglang")
    assert query_problems("sum(increase(vllm:nixl_num_failed_transfers[5m]))", "vllm")
    assert query_problems('sum(rate(vllm:request_success_total{reason="abort"}[5m]))', "vllm")
    assert query_problems("max by (tp_rank) (vllm:num_requests_running)", "vllm")
    assert query_problems("histogram_quantile(0.99, sum by (pod) (rate(sglang:inter_token_latency_seconds_bucket[5m])))",
                          "sglang")
    assert not query_problems("max by (tp_rank) (sglang:num_running_reqs)", "sglang")


def test_types_and_labels_come_from_the_wheels_with_their_origin():
    for engine, version in metrics.ENGINE_VERSIONS.items():
        table = catalogue(engine)
        assert (table["package"], table["version"]) == (engine, version)
        assert len(table["sha256"]) == 64 and table["wheel"].startswith(f"{engine}-{version}-")
    sg = catalogue("sglang")["metrics"]
    assert sg["sglang:eplb_balancedness"]["type"] == "summary"
    assert sg["sglang:num_running_reqs"]["collector"] == "SchedulerMetricsCollector"
    assert {"tp_rank", "moe_ep_rank"} <= set(sg["sglang:num_running_reqs"]["labels"])
    assert sg["sglang:time_to_first_token_seconds"]["collector"] == "TokenizerMetricsCollector"
    assert "sglang:eplb_balancedness" not in exposed_series("sglang")
    assert "vllm:nixl_num_failed_transfers_total" in exposed_series("vllm")


def test_the_expert_balance_alert_and_gate_exist_exactly_where_the_engine_reports_it():
    """SGLang registers sglang:eplb_balancedness only with --expert-balancedness-report-mode
    prometheus|both (0.5.23 srt/runtime_context.py, default off): the alert and the fleet gate are
    rendered for the pools whose command line turns it on, and for no other."""
    spec = spec_of("prod", "sglang")
    roles = balancedness_roles(spec)
    assert roles, "prod's MoE pools run EPLB and report balancedness"
    assert "PdstackExpertImbalance" in {r.name for r in alert_rules(spec)}
    gates = fleet_queries("sglang", "ns", "10m", list(spec.deployment.pools()), roles)
    assert {f"{r} expert balancedness" for r in roles} <= set(gates)
    assert "_sum" in gates[f"{roles[0]} expert balancedness"]
    assert balancedness_roles(spec_of("prod", "vllm")) == []
    assert ENGINE_METRICS["vllm"].expert_balancedness is None


def test_the_scraper_sees_every_node_that_exports():
    """SGLang's non-rank-0 nodes serve their schedulers' /metrics on --port (0.5.23
    srt/entrypoints/engine.py, launch_dummy_health_check_server with enable_metrics); a headless
    vLLM worker serves nothing (0.33.0 entrypoints/cli/serve.py run_headless), so only its
    leader is scraped. The scaler then counts instances by leader, not pods."""
    from infra.offline import run_spec

    for engine in ("sglang", "vllm"):
        run = run_spec(spec_of("prod", engine))
        (monitor,) = run.by_kind("PodMonitor")
        assert "matchLabels" not in monitor["spec"]["selector"]
        assert "leaderworkerset.sigs.k8s.io/group-index" in monitor["spec"]["podTargetLabels"]
        endpoint = monitor["spec"]["podMetricsEndpoints"][0]
        drops = endpoint.get("relabelings", [])
        if engine == "sglang":
            assert drops == []
        else:
            # decode's nodes each serve their own ranks (hybrid DP load balancing); prefill's workers are headless
            assert drops and drops[0]["action"] == "drop" and drops[0]["regex"].startswith("(prefill)")
    spec = spec_of("prod", "sglang")
    (ratio,) = [s for s in signals(spec, "prefill") if s.name == "ratio_floor"]
    assert 'leaderworkerset_sigs_k8s_io_worker_index="0"' in ratio.query


def test_the_catalogue_is_sorted_json():
    for engine in metrics.ENGINE_VERSIONS:
        path = metrics.PINNED_DIR / f"{engine}-{metrics.ENGINE_VERSIONS[engine]}-metrics.json"
        assert path.read_text() == json.dumps(json.loads(path.read_text()), indent=1, sort_keys=True) + "\n"
