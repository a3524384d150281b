"""What operators watch, in PromQL, for each pinned engine. Pure.

Every series a query reads is one the pinned engine really exposes, with the labels it really
carries: `pinned/<engine>-<version>-metrics.json` holds each metric's name, type and label names
as the wheel's source declares them (`scripts/extract_engine_metrics.py`), and `exposed_series`
turns them into series the way prometheus_client writes them (a Counter `x` as `x_total`, a
Histogram as `x_bucket`/`x_sum`/`x_count`, a Summary as `x_sum`/`x_count` only: no bare series).
tests/test_metrics_contract.py checks every alert, scaler, canary gate, validation gate and
dashboard query against them. GPU memory comes from NVIDIA's dcgm-exporter, whose default
counters (etc/default-counters.csv in NVIDIA/dcgm-exporter) include the names in DCGM_METRICS.

Which pods export: an SGLang group's rank-0 node serves the tokenizer's metrics (TTFT, ITL,
requests, tokens) and its own schedulers'; every other node serves its own schedulers' metrics
(running and queued requests, token usage, KV-transfer failures) on the same --port when
--enable-metrics is on (sglang 0.5.23, srt/entrypoints/engine.py: node_rank >= 1 runs
launch_dummy_health_check_server with metrics). A headless vLLM worker (prefill's) serves nothing
(vllm 0.33.0, entrypoints/cli/serve.py run_headless), and its leader's API server reports every
DP engine (label `engine`); vLLM decode runs hybrid DP load balancing, where every node's API
servers report that node's engines. So queries read scheduler gauges summed over all of a pool's
pods, and count instances by their leaders.

Which role exports what in PD mode decides which pools an alert reads (`alert_rules`):
- TTFT: SGLang's prefill never observes it; the decode server's tokenizer does, from the
  request's arrival (sent to both at once) to its first token, so the client's TTFT (sglang
  0.5.23 srt/managers/tokenizer_manager.py collect_metrics: "PD prefill workers never observe
  TTFT"). vLLM observes it on both, each from the request's arrival at that instance (vllm
  0.33.0 v1/metrics/stats.py update_from_output): prefill's queue and prompt, decode's KV pull
  and first step. Either role's p99 above the SLO puts the client's above it too; summed
  together, one role's tail is hidden in the other's samples.
- Inter-token latency: only where tokens are decoded (a prefill instance makes one token).
- Prefix-cache hit rate: owned by the roles that compute prompts (`spec.runs_prefix_cache`).
  An SGLang decode scheduler publishes sglang:cache_hit_rate as a constant 0 (srt/managers/
  scheduler_components/metrics_reporter.py: only report_prefill_stats sets it, and a PD decode
  batch has no prefill stats; observability/metrics_collector.py log_stats publishes it
  anyway); a vLLM decode instance counts its own local lookups in vllm:prefix_cache_queries
  (v1/core/sched/scheduler.py record_prefix_cache_stats, at every admission).
Scalers, `plan --watch` and the dashboard read a role's TTFT where its engine times it
(`ttft_pool`, from `EngineMetrics.ttft_timed_by`, the one table of it): an SGLang prefill pool's
from decode (the client's TTFT, which grows as prompts wait for prefill), a vLLM prefill pool's
from itself (its queue and prompt).
Every rule selects one namespace, its own: the environment's, or its release track's
(`<namespace>-r<revision>`, whose PrometheusRule the track renders), so a canary's series never
enter the serving revision's alerts (the canary is judged by its gates, infra/rollout/canary.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from infra import naming
from infra.render.flagsets import PINNED_DIR
from infra.spec import StackSpec, runs_prefix_cache

DCGM_METRICS = frozenset({"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL"})
ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}


def series_label(k8s_label: str) -> str:
    """A pod label as prometheus-operator's podTargetLabels writes it on every series."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", k8s_label)


ROLE_SERIES_LABEL = series_label(naming.ROLE_LABEL)
RELEASE_SERIES_LABEL = series_label(naming.RELEASE_LABEL)
GROUP_SERIES_LABEL = series_label(naming.LWS_GROUP_INDEX_LABEL)
WORKER_SERIES_LABEL = series_label(naming.LWS_WORKER_INDEX_LABEL)
POD_TARGET_LABELS = (naming.ROLE_LABEL, naming.RELEASE_LABEL, naming.LWS_GROUP_INDEX_LABEL,
                     naming.LWS_WORKER_INDEX_LABEL)
