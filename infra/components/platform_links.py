"""What ties a serving namespace to the platform stack: the weights role for its pods.

pod-identity: one EKS Pod Identity association per namespace (the environment's and each
release track's) for the engine service account, to the role the platform made; the fetch
step's AWS SDK finds the credentials through the Pod Identity agent. irsa: the service account
carries the role's ARN (eks.amazonaws.com/role-arn). Either way no Secret is copied anywhere,
and a canary track's namespace gets its access with the track.

Order: the link is made with its namespace, before the engines, and the engines wait for it.
EKS injects Pod Identity credentials (and IRSA's web-identity token) when a pod is admitted,
so a pod created before its association or annotation runs without credentials until it is
recreated. An association needs neither the service account nor any engine to exist, so it
belongs to the rollout's first step ("initialise environment", infra/rollout/steps.py) and
depends only on the namespace; IRSA's annotation is written on the engine service account
itself (infra/components/engines.py), never patched onto it afterwards.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.components.engines import ENGINE_SERVICE_ACCOUNT
from infra.components.k8s import Layer, LayerContext

IRSA_ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"


class PlatformLinks(Layer):
    layer = "identity"

    def __init__(self, name: str, ctx: LayerContext, platform: pulumi.StackReference, env_name: str,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        mode = ctx.spec.model.weights.access_mode()
        # What the engine service account carries (irsa); empty for the other modes.
        self.service_account_annotations: dict[str, pulumi.Input[str]] = {}
        if mode == "pod-identity":
            ns = ctx.namespace
            # Before each namespace had its own link, one `<env>-identity` component held every
            # namespace's association: the alias keeps those associations instead of replacing them.
            old_name = f"{env_name}-identity"
            aliases = [] if name == old_name else [
                pulumi.Alias(parent=pulumi.create_urn(old_name, "pdstack:identity:PlatformLinks"))]
            aws.eks.PodIdentityAssociation(
                f"weights-{ns}", cluster_name=platform.require_output("cluster_name"), namespace=ns,
                service_account=ENGINE_SERVICE_ACCOUNT, role_arn=platform.require_output("weights_role_arn"),
                tags={"pdstack.io/environment": ctx.spec.environment.name},
                opts=pulumi.ResourceOptions(parent=self, providers=[], aliases=aliases))
        elif mode == "irsa":
            self.service_account_annotations = {IRSA_ROLE_ANNOTATION: platform.require_output("weights_role_arn")}
        self.register_outputs({})
