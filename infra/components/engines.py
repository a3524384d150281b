"""Execution layer: the engine pools. Each instance is one LeaderWorkerSet group.

A pool (prefill, decode, or the one colocated pool) is a LeaderWorkerSet whose replicas
are instances and whose group size is the nodes one instance spans. The group leader
serves HTTP (vLLM decode: every node, for its own ranks); routers find the pods that serve by
label (naming.SERVES_API_LABEL) through the Kubernetes API, and a Service over them
(`engine-<role>-http`) gives operators a stable name. LWS owns `engine-<role>`.
"""

from __future__ import annotations

import pulumi

from infra import naming
from infra.components.k8s import Layer, LayerContext, config_hash, disruption_budget
from infra.components.placement import gpu_scheduling
from infra.planning.capacity import domain_placement, pool_capacity
from infra.components.storage import engine_cache_mounts, weights_init_container, weights_volumes
from infra.render.engine_args import (
    BOOTSTRAP_PORT, ENGINE_PORT, PLACEMENT_MOUNT, EngineLaunch, all_launches, routes_through_sidecar,
    serves_on_every_node)
from infra.render.fabric import fabric_env, fabric_resources
from infra.render.kvcache_config import KVCACHE_CONFIG_MOUNT, KVCachePlan
from infra.render.probes import engine_probes
from infra.render.router_config import routing_sidecar_container
from infra.spec import REPO_ROOT, StackSpec, pod_memory_gib

ENGINE_SERVICE_ACCOUNT = "engine"
ENGINE_PORT_NAME = "engine"  # the engine's own HTTP port (and /metrics), behind a sidecar or not
IMEX_CLAIM = "imex-channel"
EXPERT_PLACEMENT_CONFIGMAP = "expert-placement"
LAUNCH_MOUNT = "/etc/pdstack/launch"


def compute_domain_name(role: str) -> str:
    return f"{naming.engine(role)}-nvlink"


def imex_channel_template(role: str) -> str:
    """The ResourceClaimTemplate the ComputeDomain's controller creates for its channel."""
    return f"{naming.engine(role)}-imex-channel"


def uses_multi_node_nvlink(spec: StackSpec, role: str) -> bool:
    """Groups placed inside an NVLink domain talk over multi-node NVLink between their nodes."""
    return domain_placement(spec, role) != "none"


def compute_domain_manifest(ctx: LayerContext, role: str) -> dict:
    """An IMEX domain for one pool's groups (NVIDIA/k8s-dra-driver-gpu v25.12.0,
    api/nvidia.com/resource/v1beta1/computedomain.go). Cross-node NVLink memory (NCCL's MNNVL,
    NVSHMEM inside the rack) needs an IMEX channel in every pod; the driver's controller makes
    the claim template named here and starts IMEX daemons on the nodes the pods land on.
    numNodes 0: with IMEXDaemonsWithDNSNames (on by default in v25.12) it gates nothing and is
    only a status hint, and the spec is immutable, so a fixed count would break scaling."""
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": ctx.metadata(compute_domain_name(role), "engine", **{naming.ROLE_LABEL: role}),
        "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": imex_channel_template(role)}}},
    }


def pod_labels(spec: StackSpec, role: str, base: dict[str, str]) -> dict[str, str]:
    labels = {**base, naming.ROLE_LABEL: role, "app.kubernetes.io/name": naming.engine(role)}
    if spec.deployment.load_balancer.implementation == "gateway_epp" and role != "colocated":
        labels["llm-d.ai/role"] = role  # what the endpoint picker's prefill/decode filters read
    return labels


def serves_api(spec: StackSpec, role: str, leader: bool) -> bool:
    """Whether a pool's pod serves the engine's HTTP API: a group's leader, or any node of a pool
    whose nodes each serve their own ranks."""
    return leader or serves_on_every_node(spec, role)


