"""Load balancing layer: the encoder, prefill/decode router, and expert balancers.

- Encoder: input pre-processing, inside the engines or a dedicated encoder pool.
- Prefill and Decode: one router (sglang-router in PD mode, or the inference extension's
  endpoint picker behind an InferencePool) meant to pick by live load and prefix affinity (the
  pinned sglang-router in PD mode picks at random: infra/render/router_config.py says why).
- Expert: the redundant-expert placement files the engines load at start.
"""

from __future__ import annotations

import pulumi

from infra import naming
from infra.components.engines import EXPERT_PLACEMENT_CONFIGMAP, placement_files
from infra.components.k8s import Layer, LayerContext, config_hash, disruption_budget
from infra.components.placement import gpu_scheduling
from infra.components.storage import engine_cache_mounts, weights_init_container, weights_volumes
from infra.render import rbac
from infra.render.engine_args import ENGINE_PORT, encoder_args, encoder_launch, launch_script
from infra.render.probes import encoder_probes
from infra.render.router_config import RouterLaunch, router_launch
from infra.spec import image_platforms

ROUTER_LABELS = {"app.kubernetes.io/name": naming.ROUTER}
RBAC_COMPONENT = {"sglang_router": "sglang_router", "gateway_epp": "endpoint_picker"}


def router_rbac(ctx: LayerContext, launch: RouterLaunch) -> list[dict]:
    """The router's account may do what its program, started with these flags, asks of the API
    server, and nothing else (infra/render/rbac.py: derived from the pinned source). Every need
    pdstack renders is namespaced: the router discovers pods in its own namespace, and the
    picker runs without metrics authentication (infra/render/router_config.py says why)."""
    needs = rbac.needs_for(RBAC_COMPONENT[launch.implementation], launch.args)
    cluster = [n for n in needs if n.scope != "namespace"]
    if cluster:
        raise AssertionError(f"{launch.implementation}: cluster-wide needs {cluster}; render them namespaced")
    meta = ctx.metadata(naming.ROUTER, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": rbac.rules(needs, "namespace")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": naming.ROUTER},
         "subjects": [{"kind": "ServiceAccount", "name": naming.ROUTER, "namespace": ctx.namespace}]},
    ]


def router_probes(launch: RouterLaunch) -> dict:
    """The picker answers gRPC health on its own port ("readiness": synced, and the leader when
    replicas elect one); the SGLang router is probed on its serving port."""
    if launch.health_port is None:
        return {"readinessProbe": {"tcpSocket": {"port": launch.port}, "periodSeconds": 5}}
    return {"readinessProbe": {"grpc": {"port": launch.health_port, "service": "readiness"}, "periodSeconds": 2},
            "livenessProbe": {"grpc": {"port": launch.health_port, "service": "liveness"},
                              "initialDelaySeconds": 5, "periodSeconds": 10}}


def architecture_pin(spec, image: str) -> dict:
    """A CPU pod whose image digest runs on one architecture only (images.platforms) is kept to
    nodes of it (kubernetes.io/arch, set by the kubelet): elsewhere it would not start."""
    platforms = image_platforms(spec, image)
    return {"nodeSelector": {"kubernetes.io/arch": platforms[0]}} if platforms and len(platforms) == 1 else {}


def router_deployment(ctx: LayerContext, launch: RouterLaunch, reads: dict[str, str] | None = None) -> dict:
    """`reads`: the data of the router's launch ConfigMap (its digest goes on the pod template)."""
    spec = ctx.spec
    mounts = [{"name": "launch", "mountPath": "/etc/pdstack/launch", "readOnly": True}]
    if launch.files:
        mounts.append({"name": "epp-config", "mountPath": "/etc/epp", "readOnly": True})
    if launch.model_folder:
        mounts.append({"name": "model-folder", "mountPath": launch.model_folder, "readOnly": True})
    container = {
        "name": naming.ROUTER,
        # The SGLang router, or the endpoint picker: two programs, two images.
        "image": spec.images.router if launch.implementation == "sglang_router" else spec.images.endpoint_picker,
        "ports": [{"name": "http", "containerPort": launch.port}, {"name": "metrics", "containerPort": launch.metrics_port}],
        "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"cpu": "8", "memory": "16Gi"}},
        "volumeMounts": mounts,
        **router_probes(launch),
    }
    if launch.implementation == "sglang_router":
        container["command"] = ["/bin/sh", "/etc/pdstack/launch/launch.sh"]
    else:
        container["command"] = launch.entrypoint
        container["args"] = launch.args
    volumes = [{"name": "launch", "configMap": {"name": f"{naming.ROUTER}-launch", "defaultMode": 0o555}}]
    if launch.model_folder:
        volumes.append({"name": "model-folder", "emptyDir": {}})
    if launch.files:
        volumes.append({"name": "epp-config", "configMap": {"name": f"{naming.ROUTER}-launch", "items": [{"key": "config.yaml", "path": "config.yaml"}]}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(naming.ROUTER, "router", **ROUTER_LABELS),
        "spec": {
            "replicas": spec.deployment.load_balancer.replicas,
            # A stand-by cannot become Ready while the old leader holds the lease: a rolling
            # update would wait forever for it, so an elected router is replaced whole.
            **({"strategy": {"type": "Recreate"}} if launch.leader_elected else {}),
            "selector": {"matchLabels": ROUTER_LABELS},
            "template": {
                "metadata": {"labels": ctx.pod_labels(**ROUTER_LABELS),
                             "annotations": {naming.CONFIG_HASH_ANNOTATION: config_hash(reads or {})}},
                "spec": {"serviceAccountName": naming.ROUTER, **architecture_pin(spec, container["image"]),
                         "containers": [container], "volumes": volumes},
            },
        },
    }


def inference_pool(ctx: LayerContext, launch: RouterLaunch) -> dict:
    port = ENGINE_PORT[ctx.spec.engine.kind]
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": ctx.metadata(naming.INFERENCE_POOL, "router"),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/part-of": "pdstack", naming.SERVES_API_LABEL: "true"}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": naming.ROUTER, "port": {"number": launch.port}},
        },
    }


