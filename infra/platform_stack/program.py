"""The platform stack: cloud, then the catalog's controllers, then what needs their CRDs (the
GatewayClass, Prometheus and Grafana, node classes), then the node layer. Exports what the
serving stacks read through a StackReference."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra.components.engines import uses_multi_node_nvlink
from infra.components.k8s import logical_name
from infra.inputs import InputError, load_yaml_mapping
from infra.planning.capacity import pool_capacity
from infra.platform_stack.catalog import PlatformContext, controller, installed
from infra.platform_stack.cloud import build_cloud
from infra.platform_stack.components.controllers import ControllerInstall
from infra.platform_stack.components.gateway import GatewayPlatform
from infra.platform_stack.components.nodes import StaticNodes
from infra.platform_stack.components.observability import Observability, prometheus_url
from infra.platform_stack.checks import controller_problems, oidc_provider_problems, platform_problems
from infra.platform_stack.spec import PlatformSpec, PlatformSpecError, parse_platform_spec
from infra.platform_stack.taints import gpu_node_taints, tolerations_for
from infra.recording import manifest_of, record
from infra.rollout.preflight import Inventory, load_inventory
from infra.spec import REPO_ROOT, StackSpec
from infra.spec_checks import load_spec

ENVOY_GATEWAY_NAMESPACE = controller("envoy-gateway").namespace


@dataclass
class Hosted:
    spec: StackSpec
    stack: str
    inventory: Inventory | None


def hosted_environments(spec: PlatformSpec) -> list[Hosted]:
    out = []
    for env in spec.environments:
        serving = load_spec(REPO_ROOT / env.spec)
        inventory = load_inventory(REPO_ROOT / env.inventory) if env.inventory else None
        out.append(Hosted(serving, env.stack or serving.environment.name, inventory))
    return out


def committed_platform_specs(exclude: str) -> dict[str, PlatformSpec]:
    """The platform specs in stacks/ (file -> spec), but `exclude`'s own: what rules across
    stacks (one account's one GitHub OIDC provider) are checked against. A file that does not
    read as a platform spec is left to its own stack's preview to refuse."""
    found = {}
    for path in sorted((REPO_ROOT / "stacks").glob("*.yaml")):
        if path.stem == exclude:
            continue
        try:
            data = load_yaml_mapping(path, "spec")
            if data.get("kind") == "platform":
                found[f"stacks/{path.name}"] = parse_platform_spec(data, path)
        except (InputError, PlatformSpecError):
            continue
    return found


def platform_context(spec: PlatformSpec, serving: list[StackSpec]) -> PlatformContext:
    static = any(pool_capacity(s, r).static for s in serving for r in s.deployment.pools())
    reserved = any(s.hardware.capacity_type == "reserved" for s in serving)
    return PlatformContext(
        spec=spec, gpu_tolerations=tuple(tolerations_for(gpu_node_taints(serving))),
        fabrics=frozenset(s.hardware.fabric.kind for s in serving if s.hardware.fabric),
        scalers=frozenset(s.deployment.autoscaling.scaler for s in serving if s.deployment.autoscaling.enabled),
        compute_domains=any(uses_multi_node_nvlink(s, r) for s in serving for r in s.deployment.pools()),
        karpenter_gates={"staticCapacity": static, "reservedCapacity": reserved})


def build_platform(spec: PlatformSpec, hosted: list[Hosted] | None = None) -> dict[str, pulumi.ComponentResource]:
    hosted = hosted_environments(spec) if hosted is None else hosted
    serving = [h.spec for h in hosted]
    ctx = platform_context(spec, serving)
    problems = platform_problems(spec, hosted) + controller_problems(ctx) + oidc_provider_problems(
        spec, committed_platform_specs(exclude=spec.name))
    if problems:
        raise PlatformSpecError(problems)
    cloud = build_cloud(spec, serving)
    k8s_opts = pulumi.ResourceOptions(providers=[cloud.kubernetes] if cloud.kubernetes else None)
    namespaces: dict[str, pulumi.Resource] = {}

    installs: dict[str, ControllerInstall] = {}

    def after(row: str) -> list[pulumi.Resource]:  # a user-installed row is there before the stack runs
        return installs[row].ready() if row in installs else []

    for row in installed(ctx):  # the catalog lists a row after those it comes after
        # after what its pods need and the rows it names, deleted before them
        opts = pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(
            depends_on=cloud.before_controllers + cloud.before_controller.get(row.name, [])
            + [r for name in row.after for r in after(name)]))
        installs[row.name] = ControllerInstall(row, ctx, namespaces, opts, cloud.controller_values.get(row.name))
    layers: dict[str, pulumi.ComponentResource] = dict(installs)

    # The class after the load balancer controller and its webhooks: each Gateway's Service is made
    # for it, and deleted (its NLB with it) while the controller still runs.
    layers["gateway"] = GatewayPlatform("gateway", spec, ENVOY_GATEWAY_NAMESPACE, cloud.gateway_service_annotations,
                                        after("envoy-gateway") + after("aws-load-balancer-controller"), k8s_opts)
    layers["observability"] = Observability("observability", spec, after("prometheus-operator"), k8s_opts)
    node_classes = [m for hook in cloud.after_controllers for m in hook(installs)]
    if spec.nodes.mode == "static":
        layers["nodes"] = StaticNodes("nodes", [(h.spec, h.inventory) for h in hosted if h.inventory], k8s_opts)
    if cloud.kubeconfig is not None:  # an existing cluster has none: its serving stacks use their own context
        pulumi.export("kubeconfig", pulumi.Output.secret(cloud.kubeconfig))
    pulumi.export("cluster_name", cloud.cluster_name)
    pulumi.export("gateway_class", spec.gateway_class)
    pulumi.export("prometheus_url", prometheus_url(spec))
    pulumi.export("node_classes", sorted(m["metadata"]["name"] for m in node_classes))
    pulumi.export("nodes_mode", spec.nodes.mode)
    for key, value in cloud.exports.items():
        pulumi.export(key, value)
    return layers


def platform_objects(spec: PlatformSpec, hosted: list[Hosted] | None = None) -> list[dict]:
    """The Kubernetes objects the platform stack registers itself (CRDs, namespaces, the
    GatewayClass, Prometheus, Grafana, node classes, node patches), for a given spec: what the
    cluster twin applies before the charts (each row's chart and values: CATALOG, row.values)."""
    run = record(lambda: build_platform(spec, hosted), stack=spec.name)
    return [m for m in (manifest_of(r) for r in run.custom()) if m]


def unique_names(objects: list[dict]) -> bool:
    names = [logical_name(o) for o in objects]
    return len(names) == len(set(names))


def expected_outputs(spec: PlatformSpec) -> dict:
    """The outputs the platform stack exports, as far as they are known before it runs (names
    from the spec; ARNs and the kubeconfig as placeholders): what the offline run of a serving
    stack reads through its StackReference."""
    out = {"cluster_name": spec.cloud.cluster.name if spec.cloud.provider == "aws" else spec.name,
           "gateway_class": spec.gateway_class, "prometheus_url": prometheus_url(spec),
           "nodes_mode": spec.nodes.mode}
    if spec.cloud.provider == "aws":
        name = spec.cloud.cluster.name
        out.update({"kubeconfig": "{}", "weights_role_arn": f"arn:aws:iam::000000000000:role/{name}-weights-reader",
                    "weights_bucket": spec.cloud.buckets.weights,
                    "release_store_bucket": spec.cloud.buckets.release_store,
                    "weights_access": spec.cloud.weights_access})
    return out