def engine_pod_spec(spec: StackSpec, launch: EngineLaunch, kv: KVCachePlan, leader: bool) -> dict:
    role = launch.role
    phase = spec.deployment.pools()[role]
    memory = pod_memory_gib(spec, role)
    store_mounts, cache_env = engine_cache_mounts(spec)
    mounts = [
        *store_mounts,
        {"name": "launch", "mountPath": LAUNCH_MOUNT, "readOnly": True},
        {"name": "kvcache-config", "mountPath": KVCACHE_CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes = [
        *weights_volumes(spec),
        {"name": "launch", "configMap": {"name": f"{naming.engine(role)}-launch", "defaultMode": 0o555}},
        {"name": "kvcache-config", "configMap": {"name": "kvcache-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{memory['/dev/shm']}Gi"}},
    ]
    if spec.deployment.cache.disk_path:
        mounts.append({"name": "prefix-cache-disk", "mountPath": spec.deployment.cache.disk_path})
        volumes.append({"name": "prefix-cache-disk",
                        "hostPath": {"path": spec.deployment.cache.disk_path, "type": "DirectoryOrCreate"}})
    if phase.expert_placement:
        mounts.append({"name": "expert-placement", "mountPath": PLACEMENT_MOUNT, "readOnly": True})
        volumes.append({"name": "expert-placement", "configMap": {"name": EXPERT_PLACEMENT_CONFIGMAP}})
    devices = {"nvidia.com/gpu": str(launch.gpus_per_pod), **fabric_resources(spec, launch.gpus_per_pod)}
    container = {
        "name": "engine",
        "image": spec.engine_image().image,
        "command": ["/bin/sh", f"{LAUNCH_MOUNT}/launch.sh"],
        "env": [{"name": k, "value": v}
                for k, v in sorted({**cache_env, **fabric_env(spec), **kv.engine_env, **launch.env}.items())]
               + [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                  for k in sorted({*launch.pod_ip_env, *kv.pod_ip_env})],
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": launch.port}],
        # Memory holds the engine processes, /dev/shm (memory-backed, so it counts), and the larger
        # of the weights being loaded and the host cache tier plus the store segments each rank
        # lends (infra/spec/, pod_memory_gib).
        "resources": {
            "requests": {"cpu": "32", "memory": f"{memory['total']}Gi", **devices},
            "limits": {"memory": f"{memory['limit']}Gi", **devices},
        },
        "volumeMounts": mounts,
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},  # RDMA memory registration
    }
    claims = []
    if uses_multi_node_nvlink(spec, role):
        claims = [{"name": IMEX_CLAIM, "resourceClaimTemplateName": imex_channel_template(role)}]
        container["resources"]["claims"] = [{"name": IMEX_CLAIM}]
    drain = spec.deployment.autoscaling.drain_seconds
    container["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", f"sleep {drain}"]}}}
    serves = serves_api(spec, role, leader)
    if serves:  # the pods that serve HTTP (infra/render/probes.py)
        container.update(engine_probes(spec, launch.port, role))
    init_containers = [weights_init_container(spec, role)]
    if serves and routes_through_sidecar(spec, role):
        init_containers.append(routing_sidecar_container(spec))
    return {
        "serviceAccountName": ENGINE_SERVICE_ACCOUNT,
        **gpu_scheduling(spec, role),
        "initContainers": init_containers,
        "containers": [container],
        **({"resourceClaims": claims} if claims else {}),
        "volumes": volumes,
        # A stopping pod leaves the Services (so routers stop picking it) and then keeps
        # serving what it has for drain_seconds before the engine gets SIGTERM.
        "terminationGracePeriodSeconds": drain + 60,
    }


def placement_files(ctx: LayerContext) -> dict[str, str]:
    """The expert placements the engines load at start (the Expert balancer's ConfigMap)."""
    files = {}
    for role, phase in ctx.spec.deployment.pools().items():
        if phase.expert_placement:
            files[f"{role}.json"] = (REPO_ROOT / phase.expert_placement).read_text()
    return files


