"""The twin's stand-in for SGLang's `python3 -m sglang.launch_server` (an engine needs GPUs).
Standalone: it runs in the engines' CPU virtualenv (scripts/extract_engine_flags.py engine_venv)
and imports nothing from pdstack.

    python engine_standin.py --checker SOCKET <the argv after `-m sglang.launch_server`>
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
waits until that prefill has taken the room before it answers. No KV moves: the hand-off is the
bootstrap exchange only (no Mooncake or NIXL transfer, no tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
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

CATALOGUE = Path(__file__).resolve().parent.parent / "infra" / "render" / "pinned" / "sglang-0.5.23-metrics.json"
# The series a one-scheduler engine publishes here (the catalogue gives each its type and labels).
SERIES = ("sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
          "sglang:num_running_reqs", "sglang:num_queue_reqs")
ROOM_WAIT_SECONDS = float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300))


def check(argv: list[str]) -> dict:
    """The pinned SGLang's own parser and ServerArgs, for one argv: {"args": the ServerArgs fields}
    or, refused, {"status": argparse's exit status, "message": what it printed}."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    except SystemExit as exc:
        return {"status": exc.code if isinstance(exc.code, int) else 1, "message": said.getvalue()}
    except Exception as exc:  # noqa: BLE001 - ServerArgs refusing a value, reported as the engine would fail
        return {"status": 1, "message": f"{type(exc).__name__}: {exc}\n"}
    fields = {a.dest: getattr(server_args, a.dest, None) for a in parser._actions if a.dest != "help"}
    return {"args": json.loads(json.dumps(fields, default=str))}


def serve_checks(path: Path) -> int:
    """The checker: SGLang imported once; each connection sends one argv (JSON) and gets check()'s answer."""
    lock = threading.Lock()
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)  # stand-ins that connect meanwhile wait in the backlog
    importlib.import_module("sglang.srt.server_args")  # the cost paid once, here
    while True:
        connection, _ = listener.accept()
        with connection, connection.makefile("rwb") as stream:
            argv = json.loads(stream.readline())
            with lock:
                answer = check(argv)
            stream.write(json.dumps(answer).encode() + b"\n")


def parse(checker: Path, argv: list[str]):
    """The checker's verdict on this argv: its ServerArgs, or this process ends as the engine's would."""
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
        with connection.makefile("rwb") as stream:
            stream.write(json.dumps(argv).encode() + b"\n")
            stream.flush()
            answer = json.loads(stream.readline())
    if "args" not in answer:
        sys.stderr.write(answer["message"])
        sys.exit(answer["status"])
    return types.SimpleNamespace(**answer["args"])


