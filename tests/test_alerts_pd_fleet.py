"""Every alert, as each release track renders it, evaluated by `promtool test rules` on a PD fleet
of two tracks whose series are shaped as the pinned engines export them: a healthy fleet raises
nothing, and each fault raises its alert, labelled with the track and role at fault, from that
track's rules only.

Which role exports what (infra/render/metrics.py's docstring holds the citations):
- sglang 0.5.23: every node of a group serves its schedulers' gauges, the leader its tokenizer's
  histograms (srt/entrypoints/engine.py). A PD decode scheduler publishes sglang:cache_hit_rate
  as a constant 0 (srt/managers/scheduler_components/metrics_reporter.py: only
  report_prefill_stats sets it; observability/metrics_collector.py log_stats publishes it on every
  report), and its sglang:prefill_effective_tokens_total stays at the 0 every mode is seeded with. A PD prefill's tokenizer never observes TTFT nor inter-token latency
  (srt/managers/tokenizer_manager.py collect_metrics); decode's TTFT runs from the request's
  arrival to its first token.
- vllm 0.33.0: only a group's leader serves /metrics (entrypoints/cli/serve.py run_headless). Both
  roles observe TTFT from the request's arrival at them (v1/metrics/stats.py update_from_output);
  a prefill makes one token, so no inter-token latency, though its histogram's series exist
  (v1/metrics/loggers.py create_metric_per_engine); decode counts its own local prefix lookups in
  vllm:prefix_cache_queries (v1/core/sched/scheduler.py record_prefix_cache_stats).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import pytest
import yaml

from infra.components.k8s import LayerContext
from infra.components.monitoring import prometheus_rule
from infra.render.metrics import (GROUP_SERIES_LABEL, RELEASE_SERIES_LABEL, ROLE_SERIES_LABEL, WORKER_SERIES_LABEL,
                                  balancedness_roles, exposed_series)
from infra.tracks import plan_tracks
from tests.servers import require_binary

SERVING, CANARY = 7, 8
EVAL_AT = "40m"
MODEL = "deepseek-ai/DeepSeek-V3"


def tracks(engine: str):
    """The prod spec with `engine`, as two release tracks: 7 serving, 8 the new revision beside it."""
    from infra.render.engine_check import variant_spec

    data = variant_spec("prod", engine).model_dump(mode="json")
    return plan_tracks([(SERVING, 100, data), (CANARY, 0, data)])  # vLLM's gateway_epp moves traffic whole


@dataclass(frozen=True)
class Pod:
    engine: str
    revision: int
    role: str
    worker: int  # the LWS worker index: 0 the group's leader

    @property
    def namespace(self) -> str:
        return f"pdstack-prod-r{self.revision}"

    @property
    def name(self) -> str:
        return f"engine-{self.role}-0" + (f"-{self.worker}" if self.worker else "")


def pods(engine: str) -> list[Pod]:
    """The pods whose /metrics are scraped: an SGLang group's leader and its second node; a vLLM
    group's leader only."""
    workers = (0, 1) if engine == "sglang" else (0,)
    return [Pod(engine, rev, role, w) for rev in (SERVING, CANARY) for role in ("prefill", "decode") for w in workers]


def series(pod: Pod, name: str, values: str, **extra: str) -> dict:
    """One input series with exactly the labels the pinned engine puts on it (its catalogue entry)
    and those the PodMonitor's scrape adds (namespace, pod, podTargetLabels)."""
    _, entry = exposed_series(pod.engine)[name]
    engine_values = {"model_name": MODEL, "engine_type": pod.role, "tp_rank": str(8 * pod.worker), "pp_rank": "0",
                     "moe_ep_rank": "0", "engine": "0", "forward_mode": "decode", "is_streaming": "true"}
    labels = {**{k: engine_values[k] for k in entry["labels"] if k not in extra}, **extra,
              "namespace": pod.namespace, "pod": pod.name, "job": "engines", "instance": f"{pod.name}:30000",
              ROLE_SERIES_LABEL: pod.role, RELEASE_SERIES_LABEL: str(pod.revision),
              GROUP_SERIES_LABEL: "0", WORKER_SERIES_LABEL: str(pod.worker)}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}", "values": values}


