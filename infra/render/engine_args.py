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
import shlex
from dataclasses import dataclass, field

from infra import naming
from infra.render.fabric import device_names, nixl_backends
from infra.render.flagsets import flagset
from infra.render.templating import render_template
from infra.render.tracing import engine_trace_args
from infra.spec import PhaseSpec, StackSpec, runs_prefix_cache

ENGINE_PORT = {"sglang": 30000, "vllm": 8000}  # what a pool's pods serve on
SIDECAR_ENGINE_PORT = 8200  # the engine's own port behind llm-d's routing sidecar
BOOTSTRAP_PORT = 8998  # SGLang PD: prefill's KV bootstrap server the decode side dials
DIST_INIT_PORT = 20000  # SGLang torch.distributed rendezvous on the group leader
VLLM_DP_RPC_PORT = 13345  # vLLM data-parallel coordinator on the group leader
PLACEMENT_MOUNT = "/etc/pdstack/expert-placement"

# vLLM 0.33.0 KV connector names, from vllm/distributed/kv_transfer/kv_connector/factory.py.
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
    pod_ip_env: tuple[str, ...] = ()  # env vars set to the pod's IP (downward API status.podIP)

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


# Where pods see the node's weight cache (its hostPath is model.weights.node_cache_path, wherever
# the node keeps it): one path in every container, so engine command lines do not depend on the node.
WEIGHTS_MOUNT = "/mnt/weights"


# Where engines keep the kernels they compile (DeepGEMM, Triton, torch.compile, FlashInfer, CUDA's
# PTX cache): a node-local volume beside the weights (infra/components/storage.py), so a restart or a
# recreated group on the node reuses them instead of compiling again.
JIT_CACHE_MOUNT = "/var/cache/pdstack-jit"
JIT_CACHE_FOLDER = ".pdstack-jit"  # on the node: under model.weights.node_cache_path, one folder per engine build


def jit_cache_env(engine: str) -> dict[str, str]:
    """What points an engine's compiled-kernel caches at JIT_CACHE_MOUNT.

    SGLang 0.5.23 keeps them all under SGLANG_CACHE_DIR (sglang/srt/environ.py): its DeepGEMM cache
    (SGLANG_DG_CACHE_DIR, default `<SGLANG_CACHE_DIR>/deep_gemm`, which
    sglang/srt/layers/deep_gemm_wrapper/compile_utils.py hands DeepGEMM as DG_JIT_CACHE_DIR), and the
    third-party caches `third_party_cache_defaults` lists (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR,
    CUDA_CACHE_PATH, TILELANG_CACHE_DIR, FLASHINFER_WORKSPACE_BASE), which importing sglang sets
    under it (sglang/__init__.py, _redirect_third_party_caches) where they are unset.
    vLLM 0.33.0 keeps torch.compile's and DeepGEMM's under VLLM_CACHE_ROOT (vllm/envs.py;
    vllm/utils/deep_gemm.py: DG_JIT_CACHE_DIR default `<VLLM_CACHE_ROOT>/deep_gemm`), and leaves
    the third-party ones at their home-folder defaults: they get the folders SGLang gives them,
    but for TORCHINDUCTOR_CACHE_DIR, which vLLM sets itself inside its compile cache
    (vllm/compilation/compiler_interface.py, initialize_inductor_cache).
    """
    if engine == "sglang":
        return {"SGLANG_CACHE_DIR": JIT_CACHE_MOUNT}
    return {"VLLM_CACHE_ROOT": f"{JIT_CACHE_MOUNT}/vllm", "TRITON_CACHE_DIR": f"{JIT_CACHE_MOUNT}/triton",
            "CUDA_CACHE_PATH": f"{JIT_CACHE_MOUNT}/nv", "TILELANG_CACHE_DIR": f"{JIT_CACHE_MOUNT}/tilelang",
            "FLASHINFER_WORKSPACE_BASE": JIT_CACHE_MOUNT}


def weights_path(spec: StackSpec) -> str:
    return f"{WEIGHTS_MOUNT}/{spec.model.weights.prefix.strip('/')}"


