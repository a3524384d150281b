"""After the load: what the engines' own metrics say about the fleet (Prometheus). Per role, the
spread of running requests over instances (a persistent hot spot means the balancer is not
balancing), expert balancedness (EPLB), KV transfers that failed and requests that failed or
were aborted during the test; and the KV cache one decode instance holds, for the measured
surface. Pure: query text in, gates (or figures) out."""

from __future__ import annotations

import math

from infra.render.metrics import (ENGINE_METRICS, GROUP_SERIES_LABEL, RELEASE_SERIES_LABEL, ROLE_SERIES_LABEL,
                                 summary_mean, with_selector)
from infra.tracks import namespaces_matcher
from infra.rollout.canary import Gate

MAX_LOAD_SPREAD = 1.5  # busiest instance's running requests over the mean, averaged over the window
MIN_EXPERT_BALANCEDNESS = 0.8  # SGLang's eplb_balancedness: mean over max GPU load of experts, 1 is even


def role_selector(namespace: str, role: str) -> str:
    """The series of one pool, in the environment's namespace and every release track's."""
    return f'{{{namespaces_matcher(namespace)},{ROLE_SERIES_LABEL}="{role}"}}'


def fleet_queries(engine: str, namespace: str, window: str, roles: list[str],
                  balancedness_roles: list[str] = ()) -> dict[str, str]:
    """`balancedness_roles`: pools whose engines export expert balancedness
    (infra.render.metrics.balancedness_roles); SGLang registers it only when told to."""
    m = ENGINE_METRICS[engine]
    queries = {}
    for role in roles:
        sel = role_selector(namespace, role)
        # An instance's load is its group's: every node of an SGLang group exports its own
        # schedulers' running requests.
        running = f"sum by (namespace, {GROUP_SERIES_LABEL}) (avg_over_time({with_selector(m.running, sel)}[{window}]))"
        queries[f"{role} load spread"] = f"max({running}) / avg({running})"
        if m.expert_balancedness and role in balancedness_roles:
            queries[f"{role} expert balancedness"] = \
                f"min({summary_mean(m.expert_balancedness, sel, window, over='increase')})"
    sel = f"{{{namespaces_matcher(namespace)}}}"
    queries["KV transfer failures"] = f"sum(increase({with_selector(m.kv_transfer_failures, sel)}[{window}])) or vector(0)"
    queries["failed or aborted requests"] = f"sum(increase({with_selector(m.requests_failed, sel)}[{window}])) or vector(0)"
    return queries


def fleet_gates(values: dict[str, float]) -> list[Gate]:
    """No data for a spread is a failed gate (the engines were not seen); a missing balancedness
    is skipped only if the engine exports none (vLLM)."""
    gates = []
    for name, value in values.items():
        seen = math.isfinite(value)
        if name.endswith("load spread"):
            gates.append(Gate(name, seen and value <= MAX_LOAD_SPREAD,
                              f"{value:.2f}x the mean (at most {MAX_LOAD_SPREAD:g}x)" if seen else "no samples"))
        elif name.endswith("expert balancedness"):
            gates.append(Gate(name, seen and value >= MIN_EXPERT_BALANCEDNESS,
                              f"{value:.2f} (at least {MIN_EXPERT_BALANCEDNESS:g})" if seen else "no samples"))
        else:
            gates.append(Gate(name, seen and value == 0, f"{value:g} during the test" if seen else "no samples"))
    return gates


# What states each engine scheduler's KV cache, per the pinned engines' source:
# - SGLang 0.5.23 (srt/observability/metrics_collector.py, SchedulerMetricsCollector.emit_constants
#   and init_new): every scheduler sets the gauge `sglang:max_total_num_tokens` once at start,
#   labelled with its tp_rank and, under data parallelism, its dp_rank. The tensor-parallel ranks
#   of one attention group hold one pool of tokens between them; each DP rank has its own.
# - vLLM 0.33.0 (v1/metrics/loggers.py, log_metrics_info; config/cache.py, metrics_info): the
#   gauge `vllm:cache_config_info`, one series an engine (label `engine`), set to 1, with every
#   CacheConfig field as a label, num_gpu_blocks and block_size among them.
KV_CAPACITY_METRIC = {"sglang": "sglang:max_total_num_tokens", "vllm": "vllm:cache_config_info"}
INSTANCE_LABELS = ("namespace", RELEASE_SERIES_LABEL, GROUP_SERIES_LABEL)


