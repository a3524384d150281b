"""A request's KV moved from a prefill process to a decode process with the real transfer libraries of
the pinned wheels, configured from dev's and prod's rendered engine pods (issue #40, "The KV hand-off
moves real bytes"): twin/kv_handoff.py.

Libraries: Mooncake's EFA build, `mooncake-transfer-engine-efa` at the release the specs' master
image is tagged with, as the engine image installs it (twin/kv_libraries.py: with
libcudart.so.12 from PyPI and a stand-in for the CUDA driver; no GPU is touched on the tcp
transport), and `nixl` 1.5.0 with its `nixl-cu12`/`nixl-cu13` wheels (the recipe's NIXL_VERSION,
tests/test_engine_image.py), unpacked once into the machine's cache, on the path of the engines' CPU
virtualenv (torch, which nixl._api imports). Every wheel from scripts/pinned_wheels.py.

Network: two pod network namespaces on twin/pods.py's PodNetwork (a hub bridge, a veth and a pod IP
each, nothing on the machine's interfaces), so "localhost" in one pod is not the other, as on a
cluster. Settings: the rendered LeaderWorkerSets' env (the downward API's status.podIP given the
pod's twin address), the argv their launch script execs, the prefill's `sglang.ai/bootstrap-port`
annotation (the port sglang-router hands the decode). The twin's CPU stands for EFA: only
MOONCAKE_PROTOCOL efa -> tcp (and the EFA device names dropped) and NIXL LIBFABRIC -> UCX differ
from the render (kv_handoff.on_cpu). A deliberately broken render (a wrong port, hostname, protocol
or backend) fails the hand-off.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from infra import naming
from infra.render.engine_args import all_launches
from infra.render.engine_check import MODEL_CONFIGS, MODELS, launch_argv, variant_spec
from tests.conftest import script_modules
from tests.servers import require_binary
from twin import kv_handoff, kv_libraries
from twin.kv_handoff import BOOTSTRAP_ANNOTATION, container_env, on_cpu, settings_from_pod

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 64  # one request's prompt
PREFILL_IP, DECODE_IP = "10.244.40.2", "10.244.40.3"


def _scripts():
    return script_modules("pinned_wheels", "extract_engine_flags")


@functools.cache
def rendered_pods(stack: str, engine: str) -> dict[str, dict]:
    """{role: {"env", "argv", "annotations"}} of the leader pod of each PD pool, as rendered."""
    from infra.offline import run_spec

    spec = variant_spec(stack, engine)
    launches = all_launches(spec)
    pods = {}
    for group in run_spec(spec).by_kind("LeaderWorkerSet"):
        template = group["spec"]["leaderWorkerTemplate"].get("leaderTemplate") or \
            group["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        role = template["metadata"]["labels"].get(naming.ROLE_LABEL)
        if role in ("prefill", "decode") and not group["metadata"]["name"].endswith("-canary"):
            container = next(c for c in template["spec"]["containers"] if c["name"] == "engine")
            pods[role] = {"container": container, "argv": launch_argv(launches[role], 0),
                          "annotations": template["metadata"].get("annotations", {})}
    assert set(pods) == {"prefill", "decode"}, f"{stack}/{engine}: PD pools rendered: {sorted(pods)}"
    return pods


def settings(pods: dict, role: str, engine: str, ip: str) -> kv_handoff.HandoffSettings:
    pod = pods[role]
    return settings_from_pod(engine, role, container_env(pod["container"], ip), pod["argv"], ip)


def kv_bytes(stack: str, engine: str) -> int:
    config = json.loads((MODELS / MODEL_CONFIGS[variant_spec(stack, engine).model.name]).read_text())
    return TOKENS * kv_handoff.kv_bytes_per_token(config)


@pytest.fixture(scope="module")
def libraries() -> dict:
    """The pinned wheels unpacked as pip would install them (twin/kv_libraries.py, once per pin
    into the machine's cache), and the interpreter and env to run them."""
    _, engine_flags = _scripts()
    python = engine_flags.engine_venv() / "bin" / "python"
    return {"python": str(python), "env": {"PATH": "/usr/bin:/bin", **kv_libraries.environment()}}


@pytest.fixture(scope="module")
def pods_network(tmp_path_factory):
    """Two pod namespaces (prefill, decode) on the twin's pod network; {ip: holder pid}."""
    require_binary("unshare")
    require_binary("nsenter")
    from twin.pods import PodNetwork

    folder = tmp_path_factory.mktemp("kv-net")
    network = PodNetwork(folder, apiserver_port=9)  # no API server: the tunnel is never dialled
    holders = {}
    try:
        for ip in (PREFILL_IP, DECODE_IP):
            holders[ip] = network.attach(ip, folder / f"{ip}.log")
        yield {ip: h.pid for ip, h in holders.items()}
    finally:
        for holder in holders.values():
            holder.kill()
            holder.wait()
        network.stop()


class Pair:
    """A prefill process serving one room's KV, and decode processes asking for it, each in its pod's namespace."""

    def __init__(self, libraries, pods_network, tmp_path: Path):
        self.libraries, self.net, self.tmp = libraries, pods_network, tmp_path
        self.procs: list[subprocess.Popen] = []

    def _argv(self, ip: str, *args: str) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.net[ip]}/ns/net", "--", self.libraries["python"],
                str(ROOT / "twin" / "kv_handoff.py"), *args]

    def serve(self, s, nbytes: int) -> dict:
        ready, log = self.tmp / "ready.json", self.tmp / "prefill.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self._argv(PREFILL_IP, "serve", "--settings", json.dumps(asdict(s)), "--room", "r1",
                                               "--bytes", str(nbytes), "--ready", str(ready)),
                                    env=self.libraries["env"], stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        while not ready.exists():
            assert proc.poll() is None, f"prefill exited {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        return json.loads(ready.read_text())

    def receive(self, s, port: int, nbytes: int, peer: str = PREFILL_IP) -> subprocess.CompletedProcess:
        return subprocess.run(self._argv(DECODE_IP, "receive", "--settings", json.dumps(asdict(s)), "--room", "r1",
                                         "--bytes", str(nbytes), "--peer", f"{peer}:{port}"),
                              env=self.libraries["env"], capture_output=True, text=True, timeout=300)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def pair(libraries, pods_network, tmp_path):
    p = Pair(libraries, pods_network, tmp_path)
    yield p
    p.stop()


