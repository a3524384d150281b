"""A small OpenAI-compatible streaming server on 127.0.0.1 that stands in for the gateway in the
load-test tests: it answers /v1/chat/completions as server-sent events after a configured
time to first token, then one chunk per output token at a configured inter-token delay, fails
a configured share of requests with HTTP 500, and requires an API key (401 without one). Like
an engine it publishes, on /metrics, the requests it runs (those holding one of `max_running`
slots) as the pinned SGLang's running-requests gauge, for a real Prometheus to scrape
(stub_prometheus): what `validate-deployment --prometheus` reads as the batch the engine held;
the requests waiting for a slot as its waiting-queue gauge (sglang:num_queue_reqs; its decode
prealloc and transfer queues, registered as every SGLang scheduler registers them, stay 0: no KV
arrives here), which tells an engine at its cap from a load generator that kept fewer in flight;
and, as an engine balancing its experts does (dev's DeepSeek, EPLB), the experts' balancedness
of each request it ran: 1, even (a stand-in has no experts)."""

from __future__ import annotations

import contextlib
import http.server
import json
import random
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from infra.validation.health import DECODE_QUEUE_METRICS
from tests.engine_exporter import SGLANG, engine_metric, metrics_handler
from tests.servers import prometheus, send_json, serving


@dataclass
class Behaviour:
    ttft_s: float = 0.2
    itl_s: float = 0.02
    error_rate: float = 0.0
    api_key: str | None = "test-key"  # None: serve anyone
    max_running: int | None = None  # an engine's running-request cap: a request past it waits for a slot


def _handler(b: Behaviour, rng: random.Random):
    slots = threading.BoundedSemaphore(b.max_running) if b.max_running else None
    registry = CollectorRegistry()
    running = engine_metric(registry, SGLANG.running)  # a gauge: inc/dec are atomic (prometheus_client's lock)
    queues = [engine_metric(registry, name) for name in DECODE_QUEUE_METRICS["sglang"]]  # each series published
    queued = queues[0]  # the waiting queue: the one a request past the running cap waits in
    balancedness = engine_metric(registry, SGLANG.expert_balancedness)
    metrics = metrics_handler(registry)

    @contextlib.contextmanager
    def slot():
        """One of the `max_running` slots, waited for in the queue as an engine past its cap waits."""
        if slots is None:
            yield
            return
        with queued.track_inprogress():
            slots.acquire()
        try:
            yield
        finally:
            slots.release()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes: simplest streaming

        def log_message(self, *args):
            pass

        def _json(self, status: int, payload: dict) -> None:
            send_json(self, status, payload)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/metrics":
                return metrics.do_GET(self)  # the text format, as tests/engine_exporter.py serves an engine's
            self._json(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})

        def do_POST(self):  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if b.api_key is not None and self.headers.get("Authorization") != f"Bearer {b.api_key}":
                return self._json(401, {"error": {"message": "missing or wrong API key"}})
            if rng.random() < b.error_rate:
                return self._json(500, {"error": {"message": "injected failure"}})
            tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
            if not request.get("stream"):
                time.sleep(b.ttft_s)
                return self._json(200, {"id": "c", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            with slot(), running.track_inprogress():
                time.sleep(b.ttft_s)
                for i in range(tokens):
                    if i:
                        time.sleep(b.itl_s)
                    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "stub",
                             "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                balancedness.observe(1.0)
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


def openai_stub(behaviour: Behaviour):
    """The stand-in on a free port of 127.0.0.1 (a context manager yielding its URL)."""
    return serving(_handler(behaviour, random.Random(7)))


def stub_prometheus(workdir, url: str, namespace: str):
    """A real Prometheus scraping the stand-in at `url` as both pools of `namespace`'s fleet (one
    prefill and one decode instance: the target labels the Prometheus operator adds from a
    PodMonitor, infra/render/metrics.py); a context manager yielding its URL. Scraped 4 times a
    second: a level's run lasts 2-3 s on an idle machine, and the held batch is the gauge's median
    over it (infra/validation/health.py held_batch_query), which a sample or two of the run's
    start and end must not move."""
    from infra.render.metrics import GROUP_SERIES_LABEL, ROLE_SERIES_LABEL

    port = int(url.rsplit(":", 1)[1])
    return prometheus(workdir, [(port, {"namespace": namespace, ROLE_SERIES_LABEL: role, GROUP_SERIES_LABEL: "0"})
                                for role in ("prefill", "decode")], scrape_seconds=0.25)


def offline_tokenizer(hf_home) -> str:
    """A word-level tokenizer in the Hugging Face cache layout, so aiperf counts tokens with no
    network (HF_HUB_OFFLINE=1, HF_HOME=hf_home). Its words are what the stub streams."""
    from pathlib import Path

    name = "pdstack/loopback-tokenizer"
    revision = "0" * 40
    snapshot = Path(hf_home) / "hub" / "models--pdstack--loopback-tokenizer" / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(4096)}}
    (snapshot / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [
            {"id": 0, "content": "[UNK]", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "unk_token": "[UNK]"}))
    refs = snapshot.parent.parent / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(revision)
    return name