# What Prometheus adds to every scraped series from a PodMonitor/ServiceMonitor target
# (prometheus-operator: namespace, pod, container, endpoint, job, instance; service for
# ServiceMonitors), and the pod labels the monitors copy.
TARGET_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "job", "instance", "service",
                           *(series_label(k) for k in POD_TARGET_LABELS)})
# What an alert about a pool says it is about: its namespace (environment or release track) and role.
BY_POOL = ("namespace", ROLE_SERIES_LABEL)


@functools.cache
def catalogue(engine: str) -> dict:
    """The pinned engine's metrics: name -> {type, labels, optional_labels, source, collector}."""
    return json.loads((PINNED_DIR / f"{engine}-{ENGINE_VERSIONS[engine]}-metrics.json").read_text())


@functools.cache
def exposed_series(engine: str) -> dict[str, tuple[str, dict]]:
    """Series name -> (metric name, metric entry), as prometheus_client exposes them."""
    out: dict[str, tuple[str, dict]] = {}
    for name, m in catalogue(engine)["metrics"].items():
        suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"],
                    "summary": ["_sum", "_count"]}[m["type"]]
        base = name.removesuffix("_total") if m["type"] == "counter" else name
        for suffix in suffixes:
            out[base + suffix] = (name, m)
    return out


def workers_export_metrics(engine: str, worker_args: list[str]) -> bool:
    """Whether a multi-node group's non-leader pods serve /metrics (see the module docstring)."""
    if engine == "sglang":
        return "--enable-metrics" in worker_args
    return "--headless" not in worker_args


@dataclass(frozen=True)
class EngineMetrics:
    ttft_bucket: str
    tpot_bucket: str
    queue_depth: str
    running: str
    kv_cache_usage: str  # 0..1
    # Prompt tokens the prefix cache served, and all it was asked for (counters: the hit rate is
    # their ratio, `prefix_hit_ratio`)
    prefix_hit_tokens: str
    prefix_lookup_tokens: str
    kv_transfer_failures: str  # counter
    # Histogram of one KV transfer's time, and its unit in seconds (SGLang's is in ms, timed on the
    # prefill, which pushes; vLLM's in s, on the decode, which pulls)
    kv_transfer_time_bucket: str
    kv_transfer_time_unit_s: float
    requests_total: str  # counter of finished requests
    requests_started: str  # counter of requests received (the error-rate denominator)
    requests_failed: str  # counter of requests aborted or failed (the error-rate numerator)
    generation_tokens: str  # counter of output tokens (decode throughput)
    prompt_length: str  # Histogram of prompt tokens per request (its _bucket/_sum/_count)
    output_length: str  # Histogram of output tokens per request
    expert_balancedness: str | None  # Summary of 0..1 (1: perfectly balanced); None if not exported
    # role -> the pool whose TTFT histogram times that role's requests, where it is not the role's own
    # (the module docstring): the pool a role's TTFT is read from.
    ttft_timed_by: dict[str, str]

    def prefix_hit_ratio(self, by: tuple[str, ...] = BY_POOL) -> str:
        """The prefix-cache hit rate, 0..1, per `by` group (every pool: BY_POOL; () for one figure
        over all the series it is narrowed to), token-weighted over the window; narrow it with
        every_series_with_selector. No lookups give 0/0, no value: an idle pool is no low hit rate."""
        total = f"sum by ({', '.join(by)})" if by else "sum"
        return f"{total} (rate({self.prefix_hit_tokens}[5m])) / {total} (rate({self.prefix_lookup_tokens}[5m]))"


