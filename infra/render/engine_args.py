"""Spec to engine command lines, for each pool. Pure: no Pulumi, no I/O.

One function per engine builds the argument list; `engine_launch` wraps it with what the
pod needs (ports, launch script from templates/). Every list is checked against the
pinned engine's real flag set before it leaves this module, so a misspelled or removed
flag fails at render time, not on a GPU node at 3 a.m.

Multi-node instances run as LeaderWorkerSet groups. LWS injects LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX into every pod; the launch script turns them into
the engine's rank arguments (shell variables, expanded when the container starts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from infra import naming
from infra.render.flagsets import flagset
from infra.render.templating import render_template
from infra.render.tracing import engine_trace_args
from infra.spec import PhaseSpec, StackSpec

ENGINE_PORT = {"sglang": 30000, "vllm": 8000}
BOOTSTRAP_PORT = 8998  # SGLang PD: prefill's KV bootstrap server the decode side dials
DIST_INIT_PORT = 20000  # SGLang torch.distributed rendezvous on the group leader
VLLM_DP_RPC_PORT = 13345  # vLLM data-parallel coordinator on the group leader
PLACEMENT_MOUNT = "/etc/pdstack/expert-placement"

# vLLM 0.33.0 KV connector names, from vllm/distributed/kv_transfer/kv_connector/factory.py.
VLLM_TRANSFER_CONNECTOR = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
VLLM_STORE_CONNECTOR = {"lmcache": "LMCacheConnectorV1", "mooncake": "MooncakeStoreConnector"}
# DeepEP kernels by phase: throughput-oriented for prefill, low-latency for decode.
VLLM_ALL2ALL = {"prefill": "deepep_high_throughput", "decode": "deepep_low_latency", "colocated": "deepep_high_throughput"}


@dataclass(frozen=True)
class EngineLaunch:
    role: str
    engine: str
    version: str
    entrypoint: list[str]
    args: list[str]
    port: int
    multi_node: bool
    nodes: int
    gpus_per_pod: int
    notes: list[str] = field(default_factory=list)
    prelude: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # engine settings that exist only as env vars

    def script(self) -> str:
        return launch_script(f"{self.engine} {self.version} {self.role} server",
                             [*self.entrypoint, *self.args], notes=self.notes, prelude=self.prelude)


def launch_script(title: str, command: list[str], notes: list[str] = (), prelude: list[str] = ()) -> str:
    """The container's /bin/sh launch script, from templates/launch.sh.j2."""
    return render_template("launch.sh.j2", title=title, notes=list(notes), prelude=list(prelude),
                           lines=command_lines(command))


def command_lines(tokens: list[str]) -> list[list[str]]:
    """Group a command into lines a reviewer can read: the program, then one flag per line."""
    first_flag = next((i for i, t in enumerate(tokens) if t.startswith("--")), len(tokens))
    lines = [tokens[:first_flag]]
    for token in tokens[first_flag:]:
        if token.startswith("--") or token == '"$@"' or len(lines[-1]) > 1 or lines[-1] is lines[0]:
            lines.append([token])
        else:
            lines[-1].append(token)
    return lines


def weights_path(spec: StackSpec) -> str:
    return f"{spec.model.weights.node_cache_path.rstrip('/')}/{spec.model.weights.prefix.strip('/')}"


def placement_path(role: str) -> str:
    return f"{PLACEMENT_MOUNT}/{role}.json"


def _rank_prelude(phase: PhaseSpec, gpus_per_node: int) -> list[str]:
    return [
        'NODE_RANK="${LWS_WORKER_INDEX:-0}"',
        'LEADER="${LWS_LEADER_ADDRESS:-127.0.0.1}"',
        f'NNODES="${{LWS_GROUP_SIZE:-{phase.nodes_per_instance(gpus_per_node)}}}"',
    ]


