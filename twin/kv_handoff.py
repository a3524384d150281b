"""One request's KV moved from a prefill process to a decode process with the real transfer library
of the pinned wheels (Mooncake's transfer engine, NIXL), configured from an engine pod's rendered
settings. Standalone (imports nothing from pdstack), so an engine stand-in in the engines' CPU
virtualenv can use it: `serve_kv` on the prefill, `receive_kv` on the decode.

    settings = settings_from_pod("prefill", container_env, argv, pod_ip)   # pure
    settings, changed = on_cpu(settings)        # the twin's CPU stands for EFA: efa->tcp, LIBFABRIC->UCX
    server = serve_kv(settings, {room: kv_bytes})                     # prefill
    data = receive_kv(decode_settings, prefill_ip, port, room, nbytes)  # decode; HandoffError on failure

What is read from the pod, as the pinned engines read it:
- SGLang 0.5.23: `--disaggregation-transfer-backend` (default mooncake), the prefill's
  `--disaggregation-bootstrap-port` (default 8998: sglang/srt/arg_groups/fields/disagg.py), which
  the decode dials at the port the router names (sglang-router 0.3.2 reads it from the prefill pod's
  `sglang.ai/bootstrap-port` annotation), `--disaggregation-ib-device`; MOONCAKE_PROTOCOL (default
  "rdma", sglang/srt/environ.py), SGLANG_DISAGGREGATION_NIXL_BACKEND (default UCX). The hostname
  is get_local_ip_auto()'s: SGLANG_HOST_IP or HOST_IP, else the pod's address
  (sglang/srt/utils/network.py).
- vLLM 0.33.0: `--kv-transfer-config`'s NixlConnector `kv_connector_extra_config.backends` (default
  ["UCX"], kv_connector/v1/nixl/base_worker.py); the prefill's handshake side channel listens on and
  is advertised as VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT (defaults "localhost" and
  5600, vllm/envs.py; plus the DP rank, base_scheduler.py: rank 0 here), and the decode dials what
  the prefill advertised (kv_transfer_params remote_host/remote_port).

How each library is driven, as the engines drive it:
- Mooncake (SGLang's MooncakeTransferEngine,
  sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py):
  `TransferEngine().initialize(hostname, "P2PHANDSHAKE", MOONCAKE_PROTOCOL, ib device or "")`, its
  session id `hostname:get_rpc_port()`, `register_memory(ptr, len)`, and the prefill's
  `transfer_sync_write(decode_session, src, dst, len)` (the decode's buffer is written: SGLang's
  prefill pushes).
- NIXL, SGLang (sglang/srt/disaggregation/nixl/conn.py): `nixl_agent_config(backends=[],
  num_threads=8 on prefill / 0 on decode, sync_mode=NIXL_THREAD_SYNC_STRICT)`, a uuid-named agent,
  `create_backend(backend, params)` (UCX on prefill gets num_threads), DRAM registration, and the
  prefill's `initialize_xfer("WRITE", ...)` to the decode agent it added from its metadata.
- NIXL, vLLM (kv_connector/v1/nixl/base_worker.py): `nixl_agent_config(num_threads=4,
  capture_telemetry=True)` when the backends are ["UCX"], else `nixl_agent_config(backends=...,
  capture_telemetry=True)`; the decode adds the prefill's agent from the handshake and READs
  (pull_worker.py), then notifies the prefill, which frees the request's blocks.

Simplified here: the exchange that carries session ids, agent metadata and addresses is one HTTP
server on the prefill at the rendered port (SGLang's decode reaches the prefill's bootstrap server
there, then its rank's ZMQ port; vLLM's handshake is ZMQ), and the KV is one contiguous buffer (the
engines send page by page).
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SGLANG_BOOTSTRAP_PORT = 8998  # sglang 0.5.23 --disaggregation-bootstrap-port's default
VLLM_SIDE_CHANNEL = ("localhost", 5600)  # vllm 0.33.0 envs.py VLLM_NIXL_SIDE_CHANNEL_HOST/PORT defaults
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"  # where sglang-router reads a prefill's bootstrap port
# What the twin's CPU nodes stand for (the fabric's transport -> the one a CPU has). Only these
# differ from the render: nothing else is changed, so a wrong value elsewhere still fails. (Mooncake's
# EFA build, which dev's image installs, honours "efa" and fails without an EFA device; it installs
# TCP for any other protocol: tests/test_kv_handoff.py.)
CPU_TRANSPORT = {"mooncake_protocol": {"efa": "tcp"}, "nixl_backend": {"LIBFABRIC": "UCX"}}
XFER_POLL_SECONDS = 0.005
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class HandoffError(RuntimeError):
    """The hand-off failed; the message says which setting and what the library answered."""


@dataclass(frozen=True)
class HandoffSettings:
    engine: str  # sglang | vllm
    role: str  # prefill | decode
    backend: str  # mooncake | nixl
    host: str  # the address this side registers under and advertises
    port: int  # prefill: where it serves the hand-off (SGLang's bootstrap port, vLLM's side channel)
    mooncake_protocol: str = ""
    devices: str = ""  # --disaggregation-ib-device (SGLang)
    nixl_backend: str = ""


def _flag(argv: list[str], name: str) -> str | None:
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def container_env(container: dict, pod_ip: str) -> dict[str, str]:
    """A rendered container's env as the process sees it: values, and status.podIP from the downward API."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = pod_ip
    return env