ENGINE_METRICS = {
    "sglang": EngineMetrics(
        ttft_bucket="sglang:time_to_first_token_seconds_bucket",
        tpot_bucket="sglang:inter_token_latency_seconds_bucket",
        queue_depth="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_cache_usage="sglang:token_usage",
        # Prompt tokens served from a cache tier over all, as the counter's own help text says to
        # read it (srt/observability/metrics_collector.py prefill_effective_tokens_total: modes
        # input, device_hit, host_hit, storage_hit, each seeded at 0): token-weighted, over the
        # window, where sglang:cache_hit_rate holds each rank's last batch.
        prefix_hit_tokens='sglang:prefill_effective_tokens_total{mode=~".+_hit"}',
        prefix_lookup_tokens="sglang:prefill_effective_tokens_total",
        kv_transfer_failures="sglang:num_transfer_failed_reqs_total",
        kv_transfer_time_bucket="sglang:kv_transfer_latency_ms_bucket",  # disaggregation/prefill.py
        kv_transfer_time_unit_s=0.001,
        requests_total="sglang:e2e_request_latency_seconds_count",
        requests_started="sglang:num_requests_total",
        requests_failed="sglang:num_aborted_requests_total",
        generation_tokens="sglang:generation_tokens_total",
        prompt_length="sglang:prompt_tokens_histogram",
        output_length="sglang:generation_tokens_histogram",
        expert_balancedness="sglang:eplb_balancedness",
        # A PD prefill's tokenizer observes no TTFT; decode's, from the request's arrival
        # (srt/managers/tokenizer_manager.py collect_metrics).
        ttft_timed_by={"prefill": "decode"},
    ),
    "vllm": EngineMetrics(
        ttft_bucket="vllm:time_to_first_token_seconds_bucket",
        tpot_bucket="vllm:inter_token_latency_seconds_bucket",
        queue_depth="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_cache_usage="vllm:kv_cache_usage_perc",
        prefix_hit_tokens="vllm:prefix_cache_hits_total",
        prefix_lookup_tokens="vllm:prefix_cache_queries_total",
        kv_transfer_failures="vllm:nixl_num_failed_transfers_total",
        kv_transfer_time_bucket="vllm:nixl_xfer_time_seconds_bucket",  # kv_connector/v1/nixl/stats.py
        kv_transfer_time_unit_s=1.0,
        requests_total="vllm:e2e_request_latency_seconds_count",
        requests_started="vllm:request_success_total",
        requests_failed='vllm:request_success_total{finished_reason="abort"}',
        generation_tokens="vllm:generation_tokens_total",
        prompt_length="vllm:request_prompt_tokens",
        output_length="vllm:request_generation_tokens",
        expert_balancedness=None,
        ttft_timed_by={},  # each role its own part (v1/metrics/stats.py update_from_output)
    ),
}


def increase_from_zero(counter: str, window: str, by: tuple[str, ...] = ()) -> str:
    """How much `counter` (narrowed already) rose in `window`, summed per `by` (none: one figure,
    0 when nothing rose), counting a series that first appeared in the window from 0.

    A labelled prometheus_client counter that is not seeded is exported only from its first
    increment (SGLang 0.5.23's sglang:num_transfer_failed_reqs_total first appears at 1, or at
    10 when ten requests failed between two scrapes), and `increase()` starts from a series'
    first sample, so it alone misses what the series held when it appeared (Prometheus docs,
    querying/functions: increase "extrapolates" between the samples it has). The minimum of a
    series that did not exist one window ago is that part."""
    total = f"sum by ({', '.join(by)})" if by else "sum"
    rose = f"{total} (increase({counter}[{window}]))"
    appeared = f"{total} (min_over_time({counter}[{window}]) unless {counter} offset {window})"
    if by:
        return f"({rose} or {appeared} * 0) + ({appeared} or {rose} * 0)"
    return f"({rose} or vector(0)) + ({appeared} or vector(0))"


def with_selector(metric: str, selector: str) -> str:
    """`metric` (possibly with its own `{...}`) narrowed by `selector` ('{a="b"}' or '')."""
    if not selector:
        return metric
    inner = selector.strip()[1:-1]
    if metric.endswith("}"):
        return f"{metric[:-1]},{inner}}}"
    return f"{metric}{{{inner}}}"


def every_series_with_selector(expression: str, selector: str) -> str:
    """A PromQL expression (e.g. `prefix_hit_ratio`) with every engine series it reads narrowed by
    `selector`, beside any matchers of its own."""
    return re.sub(r"\b(?:sglang|vllm):[A-Za-z_]+(?:\{[^}]*\})?", lambda m: with_selector(m.group(0), selector), expression)


def p99(bucket: str, selector: str = "", window: str = "5m", by: tuple[str, ...] = ()) -> str:
    """The 99th percentile of a histogram's samples in `window`, one per `by` group."""
    return f"histogram_quantile(0.99, sum by ({', '.join((*by, 'le'))}) (rate({with_selector(bucket, selector)}[{window}])))"


