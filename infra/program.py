"""The Pulumi program: build_stack(spec) wires the layers together, top of the stack last.

`stacks/__main__.py` (what Pulumi.yaml runs) calls `main()`, and so does the offline
preview under Pulumi's mocks: one program, two ways to run it.
"""

from __future__ import annotations

import pulumi

from infra.components.foundation import Foundation
from infra.components.k8s import Layer, LayerContext
from infra.spec import StackSpec, load_spec, stack_spec_path


def build_stack(spec: StackSpec) -> dict[str, Layer]:
    ctx = LayerContext(spec=spec, namespace=spec.environment.namespace, labels=spec.labels())
    env = spec.environment.name
    foundation = Foundation(f"{env}-foundation", ctx)
    layers: dict[str, Layer] = {"foundation": foundation}
    pulumi.export("namespace", ctx.namespace)
    return layers


def spec_for_current_stack() -> StackSpec:
    """The spec file named by config `pdstack:specFile`, else stacks/<stack>.yaml."""
    config = pulumi.Config("pdstack")
    path = config.get("specFile") or stack_spec_path(pulumi.get_stack())
    return load_spec(path)


def main() -> None:
    build_stack(spec_for_current_stack())
