"""Spec to the KV cache layer: the distributed store and what engines need to reach it. Pure.

- `mooncake`: one Mooncake master (object metadata and eviction). Transfer engines find each
  other by Mooncake's P2P handshake (MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE), as Mooncake's
  Kubernetes guide deploys it (kvcache-ai/Mooncake docs/source/deployment/kubernetes-deployment-
  guide/mooncake-on-kubernetes.md): no metadata service to run, and each client registers under
  its pod IP (MOONCAKE_LOCAL_HOSTNAME; SGLang's default is "localhost", which no peer can reach).
  The master is a single replica without HA: Mooncake's HA mode (mooncake-transfer-engine
  0.3.13.post1, `mooncake_master --enable_ha --ha_backend_type=etcd|redis|k8s`, etcd by default
  with --etcd_endpoints) elects its leader through a backend pdstack does not run. The master holds only the store's metadata (which
  object lives in which client's segment, leases, the mounted segments): a restart loses all of
  it, so every cached object is a miss (the bytes stay in the engines' segments, unreachable) and
  the prefix cache is recomputed and written again. Engines keep serving: each store client's ping
  thread (store.so, Client::PingThreadMain) finds the master gone, reconnects to the same address
  and remounts its segments. tests/test_kvcache_master.py runs the rendered master with the
  wheel's binary. SGLang's HiCache reads the MOONCAKE_* variables
  (sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py, load_from_env); vLLM's
  MooncakeStoreConnector reads only the JSON file MOONCAKE_CONFIG_PATH names
  (vllm/distributed/mooncake_store.py), which this layer renders into its ConfigMap, and
  registers under the address vLLM detects (get_ip).
  Every rank process that runs the prefix cache lends its own segment of host memory, so
  the spec's capacity is split over those ranks (infra/spec/, store_segment_gib_per_rank).
  SGLang 0.5.23 divides MOONCAKE_GLOBAL_SEGMENT_SIZE by the storage config's tp_size x pp_size
  (mooncake_store.py, rank_scale_factor), and that tp_size is the attention-TP size under DP
  attention (sglang/srt/managers/cache_controller.py, _generate_storage_config): the value
  rendered is the per-rank segment times that divisor, so each rank lends what the pod's memory
  budget counts. vLLM lends the file's global_segment_size per rank as it is.
- `lmcache`: an LMCache server as the shared tier, with an LMCache config file for vLLM.
  SGLang 0.5.23 has no LMCache backend; the spec check says so.

No KV transfer bandwidth quota: EFA and RDMA traffic bypasses the kernel, so the CNI's
`kubernetes.io/egress-bandwidth` shaper never sees it, and none of the transfer paths has a rate
limit at the pinned versions (SGLang 0.5.23's Mooncake and NIXL settings in sglang/srt/environ.py,
vLLM 0.33.0's NixlConnector config). pdstack used to render the annotation and claim a quota; it
renders none now (README, "Not verified here").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import json

import yaml

from infra import naming
from infra.render.fabric import device_names, mooncake_protocol
from infra.render.engine_args import attention_dp
from infra.spec import StackSpec, runs_prefix_cache, store_ranks, store_segment_gib_per_rank

MOONCAKE_RPC_PORT = 50051
MOONCAKE_HANDSHAKE = "P2PHANDSHAKE"
MOONCAKE_METRICS_PORT = 9003
LMCACHE_PORT = 65432
KVCACHE_CONFIG_MOUNT = "/etc/pdstack/kvcache"
LMCACHE_CONFIG_PATH = f"{KVCACHE_CONFIG_MOUNT}/lmcache.yaml"
MOONCAKE_CONFIG_PATH = f"{KVCACHE_CONFIG_MOUNT}/mooncake.json"
MOONCAKE_LOCAL_BUFFER_GIB = 4


@dataclass(frozen=True)
class KVCachePlan:
    store: str
    server_name: str
    image: str
    command: list[str]
    ports: dict[str, int]
    engine_env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    pod_ip_env: tuple[str, ...] = ()  # engine env vars set to the pod's IP (downward API)
    notes: list[str] = field(default_factory=list)


def sglang_segment_divisor(spec: StackSpec) -> int:
    """What SGLang divides MOONCAKE_GLOBAL_SEGMENT_SIZE by in each rank of the pool that runs the
    store: its attention-TP size (TP / attention DP) times PP (1: pdstack renders no PP)."""
    (phase,) = [p for r, p in spec.deployment.pools().items() if runs_prefix_cache(spec, r)] or [None]
    return 1 if phase is None else phase.expert_parallel // attention_dp(phase)


def kv_cache_plan(spec: StackSpec) -> KVCachePlan:
    cache, ns = spec.deployment.cache, spec.environment.namespace
    policy = f"eviction {cache.eviction_policy}, capacity {cache.capacity_gib} GiB, prefix cache {'on' if cache.prefix_cache else 'off'}"
    if cache.store == "mooncake":
        host = naming.service_dns(naming.MOONCAKE_MASTER, ns)
        segment_gib = store_segment_gib_per_rank(spec)
        master = f"{host}:{MOONCAKE_RPC_PORT}"
        pod_ip_env: tuple[str, ...] = ()
        if spec.engine.kind == "sglang":
            engine_env = {
                "MOONCAKE_MASTER": master,
                "MOONCAKE_TE_META_DATA_SERVER": MOONCAKE_HANDSHAKE,
                "MOONCAKE_PROTOCOL": mooncake_protocol(spec),
                "MOONCAKE_DEVICE": ",".join(device_names(spec)),
                "MOONCAKE_GLOBAL_SEGMENT_SIZE": f"{segment_gib * sglang_segment_divisor(spec)}gb",
            }
            pod_ip_env = ("MOONCAKE_LOCAL_HOSTNAME",)
            files = {}
        else:
            engine_env = {"MOONCAKE_CONFIG_PATH": MOONCAKE_CONFIG_PATH}
            files = {"mooncake.json": json.dumps({
                "metadata_server": MOONCAKE_HANDSHAKE,
                "master_server_address": master,
                "protocol": mooncake_protocol(spec),
                "device_name": ",".join(device_names(spec)),
                "global_segment_size": f"{segment_gib}GB",
                "local_buffer_size": f"{MOONCAKE_LOCAL_BUFFER_GIB}GB",
            }, indent=1, sort_keys=True) + "\n"}
        return KVCachePlan(
            store="mooncake",
            server_name=naming.MOONCAKE_MASTER,
            image=spec.images.mooncake_master,
            command=[
                "mooncake_master",
                f"--rpc_port={MOONCAKE_RPC_PORT}",  # --port is deprecated (its --helpfull)
                f"--metrics_port={MOONCAKE_METRICS_PORT}",
                # LRU eviction starts at 95% full and frees 5% at a time.
                "--eviction_high_watermark_ratio=0.95",
                "--eviction_ratio=0.05",
            ],
            ports={"rpc": MOONCAKE_RPC_PORT, "metrics": MOONCAKE_METRICS_PORT},
            engine_env=engine_env,
            pod_ip_env=pod_ip_env,
            files=files,
            notes=[policy, f"{segment_gib} GiB of host memory lent to the store by each of {store_ranks(spec)} "
                           "prefix-cache ranks", "one master, no HA: a restart empties the store (a cache)"],
        )
    host = naming.service_dns(naming.LMCACHE_SERVER, ns)
    config = {
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": store_segment_gib_per_rank(spec),
        "remote_url": f"lm://{host}:{LMCACHE_PORT}",
        "remote_serde": "naive",
        "cache_policy": cache.eviction_policy.upper(),
        "save_unfull_chunk": False,
    }
    if cache.disk_path:
        config.update(local_disk=f"file://{cache.disk_path.rstrip('/')}/", max_local_disk_size=cache.disk_gib)
    return KVCachePlan(
        store="lmcache",
        server_name=naming.LMCACHE_SERVER,
        image=spec.images.lmcache_server,
        command=["lmcache_server", "0.0.0.0", str(LMCACHE_PORT)],
        ports={"rpc": LMCACHE_PORT},
        engine_env={"LMCACHE_CONFIG_FILE": LMCACHE_CONFIG_PATH},
        files={"lmcache.yaml": yaml.safe_dump(config, sort_keys=True)},
        notes=[policy],
    )