class Engine:
    def __init__(self, args):
        self.args = args
        self.mode = getattr(args, "disaggregation_mode", "null") or "null"
        self.model = args.served_model_name or args.model_path
        self.page_size = args.page_size or 1
        self.counts = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.running = 0  # requests in flight
        self.lock = threading.Lock()

    # --- what the HTTP server answers ---------------------------------------------------------
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
        core = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": self.running, "num_waiting_reqs": 0,
                "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 0, "num_active_tokens": 0,
                "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 0, "max_running_requests": 0,
                "token_usage": 0.0, "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.0,
                "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None}
        sections = {"disaggregation": {"mode": self.mode, "prefill_bootstrap_queue_reqs": 0,
                                       "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                       "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                       "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
                    "queues": {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}}
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": "0.5.23",
                "accelerator": None, "num_accelerators": self.args.tp_size, "loads": [{**core, **sections}]}

    def metrics(self) -> str:
        catalogue = json.loads(CATALOGUE.read_text())["metrics"]
        values = {"engine_type": {"prefill": "prefill", "decode": "decode"}.get(self.mode, "unified"),
                  "model_name": self.model, "is_streaming": "false", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        numbers = {"sglang:num_requests_total": self.counts["requests"],
                   "sglang:prompt_tokens_total": self.counts["prompt_tokens"],
                   "sglang:generation_tokens_total": self.counts["generation_tokens"],
                   "sglang:num_running_reqs": self.running, "sglang:num_queue_reqs": 0}
        lines = []
        for name in SERIES:
            entry = catalogue[name]
            base = name.removesuffix("_total") if entry["type"] == "counter" else name
            labels = ",".join(f'{label}="{values[label]}"' for label in entry["labels"] or ())
            lines += [f"# HELP {base} {base}", f"# TYPE {base} {entry['type']}", f"{name}{{{labels}}} {float(numbers[name])}"]
        return "\n".join(lines) + "\n"

    def generate(self, route: str, body: dict) -> dict:
        """The answer to one generation request, after the PD hand-off of this engine's mode."""
        with self.lock:
            self.running += 1
        try:
            return self._generate(route, body)
        finally:
            with self.lock:
                self.running -= 1

    def _generate(self, route: str, body: dict) -> dict:
        handed_off = ""
        if self.mode == "prefill":
            self.take_room(body)
        elif self.mode == "decode":
            handed_off = self.receive_from_prefill(body)
        prompt = json.dumps(body.get("messages") or body.get("prompt") or body.get("text") or "")
        tokens = max(1, min(int(body.get("max_tokens") or body.get("max_completion_tokens") or 8), 16))
        text = " ".join(["twin"] * tokens) + (f" [{handed_off}]" if handed_off else "")
        with self.lock:
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += len(prompt.split())
            self.counts["generation_tokens"] += tokens
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens,
                 "total_tokens": len(prompt.split()) + tokens}
        ident, created = uuid.uuid4().hex, int(time.time())
        if route == "/v1/chat/completions":
            return {"id": ident, "object": "chat.completion", "created": created, "model": self.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "length"}], "usage": usage}
        if route == "/v1/completions":
            return {"id": ident, "object": "text_completion", "created": created, "model": self.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}
        return {"text": text, "meta_info": {"id": ident, "prompt_tokens": usage["prompt_tokens"],
                                            "completion_tokens": tokens, "finish_reason": {"type": "length"}}}

    # --- the PD bootstrap exchange ------------------------------------------------------------
    def take_room(self, body: dict) -> None:
        room = body.get("bootstrap_room")
        if room is None:
            raise ValueError("a prefill request without bootstrap_room (the router adds it in PD mode)")
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
        return f"prefill {address} room {room}"


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
        path = self.path.split("?")[0]
        answers = {"/model_info": self.engine.model_info, "/get_model_info": self.engine.model_info,
                   "/server_info": self.engine.server_info, "/get_server_info": self.engine.server_info,
                   "/v1/models": self.engine.models, "/v1/loads": self.engine.loads}
        if path in ("/health", "/health_generate", "/ready"):
            self.reply(200)
        elif path in answers:
            self.reply(200, json.dumps(answers[path]()).encode())
        elif path == "/metrics" and self.engine.args.enable_metrics:
            self.reply(200, self.engine.metrics().encode(), "text/plain; version=0.0.4")
        else:
            self.reply(404, b'{"detail":"Not Found"}')

    def do_POST(self):
        path = self.path.split("?")[0]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
            self.reply(404, b'{"detail":"Not Found"}')
            return
        try:
            answer = self.engine.generate(path, body)
        except (ValueError, TimeoutError, OSError) as exc:
            self.reply(400 if isinstance(exc, ValueError) else 500,
                       json.dumps({"object": "error", "message": str(exc), "code": 400}).encode())
            return
        if not body.get("stream"):
            self.reply(200, json.dumps(answer).encode())
            return
        chunk = dict(answer, object="chat.completion.chunk")
        chunk["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": c.get("message", {}).get(
            "content", c.get("text"))}, "finish_reason": c["finish_reason"]} for c in answer.get("choices", [])]
        events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.reply(200, events, "text/event-stream")


class _BootstrapHandler(BaseHTTPRequestHandler):
    """SGLang's CommonKVBootstrapServer, the routes the exchange uses."""
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
        if path == "/register_dp_rank":
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
    if argv[:1] != ["--checker"]:
        sys.exit("engine_standin.py: --checker SOCKET first (twin/pods.py's python3 gives it)")
    engine = Engine(parse(Path(argv[1]), argv[2:]))
    print(f"engine stand-in: sglang 0.5.23 argv accepted by its parser; mode {engine.mode}, "
          f"serving {engine.model} on {engine.args.host}:{engine.args.port}", file=sys.stderr, flush=True)
    if engine.mode == "prefill":
        serve_bootstrap(engine)
    _Handler.engine = engine
    ThreadingHTTPServer((engine.args.host, engine.args.port), _Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