def pools_selector(namespace: str, roles: list[str]) -> str:
    """The series of some pools of one namespace: an environment's, or one release track's."""
    role = f'="{roles[0]}"' if len(roles) == 1 else f'=~"{"|".join(roles)}"'
    return f'{{namespace="{namespace}",{ROLE_SERIES_LABEL}{role}}}'


def ttft_pool(spec: StackSpec, role: str) -> str:
    """The pool whose TTFT histogram times the first token of `role`'s requests."""
    return ENGINE_METRICS[spec.engine.kind].ttft_timed_by.get(role, role)


def ttft_pools(spec: StackSpec) -> list[str]:
    """The pools whose TTFT histogram has samples in PD mode: each role's `ttft_pool`, once."""
    return list(dict.fromkeys(ttft_pool(spec, role) for role in spec.deployment.pools()))


def ttft_selector(spec: StackSpec, role: str) -> str:
    """The series timing `role`'s first tokens, in this namespace (environment or release track)."""
    return pools_selector(spec.environment.namespace, [ttft_pool(spec, role)])


def summary_mean(summary: str, selector: str, window: str, over: str = "rate") -> str:
    """A Summary's mean per series over a window: it has no bare series, only _sum and _count."""
    return f"{over}({with_selector(summary + '_sum', selector)}[{window}]) / " \
           f"{over}({with_selector(summary + '_count', selector)}[{window}])"


# Requests each balancer counts: sglang-router 0.3.2's (pinned/sglang-router-0.3.2.json), and the
# endpoint picker's inference_objective_request_total (a CounterVec, subsystem inference_objective,
# gateway-api-inference-extension v1.4.0 pkg/epp/metrics/metrics.go).
ROUTER_REQUESTS = {"sglang_router": "smg_http_requests_total", "gateway_epp": "inference_objective_request_total"}

BALANCEDNESS_FLAG = "--expert-balancedness-report-mode"


def exports_expert_balancedness(args: list[str]) -> bool:
    """SGLang registers sglang:eplb_balancedness only when the report goes to Prometheus
    (sglang 0.5.23 srt/runtime_context.py exports_expert_balancedness_to_prometheus: mode
    prometheus or both; default off), on the moe_ep_rank 0 scheduler."""
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith(BALANCEDNESS_FLAG + "=") else \
            args[i + 1] if arg == BALANCEDNESS_FLAG and i + 1 < len(args) else None
        if value in ("prometheus", "both"):
            return True
    return False


def balancedness_roles(spec: StackSpec) -> list[str]:
    """Pools whose rendered engine command exports expert balancedness."""
    from infra.render.engine_args import all_launches

    if ENGINE_METRICS[spec.engine.kind].expert_balancedness is None:
        return []
    return [role for role, launch in all_launches(spec).items() if exports_expert_balancedness(launch.args)]


def instances_query(metric: str, selector: str, in_namespaces: str = "") -> str:
    """Serving instances: groups whose leader exports `metric` (every node of an SGLang group
    exports its schedulers' gauges, so pods are not instances); with `in_namespaces` (an expression
    by namespace), only those in the namespaces it yields."""
    leaders = with_selector(with_selector(metric, selector), f'{{{WORKER_SERIES_LABEL}="0"}}')
    only = f" and on (namespace) ({in_namespaces})" if in_namespaces else ""
    return f"count(count by (namespace, pod) ({leaders}){only})"


def prefix_cache_roles(spec: StackSpec) -> list[str]:
    """Pools that own a prefix cache: those that compute prompts (the module docstring)."""
    return [role for role in spec.deployment.pools() if runs_prefix_cache(spec, role)]


def prefix_hit_ratio(spec: StackSpec, namespace: str | None = None) -> str:
    """The prefix-cache hit rate of the pools that own one, per pool, in `namespace` (default: the
    spec's; a dashboard passes its variable)."""
    return every_series_with_selector(ENGINE_METRICS[spec.engine.kind].prefix_hit_ratio(),
                                      pools_selector(namespace or spec.environment.namespace, prefix_cache_roles(spec)))


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    severity: str
    summary: str
    for_: str = "5m"