def handoff(pair: Pair, pods: dict, engine: str, nbytes: int) -> tuple[dict, subprocess.CompletedProcess]:
    """The rendered pods' hand-off on the CPU: the prefill serves, the decode dials the port its
    engine would (SGLang: the router's, from the prefill's annotation; vLLM: the one the prefill advertises)."""
    prefill, _ = on_cpu(settings(pods, "prefill", engine, PREFILL_IP))
    decode, _ = on_cpu(settings(pods, "decode", engine, DECODE_IP))
    served = pair.serve(prefill, nbytes)
    if engine == "sglang":
        host, port = PREFILL_IP, int(pods["prefill"]["annotations"][BOOTSTRAP_ANNOTATION])
    else:
        host, port = prefill.host, prefill.port
    return served, pair.receive(decode, port, nbytes, peer=host)


CASES = [("dev", "sglang", "mooncake"), ("prod", "sglang", "nixl"), ("dev", "vllm", "nixl"), ("prod", "vllm", "nixl")]


@pytest.mark.parametrize(("stack", "engine", "backend"), CASES, ids=[f"{s}-{e}" for s, e, _ in CASES])
def test_the_rendered_pods_move_a_requests_kv_intact(stack, engine, backend, pair):
    """The KV of one 64-token request of the stack's model (kv_bytes_per_token of its pinned config)
    crosses from the prefill pod to the decode pod with the rendered backend, and its sha256 on the
    decode is the prefill's."""
    pods = rendered_pods(stack, engine)
    nbytes = kv_bytes(stack, engine)
    assert settings(pods, "prefill", engine, PREFILL_IP).backend == backend
    served, done = handoff(pair, pods, engine, nbytes)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"sha256": served["sha256"], "bytes": nbytes}