def kv_capacity_query(engine: str, namespace: str, role: str) -> str:
    return with_selector(KV_CAPACITY_METRIC[engine], role_selector(namespace, role))


def kv_tokens_per_instance(engine: str, series: list[tuple[dict[str, str], float]]) -> float | None:
    """Tokens of KV the smallest instance of a pool holds (the one that caps its batch first),
    from the series of `kv_capacity_query`; None if there are none. An instance is one
    LeaderWorkerSet group of one release track; its pods' series add up as the module comment
    above says (SGLang: the largest over tp ranks, summed over dp ranks; vLLM: num_gpu_blocks x
    block_size, summed over the engines each pod reports)."""
    per_instance: dict[tuple, dict[tuple, float]] = {}
    for labels, value in series:
        instance = tuple(labels.get(k, "") for k in INSTANCE_LABELS)
        pools = per_instance.setdefault(instance, {})
        if engine == "sglang":
            key = (labels.get("dp_rank", ""),)
            pools[key] = max(pools.get(key, 0.0), value)
        else:
            try:
                tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                continue  # an engine still starting reports num_gpu_blocks=None
            pools[(labels.get("pod", ""), labels.get("engine", ""))] = float(tokens)
    totals = [sum(pools.values()) for pools in per_instance.values() if pools]
    return min(totals) if totals else None


def _per_instance(metric: str, namespace: str, role: str) -> str:
    """A gauge of a pool summed per instance: an instance's is its group's (as fleet_queries sums it)."""
    return f"sum by (namespace, {GROUP_SERIES_LABEL}) ({with_selector(metric, role_selector(namespace, role))})"


def held_batch_query(engine: str, namespace: str, role: str, seconds: int) -> str:
    """Sequences one instance of a pool held during the last `seconds` (one load-test run): the
    engines' running-requests gauge, an instance's being its group's, its median over the run's
    samples with idle ones left out (the tool starting, the last requests draining: a mean over
    them puts each ITL at a smaller batch than it was measured at), averaged over the instances."""
    running = _per_instance(ENGINE_METRICS[engine].running, namespace, role)
    return f"avg(quantile_over_time(0.5, ({running} > 0)[{max(1, seconds)}s:]))"


# Where a request waits at a decode engine that cannot run it yet, per the pinned engines' source:
# - SGLang 0.5.23 (srt/disaggregation/decode.py, its life-cycle docstring and DecodeReqToTokenPool):
#   a decode instance takes a request into its prealloc queue until it can allocate the KV, then its
#   transfer queue while the KV arrives, then its waiting queue until the running batch has room
#   (`--max-running-requests` bounds the running; pre_alloc_size more slots the other two). Each
#   queue is a gauge every scheduler registers at start (observability/metrics_collector.py,
#   SchedulerMetricsCollector: 0 outside PD decode): at the running cap the waiting queue fills, at
#   the KV's the prealloc queue.
# - vLLM 0.33.0 (v1/metrics/loggers.py, PrometheusStatLogger.record): `vllm:num_requests_waiting`
#   is those waiting for capacity and those deferred (a KV transfer among the reasons) together.
DECODE_QUEUE_METRICS = {
    "sglang": (ENGINE_METRICS["sglang"].queue_depth, "sglang:num_decode_prealloc_queue_reqs",
               "sglang:num_decode_transfer_queue_reqs"),
    "vllm": (ENGINE_METRICS["vllm"].queue_depth,),
}


def queue_depth_query(engine: str, namespace: str, role: str, seconds: int) -> str:
    """Requests one decode instance kept waiting during the last `seconds` (one load-test run): its
    queues (DECODE_QUEUE_METRICS) added up, their median over the samples at which it ran any
    request (the window holds the tool starting too), averaged over the instances. An engine at
    its cap queues what it cannot run: above 0, requests waited there half the time it was busy
    or more."""
    queued = " + ".join(_per_instance(metric, namespace, role) for metric in DECODE_QUEUE_METRICS[engine])
    running = _per_instance(ENGINE_METRICS[engine].running, namespace, role)
    return f"avg(quantile_over_time(0.5, (({queued}) and ({running} > 0))[{max(1, seconds)}s:]))"


def kv_usage_query(engine: str, namespace: str, role: str, seconds: int) -> str:
    """The highest share of KV cache in use (0..1) on any engine of a pool over the last `seconds`."""
    m = ENGINE_METRICS[engine]
    return f"max(max_over_time({with_selector(m.kv_cache_usage, role_selector(namespace, role))}[{max(1, seconds)}s]))"
