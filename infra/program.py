"""The Pulumi program: build_stack(spec) wires the layers together, top of the stack last.

`stacks/__main__.py` (what Pulumi.yaml runs) calls `main()`, and so does the offline
preview under Pulumi's mocks: one program, two ways to run it.
"""

from __future__ import annotations

import pulumi

from infra.components.access import Access, Backend, TrackAccess
from infra.components.autoscaling import Autoscaling
from infra.components.balancers import Balancers
from infra.components.engines import Engines
from infra.components.foundation import Foundation
from infra.components.k8s import Layer, LayerContext, yaml_render_directory
from infra.components.kvcache import KVCache
from infra.components.monitoring import Monitoring
from infra.components.nodepools import NodePools
from infra.components.platform_links import PlatformLinks
from infra.components.storage import Storage
from infra.components.tracing import Tracing
from infra.images import placeholder_lines
from infra.rollout.releases import ReleaseStore, store_for
from infra.spec import REPO_ROOT, StackSpec, stack_spec_path
from infra.spec_checks import load_spec
from infra.tracks import Track, plan_tracks


def after(*deps: pulumi.Resource) -> pulumi.ResourceOptions:
    return pulumi.ResourceOptions(depends_on=list(deps))


def platform_link(spec: StackSpec) -> tuple[pulumi.StackReference | None, pulumi.ProviderResource | None, str]:
    """The platform stack this environment runs on: its outputs, a provider for its cluster, and
    how it makes GPU nodes (karpenter: this stack's NodePools; node-groups, static: the platform's)."""
    if spec.platform is None:
        return None, None, "karpenter"
    import pulumi_kubernetes as k8s

    from infra.platform_stack.spec import load_platform_spec

    platform_spec = load_platform_spec(REPO_ROOT / spec.platform.spec)
    mode = platform_spec.nodes.mode
    ref = pulumi.StackReference(spec.platform.stack)
    # Which cluster comes from the platform stack, unless the stack's own
    # `kubernetes:renderYamlToDirectory` says to write each object as YAML instead of sending it
    # (the provider takes no kubeconfig then), as it does for the default provider.
    render_to = yaml_render_directory()
    if render_to:
        # kubeconfig="": the SDK would otherwise take $KUBECONFIG, which the provider refuses here.
        provider = k8s.Provider("platform-cluster", render_yaml_to_directory=render_to, kubeconfig="")
    elif platform_spec.cloud.provider == "aws":
        provider = k8s.Provider("platform-cluster", kubeconfig=ref.require_output("kubeconfig"))
    else:
        # An existing cluster: the platform stack made no kubeconfig and exports none. This stack
        # reaches the cluster as pdctl's kubectl does (infra/rollout/pulumi_cluster.py
        # kube_target): through its own `kubernetes:context`, and `kubernetes:kubeconfig` if set.
        kube = pulumi.Config("kubernetes")
        provider = k8s.Provider("platform-cluster", context=kube.get("context"), kubeconfig=kube.get("kubeconfig"))
    return ref, provider, mode


def serving_layers(ctx: LayerContext, name: str, nodepools: NodePools | None,
                   platform: pulumi.StackReference | None = None,
                   environment_namespace: str | None = None) -> dict[str, Layer]:
    """Everything one namespace runs to serve requests: the environment's, or a release track's
    (`environment_namespace` then names the environment's, whose user-provided objects it copies)."""
    foundation = Foundation(f"{name}-foundation", ctx)
    storage = Storage(f"{name}-storage", ctx, after(foundation), credentials_from=environment_namespace)
    kvcache = KVCache(f"{name}-kvcache", ctx, after(foundation))
    # The weights role, linked with the namespace and before any engine pod is admitted.
    identity = PlatformLinks(f"{name}-identity", ctx, platform, ctx.spec.environment.name, after(foundation)) \
        if platform is not None else None
    # The engines wait for what their pods read (the weights fetcher and its credentials, the KV
    # cache's config), not for the whole KV cache layer: its store comes up after them
    # (infra/rollout/steps.py), and the real engine refuses a targeted step whose dependency is
    # neither deployed nor targeted.
    engines = Engines(f"{name}-engines", ctx, kvcache.plan,
                      after(*[r for r in (nodepools, storage, kvcache.config, identity) if r]),
                      service_account_annotations=identity.service_account_annotations if identity else None)
    balancers = Balancers(f"{name}-balancers", ctx, after(engines))
    monitoring = Monitoring(f"{name}-monitoring", ctx, balancers.router.metrics_port, after(foundation))
    layers = {"foundation": foundation, "storage": storage, "kvcache": kvcache, "engines": engines,
              "balancers": balancers, "monitoring": monitoring,
              "autoscaling": Autoscaling(f"{name}-autoscaling", ctx, after(engines, monitoring))}
    if identity is not None:
        layers["identity"] = identity
    if ctx.spec.observability.otlp_endpoint:
        layers["tracing"] = Tracing(f"{name}-tracing", ctx, after(foundation))
    return layers