def test_kv_size_follows_the_pinned_model_configs():
    """Qwen3-30B-A3B (dev): 48 layers x K and V x 4 KV heads x 128 x bf16 = 98304 bytes a token.
    DeepSeek-V3 (prod, MLA): 61 layers x (512 latent + 64 rope) x bf16 = 70272 (SGLang's
    MLATokenToKVPool keeps kv_lora_rank + qk_rope_head_dim per token and layer)."""
    assert kv_bytes("dev", "sglang") == TOKENS * 98304
    assert kv_bytes("prod", "sglang") == TOKENS * 70272


def test_only_the_fabrics_transport_is_changed_for_the_cpu():
    """dev's SGLang renders Mooncake over efa on its EFA devices; prod's NIXL over LIBFABRIC (both
    only EFA can carry). on_cpu changes exactly those; the ports and hosts stay as rendered."""
    dev = settings(rendered_pods("dev", "sglang"), "prefill", "sglang", PREFILL_IP)
    used, changed = on_cpu(dev)
    assert changed == {"mooncake_protocol": ("efa", "tcp"), "devices": ("rdmap79s0,rdmap80s0,rdmap81s0,rdmap82s0", "")}
    assert (used.host, used.port) == (PREFILL_IP, 8998)
    prod = settings(rendered_pods("prod", "vllm"), "prefill", "vllm", PREFILL_IP)
    used, changed = on_cpu(prod)
    assert changed == {"nixl_backend": ("LIBFABRIC", "UCX")} and (used.host, used.port) == (PREFILL_IP, 5600)


def _broken(pods: dict, role: str, env: dict | None = None, argv: dict | None = None, drop: str = "") -> dict:
    """The rendered pods with one pod's env or argv changed as a faulty render would have it."""
    pods = copy.deepcopy(pods)
    container = pods[role]["container"]
    container["env"] = [e for e in container["env"] if e["name"] != drop and e["name"] not in (env or {})]
    container["env"] += [{"name": k, "value": v} for k, v in (env or {}).items()]
    for flag, value in (argv or {}).items():
        pods[role]["argv"][pods[role]["argv"].index(flag) + 1] = value
    return pods


BREAKS = {
    # The prefill's bootstrap server on another port than its annotation tells the router.
    "dev-sglang-port": ("dev", "sglang", lambda p: _broken(p, "prefill", argv={"--disaggregation-bootstrap-port": "8999"})),
    # The decode registers under its loopback, not its pod IP: the prefill's write goes to itself.
    "dev-sglang-hostname": ("dev", "sglang", lambda p: _broken(p, "decode", env={"SGLANG_HOST_IP": "127.0.0.1"})),
    "prod-sglang-port": ("prod", "sglang", lambda p: _broken(p, "prefill", argv={"--disaggregation-bootstrap-port": "8999"})),
    # A NIXL backend the wheel has no plugin for.
    "prod-sglang-backend": ("prod", "sglang", lambda p: _broken(p, "prefill", env={"SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCCL"})),
    # VLLM_NIXL_SIDE_CHANNEL_HOST not set from the pod IP: the prefill listens on and advertises "localhost".
    "prod-vllm-hostname": ("prod", "vllm", lambda p: _broken(p, "prefill", drop="VLLM_NIXL_SIDE_CHANNEL_HOST")),
}


