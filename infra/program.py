"""The Pulumi program: build_stack(spec) wires the layers together, top of the stack last.

`stacks/__main__.py` (what Pulumi.yaml runs) calls `main()`, and so does the offline
preview under Pulumi's mocks: one program, two ways to run it.
"""

from __future__ import annotations

import pulumi

from infra.components.access import Access
from infra.components.autoscaling import Autoscaling
from infra.components.balancers import Balancers
from infra.components.engines import Engines
from infra.components.foundation import Foundation
from infra.components.k8s import Layer, LayerContext
from infra.components.kvcache import KVCache
from infra.components.monitoring import Monitoring
from infra.components.nodepools import NodePools
from infra.components.storage import Storage
from infra.components.tracing import Tracing
from infra.spec import StackSpec, load_spec, stack_spec_path


def build_stack(spec: StackSpec, release: str = "unreleased") -> dict[str, Layer]:
    ctx = LayerContext(spec=spec, namespace=spec.environment.namespace, labels=spec.labels(), release=release)
    env = spec.environment.name
    after = lambda *deps: pulumi.ResourceOptions(depends_on=list(deps))  # noqa: E731
    foundation = Foundation(f"{env}-foundation", ctx)
    nodepools = NodePools(f"{env}-nodepools", ctx, after(foundation))
    storage = Storage(f"{env}-storage", ctx, after(foundation))
    kvcache = KVCache(f"{env}-kvcache", ctx, after(foundation))
    engines = Engines(f"{env}-engines", ctx, kvcache.plan, after(nodepools, storage, kvcache))
    balancers = Balancers(f"{env}-balancers", ctx, after(engines))
    access = Access(f"{env}-access", ctx, balancers.router, after(balancers))
    monitoring = Monitoring(f"{env}-monitoring", ctx, balancers.router.metrics_port, after(foundation))
    autoscaling = Autoscaling(f"{env}-autoscaling", ctx, after(engines, monitoring))
    layers = {"autoscaling": autoscaling}
    if spec.observability.otlp_endpoint:
        layers["tracing"] = Tracing(f"{env}-tracing", ctx, after(foundation))
    pulumi.export("namespace", ctx.namespace)
    pulumi.export("endpoint", f"https://{spec.access.domains[0]}/v1")
    pulumi.export("api_keys", pulumi.Output.secret(access.api_keys))
    return {
        "foundation": foundation, "nodepools": nodepools, "storage": storage, "kvcache": kvcache,
        "engines": engines, "balancers": balancers, "access": access, "monitoring": monitoring, **layers,
    }


def spec_for_current_stack() -> StackSpec:
    """The spec file named by config `pdstack:specFile`, else stacks/<stack>.yaml."""
    config = pulumi.Config("pdstack")
    path = config.get("specFile") or stack_spec_path(pulumi.get_stack())
    return load_spec(path)


def main() -> None:
    # `pdctl rollout` sets pdstack:release to the revision it applies; pods carry it as a label.
    build_stack(spec_for_current_stack(), release=pulumi.Config("pdstack").get("release") or "unreleased")
