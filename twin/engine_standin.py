"""The twin's stand-in for the engines (they need GPUs): SGLang 0.5.23's `python3 -m
sglang.launch_server` and vLLM 0.33.0's `vllm serve`. Standalone: it runs in the engines' CPU
virtualenv (scripts/extract_engine_flags.py engine_venv) and imports nothing from pdstack.

    python engine_standin.py --checker SOCKET sglang <the argv after `-m sglang.launch_server`>
    python engine_standin.py --checker SOCKET vllm <the argv after `vllm serve`>
    python engine_standin.py --serve-checks SOCKET     # the one checker all stand-ins ask

First its argv goes through the pinned engine's own parser: sglang 0.5.23's
`ServerArgs.add_cli_args` on an argparse parser, then `ServerArgs.from_cli_args` (its types, choices
and defaults). Importing SGLang costs ~0.7 GB and most of a minute on a busy machine, so one checker
process does it once and every stand-in sends it its argv over a Unix socket. A flag the engine
refuses ends the stand-in as the engine's does (argparse's message on stderr, its exit status 2).
What it does not run is the resolution that needs a GPU (`resolve_once`, `check_server_args`:
infra/render/engine_check/probe.py runs those in the scratch virtualenv).

Then it serves what SGLang 0.5.23 serves on `--host`/`--port` (sglang/srt/entrypoints/http_server.py):
GET /health, /health_generate, /ready, /model_info (+ /get_model_info), /server_info
(+ /get_server_info), /v1/models, /v1/loads (entrypoints/v1_loads.py: one DP rank's LoadSnapshot,
managers/load_snapshot.py, its core keys and the disaggregation and queues sections; JSON only), /metrics (with --enable-metrics; names, types and labels from
infra/render/pinned/sglang-0.5.23-metrics.json), POST /generate, /v1/completions,
/v1/chat/completions (OpenAI shapes, `stream` as server-sent events). No /get_load: the pinned
engine serves none (sglang-router 0.3.2's load poll, core/worker_manager.rs, gets a 404).

PD mode, as sglang-router 0.3.2 drives it (routers/http/pd_router.rs): the router sends the same
request to one prefill and one decode, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`
added. The prefill serves SGLang's bootstrap server on --disaggregation-bootstrap-port
(disaggregation/common/conn.py CommonKVBootstrapServer: GET /health, PUT and GET /route,
POST /register_dp_rank, /query_dp_ranks), registers its ranks there with PUT /route at start, and
for each request records the room (POST /register_dp_rank). The decode asks the prefill named in
the request for its parallel layout (GET /route with every rank -1, as the decode's
`try_ensure_parallel_info` does; a page size other than its own fails the request, as there) and
waits until that prefill has taken the room before it answers; then the room's KV moves (below).

vLLM 0.33.0 mode: the argv goes through `vllm serve`'s own parser and validation
(vllm/entrypoints/cli/serve.py ServeSubcommand: subparser_init -> make_arg_parser, then validate;
the positional model wins, as its cmd does), in the same checker process (VLLM_TARGET_DEVICE=cpu,
as scripts/extract_engine_flags.py imports it). Not run here: cmd's LB rules and
create_engine_config, which need GPUs (infra/render/engine_check/probe.py runs them). With
`--headless` it starts no HTTP server (serve.py run_headless: engine processes only) and just
lives. Otherwise it serves what vLLM's API server serves (entrypoints/launchers/api_server/routers.py):
GET /health, GET and POST /ping (serve/sagemaker/api_router.py), /v1/models, /version, /load
(serve/instrumentator/basic.py: {"server_load": requests in flight}), /metrics (names, types and
labels from infra/render/pinned/vllm-0.33.0-metrics.json), POST /v1/completions,
/v1/chat/completions. `--data-parallel-hybrid-lb` changes nothing here: every node's pod that is
not headless runs its own API server. NixlConnector P/D (kv_connector/v1/nixl/): a request whose
kv_transfer_params say do_remote_decode (what llm-d's routing sidecar sends the prefill) is
answered with kv_transfer_params naming this engine (pull_scheduler.py request_finished:
do_remote_prefill, remote_engine_id, remote_request_id, remote_host/remote_port = the side
channel VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT + DP index); the prefill's side
channel is vLLM's ZMQ ROUTER (base_scheduler.py _nixl_handshake_listener: msgpack
(GET_META_MSG, pp_rank, tp_rank) in, the handshake payload and its clock out); a decode given
do_remote_prefill does the decode's handshake there (base_worker.py _nixl_handshake: REQ socket,
5 s receive timeout, "Remote NIXL agent engine ID mismatch") before it answers; then it READs the
request's KV (below).

The KV hand-off (twin/kv_handoff.py EngineKV, the pinned libraries from twin/kv_libraries.py):
a PD engine makes its transfer library at start from its own env and argv (a backend the library
refuses ends it, as it ends the engine); per request the prefill registers the request's KV (the
served model's bytes per prompt token) under its room, and the decode takes it with the real
library, its sha256 checked: SGLang's prefill writes it (Mooncake or NIXL), the exchange on the
bootstrap port the router names; vLLM's decode READs it with NIXL, the exchange on the prefill's
ZMQ side channel. A failed transfer aborts the request with a 500, as the engines do (SGLang
disaggregation/decode.py pop_transferred; vLLM kv_load_failure_policy "fail"), and counts in the
engine's own metric (sglang:num_transfer_failed_reqs_total, vllm:nixl_num_failed_transfers_total);
each transfer's time goes to sglang:kv_transfer_latency_ms (the prefill's, ms) or
vllm:nixl_xfer_time_seconds (the decode's).

Token timing (both engines), a fleet model a test can change per pod: the first token after
TWIN_STANDIN_TTFT_MS, each next one after TWIN_STANDIN_ITL_MS (env, defaults below), or after
what POST /twin/timing {"ttft_ms": .., "itl_ms": ..} last set (the stand-in's own endpoint,
reached through the pod network); a streamed answer is one server-sent event per token. The
engines' histograms follow it: time to first token, inter-token latency and end-to-end latency,
with each engine's own buckets (sglang/srt/observability/metrics_collector.py,
vllm/v1/metrics/buckets.py).

Load (twin/engine_load.py): an instance runs at most as many requests as its own flag allows
(SGLang --max-running-requests, vLLM --max-num-seqs; capacity()) and keeps the rest waiting in
arrival order; a waiting request's TTFT counts its wait. What it publishes is what it holds:
sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage and /v1/loads' counts; vLLM's
vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (the gauges the
endpoint picker's queue and KV-cache scorers read, gateway-api-inference-extension v1.4.0
pkg/epp/server/options.go) and /load; each engine's queue-time histogram
(sglang:queue_time_seconds, vllm:request_queue_time_seconds). GET /twin/load (the stand-in's own)
answers its record: every change of running and waiting, with the time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import socket
import sys
import threading
import time
import types
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import engine_load  # twin/engine_load.py, beside this file
import kv_handoff  # twin/kv_handoff.py, beside this file

PINNED = Path(__file__).resolve().parent.parent / "infra" / "render" / "pinned"
VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
ROOM_WAIT_SECONDS = float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300))
# the fleet model's defaults: a healthy instance (a test makes one slow through /twin/timing or the env)
TTFT_MS = float(os.environ.get("TWIN_STANDIN_TTFT_MS", 40))
ITL_MS = float(os.environ.get("TWIN_STANDIN_ITL_MS", 5))
# Each engine's default buckets: sglang/srt/observability/metrics_collector.py TokenizerMetricsCollector,
# vllm/v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS.
BUCKETS = {
    "sglang": {"ttft": (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400),
               "itl": (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                       0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000),
               "e2e": (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400),
               "kv": (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),  # ms: SchedulerMetricsCollector
               "queue": (0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50,
                         60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
                         2000, 2500, 3000)},  # SchedulerMetricsCollector queue_time
    "vllm": {"ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
             "itl": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0),
             "e2e": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0),
             "kv": (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)},  # nixl/stats.py
}
BUCKETS["vllm"]["queue"] = BUCKETS["vllm"]["e2e"]  # vllm/v1/metrics/loggers.py: request_latency_buckets both
GET_META_MSG = b"get_meta_msg"  # vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py
KV_MSG = b"twin_kv"  # twin/kv_handoff.py's exchange on the side channel (vLLM's handshake payload carries its agent)


def check(engine: str, argv: list[str]) -> dict:
    """The pinned engine's own parser and validation, for one argv: {"args": the parsed fields}
    or, refused, {"status": argparse's exit status, "message": what it printed}."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            fields = _check_vllm(argv) if engine == "vllm" else _check_sglang(argv)
    except SystemExit as exc:
        return {"status": exc.code if isinstance(exc.code, int) else 1, "message": said.getvalue()}
    except Exception as exc:  # noqa: BLE001 - the engine refusing a value, reported as the engine would fail
        return {"status": 1, "message": f"{type(exc).__name__}: {exc}\n"}
    return {"args": json.loads(json.dumps(fields, default=_plain))}


def _check_sglang(argv: list[str]) -> dict:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    return {a.dest: getattr(server_args, a.dest, None) for a in parser._actions if a.dest != "help"}


def _check_vllm(argv: list[str]) -> dict:
    """vllm/entrypoints/cli/serve.py: `vllm serve`'s subparser (make_arg_parser), validate, and
    cmd's first rule (the positional model wins)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # as scripts/extract_engine_flags.py imports it
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    command = serve.ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return vars(args)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return str(value)


def serve_checks(path: Path) -> int:
    """The checker: each engine imported once (on its first argv); each connection sends one
    {"engine", "argv"} (JSON) and gets check()'s answer."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)  # stand-ins that connect meanwhile wait in the backlog
    while True:
        connection, _ = listener.accept()
        with connection, connection.makefile("rwb") as stream:
            asked = json.loads(stream.readline())
            stream.write(json.dumps(check(asked["engine"], asked["argv"])).encode() + b"\n")


def parse(checker: Path, engine: str, argv: list[str]):
    """The checker's verdict on this argv: its parsed fields, or this process ends as the engine's would."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        deadline = time.monotonic() + 60
        while True:  # the checker may not have bound its socket yet
            try:
                connection.connect(str(checker))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        connection.settimeout(None)
        with connection.makefile("rwb") as stream:
            stream.write(json.dumps({"engine": engine, "argv": argv}).encode() + b"\n")
            stream.flush()
            answer = json.loads(stream.readline())
    if "args" not in answer:
        sys.stderr.write(answer["message"])
        sys.exit(answer["status"])
    return types.SimpleNamespace(**answer["args"])


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        return ([f'{name}_bucket{{{labels}{sep}le="{float(b)}"}} {float(c)}' for b, c in zip(self.buckets, self.counts)]
                + [f'{name}_bucket{{{labels}{sep}le="+Inf"}} {float(self.count)}',
                   f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {float(self.count)}"])


def _prompt_tokens(body: dict) -> int:
    return len(json.dumps(body.get("messages") or body.get("prompt") or body.get("text") or "").split())


def _token_count(body: dict) -> int:
    """How many tokens an answer has: what the request allows, at most 16 (a short answer is enough)."""
    return max(1, min(int(body.get("max_tokens") or body.get("max_completion_tokens") or 8), 16))


class Engine:
    """What both engines share: counts, token timing and its histograms, the OpenAI answers."""
    kind = ""
    HISTOGRAMS: dict = {}  # metric name -> "ttft" | "itl" | "e2e" | "kv"
    KV_TIME_UNIT = 1  # its KV transfer histogram's unit, per second

    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        # running and waiting requests and the KV they hold, bounded as the engine's own flags bound them
        self.load = engine_load.EngineLoad(*self.capacity())
        self.timing = {"ttft_ms": TTFT_MS, "itl_ms": ITL_MS}
        self.histograms = {name: Histogram(BUCKETS[self.kind][which]) for name, which in self.HISTOGRAMS.items()}
        self.catalogue = json.loads((PINNED / f"{self.kind}-{VERSIONS[self.kind]}-metrics.json").read_text())["metrics"]
        self.kv: kv_handoff.EngineKV | None = None  # its part in the KV hand-off (start_kv), if it has one

    def start_kv(self, argv: list[str]) -> None:
        """The KV transfer library made from this process's env and argv, as the engine's KV manager
        makes it at start: one the library refuses ends the process, as it ends the engine."""
        roles = self.kv_roles()
        if not roles:
            return
        try:
            self.kv = kv_handoff.EngineKV(self.kind, roles, dict(os.environ), argv, _local_ip(), self.model)
        except kv_handoff.HandoffError as exc:
            sys.exit(f"engine stand-in: the KV transfer engine did not start: {exc}")
        self.kv.timed = lambda seconds: self.observe("kv", seconds * self.KV_TIME_UNIT)
        print(f"engine stand-in: KV hand-off as {'+'.join(roles)} over {self.kv.settings.backend} at "
              f"{self.kv.settings.host}:{self.kv.settings.port} (the CPU's in place of the render's: "
              f"{self.kv.changed or 'nothing'})", file=sys.stderr, flush=True)

    def kv_roles(self) -> tuple[str, ...]:
        return ()

    def transfers_failed(self) -> int:
        return self.kv.failed if self.kv else 0

    def observe(self, which: str, seconds: float) -> None:
        with self.lock:
            for name, kind in self.HISTOGRAMS.items():
                if kind == which:
                    self.histograms[name].observe(seconds)

    def tokens(self, body: dict, ticket: engine_load.Ticket, arrived: float):
        """The answer's tokens, each when the fleet model says (TTFT, then ITL apart); observed, and
        held as KV by the running request. TTFT counts from the request's arrival, its time waiting
        for a slot included, as the engines' histograms count it."""
        count = _token_count(body)
        ttft, itl = self.timing["ttft_ms"] / 1000, self.timing["itl_ms"] / 1000
        started = arrived + ticket.waited  # when it got its slot
        last = started
        for i in range(count):
            # the first token TTFT after it got its slot (a hand-off's wait counts), the next ones ITL apart
            time.sleep(max(0.0, ttft - (time.monotonic() - started)) if i == 0 else itl)
            now = time.monotonic()
            self.observe("ttft" if i == 0 else "itl", now - (arrived if i == 0 else last))
            self.load.hold(ticket)
            last = now
            yield "twin" if i == 0 else " twin"

    def generate(self, route: str, body: dict):
        """(status, answer) for one generation request; a streamed one's answer is its events."""
        started = time.monotonic()
        prompt = _prompt_tokens(body)
        ticket = self.load.admit(prompt)  # waits while the engine runs as many as its flags allow
        self.observe("queue", ticket.waited)
        try:
            extra = self.before_tokens(body)
        except (ValueError, TimeoutError, OSError, RuntimeError) as exc:
            self.load.release(ticket)
            status = 400 if isinstance(exc, ValueError) else 500
            if body.get("stream") and isinstance(exc, kv_handoff.HandoffError):
                # an abort with a status is an error event in a 200 stream (sglang serving_chat.py
                # create_streaming_error_response; vLLM's serving likewise), then [DONE]
                kind = {"sglang": "INTERNAL_SERVER_ERROR", "vllm": "InternalServerError"}[self.kind]
                error = {"error": {"object": "error", "message": str(exc), "type": kind, "param": None, "code": 500}}
                return 200, iter((f"data: {json.dumps(error)}\n\n".encode(), b"data: [DONE]\n\n"))
            return status, {"object": "error", "message": str(exc), "code": status}
        ident, created = uuid.uuid4().hex, int(time.time())
        chat = route == "/v1/chat/completions"

        def finish(generated: int) -> dict:
            self.load.release(ticket)
            with self.lock:
                self.counts["requests"] += 1
                self.counts["prompt_tokens"] += prompt
                self.counts["generation_tokens"] += generated
            self.observe("e2e", time.monotonic() - started)
            return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

        note = f" [{extra['note']}]" if extra.get("note") else ""
        if body.get("stream"):
            return 200, self._events(route, body, ticket, started, ident, created, note, extra, finish)
        try:
            texts = list(self.tokens(body, ticket, started))
        finally:
            self.load.release(ticket)
        usage = finish(len(texts))
        text = "".join(texts) + note
        if chat:
            answer = {"id": ident, "object": "chat.completion", "created": created, "model": self.model,
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "length"}], "usage": usage}
        elif route == "/v1/completions":
            answer = {"id": ident, "object": "text_completion", "created": created, "model": self.model,
                      "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}
        else:
            answer = {"text": text, "meta_info": {"id": ident, "prompt_tokens": prompt, "completion_tokens": len(texts),
                                                  "finish_reason": {"type": "length"}}}
        if "kv_transfer_params" in extra:
            answer["kv_transfer_params"] = extra["kv_transfer_params"]
        return 200, answer

    def _events(self, route, body, ticket, started, ident, created, note, extra, finish):
        try:  # a client that goes away mid-stream frees its slot too
            yield from self._token_events(route, body, ticket, started, ident, created, note, extra)
        finally:
            self.load.release(ticket)
        finish(_token_count(body))
        yield b"data: [DONE]\n\n"

    def _token_events(self, route, body, ticket, started, ident, created, note, extra):
        chat, generated, count = route == "/v1/chat/completions", 0, _token_count(body)
        for text in self.tokens(body, ticket, started):
            generated += 1
            last = generated == count
            text += note if last else ""
            choice = ({"index": 0, "delta": {"role": "assistant", "content": text} if generated == 1 else {"content": text}}
                      if chat else {"index": 0, "text": text})
            choice["finish_reason"] = "length" if last else None
            event = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                     "model": self.model, "choices": [choice]}
            if last and "kv_transfer_params" in extra:
                event["kv_transfer_params"] = extra["kv_transfer_params"]
            yield f"data: {json.dumps(event)}\n\n".encode()

    def metrics(self) -> str:
        values, numbers = self.metric_values()
        lines = []
        for name, entry in self.catalogue.items():
            if name not in numbers and name not in self.histograms:
                continue
            base = name.removesuffix("_total")
            labels = ",".join(f'{label}="{values[label]}"' for label in entry["labels"] or ())
            lines += [f"# HELP {base} {base}", f"# TYPE {base} {entry['type']}"]
            if name in self.histograms:
                lines += self.histograms[name].samples(name, labels)
            else:
                sample = base + "_total" if entry["type"] == "counter" else name
                lines.append(f"{sample}{{{labels}}} {float(numbers[name])}")
        return "\n".join(lines) + "\n"

    def control(self, body: dict) -> dict:
        """POST /twin/timing: the fleet model's TTFT and ITL for this instance from now on."""
        for key in ("ttft_ms", "itl_ms"):
            if key in body:
                self.timing[key] = float(body[key])
        return self.timing