def build_stack(spec: StackSpec, release: str = "unreleased", tracks: list[Track] | None = None) -> dict[str, Layer]:
    """The whole stack. With `tracks`, each release track serves from its own namespace and
    the environment's namespace keeps only the entry point, which splits traffic by weight."""
    platform, provider, nodes_mode = platform_link(spec)
    ctx = LayerContext(spec=spec, namespace=spec.environment.namespace, labels=spec.labels(), release=release,
                       provider=provider)
    env = spec.environment.name
    layers: dict[str, Layer] = {}
    nodepools = None
    if nodes_mode == "karpenter":  # cluster-wide, sized by the newest spec's maximums
        nodepools = layers["nodepools"] = NodePools(f"{env}-nodepools", ctx)
    if not tracks:
        layers.update(serving_layers(ctx, env, nodepools, platform))
        backends = [Backend(ctx.namespace, layers["balancers"].router)]
        routers = [layers["balancers"]]
    else:
        layers["foundation"] = Foundation(f"{env}-foundation", ctx)
        if spec.observability.otlp_endpoint:  # the gateway's spans
            layers["tracing"] = Tracing(f"{env}-tracing", ctx, after(layers["foundation"]))
        backends, routers = [], []
        for track in tracks:
            tctx = LayerContext(spec=track.spec, namespace=track.namespace, labels=track.spec.labels(),
                                release=str(track.revision), name_prefix=f"r{track.revision}-", provider=provider)
            name = f"{env}-r{track.revision}"
            served = serving_layers(tctx, name, nodepools, platform, environment_namespace=ctx.namespace)
            served["access"] = TrackAccess(f"{name}-access", tctx, served["balancers"].router, ctx.namespace,
                                           after(served["foundation"]))
            layers.update({f"r{track.revision}/{k}": v for k, v in served.items()})
            backends.append(Backend(track.namespace, served["balancers"].router, track.weight))
            routers.append(served["balancers"])
    # After the environment's namespace, which its NetworkPolicies and keys' Secret name.
    access = Access(f"{env}-access", ctx, backends, routers, after(layers["foundation"]))
    layers["access"] = access
    pulumi.export("namespace", ctx.namespace)
    pulumi.export("endpoint", f"https://{spec.access.domains[0]}/v1")
    pulumi.export("api_keys", pulumi.Output.secret(access.api_keys))
    return layers


def spec_for_current_stack():
    """The spec file named by config `pdstack:specFile`, else stacks/<stack>.yaml: a serving
    spec, or a platform spec (`kind: platform`)."""
    config = pulumi.Config("pdstack")
    path = config.get("specFile") or stack_spec_path(pulumi.get_stack())
    return load_any_spec(path)


def load_any_spec(path):
    """One program for both kinds of stack: a file with `kind: platform` is a platform spec."""
    from infra.inputs import InputError, load_yaml_mapping
    from infra.platform_stack.spec import load_platform_spec

    try:
        kind = load_yaml_mapping(path, "spec").get("kind")
    except InputError:
        kind = None  # load_spec says what is wrong with the file
    return load_platform_spec(path) if kind == "platform" else load_spec(path)


def tracks_from_store(spec: StackSpec, store: ReleaseStore | None = None) -> tuple[StackSpec, int, list[Track]] | None:
    """The tracks the environment's release store says it runs (the last rollout's or
    rollback's), each from its revision's record, with the newest revision's spec for the
    shared parts; None before the first rollout. Read from the store every actor shares, so
    `pulumi up` from any clean checkout (CI) builds the same tracks and weights."""
    store = store or store_for(spec)
    recorded = store.tracks()
    if not recorded:
        return None
    tracks = plan_tracks([(rev, weight, store.get(rev).spec) for rev, weight in sorted(recorded.items())])
    newest = max(recorded)
    return store.get(newest).stack_spec(), newest, tracks


def main(store: ReleaseStore | None = None) -> None:
    """The program: `store` is the release store to read the tracks from (a rollout's, when it
    runs the program inline), else the spec's."""
    spec = spec_for_current_stack()
    for line in placeholder_lines(spec):  # `pulumi preview` names them; the policy pack refuses them
        pulumi.log.warn(line)
    if not isinstance(spec, StackSpec):
        from infra.platform_stack.program import build_platform

        build_platform(spec)
        return
    found = tracks_from_store(spec, store)
    if found:
        newest_spec, newest, tracks = found
        build_stack(newest_spec, release=str(newest), tracks=tracks)
        pulumi.export("tracks", {str(t.revision): t.weight for t in tracks})
    else:
        # Before the first rollout, pods carry pdstack:release if set (e.g. by CI), else "unreleased".
        build_stack(spec, release=pulumi.Config("pdstack").get("release") or "unreleased")