def encoder_manifests(ctx: LayerContext) -> list[dict]:
    """Dedicated encoder pool on prefill nodes; prefill calls it through its Service."""
    spec, launch = ctx.spec, encoder_launch(ctx.spec)
    labels = {"app.kubernetes.io/name": naming.ENCODER}
    meta = ctx.metadata(naming.ENCODER, "encoder", **labels)
    store_mounts, cache_env = engine_cache_mounts(spec)
    container = {
        "name": naming.ENCODER, "image": spec.engine_image().image,
        "command": [*launch.entrypoint, *launch.args],
        "env": [{"name": k, "value": v} for k, v in sorted(cache_env.items())],
        "ports": [{"name": "http", "containerPort": launch.port}],
        "resources": {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
                      "limits": {"memory": "128Gi", "nvidia.com/gpu": "1"}},
        "volumeMounts": store_mounts,
        **encoder_probes(spec, launch.port),
    }
    pod = {"serviceAccountName": "engine", **gpu_scheduling(ctx.spec, "prefill", lws_group=False),
           "initContainers": [weights_init_container(spec)], "containers": [container], "volumes": weights_volumes(spec)}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
            "replicas": spec.deployment.load_balancer.encoder.workers or 4,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": ctx.pod_labels(**labels, **{naming.ROLE_LABEL: "prefill"})}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"selector": labels, "ports": [{"name": "http", "port": launch.port, "targetPort": launch.port}]}},
        disruption_budget(ctx, naming.ENCODER, "encoder", labels, max_unavailable=1),
    ]


class Balancers(Layer):
    layer = "balancers"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        launch = self.router = router_launch(ctx.spec)
        _, encoder_summary = encoder_args(ctx.spec)
        for manifest in router_rbac(ctx, launch):
            self.add(manifest)
        script = launch_script(f"{launch.implementation} router", [*launch.entrypoint, *launch.args], notes=launch.notes)
        router_data = {"launch.sh": script, **launch.files,
                       "balancers.txt": f"encoder: {encoder_summary}\nrouter: {launch.implementation}, "
                                        f"strategy {ctx.spec.deployment.load_balancer.strategy}\n"}
        self.add({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": ctx.metadata(f"{naming.ROUTER}-launch", "router"),
            "data": router_data,
        })
        self.deployment = self.add(router_deployment(ctx, launch, router_data))
        # Drains take one router at a time; with one replica (dev) that is a short outage.
        self.add(disruption_budget(ctx, naming.ROUTER, "router", ROUTER_LABELS, max_unavailable=1))
        self.service = self.add({
            "apiVersion": "v1", "kind": "Service",
            "metadata": ctx.metadata(naming.ROUTER, "router", **ROUTER_LABELS),
            "spec": {"selector": ROUTER_LABELS, "ports": [
                {"name": "http", "port": launch.port, "targetPort": launch.port},
                {"name": "metrics", "port": launch.metrics_port, "targetPort": launch.metrics_port},
            ]},
        })
        if launch.implementation == "gateway_epp":
            self.add(inference_pool(ctx, launch))
        if ctx.spec.deployment.load_balancer.encoder.mode == "dedicated":
            for manifest in encoder_manifests(ctx):
                self.add(manifest)
        placements = placement_files(ctx)
        if placements:
            self.add({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": ctx.metadata(EXPERT_PLACEMENT_CONFIGMAP, "expert-balancer"), "data": placements})
        self.register_outputs({"router": naming.service_dns(naming.ROUTER, ctx.namespace)})