def histogram(pod: Pod, name: str, per_minute: dict[str, int]) -> list[dict]:
    """A histogram getting `per_minute` observations in each bucket (by upper bound) every minute."""
    total, out = 0, []
    for le, count in per_minute.items():
        total += count
        out.append(series(pod, f"{name}_bucket", f"0+{total}x60", le=le))
    return out + [series(pod, f"{name}_count", f"0+{total}x60"), series(pod, f"{name}_sum", f"0+{total}x60")]


def gpu(pod: Pod, used: int) -> list[dict]:
    """dcgm-exporter's framebuffer of the pod's first GPU (MiB), with its Kubernetes pod mapping."""
    labels = (f'gpu="0",UUID="GPU-{pod.revision}-{pod.role}-{pod.worker}",modelName="NVIDIA H100 80GB HBM3",'
              f'Hostname="node-{pod.revision}-{pod.role}-{pod.worker}",namespace="{pod.namespace}",pod="{pod.name}",'
              f'container="engine",job="nvidia-dcgm-exporter",instance="10.0.9.{pod.worker}:9400"')
    return [{"series": f"DCGM_FI_DEV_FB_USED{{{labels}}}", "values": f"{used}x60"},
            {"series": f"DCGM_FI_DEV_FB_FREE{{{labels}}}", "values": f"{100 - used}x60"}]


FAST = {"0.5": 1000, "1": 0, "2.5": 0, "+Inf": 0}  # TTFT: every first token within 0.5 s
STEADY = {"0.02": 1000, "0.05": 0, "0.1": 0, "+Inf": 0}  # inter-token latency within 20 ms


@dataclass
class Health:
    """What one pod shows; a fault changes one field of one pod."""

    queue: int = 2
    kv_usage: float = 0.5
    hit_rate: float = 0.35  # prefill's; the engine decides what decode shows
    transfer_failures_per_minute: int = 0
    transfer_failures_at_once: int = 0  # failed between two scrapes at minute 36, none after
    ttft: dict = field(default_factory=lambda: dict(FAST))
    itl: dict = field(default_factory=lambda: dict(STEADY))
    gpu_used: int = 50
    balancedness: float = 0.9


def prefill_tokens(pod: Pod, h: Health) -> list[dict]:
    """sglang:prefill_effective_tokens_total by mode, each seeded at 0 on every scheduler: a prefill
    computes 1000 prompt tokens a minute, `hit_rate` of them from its GPU cache; decode none."""
    per_minute = {"input": round(1000 * (1 - h.hit_rate)), "device_hit": round(1000 * h.hit_rate),
                  "host_hit": 0, "storage_hit": 0} if pod.role == "prefill" else {}
    return [series(pod, "sglang:prefill_effective_tokens_total", f"0+{per_minute.get(mode, 0)}x60", mode=mode)
            for mode in ("input", "device_hit", "host_hit", "storage_hit")]


def transfer_failures(h: Health, seeded: bool) -> str:
    """The failed-transfer counter's samples. A burst at minute 36: vLLM 0.33.0 seeds its counter at
    0 (vllm/v1/metrics/utils.py create_metric_per_engine), SGLang 0.5.23 exports its own only from
    its first increment (srt/observability/metrics_collector.py), so it first appears at the burst."""
    if h.transfer_failures_at_once:
        return f"{'0x35' if seeded else '_x36'} {h.transfer_failures_at_once}x24"  # 36 samples before it ('_x36', '0x35')
    return f"0+{h.transfer_failures_per_minute}x60"