# What the decode reports for each break: the prefill's write to a decode session at its own
# loopback fails in Mooncake; a port or host nobody serves refuses the connection.
FAILS_WITH = {
    "dev-sglang-port": f"http://{PREFILL_IP}:8998/kv/r1: <urlopen error [Errno 111] Connection refused>",
    "dev-sglang-hostname": f"http://{PREFILL_IP}:8998/kv/r1: 502 Mooncake transfer_sync_write to 127.0.0.1:",
    "prod-sglang-port": f"http://{PREFILL_IP}:8998/kv/r1: <urlopen error [Errno 111] Connection refused>",
    "prod-vllm-hostname": "http://localhost:5600/kv/r1: <urlopen error [Errno 111] Connection refused>",
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_broken_render_fails_the_handoff(name, pair):
    """Each deliberate break of the rendered settings fails the decode's hand-off with the library's
    or the exchange's own error (and the working render passes: test_the_rendered_pods_move_...)."""
    stack, engine, breaking = BREAKS[name]
    pods = breaking(rendered_pods(stack, engine))
    nbytes = kv_bytes(stack, engine)
    prefill, _ = on_cpu(settings(pods, "prefill", engine, PREFILL_IP))
    if name == "prod-sglang-backend":  # the prefill itself cannot start its agent
        done = subprocess.run(pair._argv(PREFILL_IP, "serve", "--settings", json.dumps(asdict(prefill)), "--room", "r1",
                                         "--bytes", str(nbytes), "--ready", str(pair.tmp / "ready.json")),
                              env=pair.libraries["env"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and "NIXL agent with backend 'UCCL'" in done.stderr, done.stderr[-2000:]
        return
    _, done = handoff(pair, pods, engine, nbytes)
    assert done.returncode == 1, f"{name}: the hand-off succeeded: {done.stdout}"
    assert f"kv_handoff receive: {FAILS_WITH[name]}" in done.stderr, done.stderr[-2000:]


def test_the_rendered_efa_protocol_fails_here_with_efas_own_error(pair):
    """Why the CPU hand-off changes efa to tcp (on_cpu), and that the change is not a no-op: dev's
    rendered prefill, run as rendered (MOONCAKE_PROTOCOL=efa on its EFA devices), installs Mooncake's
    EfaTransport, which finds no EFA device on this machine and fails initialize with its own error.
    kvcache-ai/Mooncake v0.3.13.post1, mooncake-integration/transfer_engine/transfer_engine_py.cpp;
    0.3.8.post1's binding ignored the protocol (`(void)(protocol);`) and moved the KV over TCP."""
    prefill = settings(rendered_pods("dev", "sglang"), "prefill", "sglang", PREFILL_IP)
    assert prefill.mooncake_protocol == "efa"
    done = subprocess.run(pair._argv(PREFILL_IP, "serve", "--settings", json.dumps(asdict(prefill)), "--room", "r1",
                                     "--bytes", "4096", "--ready", str(pair.tmp / "ready.json")),
                          env=pair.libraries["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"Mooncake TransferEngine.initialize({PREFILL_IP!r}, 'P2PHANDSHAKE', 'efa', " in done.stderr
    assert "Installing EFA transport as requested by protocol parameter" in done.stderr
    assert "Failed to install EFA transport" in done.stderr and "TcpTransport" not in done.stderr


@pytest.mark.parametrize("protocol", ["rdma", "no-such-protocol"])
def test_mooncakes_efa_build_moves_kv_over_tcp_for_any_other_protocol(protocol, pair):
    """Why a CPU cannot fail a MOONCAKE_PROTOCOL other than efa: the EFA build installs TCP for any
    other protocol, known or not ("Installing TCP transport (auto_discover disabled in EFA build)",
    transfer_engine_py.cpp v0.3.13.post1). On a node that is KV over TCP instead of EFA, which is
    why infra/render/fabric.py renders efa wherever the image has the EFA build (and the spec check
    refuses mooncake_efa for a Mooncake before 0.3.10)."""
    pods = _broken(_broken(rendered_pods("dev", "sglang"), "prefill", env={"MOONCAKE_PROTOCOL": protocol}),
                   "decode", env={"MOONCAKE_PROTOCOL": protocol})
    prefill = settings(pods, "prefill", "sglang", PREFILL_IP)
    assert on_cpu(prefill)[0].mooncake_protocol == protocol
    nbytes = kv_bytes("dev", "sglang")
    served, done = handoff(pair, pods, "sglang", nbytes)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["sha256"] == served["sha256"]
    assert "auto_discover disabled in EFA build" in done.stderr and "TcpTransport: listen" in done.stderr