class SGLang(Engine):
    kind = "sglang"
    HISTOGRAMS = {"sglang:time_to_first_token_seconds": "ttft", "sglang:inter_token_latency_seconds": "itl",
                  "sglang:e2e_request_latency_seconds": "e2e", "sglang:kv_transfer_latency_ms": "kv",
                  "sglang:queue_time_seconds": "queue"}
    KV_TIME_UNIT = 1000  # its KV transfer histogram counts ms

    def __init__(self, args):
        super().__init__(args)
        self.mode = getattr(args, "disaggregation_mode", "null") or "null"
        self.model = args.served_model_name or args.model_path
        self.page_size = args.page_size or 1

    def serves_http(self) -> bool:
        return True

    def capacity(self) -> tuple[int | None, int | None]:
        """(running requests, KV tokens) the flags allow: --max-running-requests; the pool
        --max-total-tokens, else that many requests of --context-length. Unset, SGLang sizes both
        from GPU memory (model_executor/pool_configurator.py), which the stand-in has none of:
        no bound, and no usage."""
        running, total = self.args.max_running_requests, self.args.max_total_tokens
        if total is None and running and self.args.context_length:
            total = running * self.args.context_length
        return running, total

    def gets(self) -> dict:
        return {"/model_info": self.model_info, "/get_model_info": self.model_info,
                "/server_info": self.server_info, "/get_server_info": self.server_info,
                "/v1/models": self.models, "/v1/loads": self.loads}

    health = ("/health", "/health_generate", "/ready")
    posts = ("/generate", "/v1/completions", "/v1/chat/completions")

    def serves_metrics(self) -> bool:
        return bool(self.args.enable_metrics)

    def start(self) -> None:
        if self.mode == "prefill":
            serve_bootstrap(self)

    def kv_roles(self) -> tuple[str, ...]:
        """A PD group's first node: the others' ranks hand off their shards beside it (not run here)."""
        return (self.mode,) if self.mode in ("prefill", "decode") and not self.args.node_rank else ()

    def metric_values(self):
        values = {"engine_type": {"prefill": "prefill", "decode": "decode"}.get(self.mode, "unified"),
                  "model_name": self.model, "is_streaming": "false", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        numbers = {"sglang:num_requests_total": self.counts["requests"],
                   "sglang:prompt_tokens_total": self.counts["prompt_tokens"],
                   "sglang:generation_tokens_total": self.counts["generation_tokens"],
                   "sglang:num_running_reqs": self.load.running, "sglang:num_queue_reqs": self.load.waiting,
                   "sglang:token_usage": self.load.kv_usage()}
        if self.transfers_failed():  # not seeded: exported from its first increment (metrics_collector.py)
            numbers["sglang:num_transfer_failed_reqs_total"] = self.transfers_failed()
        return values, numbers

    def model_info(self) -> dict:
        return {"model_path": self.args.model_path, "served_model_name": self.model,
                "tokenizer_path": self.args.tokenizer_path or self.args.model_path, "is_generation": True,
                "disaggregation_mode": self.mode, "model_type": None, "architectures": None}

    def server_info(self) -> dict:
        return {"model_path": self.args.model_path, "served_model_name": self.model,
                "tp_size": self.args.tp_size, "dp_size": self.args.dp_size, "page_size": self.page_size,
                "disaggregation_mode": self.mode, "load_balance_method": getattr(self.args, "load_balance_method", None),
                "version": "0.5.23", "frontend": "python", "internal_states": [{}]}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "sglang", "root": self.model}]}

    def loads(self) -> dict:
        load = self.load.snapshot()
        core = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": load["running"],
                "num_waiting_reqs": load["waiting"], "num_waiting_uncached_tokens": 0,
                "num_used_tokens": load["kv_tokens"], "num_total_tokens": load["kv_capacity_tokens"] or 0,
                "num_active_tokens": load["kv_tokens"], "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": load["kv_capacity_tokens"] or 0, "max_running_requests": load["max_running"] or 0,
                "token_usage": load["kv_usage"], "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.0,
                "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None}
        sections = {"disaggregation": {"mode": self.mode, "prefill_bootstrap_queue_reqs": 0,
                                       "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                       "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                       "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
                    "queues": {"waiting": load["waiting"], "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}}
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": "0.5.23",
                "accelerator": None, "num_accelerators": self.args.tp_size, "loads": [{**core, **sections}]}

    # --- the PD bootstrap exchange ------------------------------------------------------------
    def before_tokens(self, body: dict) -> dict:
        if self.mode == "prefill":
            self.take_room(body)
        elif self.mode == "decode":
            return {"note": self.receive_from_prefill(body)}
        return {}

    def take_room(self, body: dict) -> None:
        room = body.get("bootstrap_room")
        if room is None:
            raise ValueError("a prefill request without bootstrap_room (the router adds it in PD mode)")
        if self.kv:
            self.kv.offer(str(int(room)), _prompt_tokens(body))
        _call(f"http://127.0.0.1:{self.args.disaggregation_bootstrap_port}/register_dp_rank",
              {"bootstrap_room": int(room), "dp_rank": 0})

    def receive_from_prefill(self, body: dict) -> str:
        host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
        if host is None or room is None:
            raise ValueError("a decode request without bootstrap_host/bootstrap_room (the router adds them in PD mode)")
        address = f"{host}:{port or self.args.disaggregation_bootstrap_port}"
        info = _call(f"http://{address}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        if info.get("page_size") is not None and info["page_size"] != self.page_size:
            raise ValueError(f"Page size mismatch: prefill server has page_size={info['page_size']}, but decode "
                             f"server has page_size={self.page_size}")
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        while str(int(room)) not in _call(f"http://{address}/query_dp_ranks", {"bootstrap_rooms": [int(room)]}):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill {address} never took bootstrap room {room}")
            time.sleep(0.05)
        if not self.kv:
            return f"prefill {address} room {room}"
        try:  # the KV at the address the router named (the bootstrap server carries the exchange)
            moved = self.kv.take(host, int(port or self.args.disaggregation_bootstrap_port), str(int(room)),
                                 _prompt_tokens(body))
        except kv_handoff.HandoffError as exc:  # disaggregation/decode.py pop_transferred, KVPoll.Failed
            raise kv_handoff.HandoffError(f"Decode transfer failed for request rank=0 bootstrap_room={room} "
                                          f"with exception {exc}") from None
        return f"prefill {address} room {room}: {moved}"


class VLLM(Engine):
    kind = "vllm"
    HISTOGRAMS = {"vllm:time_to_first_token_seconds": "ttft", "vllm:inter_token_latency_seconds": "itl",
                  "vllm:e2e_request_latency_seconds": "e2e", "vllm:nixl_xfer_time_seconds": "kv",
                  "vllm:request_queue_time_seconds": "queue"}
    health = ("/health", "/ping")
    posts = ("/v1/completions", "/v1/chat/completions", "/ping")

    def __init__(self, args):
        super().__init__(args)
        names = args.served_model_name
        self.model = (names[0] if isinstance(names, list) and names else names) or args.model
        self.engine_id = uuid.uuid4().hex  # vLLM's engine_id, a uuid per instance unless the config names one
        config = args.kv_transfer_config if isinstance(args.kv_transfer_config, dict) else {}
        nixl = [c for c in [config, *(config.get("kv_connector_extra_config") or {}).get("connectors", [])]
                if c.get("kv_connector") == "NixlConnector"]
        self.nixl_role = nixl[0].get("kv_role") if nixl else None
        self.side_channel = (os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
                             int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", 5600))
                             + int(args.data_parallel_rank or 0))
        self.block_size = args.block_size

    def serves_http(self) -> bool:
        return not self.args.headless

    def capacity(self) -> tuple[int | None, int | None]:
        """(running requests, KV tokens) the flags allow: --max-num-seqs, unset 1024 (an H100's
        default for the API server, vllm/engine/arg_utils.py get_batch_defaults); the KV pool
        --num-gpu-blocks-override blocks of --block-size, else that many sequences of --max-model-len
        (vLLM sizes it from GPU memory, which the stand-in has none of)."""
        running = self.args.max_num_seqs or 1024
        blocks, block_size = self.args.num_gpu_blocks_override, self.args.block_size or 16
        length = int(self.args.max_model_len) if self.args.max_model_len else None
        return running, blocks * block_size if blocks else (running * length if length else None)

    def serves_metrics(self) -> bool:
        return True

    def gets(self) -> dict:
        return {"/v1/models": self.models, "/version": lambda: {"version": "0.33.0"},
                "/load": lambda: {"server_load": self.load.running + self.load.waiting}}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": self.args.model, "parent": None,
                                            "max_model_len": self.args.max_model_len}]}

    def metric_values(self):
        values = {"engine": "0", "model_name": self.model, "finished_reason": "length"}
        numbers = {"vllm:num_requests_running": self.load.running, "vllm:num_requests_waiting": self.load.waiting,
                   "vllm:kv_cache_usage_perc": self.load.kv_usage(),
                   "vllm:prompt_tokens": self.counts["prompt_tokens"],
                   "vllm:generation_tokens": self.counts["generation_tokens"],
                   "vllm:request_success": self.counts["requests"],
                   "vllm:nixl_num_failed_transfers": self.transfers_failed()}
        return values, numbers

    def kv_roles(self) -> tuple[str, ...]:
        return {"kv_producer": ("prefill",), "kv_consumer": ("decode",),
                "kv_both": ("prefill", "decode")}.get(self.nixl_role, ())

    def start(self) -> None:
        if self.nixl_role in ("kv_producer", "kv_both"):
            threading.Thread(target=self._handshake_listener, daemon=True).start()

    def _handshake_listener(self) -> None:
        """base_scheduler.py _nixl_handshake_listener: a ZMQ ROUTER on the side channel."""
        import msgspec
        import zmq

        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(f"tcp://{'*' if self.side_channel[0] in ('0.0.0.0', '') else self.side_channel[0]}:{self.side_channel[1]}")
        payload = msgspec.msgpack.encode({"engine_id": self.engine_id, "block_size": self.block_size})
        while True:
            identity, _, msg = sock.recv_multipart()
            message, *rest = msgspec.msgpack.decode(msg)
            if message == KV_MSG and self.kv:  # (KV_MSG, method, path, body as JSON)
                answered = self.kv.rooms.answer(rest[0], rest[1], json.loads(rest[2]))
                sock.send_multipart((identity, b"", json.dumps(answered).encode()))
                continue
            if message != GET_META_MSG:
                print(f"Connection listener got unexpected message {message}", file=sys.stderr)
            sock.send_multipart((identity, b"", payload, msgspec.msgpack.encode(time.perf_counter())))

    def before_tokens(self, body: dict) -> dict:
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # this is the prefill of a P/D pair
            if self.nixl_role not in ("kv_producer", "kv_both"):
                raise ValueError("kv_transfer_params ask for a remote decode, but this engine's NixlConnector "
                                 f"is {self.nixl_role or 'not configured'}")
            params = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[0]],
                "remote_engine_id": self.engine_id, "remote_request_id": uuid.uuid4().hex,
                "remote_host": self.side_channel[0], "remote_port": self.side_channel[1],
                "tp_size": self.args.tensor_parallel_size, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": _prompt_tokens(body),
                "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull"}
            if self.kv:
                self.kv.offer(params["remote_request_id"], params["remote_num_tokens"])
            return {"kv_transfer_params": params}
        if params.get("do_remote_prefill"):
            return {"note": self._handshake(params)}
        return {}

    def _handshake(self, params: dict) -> str:
        """base_worker.py _nixl_handshake: REQ to the prefill's side channel, 5 s receive timeout;
        then the request's KV READ from the prefill's agent (twin/kv_handoff.py, its exchange on the
        same side channel)."""
        import msgspec

        if self.nixl_role not in ("kv_consumer", "kv_both"):
            raise ValueError("kv_transfer_params ask for a remote prefill, but this engine's NixlConnector "
                             f"is {self.nixl_role or 'not configured'}")
        host, port = params["remote_host"], int(params["remote_port"])
        payload, _clock = _side_channel(host, port, (GET_META_MSG, 0, 0), "NIXL handshake")
        metadata = msgspec.msgpack.decode(payload)
        if metadata["engine_id"] != params["remote_engine_id"]:
            raise RuntimeError(f"Remote NIXL agent engine ID mismatch. Expected {params['remote_engine_id']},"
                               f"received {metadata['engine_id']}.")
        said = f"prefill {metadata['engine_id']} at {host}:{port} request {params.get('remote_request_id')}"
        if not self.kv:
            return said

        def exchange(path: str, body: dict | None) -> dict:
            method = "GET" if body is None else "POST"
            try:
                (answer,) = _side_channel(host, port, (KV_MSG, method, path, json.dumps(body or {})), "KV exchange")
            except TimeoutError as exc:
                raise kv_handoff.HandoffError(str(exc)) from None
            status, answered = json.loads(answer)
            if status != 200:
                raise kv_handoff.HandoffError(f"tcp://{host}:{port} {path}: {status} {answered.get('error', '')}")
            return answered

        # a failed READ finishes the request with an error (kv_load_failure_policy "fail", vLLM's default)
        moved = self.kv.take(host, port, params["remote_request_id"], int(params.get("remote_num_tokens") or 1),
                             call=exchange)
        return f"{said}: {moved}"