def sglang_series(pod: Pod, h: Health, balanced: list[str]) -> list[dict]:
    out = [series(pod, "sglang:num_queue_reqs", f"{h.queue}x60"),
           series(pod, "sglang:token_usage", f"{h.kv_usage}x60"),
           series(pod, "sglang:cache_hit_rate", f"{h.hit_rate if pod.role == 'prefill' else 0}x60"),
           *prefill_tokens(pod, h),
           series(pod, "sglang:num_transfer_failed_reqs_total", transfer_failures(h, seeded=False))]
    if pod.role in balanced:
        out += [series(pod, "sglang:eplb_balancedness_sum", f"0+{h.balancedness * 10:g}x60", forward_mode="decode"),
                series(pod, "sglang:eplb_balancedness_count", "0+10x60", forward_mode="decode")]
    if pod.role == "decode" and pod.worker == 0:  # the tokenizer runs on the leader; prefill observes neither
        out += histogram(pod, "sglang:time_to_first_token_seconds", h.ttft)
        out += histogram(pod, "sglang:inter_token_latency_seconds", h.itl)
    return out


def vllm_series(pod: Pod, h: Health, balanced: list[str]) -> list[dict]:
    lookups = 1000  # prompt tokens a minute, looked up on both roles
    hits = round(lookups * h.hit_rate) if pod.role == "prefill" else 0
    return [series(pod, "vllm:num_requests_waiting", f"{h.queue}x60"),
            series(pod, "vllm:kv_cache_usage_perc", f"{h.kv_usage}x60"),
            series(pod, "vllm:prefix_cache_queries_total", f"0+{lookups}x60"),
            series(pod, "vllm:prefix_cache_hits_total", f"0+{hits}x60"),
            series(pod, "vllm:nixl_num_failed_transfers_total", transfer_failures(h, seeded=True)),
            *histogram(pod, "vllm:time_to_first_token_seconds", h.ttft),
            *histogram(pod, "vllm:inter_token_latency_seconds",
                       h.itl if pod.role == "decode" else {le: 0 for le in h.itl})]


def fleet(engine: str, faults: dict[Pod, Health]) -> list[dict]:
    balanced = balancedness_roles(tracks(engine)[0].spec)
    make = sglang_series if engine == "sglang" else vllm_series
    out = []
    for pod in pods(engine):
        h = faults.get(pod, Health())
        out += make(pod, h, balanced) + gpu(pod, h.gpu_used)
    return out


def alert_names(engine: str) -> set[str]:
    return {r["alert"] for t in tracks(engine) for g in rule_groups(t) for r in g["rules"]}


def rule_groups(track) -> list[dict]:
    (rule,) = [prometheus_rule(LayerContext(track.spec, track.namespace))]
    return rule["spec"]["groups"]