def placement_path(role: str) -> str:
    return f"{PLACEMENT_MOUNT}/{role}.json"


def _rank_prelude(phase: PhaseSpec, gpus_per_node: int) -> list[str]:
    return [
        'NODE_RANK="${LWS_WORKER_INDEX:-0}"',
        'LEADER="${LWS_LEADER_ADDRESS:-127.0.0.1}"',
        f'NNODES="${{LWS_GROUP_SIZE:-{phase.nodes_per_instance(gpus_per_node)}}}"',
    ]


def attention_dp(phase: PhaseSpec) -> int:
    """Attention data-parallel ranks of one instance (1 when attention is tensor-parallel)."""
    return phase.expert_parallel if phase.dp_attention and phase.expert_parallel > 1 else 1


def dense_mlp_fully_data_parallel(spec: StackSpec, phase: PhaseSpec) -> bool:
    """Whether the dense (non-MoE) layers must be replicated per rank instead of split over TP.

    SGLang splits a dense MLP over the whole TP group unless --moe-dense-tp-size 1
    (sglang/srt/models/deepseek_v2.py: parallel_group "replicated" if is_dense_ffn_fully_dp()).
    With block-wise FP8 weights every split must be a whole number of blocks
    (sglang/srt/layers/quantization/fp8_utils.py, validate_fp8_block_shape): DeepSeek-V3's
    18432-wide FFN over TP 64 is 288 columns, not a multiple of 128, so it cannot be split.
    """
    width, tp = spec.model.dense_intermediate_size, phase.expert_parallel
    if not spec.model.num_dense_layers() or width is None or tp == 1 or attention_dp(phase) == 1:
        return False
    block = spec.model.fp8_block_size or 1
    return width % tp != 0 or (width // tp) % block != 0


def sglang_args(spec: StackSpec, role: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """(args, prelude, notes, rank flags) for `python3 -m sglang.launch_server` in one pool.

    Rank flags: flags the prelude adds for some ranks only (none for SGLang), for the flag check.
    """
    phase = spec.deployment.pools()[role]
    dep, eng, hw = spec.deployment, spec.engine, spec.hardware
    ep = phase.expert_parallel
    dp = attention_dp(phase)
    nodes = phase.nodes_per_instance(hw.gpus_per_node)
    notes: list[str] = []
    args = [
        "--model-path", weights_path(spec),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(engine_listen_port(spec, role)),
        "--tp-size", str(ep),
        "--ep-size", str(ep),
        "--mem-fraction-static", str(eng.mem_fraction_static),
        "--context-length", str(spec.model.context_length),
        "--page-size", str(eng.kv_page_size),
        "--enable-metrics",
    ]
    if eng.trust_remote_code:
        args.append("--trust-remote-code")
    if dp > 1:
        # 0.5.23 spells DP attention as its width (--enable-dp-attention is deprecated). The LM
        # head then runs inside each attention-DP group instead of gathering across all ranks.
        args += ["--attn-dp-size", str(dp), "--enable-dp-lm-head"]
    if dense_mlp_fully_data_parallel(spec, phase):
        args += ["--moe-dense-tp-size", "1"]
        notes.append(f"dense layers replicated per rank: {spec.model.dense_intermediate_size} / TP {ep} is not "
                     f"a whole number of {spec.model.fp8_block_size}-wide FP8 blocks")
    if eng.moe_a2a_backend == "deepep" and ep > 1:
        # Throughput kernels for prompts, low-latency kernels (CUDA-graph friendly) for tokens.
        mode = "low_latency" if role == "decode" else "normal"
        args += ["--moe-a2a-backend", "deepep", "--deepep-mode", mode]
        if role == "decode" and dp > 1:
            args.append("--enable-two-batch-overlap")  # overlap one micro-batch's all-to-all with the other's compute
    if role in ("prefill", "decode"):
        args += [
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", eng.kv_transfer,
        ]
        if device_names(spec):
            args += ["--disaggregation-ib-device", ",".join(device_names(spec))]
        if role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    if not dep.cache.prefix_cache:
        args.append("--disable-radix-cache")
    elif runs_prefix_cache(spec, role) and dep.cache.store == "mooncake":
        # Prefix cache spills from GPU to host memory and on to the Mooncake store. Decode keeps
        # none: prefill hands it each request's KV, and SGLang's PD decode mode turns the radix
        # cache off (sglang/srt/arg_groups/pd_disaggregation_hook.py), which HiCache needs.
        args += ["--enable-hierarchical-cache", "--hicache-size", str(phase.host_cache_gib_per_rank),
                 "--hicache-storage-backend", "mooncake"]
    if phase.enable_eplb and ep > 1:
        args.append("--enable-eplb")
        # sglang:eplb_balancedness exists only when reported to Prometheus (default off); EPLB
        # records the expert distribution anyway (srt/arg_groups/parallel_hook.py).
        args += ["--expert-balancedness-report-mode", "prometheus"]
        if phase.redundant_experts:
            args += ["--ep-num-redundant-experts", str(phase.redundant_experts)]
    if phase.expert_placement:
        args += ["--init-expert-location", placement_path(role)]
        notes.append(f"expert placement from {phase.expert_placement} (pdctl eplb)")
    elif phase.enable_eplb and ep > 1:
        notes.append("no placement file: SGLang's own EPLB places redundant experts at runtime")
    if phase.chunked_prefill_tokens_per_rank:
        # SGLang divides --chunked-prefill-size over the attention-DP ranks.
        args += ["--chunked-prefill-size", str(phase.chunked_prefill_tokens_per_rank * dp)]
    if phase.max_running_requests:
        args += ["--max-running-requests", str(phase.max_running_requests)]
        if role == "decode":
            # CUDA graphs for every batch a rank can run: the instance's cap shared over its DP ranks.
            args += ["--cuda-graph-max-bs-decode", str(max(1, phase.max_running_requests // dp))]
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
    return args, prelude, notes, []


def vllm_kv_transfer_config(spec: StackSpec, role: str) -> dict | None:
    """vLLM's --kv-transfer-config: the P-to-D connector, and the shared store where the prefix cache runs.

    vLLM 0.33.0: PD roles are kv_producer (prefill) and kv_consumer (decode). The P-to-D hop is
    NIXL: vLLM serves PD only behind llm-d's endpoint picker, whose routing sidecar drives
    vLLM's NixlConnector (the spec check refuses Mooncake there). The store connector reads the
    JSON file named by MOONCAKE_CONFIG_PATH (vllm/distributed/mooncake_store.py).
    """
    dep = spec.deployment
    connectors = []
    if role in ("prefill", "decode"):
        # The prefill side holds KV for a decode peer this long (nixl/base_scheduler.py, default 30 s).
        connectors.append({"kv_connector": "NixlConnector",
                           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                           "kv_connector_extra_config": {
                               "kv_lease_duration": int(spec.timeouts.prefill_to_decode_kv.timeout_seconds),
                               "backends": nixl_backends(spec)}})
    if runs_prefix_cache(spec, role):
        connectors.append({"kv_connector": VLLM_STORE_CONNECTOR[dep.cache.store], "kv_role": "kv_both"})
    if not connectors:
        return None
    if len(connectors) == 1:
        return connectors[0]
    return {"kv_connector": "MultiConnector", "kv_role": connectors[0]["kv_role"],
            "kv_connector_extra_config": {"connectors": connectors}}


def vllm_args(spec: StackSpec, role: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """(args, prelude, notes, rank flags) for `vllm serve <weights>` in one pool (see sglang_args)."""
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
        "--port", str(engine_listen_port(spec, role)),
        "--tensor-parallel-size", "1",
        "--data-parallel-size", str(ep),
        "--gpu-memory-utilization", str(eng.mem_fraction_static),
        "--max-model-len", str(spec.model.context_length),
        "--block-size", str(eng.kv_page_size),
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
    kv_config = vllm_kv_transfer_config(spec, role)
    if kv_config:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    batched_tokens = phase.chunked_prefill_tokens_per_rank
    if phase.max_running_requests:
        args += ["--max-num-seqs", str(phase.max_running_requests)]
        # A step must fit every running sequence's token: with DeepEP low-latency, EP and DP > 1
        # vLLM defaults the budget to 256 (batched DP MoE), below the cap, and its
        # SchedulerConfig refuses that (vllm/config/scheduler.py).
        batched_tokens = max(batched_tokens or 0, phase.max_running_requests)
    if batched_tokens:
        args += ["--max-num-batched-tokens", str(batched_tokens)]
    args += engine_trace_args(spec, role)
    prelude: list[str] = []
    leader_only = encoder_args(spec)[0] if role in ("prefill", "colocated") else decode_api_servers(local)
    if nodes > 1:
        prelude = _rank_prelude(phase, hw.gpus_per_node) + [f"START_RANK=$((NODE_RANK * {local}))"]
        args += [
            "--data-parallel-size-local", str(local),
            "--data-parallel-address", "${LEADER}",
            "--data-parallel-rpc-port", str(VLLM_DP_RPC_PORT),
        ]
    if nodes > 1 and serves_on_every_node(spec, role):
        # Hybrid LB: each node's API servers front its own ranks (as many as it has, vLLM's default
        # there), so no node carries the whole instance's HTTP (vllm/entrypoints/cli/serve.py:
        # --data-parallel-hybrid-lb with --data-parallel-start-rank; run_headless refuses hybrid LB).
        notes.append("every node serves HTTP for its own ranks (hybrid DP load balancing)")
        args += ["--data-parallel-hybrid-lb", "--data-parallel-start-rank", "${START_RANK}"]
        rank_flags = []
    elif nodes > 1:
        # Workers run headless engines for their ranks. The leader serves HTTP for all ranks
        # (internal load balancing): it must not pass --data-parallel-start-rank, which vLLM
        # reads as hybrid LB, where the leader's API server would reach only its local ranks
        # (vllm/entrypoints/cli/serve.py). --api-server-count is refused with --headless.
        notes.append("workers (NODE_RANK > 0) run headless: only the leader serves HTTP")
        worker_only = ["--headless", "--data-parallel-start-rank", "$START_RANK"]
        worker = " ".join(f'"{w}"' if w.startswith("$") else w for w in worker_only)
        leader = " ".join(map(shlex.quote, leader_only))  # values (the encoder's URL) arrive whole
        prelude.append(f'if [ "$NODE_RANK" -gt 0 ]; then set -- {worker}; else set -- {leader}; fi')
        rank_flags = [*leader_only, *("0" if w.startswith("$") else w for w in worker_only)]
    else:
        args += leader_only
        rank_flags = []
    return args, prelude, notes, rank_flags


def serves_on_every_node(spec: StackSpec, role: str) -> bool:
    """Whether every node of a multi-node instance serves HTTP for its own ranks, not its leader
    for all: vLLM decode (hybrid DP load balancing: the picker spreads requests over every node's
    API servers, as llm-d's wide-EP guide runs it). SGLang's nodes past the first serve no API."""
    return spec.engine.kind == "vllm" and role == "decode"


def decode_api_servers(local_ranks: int) -> list[str]:
    """vLLM decode's API servers: one per DP rank on the leader's node.

    Without --api-server-count vLLM starts one API server per DP rank of the whole instance under
    internal load balancing (vllm/entrypoints/cli/serve.py: "Internal LB: Use full DP size"): 64
    processes on prod's decode leader. llm-d's wide-EP guide runs --data-parallel-hybrid-lb, where
    the count defaults to the node's local DP size and every pod serves HTTP
    (llm-d/llm-d guides/wide-ep-lws/manifests/modelserver/base/decode.yaml), as a multi-node decode
    instance runs here (serves_on_every_node). A single-node one gets the count hybrid LB would give
    its node, explicitly.
    """
    return ["--api-server-count", str(local_ranks)]


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
    """The prefill-to-decode KV hop's settings, where the engine takes them from the environment.

    SGLang 0.5.23 (sglang/srt/environ.py): the prefill side gives up on a decode peer that
    has not bootstrapped the request, and the decode side on KV that has not arrived (which
    includes the prompt's wait and prefill on the prefill side), after these many seconds (both
    default to 300; sglang/srt/disaggregation/common/conn.py suggests 600 where long TTFTs are
    acceptable): the router's attempt at the prefill side, timeouts.router_to_prefill. Its NIXL backend is SGLANG_DISAGGREGATION_NIXL_BACKEND
    (default UCX; sglang/srt/disaggregation/nixl/conn.py), LIBFABRIC on EFA. vLLM's NIXL
    connector takes a lease and its backends in the connector config instead (see
    vllm_kv_transfer_config).
    """
    if role not in ("prefill", "decode") or spec.engine.kind != "sglang":
        return {}
    seconds = str(int(spec.timeouts.router_to_prefill.timeout_seconds))
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": seconds, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": seconds}
    if spec.engine.kv_transfer == "nixl":
        env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] = nixl_backends(spec)[0]
    return env


def pod_ip_env(spec: StackSpec, role: str) -> tuple[str, ...]:
    """Env vars an engine must get its pod's IP in, or it advertises localhost to its peers.

    vLLM 0.33.0's NIXL connector listens for and advertises its handshake side channel on
    VLLM_NIXL_SIDE_CHANNEL_HOST (vllm/envs.py, default "localhost"); llm-d sets it from
    status.podIP (llm-d/llm-d guides/wide-ep-lws/manifests/modelserver/base/decode.yaml).
    """
    if spec.engine.kind == "vllm" and spec.engine.kv_transfer == "nixl" and role in ("prefill", "decode"):
        return ("VLLM_NIXL_SIDE_CHANNEL_HOST",)
    return ()


def routes_through_sidecar(spec: StackSpec, role: str) -> bool:
    """With the endpoint picker, a PD request reaches the decode pod first: llm-d's routing
    sidecar there sends the prompt to the prefill pod the picker chose, then to its own engine
    (llm-d-inference-scheduler v0.7.1, pkg/sidecar/proxy)."""
    return spec.deployment.load_balancer.implementation == "gateway_epp" and role == "decode"


def engine_listen_port(spec: StackSpec, role: str) -> int:
    return SIDECAR_ENGINE_PORT if routes_through_sidecar(spec, role) else ENGINE_PORT[spec.engine.kind]


def engine_launch(spec: StackSpec, role: str) -> EngineLaunch:
    """The full, checked launch of one pool's engine."""
    kind = spec.engine.kind
    phase = spec.deployment.pools()[role]
    args, prelude, notes, rank_flags = (sglang_args if kind == "sglang" else vllm_args)(spec, role)
    entrypoint = ["python3", "-m", "sglang.launch_server"] if kind == "sglang" else ["vllm", "serve"]
    flags = args[1:] if kind == "vllm" else args  # vllm takes the model path first
    flagset(kind).require(flags, f"{role} engine")
    flagset(kind).require(rank_flags, f"{role} engine (per-rank flags)")
    env = kv_hop_env(spec, role)
    ip_env = pod_ip_env(spec, role)
    flagset(kind).require_env([*env, *ip_env], f"{role} engine")
    nodes = phase.nodes_per_instance(spec.hardware.gpus_per_node)
    if kind == "vllm" and nodes > 1 and not serves_on_every_node(spec, role):
        args = [*args, '"$@"']  # --headless on workers, from the prelude
    return EngineLaunch(
        role=role,
        engine=kind,
        version=spec.engine.version,
        entrypoint=entrypoint,
        args=args,
        port=engine_listen_port(spec, role),
        multi_node=nodes > 1,
        nodes=nodes,
        gpus_per_pod=min(phase.gpus_per_instance(), spec.hardware.gpus_per_node),
        notes=notes,
        prelude=prelude,
        env=env,
        pod_ip_env=ip_env,
    )


def all_launches(spec: StackSpec) -> dict[str, EngineLaunch]:
    return {role: engine_launch(spec, role) for role in spec.deployment.pools()}