def sglang_args(spec: StackSpec, role: str) -> tuple[list[str], list[str], list[str]]:
    """(args, prelude, notes) for `python3 -m sglang.launch_server` in one pool."""
    phase = spec.deployment.pools()[role]
    dep, eng, hw = spec.deployment, spec.engine, spec.hardware
    ep = phase.expert_parallel
    nodes = phase.nodes_per_instance(hw.gpus_per_node)
    notes: list[str] = []
    args = [
        "--model-path", weights_path(spec),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT["sglang"]),
        "--tp-size", str(ep),
        "--ep-size", str(ep),
        "--mem-fraction-static", str(eng.mem_fraction_static),
        "--context-length", str(spec.model.context_length),
        "--enable-metrics",
    ]
    if eng.trust_remote_code:
        args.append("--trust-remote-code")
    if phase.dp_attention and ep > 1:
        args += ["--dp-size", str(ep), "--enable-dp-attention"]
    if eng.moe_a2a_backend == "deepep" and ep > 1:
        args += ["--moe-a2a-backend", "deepep"]
    if role in ("prefill", "decode"):
        args += [
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", eng.kv_transfer,
        ]
        if eng.rdma_devices:
            args += ["--disaggregation-ib-device", ",".join(eng.rdma_devices)]
        if role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    if not dep.cache.prefix_cache:
        args.append("--disable-radix-cache")
    elif dep.cache.store == "mooncake":
        # Prefix cache spills from GPU to host memory and on to the Mooncake store.
        args += ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    if phase.enable_eplb and ep > 1:
        args.append("--enable-eplb")
        if phase.redundant_experts:
            args += ["--ep-num-redundant-experts", str(phase.redundant_experts)]
    if phase.expert_placement:
        args += ["--init-expert-location", placement_path(role)]
        notes.append(f"expert placement from {phase.expert_placement} (pdctl eplb)")
    elif phase.enable_eplb and ep > 1:
        notes.append("no placement file: SGLang's own EPLB places redundant experts at runtime")
    if phase.chunked_prefill_size:
        args += ["--chunked-prefill-size", str(phase.chunked_prefill_size)]
    if phase.max_running_requests:
        args += ["--max-running-requests", str(phase.max_running_requests)]
    if role in ("prefill", "colocated"):
        args += encoder_args(spec)[0]
    args += engine_trace_args(spec, role)
    prelude: list[str] = []
    if nodes > 1:
        prelude = _rank_prelude(phase, hw.gpus_per_node)
        args += [
            "--nnodes", "${NNODES}",
            "--node-rank", "${NODE_RANK}",
            "--dist-init-addr", f"${{LEADER}}:{DIST_INIT_PORT}",
        ]
    return args, prelude, notes


def vllm_args(spec: StackSpec, role: str) -> tuple[list[str], list[str], list[str]]:
    """(args, prelude, notes) for `vllm serve <weights>` in one pool."""
    phase = spec.deployment.pools()[role]
    dep, eng, hw = spec.deployment, spec.engine, spec.hardware
    ep = phase.expert_parallel
    nodes = phase.nodes_per_instance(hw.gpus_per_node)
    local = min(ep, hw.gpus_per_node)
    notes: list[str] = []
    args = [
        weights_path(spec),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT["vllm"]),
        "--tensor-parallel-size", "1",
        "--data-parallel-size", str(ep),
        "--gpu-memory-utilization", str(eng.mem_fraction_static),
        "--max-model-len", str(spec.model.context_length),
    ]
    if eng.trust_remote_code:
        args.append("--trust-remote-code")
    if ep > 1:
        args.append("--enable-expert-parallel")
        if eng.moe_a2a_backend == "deepep":
            args += ["--all2all-backend", VLLM_ALL2ALL[role]]
    args.append("--enable-prefix-caching" if dep.cache.prefix_cache else "--no-enable-prefix-caching")
    if phase.enable_eplb and ep > 1:
        args += ["--enable-eplb", "--eplb-config", json.dumps({"num_redundant_experts": phase.redundant_experts})]
    connectors = []
    if role in ("prefill", "decode"):
        transfer = {"kv_connector": VLLM_TRANSFER_CONNECTOR[eng.kv_transfer], "kv_role": "kv_both"}
        if eng.kv_transfer == "nixl":
            # The prefill side holds KV for a decode peer this long (nixl/base_scheduler.py, default 30 s).
            transfer["kv_connector_extra_config"] = {
                "kv_lease_duration": int(spec.timeouts.prefill_to_decode_kv.timeout_seconds)}
        connectors.append(transfer)
    if dep.cache.prefix_cache:
        connectors.append({"kv_connector": VLLM_STORE_CONNECTOR[dep.cache.store], "kv_role": "kv_both"})
    if len(connectors) == 1:
        args += ["--kv-transfer-config", json.dumps(connectors[0])]
    elif connectors:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": connectors},
        })]
    if phase.max_running_requests:
        args += ["--max-num-seqs", str(phase.max_running_requests)]
    if phase.chunked_prefill_size:
        args += ["--max-num-batched-tokens", str(phase.chunked_prefill_size)]
    if role in ("prefill", "colocated"):
        args += encoder_args(spec)[0]
    args += engine_trace_args(spec, role)
    prelude: list[str] = []
    if nodes > 1:
        prelude = _rank_prelude(phase, hw.gpus_per_node) + [f"START_RANK=$((NODE_RANK * {local}))"]
        args += [
            "--data-parallel-size-local", str(local),
            "--data-parallel-address", "${LEADER}",
            "--data-parallel-rpc-port", str(VLLM_DP_RPC_PORT),
            "--data-parallel-start-rank", "${START_RANK}",
        ]
        notes.append("workers (NODE_RANK > 0) run headless: only the leader serves HTTP")
        prelude.append('if [ "$NODE_RANK" -gt 0 ]; then set -- --headless; else set --; fi')
    if eng.rdma_devices:
        notes.append(f"RDMA devices for KV transfer: {', '.join(eng.rdma_devices)} (UCX_NET_DEVICES)")
    return args, prelude, notes


