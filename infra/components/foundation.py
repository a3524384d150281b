"""Foundation layer: the environment's namespace and the resolved spec, for operators."""

from __future__ import annotations

import json

import pulumi

from infra.components.k8s import Layer, LayerContext


def resolved_spec_json(ctx: LayerContext) -> str:
    # The spec holds no secrets (API keys are generated, never written in it), so the
    # resolved form can sit in a ConfigMap where operators and the rollout tool read it.
    return json.dumps(ctx.spec.model_dump(mode="json"), indent=2, sort_keys=True)


class Foundation(Layer):
    layer = "foundation"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        self.namespace = self.add(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": ctx.namespace, "labels": {**ctx.labels}},
            }
        )
        self.spec_config = self.add(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": ctx.metadata("pdstack-spec", "foundation"),
                "data": {"spec.json": resolved_spec_json(ctx)},
            },
            depends_on=[self.namespace],
        )
        self.register_outputs({"namespace": ctx.namespace})