def run_promtool(tmp_path, engine: str, inputs: list[dict], expected: dict[str, list[dict]]) -> str:
    """Both tracks' PrometheusRules as rendered; every alert name is checked (absent: none)."""
    files = []
    for track in tracks(engine):
        path = tmp_path / f"r{track.revision}.rules.yaml"
        path.write_text(yaml.safe_dump({"groups": rule_groups(track)}))
        files.append(path.name)
    annotations = {r["alert"]: r["annotations"] for t in tracks(engine) for g in rule_groups(t) for r in g["rules"]}
    checks = [{"eval_time": EVAL_AT, "alertname": name,
               "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations[name]}
                              for labels in expected.get(name, [])]}
              for name in sorted(alert_names(engine))]
    unknown = set(expected) - alert_names(engine)
    assert not unknown, f"no such alert rendered: {unknown}"
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": files, "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}]}))
    done = subprocess.run([require_binary("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stdout + done.stderr


ENGINES = ("sglang", "vllm")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_healthy_pd_fleet_raises_no_alert(tmp_path, engine):
    """Prefill hits 35% of its prompts while SGLang's decode schedulers publish 0 and vLLM's decode
    looks up every prompt with no hit: taken over both roles, the hit rate read 17.5%, below 20%."""
    failed = run_promtool(tmp_path, engine, fleet(engine, {}), {})
    assert not failed, failed


# 2% of decode's first tokens at 1-2.5 s: its p99 ~1.75 s, above the 1.5 s SLO. Under vLLM, prefill
# observes as many fast first tokens: summed with them, the tail is 1% and the p99 0.5 s.
SLOW_FIRST_TOKENS = {"0.5": 980, "1": 0, "2.5": 20, "+Inf": 0}

# fault -> (role at fault; on which of its scraped pods: the group's "leader", its "last" node, or
#           the whole "pool"; their Health; the alerts it raises, each with whether it names the pod)
FAULTS = {
    "queue on a rank": ("decode", "last", Health(queue=100), [("PdstackQueueDepthHigh", True)]),
    "KV cache full": ("decode", "last", Health(kv_usage=0.99),
                      [("PdstackKVCacheNearlyFull", True), ("PdstackKVCacheFull", True)]),
    "prefill's hit rate low": ("prefill", "pool", Health(hit_rate=0.1), [("PdstackPrefixCacheHitRateLow", False)]),
    "KV transfers failing": ("prefill", "last", Health(transfer_failures_per_minute=1),
                             [("PdstackKVTransferErrors", False)]),
    "KV transfers failing at once": ("decode", "leader", Health(transfer_failures_at_once=10),
                                     [("PdstackKVTransferErrors", False)]),
    "decode's first tokens slow": ("decode", "leader", Health(ttft=SLOW_FIRST_TOKENS), [("PdstackTTFTp99Warning", False)]),
    "decode's tokens slow": ("decode", "leader", Health(itl={"0.02": 0, "0.05": 1000, "0.1": 0, "+Inf": 0}),
                             [("PdstackTPOTp99Warning", False)]),
    "GPU framebuffer full": ("decode", "last", Health(gpu_used=99), [("PdstackGPUMemoryHigh", True)]),
    "experts imbalanced": ("decode", "pool", Health(balancedness=0.5), [("PdstackExpertImbalance", False)]),
}


def expected_alerts(pod: Pod, raised: list[tuple[str, bool]]) -> dict[str, list[dict]]:
    out = {}
    for name, per_pod in raised:
        severity = "critical" if name in ("PdstackKVCacheFull", "PdstackKVTransferErrors") else "warning"
        labels = {"namespace": pod.namespace, ROLE_SERIES_LABEL: pod.role, "severity": severity}
        if name == "PdstackGPUMemoryHigh":
            labels = {"namespace": pod.namespace, "pod": pod.name, "Hostname": f"node-{pod.revision}-{pod.role}-{pod.worker}",
                      "gpu": "0", "severity": severity}
        elif per_pod:
            labels["pod"] = pod.name
        out[name] = [labels]
    return out


@pytest.mark.parametrize("revision", [SERVING, CANARY], ids=["serving track", "canary track"])
@pytest.mark.parametrize("engine,fault", [(e, f) for e in ENGINES for f in FAULTS
                                          if not (e == "vllm" and f == "experts imbalanced")])  # vLLM exports none
def test_each_fault_raises_its_alert_in_its_own_track_only(tmp_path, engine, fault, revision):
    """The alert carries the namespace and role at fault; the other track's rules stay silent, so a
    canary's fault is not the serving revision's alert (the canary gates judge the canary)."""
    role, where, health, raised = FAULTS[fault]
    pool = [p for p in pods(engine) if p.revision == revision and p.role == role]
    at_fault = {"leader": pool[:1], "last": pool[-1:], "pool": pool}[where]
    failed = run_promtool(tmp_path, engine, fleet(engine, dict.fromkeys(at_fault, health)),
                          expected_alerts(at_fault[-1], raised))
    assert not failed, failed