def settings_from_pod(engine: str, role: str, env: dict[str, str], argv: list[str], pod_ip: str) -> HandoffSettings:
    """The hand-off settings one engine pod runs with (see the module's docstring for the sources)."""
    if engine == "sglang":
        backend = _flag(argv, "--disaggregation-transfer-backend") or "mooncake"
        return HandoffSettings(
            engine=engine, role=role, backend=backend,
            host=env.get("SGLANG_HOST_IP") or env.get("HOST_IP") or pod_ip,
            port=int(_flag(argv, "--disaggregation-bootstrap-port") or SGLANG_BOOTSTRAP_PORT),
            mooncake_protocol=env.get("MOONCAKE_PROTOCOL", "rdma") if backend == "mooncake" else "",
            devices=(_flag(argv, "--disaggregation-ib-device") or "") if backend == "mooncake" else "",
            nixl_backend=env.get("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX") if backend == "nixl" else "")
    if engine == "vllm":
        config = json.loads(_flag(argv, "--kv-transfer-config") or "null") or {}
        connectors = config.get("kv_connector_extra_config", {}).get("connectors", [config])
        nixl = [c for c in connectors if c.get("kv_connector") == "NixlConnector"]
        if not nixl:
            raise HandoffError(f"vllm {role}: --kv-transfer-config has no NixlConnector ({config})")
        backends = nixl[0].get("kv_connector_extra_config", {}).get("backends", ["UCX"])
        return HandoffSettings(
            engine=engine, role=role, backend="nixl",
            host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", VLLM_SIDE_CHANNEL[0]),
            port=int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", VLLM_SIDE_CHANNEL[1])),
            nixl_backend=",".join(backends))
    raise HandoffError(f"engine {engine!r}: neither sglang nor vllm")


def on_cpu(settings: HandoffSettings) -> tuple[HandoffSettings, dict[str, tuple[str, str]]]:
    """The settings a CPU can run, and what was changed ({field: (rendered, used)}): the fabric's
    transport only (CPU_TRANSPORT), and the fabric's device names with it (they name EFA devices)."""
    changed = {}
    for name, table in CPU_TRANSPORT.items():
        value = getattr(settings, name)
        used = ",".join(table.get(v, v) for v in value.split(",")) if value else value
        used = ",".join(dict.fromkeys(used.split(",")))  # LIBFABRIC,UCX -> UCX once
        if used != value:
            changed[name] = (value, used)
    if settings.devices and changed:
        changed["devices"] = (settings.devices, "")
    return replace(settings, **{k: v[1] for k, v in changed.items()}), changed


def kv_bytes_per_token(config: dict) -> int:
    """Bytes of KV one token holds over all layers, from a Hugging Face model config: MLA keeps one
    latent of kv_lora_rank + qk_rope_head_dim per layer (SGLang's MLATokenToKVPool); otherwise K and
    V of num_key_value_heads x head_dim each (MHATokenToKVPool). In the model's dtype (the engines'
    default KV dtype, "auto")."""
    dtype = DTYPE_BYTES[config.get("torch_dtype", "bfloat16")]
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * dtype
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return layers * 2 * config["num_key_value_heads"] * head_dim * dtype


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the transfer libraries, as the engines construct them ----

class _Mooncake:
    def __init__(self, s: HandoffSettings):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        ret = self.engine.initialize(s.host, "P2PHANDSHAKE", s.mooncake_protocol, s.devices)
        if ret != 0:
            raise HandoffError(f"Mooncake TransferEngine.initialize({s.host!r}, 'P2PHANDSHAKE', "
                               f"{s.mooncake_protocol!r}, {s.devices!r}) returned {ret}")
        self.session_id = f"{s.host}:{self.engine.get_rpc_port()}"

    def register(self, buffer) -> None:
        ret = self.engine.register_memory(ctypes.addressof(buffer), len(buffer))
        if ret != 0:
            raise HandoffError(f"Mooncake register_memory returned {ret}")

    def deregister(self, buffer) -> None:
        self.engine.unregister_memory(ctypes.addressof(buffer))

    def write(self, buffer, peer: dict) -> None:
        ret = self.engine.transfer_sync_write(peer["session_id"], ctypes.addressof(buffer), peer["ptr"], len(buffer))
        if ret < 0:
            raise HandoffError(f"Mooncake transfer_sync_write to {peer['session_id']} returned {ret}")


