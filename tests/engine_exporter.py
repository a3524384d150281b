"""A stand-in for one engine pod's /metrics, shaped as the pinned SGLang exports it, fed by a clock.

Every metric has the type and label names the wheel's source declares (the catalogue
infra/render/pinned/sglang-0.5.23-metrics.json): the scheduler's gauges carry tp_rank, pp_rank,
moe_ep_rank..., expert balancedness is a Summary (no bare series), counters are `_total`. Each
tick records a batch of requests with a fixed TTFT and inter-token latency, and, when degraded,
aborted requests and failed KV transfers, so that Prometheus sees real rates.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

from infra.render.metrics import ENGINE_METRICS, catalogue
from infra.validation.health import KV_CAPACITY_METRIC

SGLANG = ENGINE_METRICS["sglang"]
TYPES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram, "summary": Summary}
# Values for the labels the engine sets (a one-rank scheduler of a decode engine).
LABEL_VALUES = {"model_name": "deepseek-ai/DeepSeek-V3", "engine_type": "decode", "tp_rank": "0", "pp_rank": "0",
                "moe_ep_rank": "0", "is_streaming": "true", "forward_mode": "decode"}


def _base(name: str, suffix: str) -> str:
    return name.removesuffix(suffix)


def engine_metric(registry: CollectorRegistry, name: str, optional: tuple[str, ...] = (), **kwargs):
    """One of the pinned SGLang's metrics with its own type and label names (and those of its
    optional labels named in `optional`), label values set but the optional ones'."""
    entry = catalogue("sglang")["metrics"][name]
    assert set(optional) <= set(entry["optional_labels"] or ()), (name, optional)
    metric = TYPES[entry["type"]](name, name, labelnames=[*entry["labels"], *optional], registry=registry, **kwargs)
    fixed = {label: LABEL_VALUES[label] for label in entry["labels"]}
    return (lambda **extra: metric.labels(**fixed, **extra)) if optional else metric.labels(**fixed)


@dataclass(frozen=True)
class Behaviour:
    ttft_s: float
    itl_s: float
    abort_share: float = 0.0
    kv_failures_per_tick: int = 0
    running: float = 20.0  # requests in flight on this instance (the balancer's spread is read from it)
    expert_balancedness: float = 0.95
    kv_tokens: float = 200_000.0  # the KV pool of each scheduler (sglang:max_total_num_tokens)
    dp_ranks: int = 1  # data-parallel attention ranks: each a scheduler with a pool of its own, labelled dp_rank


HEALTHY = Behaviour(ttft_s=0.2, itl_s=0.015)
DEGRADED = Behaviour(ttft_s=4.0, itl_s=0.15, abort_share=0.1, kv_failures_per_tick=1)


def metrics_handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    """A handler serving `registry` in the classic text format whatever the scraper asks for, as
    the engines do."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return Handler


class EngineExporter:
    def __init__(self, behaviour: Behaviour, requests_per_tick: int = 20, tick_seconds: float = 0.2):
        self.behaviour, self.requests_per_tick, self.tick_seconds = behaviour, requests_per_tick, tick_seconds
        reg = self.registry = CollectorRegistry()
        self.ttft = engine_metric(reg, _base(SGLANG.ttft_bucket, "_bucket"), buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.itl = engine_metric(reg, _base(SGLANG.tpot_bucket, "_bucket"),
                                 buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5))
        self.started = engine_metric(reg, SGLANG.requests_started)
        self.aborted = engine_metric(reg, SGLANG.requests_failed)
        self.kv_failed = engine_metric(reg, SGLANG.kv_transfer_failures)
        engine_metric(reg, SGLANG.running).set(behaviour.running)
        if behaviour.dp_ranks > 1:
            kv = engine_metric(reg, KV_CAPACITY_METRIC["sglang"], optional=("dp_rank",))
            for rank in range(behaviour.dp_ranks):
                kv(dp_rank=str(rank)).set(behaviour.kv_tokens)
        else:
            engine_metric(reg, KV_CAPACITY_METRIC["sglang"]).set(behaviour.kv_tokens)
        self.balancedness = engine_metric(reg, SGLANG.expert_balancedness)
        self._stop = threading.Event()
        self.port: int | None = None

    def tick(self) -> None:
        b = self.behaviour
        self.started.inc(self.requests_per_tick)
        self.aborted.inc(round(self.requests_per_tick * b.abort_share))
        self.kv_failed.inc(b.kv_failures_per_tick)
        self.balancedness.observe(b.expert_balancedness)
        for _ in range(self.requests_per_tick):
            self.ttft.observe(b.ttft_s)
            for _ in range(5):
                self.itl.observe(b.itl_s)

    def start(self, port: int) -> None:
        """Serve the classic text format whatever the scraper asks for, as the engines do.

        (prometheus_client's own server answers Prometheus's OpenMetrics request with
        names escaped to `sglang_...`; the engines' `sglang:` names must reach Prometheus.)
        """
        self.port = port
        self._server = ThreadingHTTPServer(("127.0.0.1", port), metrics_handler(self.registry))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_seconds):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