def alert_rules(spec: StackSpec) -> list[AlertRule]:
    """The SLO alerts of one namespace (the module docstring says which role exports what), each
    labelled with the namespace and role it judges."""
    m = ENGINE_METRICS[spec.engine.kind]
    slo, ns = spec.slo, spec.environment.namespace
    ttft, tpot = slo.ttft_p99_ms / 1000, slo.tpot_p99_ms / 1000
    roles = list(spec.deployment.pools())
    every_pool = pools_selector(ns, roles)
    timing_first_tokens = pools_selector(ns, ttft_pools(spec))
    decoding = pools_selector(ns, [r for r in roles if r != "prefill"])
    by_pod = ", ".join((*BY_POOL, "pod"))
    rules = []
    for severity, factor in (("warning", 1), ("critical", 2)):
        rules += [
            AlertRule(f"PdstackTTFTp99{severity.title()}", f"{p99(m.ttft_bucket, timing_first_tokens, by=BY_POOL)} > {ttft * factor:g}",
                      severity, f"TTFT p99 above {factor}x the SLO of {slo.ttft_p99_ms:g} ms"),
            AlertRule(f"PdstackTPOTp99{severity.title()}", f"{p99(m.tpot_bucket, decoding, by=BY_POOL)} > {tpot * factor:g}",
                      severity, f"TPOT p99 above {factor}x the SLO of {slo.tpot_p99_ms:g} ms"),
        ]
    rules += [
        # Per scheduler (an SGLang DP rank, a vLLM engine): one full rank is one whose requests wait.
        AlertRule("PdstackQueueDepthHigh", f"max by ({by_pod}) ({with_selector(m.queue_depth, every_pool)}) > 64",
                  "warning", "requests queue on an instance: decode waits for prefill, or the pool is too small"),
        AlertRule("PdstackKVCacheNearlyFull", f"max by ({by_pod}) ({with_selector(m.kv_cache_usage, every_pool)}) > 0.92",
                  "warning", "KV cache nearly full: KV piles up on decode"),
        AlertRule("PdstackKVCacheFull", f"max by ({by_pod}) ({with_selector(m.kv_cache_usage, every_pool)}) > 0.98",
                  "critical", "KV cache full: requests will be preempted or rejected"),
    ]
    if prefix_cache_roles(spec):  # no pool caches prefixes: no hit rate to judge
        rules.append(AlertRule("PdstackPrefixCacheHitRateLow", f"{prefix_hit_ratio(spec)} < 0.2",
                               "warning", "prefix-cache hit rate below 20%: check router affinity and cache capacity",
                               for_="30m"))
    rules += [
        # from zero: SGLang's counter is exported from its first failure (increase_from_zero)
        AlertRule("PdstackKVTransferErrors",
                  f"{increase_from_zero(with_selector(m.kv_transfer_failures, every_pool), '5m', BY_POOL)} > 0",
                  "critical", "KV transfers from prefill to decode failed or timed out", for_="1m"),
        # dcgm-exporter labels each GPU with the namespace and pod it serves (its Kubernetes
        # mapping, as infra/reports/cost.py reads it): this namespace's GPUs only.
        AlertRule("PdstackGPUMemoryHigh",
                  f'max by (namespace, pod, Hostname, gpu) (DCGM_FI_DEV_FB_USED{{namespace="{ns}"}} / '
                  f'(DCGM_FI_DEV_FB_USED{{namespace="{ns}"}} + DCGM_FI_DEV_FB_FREE{{namespace="{ns}"}})) > 0.97',
                  "warning", "GPU framebuffer almost full"),
    ]
    balanced = balancedness_roles(spec)
    if balanced:
        rules.append(AlertRule("PdstackExpertImbalance",
                               f"min by ({', '.join(BY_POOL)}) "
                               f"({summary_mean(m.expert_balancedness, pools_selector(ns, balanced), '15m')}) < 0.6",
                               "warning", "expert load imbalanced: rerun pdctl eplb on recent loads", for_="15m"))
    return rules


def metric_names_in(expr: str) -> set[str]:
    """Metric names an expression reads (identifiers with an engine prefix or DCGM_)."""
    import re

    return set(re.findall(r"\b(?:sglang:|vllm:|smg_|DCGM_)[A-Za-z0-9_:]*", expr))