class _Nixl:
    def __init__(self, s: HandoffSettings):
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        backends = s.nixl_backend.split(",")
        self.name = str(uuid.uuid4())
        self.registered = {}  # buffer address -> its registration descriptors
        try:
            if s.engine == "sglang":
                (backend,) = backends
                threads = 8 if s.role == "prefill" else 0
                config = nixl_agent_config(backends=[], num_threads=threads,
                                           sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
                self.agent = nixl_agent(self.name, config)
                params = {"num_threads": str(threads)} if threads and backend == "UCX" else {}
                self.agent.create_backend(backend, params)
            else:
                config = (nixl_agent_config(backends=backends, capture_telemetry=True)
                          if [b for b in backends if b != "UCX"] else
                          nixl_agent_config(num_threads=4, capture_telemetry=True))
                self.agent = nixl_agent(self.name, config)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own status exceptions
            raise HandoffError(f"NIXL agent with backend {s.nixl_backend!r} ({s.engine}): "
                               f"{type(exc).__name__}: {exc}") from None
        if not self.agent.backends:
            raise HandoffError(f"NIXL agent has no backend (asked {s.nixl_backend!r})")

    def register(self, buffer) -> None:
        self.registered[ctypes.addressof(buffer)] = self.agent.register_memory(
            [(ctypes.addressof(buffer), len(buffer), 0, "")], "DRAM")

    def deregister(self, buffer) -> None:
        self.agent.deregister_memory(self.registered.pop(ctypes.addressof(buffer)))

    def metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def move(self, op: str, buffer, peer: dict, notif: bytes) -> None:
        """WRITE the local buffer to the peer's, or READ the peer's into it, and wait for the end."""
        try:
            name = self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
            local = self.agent.get_xfer_descs([(ctypes.addressof(buffer), len(buffer), 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(peer["ptr"], peer["length"], 0)], "DRAM")
            handle = self.agent.initialize_xfer(op, local, remote, name, notif)
            state = self.agent.transfer(handle)
            while state == "PROC":
                time.sleep(XFER_POLL_SECONDS)
                state = self.agent.check_xfer_state(handle)
            self.agent.release_xfer_handle(handle)
            # a peer registers a buffer per request, so its metadata is loaded afresh each time
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001
            raise HandoffError(f"NIXL {op} with agent at {peer.get('host')}: {type(exc).__name__}: {exc}") from None
        if state != "DONE":
            raise HandoffError(f"NIXL {op} ended {state}")


def _library(settings: HandoffSettings):
    if settings.backend == "mooncake":
        return _Mooncake(settings)
    if settings.backend == "nixl":
        return _Nixl(settings)
    raise HandoffError(f"transfer backend {settings.backend!r}: neither mooncake nor nixl")


def pushes(settings: HandoffSettings) -> bool:
    """SGLang's prefill writes into the decode's buffer; vLLM's decode reads from the prefill's."""
    return settings.engine == "sglang"


# ---- prefill: the rooms and the hand-off server ----

class KVRooms:
    """The prefill side: its library (made once), each room's KV in a registered buffer until the
    decode has it, and the exchange's answers. POST /kv/<room> with the decode's session or agent
    (SGLang: the prefill writes, then answers); GET /kv/<room> for the prefill's agent and buffer
    (vLLM: the decode reads, then POSTs /kv/<room>/done). A room is freed once its KV has moved."""

    def __init__(self, settings: HandoffSettings):
        self.settings = settings
        self.library = _library(settings)
        self.buffers: dict[str, ctypes.Array] = {}
        self.lock = threading.Lock()
        self.timed = lambda seconds: None  # told each write's time (the pushing side times it)

    def add(self, room: str, data: bytes) -> None:
        buffer = ctypes.create_string_buffer(data, len(data))
        with self.lock:
            self.library.register(buffer)
            self.buffers[room] = buffer

    def _moved(self, room: str) -> None:
        """The room's buffer freed (its KV moved, or the decode gave up on it)."""
        with self.lock:
            buffer = self.buffers.pop(room, None)
            if buffer is not None:
                self.library.deregister(buffer)

    def answer(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        """(status, JSON body) for one request of the exchange."""
        room = path.removeprefix("/kv/")
        if method == "POST" and room.endswith("/done"):
            self._moved(room.removesuffix("/done"))
            return 200, {}
        buffer = self.buffers.get(room)
        if buffer is None or pushes(self.settings) != (method == "POST"):
            return 404, {"error": f"no KV for room {room}"}
        if method == "GET":
            return 200, {"metadata": self.library.metadata(), "ptr": ctypes.addressof(buffer),
                         "length": len(buffer), "host": self.settings.host, "sha256": sha256(buffer.raw)}
        if len(buffer) != body.get("length"):
            return 409, {"error": f"room {room}: {len(buffer)} bytes, decode has {body.get('length')}"}
        started = time.monotonic()
        try:
            with self.lock:
                if isinstance(self.library, _Mooncake):
                    self.library.write(buffer, body)
                else:
                    self.library.move("WRITE", buffer, body, room.encode())
        except HandoffError as exc:
            self._moved(room)  # the decode aborts the request: its room is not asked again
            return 502, {"error": str(exc)}
        self.timed(time.monotonic() - started)
        digest = sha256(buffer.raw)
        self._moved(room)
        return 200, {"sha256": digest}


class KVServer(KVRooms):
    """KVRooms with the exchange served on (settings.host, settings.port) by a server of its own."""

    def __init__(self, settings: HandoffSettings, rooms: dict[str, bytes]):
        super().__init__(settings)
        for room, data in rooms.items():
            self.add(room, data)
        self.httpd = ThreadingHTTPServer((settings.host, settings.port), exchange_handler(lambda: self))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def exchange_handler(rooms):
    """An HTTP handler class answering the exchange from `rooms()` (a KVRooms)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, answered: tuple[int, dict]) -> None:
            data = json.dumps(answered[1]).encode()
            self.send_response(answered[0])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer(rooms().answer("GET", self.path, {}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            self._answer(rooms().answer("POST", self.path, body))

    return Handler


def serve_kv(settings: HandoffSettings, rooms: dict[str, bytes]) -> KVServer:
    return KVServer(settings, rooms)


# ---- decode ----

def _call(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise HandoffError(f"{url}: {exc.code} {json.loads(exc.read() or b'{}').get('error', '')}") from None
    except OSError as exc:
        raise HandoffError(f"{url}: {exc}") from None


class KVReceiver:
    """The decode side: its library (made once), and each request's KV received into a buffer
    registered for it."""

    def __init__(self, settings: HandoffSettings):
        self.settings = settings
        self.library = _library(settings)
        self.lock = threading.Lock()

    def receive(self, peer_host: str, peer_port: int, room: str, nbytes: int, timeout: float = 60,
                call=None) -> bytes:
        """`nbytes` of KV for `room` from the prefill at peer_host:peer_port (the address the router
        names for SGLang, the one the prefill advertised for vLLM); HandoffError when it fails or
        what arrived is not what the prefill holds. `call(path, body or None) -> answer` carries the
        exchange (HTTP to the peer by default; vLLM's stand-in carries it on its ZMQ side channel)."""
        call = call or (lambda path, body: _call(f"http://{peer_host}:{peer_port}{path}", body, timeout))
        buffer = ctypes.create_string_buffer(nbytes)
        with self.lock:
            self.library.register(buffer)
        try:
            path = f"/kv/{room}"
            if pushes(self.settings):
                me = {"ptr": ctypes.addressof(buffer), "length": nbytes, "host": self.settings.host}
                me.update({"session_id": self.library.session_id} if isinstance(self.library, _Mooncake)
                          else {"metadata": self.library.metadata()})
                said = call(path, me)
                if said.get("sha256") != sha256(buffer.raw):
                    raise HandoffError(f"room {room}: the KV that arrived differs from the prefill's")
            else:
                peer = call(path, None)
                if peer["length"] != nbytes:
                    raise HandoffError(f"room {room}: prefill holds {peer['length']} bytes, decode expects {nbytes}")
                with self.lock:
                    self.library.move("READ", buffer, peer, room.encode())
                call(f"{path}/done", {})
                if peer["sha256"] != sha256(buffer.raw):
                    raise HandoffError(f"room {room}: the KV that arrived differs from the prefill's")
            return buffer.raw
        finally:
            with self.lock:
                self.library.deregister(buffer)


def receive_kv(settings: HandoffSettings, peer_host: str, peer_port: int, room: str, nbytes: int,
               timeout: float = 60) -> bytes:
    """One room's KV with a receiver of its own (see KVReceiver.receive)."""
    return KVReceiver(settings).receive(peer_host, peer_port, room, nbytes, timeout)


# ---- an engine process's part (the engine stand-in's, twin/engine_standin.py) ----

MODELS = Path(__file__).resolve().parent.parent / "infra" / "render" / "engine_check" / "models"
DEFAULT_KV_BYTES_PER_TOKEN = 4096  # a model whose config the twin does not hold


def model_kv_bytes_per_token(model: str) -> int:
    """kv_bytes_per_token of a served model's pinned config (infra/render/engine_check/models, by the
    name's last part: Qwen/Qwen3-30B-A3B -> qwen3-30b-a3b.json)."""
    config = MODELS / f"{model.rsplit('/', 1)[-1].lower()}.json"
    return kv_bytes_per_token(json.loads(config.read_text())) if config.is_file() else DEFAULT_KV_BYTES_PER_TOKEN


class EngineKV:
    """One engine process's part in the hand-off, as its KV manager holds it: the library made at
    start from the process's own env and argv (settings_from_pod, then on_cpu: a backend or protocol
    the library refuses raises HandoffError there, as the engine fails to start), each request's KV
    (random bytes, the model's KV for its prompt tokens) offered by the prefill under its room and
    taken by the decode, checked by digest. `failed` counts the transfers that failed, and
    `timed(seconds)` is told each one's time where the engine times it (the pushing prefill, the
    pulling decode): what the engines' own metrics count, served by the stand-in's /metrics."""

    def __init__(self, engine: str, roles: tuple[str, ...], env: dict[str, str], argv: list[str], pod_ip: str,
                 model: str):
        self.settings, self.changed = on_cpu(settings_from_pod(engine, roles[0], env, argv, pod_ip))
        try:
            self.rooms = KVRooms(replace(self.settings, role="prefill")) if "prefill" in roles else None
            self.receiver = KVReceiver(replace(self.settings, role="decode")) if "decode" in roles else None
        except ImportError as exc:
            raise HandoffError(f"the {self.settings.backend} library is not importable ({exc}): the twin's "
                               "pods run with twin/kv_libraries.py environment()") from None
        self.per_token = model_kv_bytes_per_token(model)
        self.failed = 0
        self.lock = threading.Lock()
        self.timed = lambda seconds: None
        if self.rooms:
            self.rooms.timed = lambda seconds: self.timed(seconds)

    def offer(self, room: str, prompt_tokens: int) -> None:
        """Prefill: this request's KV, registered under its room until the decode has it."""
        self.rooms.add(room, os.urandom(max(1, prompt_tokens) * self.per_token))

    def take(self, peer_host: str, peer_port: int, room: str, prompt_tokens: int, call=None) -> str:
        """Decode: the room's KV from the prefill; what moved, or HandoffError (counted as failed)."""
        nbytes = max(1, prompt_tokens) * self.per_token
        started = time.monotonic()
        try:
            data = self.receiver.receive(peer_host, peer_port, room, nbytes, call=call)
        except HandoffError:
            with self.lock:
                self.failed += 1
            raise
        if not pushes(self.settings):
            self.timed(time.monotonic() - started)
        return f"{len(data)} bytes of KV over {self.settings.backend}, sha256 {sha256(data)[:12]}"


# ---- processes: python kv_handoff.py serve|receive (what a test or a stand-in runs) ----

def main() -> int:
    parser = argparse.ArgumentParser(prog="kv_handoff")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="prefill: serve random KV of --bytes for --room")
    serve.add_argument("--ready", required=True, help="file to write {sha256} to once serving")
    receive = sub.add_parser("receive", help="decode: print the received KV's {sha256} as JSON")
    receive.add_argument("--peer", required=True, help="host:port of the prefill's exchange")
    for p in (serve, receive):
        p.add_argument("--settings", required=True, help="HandoffSettings as JSON")
        p.add_argument("--room", required=True)
        p.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args()
    settings = HandoffSettings(**json.loads(args.settings))
    try:
        if args.command == "serve":
            data = os.urandom(args.bytes)
            server = serve_kv(settings, {args.room: data})
            tmp = args.ready + ".tmp"
            with open(tmp, "w") as out:
                json.dump({"sha256": sha256(data)}, out)
            os.replace(tmp, args.ready)
            server.thread.join()
            return 0
        host, port = args.peer.rsplit(":", 1)
        data = receive_kv(settings, host, int(port), args.room, args.bytes)
        print(json.dumps({"sha256": sha256(data), "bytes": len(data)}))
        return 0
    except (HandoffError, OSError) as exc:
        print(f"kv_handoff {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