def _side_channel(host: str, port: int, message: tuple, what: str, timeout_ms: int = 5000) -> list[bytes]:
    """One request on a vLLM prefill's side channel (a ZMQ REQ socket, as base_worker.py's); its frames."""
    import msgspec
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode(message))
        try:
            return sock.recv_multipart()
        except zmq.Again:
            raise TimeoutError(f"{what} with tcp://{host}:{port}: no answer within {timeout_ms / 1000:g} s") from None
    finally:
        sock.close()


def _call(url: str, payload: dict | None = None, method: str | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return {}


class _Handler(BaseHTTPRequestHandler):
    engine: Engine
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def reply(self, status: int, body: bytes = b"", kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path, engine = self.path.split("?")[0], self.engine
        answers = engine.gets()
        if path in engine.health:
            self.reply(200)
        elif path in answers:
            self.reply(200, json.dumps(answers[path]()).encode())
        elif path == "/twin/load":  # the stand-in's own record of its load (twin/engine_load.py)
            self.reply(200, json.dumps(engine.load.snapshot()).encode())
        elif path == "/metrics" and engine.serves_metrics():
            self.reply(200, engine.metrics().encode(), "text/plain; version=0.0.4")
        else:
            self.reply(404, b'{"detail":"Not Found"}')

    def do_POST(self):
        path, engine = self.path.split("?")[0], self.engine
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if path in engine.health:
            self.reply(200)
            return
        if path == "/twin/timing":
            self.reply(200, json.dumps(engine.control(body)).encode())
            return
        if path not in engine.posts:
            self.reply(404, b'{"detail":"Not Found"}')
            return
        status, answer = engine.generate(path, body)
        if isinstance(answer, dict):
            self.reply(status, json.dumps(answer).encode())
            return
        self.send_response(200)  # server-sent events, one chunk per token as it is made
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in answer:
            self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


class _BootstrapHandler(BaseHTTPRequestHandler):
    """SGLang's CommonKVBootstrapServer, the routes the exchange uses; and /kv/ (twin/kv_handoff.py's
    exchange, in place of the rank's own ZMQ port)."""
    kv: kv_handoff.EngineKV | None = None
    ranks: dict = {}
    layout: dict = {}
    rooms: dict = {}
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write(f"bootstrap {self.address_string()} {fmt % args}\n")

    def reply(self, status: int, payload=None, text: str = "") -> None:
        body = json.dumps(payload).encode() if payload is not None else text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if payload is not None else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path == "/health":
            self.reply(200, text="OK")
        elif path.startswith("/kv/") and self.kv:
            self.reply(*self.kv.rooms.answer("GET", path, {}))
        elif path == "/route":
            asked = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
            keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
            if not all(asked.get(k) for k in keys):
                self.reply(400, text="Missing inputs for bootstrap server.")
            elif not self.layout:
                self.reply(503, text="Prefill server not fully registered yet (0 workers registered).")
            elif all(int(asked[k]) == -1 for k in keys):
                self.reply(200, self.layout)
            else:
                found = self.ranks.get(tuple(int(asked[k]) for k in keys))
                self.reply(200 if found else 404, found, "" if found else "Bootstrap info not found")
        else:
            self.reply(404, text="Not Found")

    def do_PUT(self):
        if self.path.partition("?")[0] != "/route":
            self.reply(405, text="Method not allowed")
            return
        data = self.body()
        self.ranks[(data["attn_dp_rank"], data["attn_cp_rank"], data["attn_tp_rank"], data["pp_rank"])] = {
            "rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
        self.layout.update(attn_tp_size=data["attn_tp_size"], attn_cp_size=data["attn_cp_size"],
                           dp_size=data["attn_dp_size"], pp_size=data["pp_size"], page_size=int(data["page_size"]),
                           kv_cache_dtype=data["kv_cache_dtype"], follow_bootstrap_room=True,
                           enable_dsa_cache_layer_split=False, enable_kv_cache_sharding=False,
                           prefill_http_port=data.get("prefill_http_port"), decode_allocation_policy="early")
        self.reply(200, text="OK")

    def do_POST(self):
        path = self.path.partition("?")[0]
        data = self.body()
        if path.startswith("/kv/") and self.kv:
            self.reply(*self.kv.rooms.answer("POST", path, data))
        elif path == "/register_dp_rank":
            self.rooms[int(data["bootstrap_room"])] = int(data["dp_rank"])
            self.reply(200, text="OK")
        elif path == "/query_dp_ranks":
            self.reply(200, {str(int(r)): self.rooms[int(r)] for r in data["bootstrap_rooms"] if int(r) in self.rooms})
        else:
            self.reply(404, text="Not Found")


def _local_ip() -> str:
    """This pod's address: the one its default route leaves from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.96.0.1", 443))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def serve_bootstrap(engine: Engine) -> None:
    args = engine.args
    _BootstrapHandler.kv = engine.kv
    server = ThreadingHTTPServer((args.host, args.disaggregation_bootstrap_port), _BootstrapHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ip = _local_ip()
    _call(f"http://127.0.0.1:{args.disaggregation_bootstrap_port}/route", {
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
        "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": ip, "rank_port": 0, "page_size": engine.page_size, "kv_cache_dtype": args.kv_cache_dtype,
        "prefill_http_port": args.port}, method="PUT")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve-checks"]:
        return serve_checks(Path(argv[1]))
    if argv[:1] != ["--checker"] or argv[2:3] not in (["sglang"], ["vllm"]):
        sys.exit("engine_standin.py: --checker SOCKET sglang|vllm ARGV (twin/pods.py's python3 and vllm give them)")
    kind = argv[2]
    engine = (VLLM if kind == "vllm" else SGLang)(parse(Path(argv[1]), kind, argv[3:]))
    if not engine.serves_http():
        print(f"engine stand-in: vllm {VERSIONS[kind]} argv accepted by its parser; --headless: no API server",
              file=sys.stderr, flush=True)
        threading.Event().wait()  # a headless node runs engine processes only
    print(f"engine stand-in: {kind} {VERSIONS[kind]} argv accepted by its parser; "
          f"{getattr(engine, 'mode', None) or engine.__dict__.get('nixl_role')}, serving {engine.model} on "
          f"{engine.args.host or '0.0.0.0'}:{engine.args.port}", file=sys.stderr, flush=True)
    engine.start_kv(argv[3:])
    engine.start()
    _Handler.engine = engine
    ThreadingHTTPServer((engine.args.host or "0.0.0.0", engine.args.port), _Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