def lws_manifest(ctx: LayerContext, launch: EngineLaunch, kv: KVCachePlan, reads: tuple[dict, ...] = ()) -> dict:
    """`reads`: the data of the ConfigMaps the pods read at start (their digest goes on the template)."""
    spec, role = ctx.spec, launch.role
    phase = spec.deployment.pools()[role]
    pod_annotations = {naming.CONFIG_HASH_ANNOTATION: config_hash(*reads)}
    if spec.engine.kind == "sglang" and role == "prefill":
        pod_annotations["sglang.ai/bootstrap-port"] = str(BOOTSTRAP_PORT)
    labels = pod_labels(spec, role, ctx.pod_labels())

    def template(leader: bool) -> dict:
        serving = {naming.SERVES_API_LABEL: "true"} if serves_api(spec, role, leader) else {}
        return {"metadata": {"labels": {**labels, **serving}, "annotations": pod_annotations},
                "spec": engine_pod_spec(spec, launch, kv, leader)}

    meta = ctx.metadata(naming.engine(role), "engine", **{naming.ROLE_LABEL: role})
    group = {"size": launch.nodes, "workerTemplate": template(leader=launch.nodes == 1)}
    if launch.nodes > 1:
        group = {"size": launch.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                 "leaderTemplate": template(leader=True), "workerTemplate": template(leader=False)}
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": meta,
        "spec": {
            "replicas": phase.instances,
            "startupPolicy": "LeaderCreated",
            # Replace whole groups inside the capacity the pool reserves (infra/planning/capacity.py).
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": pool_capacity(spec, role).rollout()},
            "leaderWorkerTemplate": group,
        },
    }


class Engines(Layer):
    layer = "engines"

    def __init__(self, name: str, ctx: LayerContext, kv: KVCachePlan, opts: pulumi.ResourceOptions | None = None,
                 service_account_annotations: dict | None = None):
        """`service_account_annotations`: what the platform link puts on the engine service
        account (IRSA's role), there from the account's first version (infra/components/platform_links.py)."""
        super().__init__(name, ctx, opts)
        self.launches = all_launches(ctx.spec)
        metadata = ctx.metadata(ENGINE_SERVICE_ACCOUNT, "engine")
        if service_account_annotations:
            metadata["annotations"] = dict(service_account_annotations)
        self.service_account = self.add({
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata,
            "automountServiceAccountToken": False,  # engines never call the API server
        })
        self.groups, self.services = {}, {}
        placements = placement_files(ctx)
        for role, launch in self.launches.items():
            launch_data = {"launch.sh": launch.script()}
            script = self.add({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": ctx.metadata(f"{naming.engine(role)}-launch", "engine", **{naming.ROLE_LABEL: role}),
                "data": launch_data,
            })
            # With autoscaling on, the scaler owns the group count after the first apply.
            scaled = ["spec.replicas"] if ctx.spec.deployment.autoscaling.enabled else None
            needs = [script]
            if uses_multi_node_nvlink(ctx.spec, role):
                needs.append(self.add(compute_domain_manifest(ctx, role)))
            self.groups[role] = self.add(lws_manifest(ctx, launch, kv, (launch_data, kv.files, placements)),
                                         depends_on=needs, ignore_changes=scaled)
            # Not named after the LWS: LWS creates a headless Service of that name if none exists
            # (selecting the whole group, publishing not-ready addresses), and workers resolve
            # their leader through it before anything is Ready (kubernetes-sigs/lws v0.10.0,
            # pkg/utils/controller/controller_utils.go CreateHeadlessServiceIfNotExists).
            self.services[role] = self.add({
                "apiVersion": "v1", "kind": "Service",
                "metadata": ctx.metadata(naming.engine_http(role), "engine", **{naming.ROLE_LABEL: role}),
                "spec": {
                    "clusterIP": "None",
                    "selector": {naming.ROLE_LABEL: role, naming.SERVES_API_LABEL: "true"},
                    "ports": [{"name": "http", "port": ENGINE_PORT[ctx.spec.engine.kind],
                               "targetPort": ENGINE_PORT[ctx.spec.engine.kind]}],
                },
            })
            # A multi-node group dies with any of its pods: allow no voluntary eviction, so a
            # drain must replace whole groups through a rollout.
            self.add(disruption_budget(
                ctx, naming.engine(role), "engine",
                {naming.ROLE_LABEL: role, "app.kubernetes.io/name": naming.engine(role)},
                max_unavailable=0 if launch.multi_node else 1, **{naming.ROLE_LABEL: role}))
        self.register_outputs({})
