"""What operators watch, in PromQL, for each pinned engine. Pure.

Metric names are the ones the pinned engines really export (checked by tests against
`pinned/*.json`, which `scripts/extract_engine_flags.py` read from the wheels). GPU memory
comes from NVIDIA's dcgm-exporter, whose default counters (etc/default-counters.csv in
NVIDIA/dcgm-exporter) include the names in DCGM_METRICS.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.spec import StackSpec

DCGM_METRICS = frozenset({"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL"})


@dataclass(frozen=True)
class EngineMetrics:
    ttft_bucket: str
    tpot_bucket: str
    queue_depth: str
    running: str
    kv_cache_usage: str  # 0..1
    prefix_hit_ratio: str  # PromQL expression, 0..1
    kv_transfer_failures: str  # counter
    requests_total: str  # counter of finished requests
    requests_started: str  # counter of requests received (the error-rate denominator)
    requests_failed: str  # counter of requests aborted or failed (the error-rate numerator)
    generation_tokens: str  # counter of output tokens (decode throughput)
    expert_balancedness: str | None  # 0..1, 1 is perfectly balanced; None if not exported


ENGINE_METRICS = {
    "sglang": EngineMetrics(
        ttft_bucket="sglang:time_to_first_token_seconds_bucket",
        tpot_bucket="sglang:inter_token_latency_seconds_bucket",
        queue_depth="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_cache_usage="sglang:token_usage",
        prefix_hit_ratio="avg(sglang:cache_hit_rate)",
        kv_transfer_failures="sglang:num_transfer_failed_reqs_total",
        requests_total="sglang:e2e_request_latency_seconds_count",
        requests_started="sglang:num_requests_total",
        requests_failed="sglang:num_aborted_requests_total",
        generation_tokens="sglang:generation_tokens_total",
        expert_balancedness="sglang:eplb_balancedness",
    ),
    "vllm": EngineMetrics(
        ttft_bucket="vllm:time_to_first_token_seconds_bucket",
        tpot_bucket="vllm:inter_token_latency_seconds_bucket",
        queue_depth="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_cache_usage="vllm:kv_cache_usage_perc",
        prefix_hit_ratio="sum(rate(vllm:prefix_cache_hits_total[5m])) / clamp_min(sum(rate(vllm:prefix_cache_queries_total[5m])), 1)",
        kv_transfer_failures="vllm:nixl_num_failed_transfers",
        requests_total="vllm:e2e_request_latency_seconds_count",
        requests_started="vllm:request_success_total",
        requests_failed='vllm:request_success_total{finished_reason="abort"}',
        generation_tokens="vllm:generation_tokens_total",
        expert_balancedness=None,
    ),
}


def with_selector(metric: str, selector: str) -> str:
    """`metric` (possibly with its own `{...}`) narrowed by `selector` ('{a="b"}' or '')."""
    if not selector:
        return metric
    inner = selector.strip()[1:-1]
    if metric.endswith("}"):
        return f"{metric[:-1]},{inner}}}"
    return f"{metric}{{{inner}}}"


def p99(bucket: str, selector: str = "", window: str = "5m") -> str:
    return f"histogram_quantile(0.99, sum by (le) (rate({with_selector(bucket, selector)}[{window}])))"


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    severity: str
    summary: str
    for_: str = "5m"


def alert_rules(spec: StackSpec) -> list[AlertRule]:
    m = ENGINE_METRICS[spec.engine.kind]
    slo = spec.slo
    ttft, tpot = slo.ttft_p99_ms / 1000, slo.tpot_p99_ms / 1000
    rules = []
    for severity, factor in (("warning", 1), ("critical", 2)):
        rules += [
            AlertRule(f"PdstackTTFTp99{severity.title()}", f"{p99(m.ttft_bucket)} > {ttft * factor:g}", severity,
                      f"TTFT p99 above {factor}x the SLO of {slo.ttft_p99_ms:g} ms"),
            AlertRule(f"PdstackTPOTp99{severity.title()}", f"{p99(m.tpot_bucket)} > {tpot * factor:g}", severity,
                      f"TPOT p99 above {factor}x the SLO of {slo.tpot_p99_ms:g} ms"),
        ]
    rules += [
        AlertRule("PdstackQueueDepthHigh", f"max by (pod) ({m.queue_depth}) > 64", "warning",
                  "requests queue on an instance: decode waits for prefill, or the pool is too small"),
        AlertRule("PdstackKVCacheNearlyFull", f"max by (pod) ({m.kv_cache_usage}) > 0.92", "warning",
                  "KV cache nearly full: KV piles up on decode"),
        AlertRule("PdstackKVCacheFull", f"max by (pod) ({m.kv_cache_usage}) > 0.98", "critical",
                  "KV cache full: requests will be preempted or rejected"),
        AlertRule("PdstackPrefixCacheHitRateLow", f"{m.prefix_hit_ratio} < 0.2", "warning",
                  "prefix-cache hit rate below 20%: check router affinity and cache capacity", for_="30m"),
        AlertRule("PdstackKVTransferErrors", f"sum(increase({m.kv_transfer_failures}[5m])) > 0", "critical",
                  "KV transfers from prefill to decode failed or timed out", for_="1m"),
        AlertRule("PdstackGPUMemoryHigh",
                  "max by (Hostname, gpu) (DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)) > 0.97",
                  "warning", "GPU framebuffer almost full"),
    ]
    if m.expert_balancedness:
        rules.append(AlertRule("PdstackExpertImbalance", f"min({m.expert_balancedness}) < 0.6", "warning",
                               "expert load imbalanced: rerun pdctl eplb on recent loads", for_="15m"))
    return rules


def metric_names_in(expr: str) -> set[str]:
    """Metric names an expression reads (identifiers with an engine prefix or DCGM_)."""
    import re

    return set(re.findall(r"\b(?:sglang:|vllm:|smg_|DCGM_)[A-Za-z0-9_:]*", expr))