def encoder_args(spec: StackSpec) -> tuple[list[str], str]:
    """Extra engine args for input pre-processing, and a sentence for the rendered config.

    `engine` mode spreads tokenisation (and multimodal pre-processing) over worker
    processes inside each serving engine. `dedicated` runs encoder-only servers that the
    prefill side calls (SGLang's encoder disaggregation, multimodal models only).
    """
    enc = spec.deployment.load_balancer.encoder
    workers = enc.workers or 4
    if enc.mode == "dedicated":  # the spec checks guarantee sglang and a multimodal model
        url = f"http://{naming.service_dns(naming.ENCODER, spec.environment.namespace)}:{ENGINE_PORT['sglang']}"
        return ["--encoder-urls", url], f"dedicated encoder pool of {workers} workers at {url}"
    if spec.engine.kind == "sglang":
        return ["--tokenizer-worker-num", str(workers)], f"engine tokenises itself with {workers} tokenizer workers"
    return ["--api-server-count", str(workers)], f"engine tokenises itself in {workers} API server processes"


def encoder_launch(spec: StackSpec) -> EngineLaunch:
    """Dedicated encoder workers (SGLang --encoder-only), one GPU each, for multimodal input."""
    args = [
        "--model-path", weights_path(spec),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT["sglang"]),
        "--encoder-only",
        "--tp-size", "1",
        "--enable-metrics",
    ]
    if spec.engine.trust_remote_code:
        args.append("--trust-remote-code")
    flagset("sglang").require(args, "encoder")
    return EngineLaunch(role="encoder", engine="sglang", version=spec.engine.version,
                        entrypoint=["python3", "-m", "sglang.launch_server"], args=args,
                        port=ENGINE_PORT["sglang"], multi_node=False, nodes=1, gpus_per_pod=1)


def kv_hop_env(spec: StackSpec, role: str) -> dict[str, str]:
    """The prefill-to-decode KV hop timeout, where the engine takes it from the environment.

    SGLang 0.5.23 (sglang/srt/environ.py): the prefill side gives up on a decode peer that
    has not bootstrapped the request, and the decode side on KV that has not arrived, after
    these many seconds (both default to 300). vLLM's Mooncake connector frees KV a decode
    peer never read after VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (vllm/envs.py, default 480);
    its NIXL connector takes a lease in the connector config instead (see vllm_args).
    """
    if role not in ("prefill", "decode"):
        return {}
    seconds = str(int(spec.timeouts.prefill_to_decode_kv.timeout_seconds))
    if spec.engine.kind == "sglang":
        return {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": seconds, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": seconds}
    if spec.engine.kv_transfer == "mooncake":
        return {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": seconds}
    return {}


def engine_launch(spec: StackSpec, role: str) -> EngineLaunch:
    """The full, checked launch of one pool's engine."""
    kind = spec.engine.kind
    phase = spec.deployment.pools()[role]
    args, prelude, notes = (sglang_args if kind == "sglang" else vllm_args)(spec, role)
    entrypoint = ["python3", "-m", "sglang.launch_server"] if kind == "sglang" else ["vllm", "serve"]
    flags = args[1:] if kind == "vllm" else args  # vllm takes the model path first
    flagset(kind).require(flags, f"{role} engine")
    env = kv_hop_env(spec, role)
    flagset(kind).require_env(env, f"{role} engine")
    nodes = phase.nodes_per_instance(spec.hardware.gpus_per_node)
    if kind == "vllm" and nodes > 1:
        args = [*args, '"$@"']  # --headless on workers, from the prelude
    return EngineLaunch(
        role=role,
        engine=kind,
        version=spec.engine.version,
        entrypoint=entrypoint,
        args=args,
        port=ENGINE_PORT[kind],
        multi_node=nodes > 1,
        nodes=nodes,
        gpus_per_pod=min(phase.gpus_per_instance(), spec.hardware.gpus_per_node),
        notes=notes,
        prelude=prelude,
        env=env,
    )


def all_launches(spec: StackSpec) -> dict[str, EngineLaunch]:
    return {role: engine_launch(spec, role) for role in spec.deployment.pools()}
