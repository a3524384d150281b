"""What ties a serving namespace to the platform stack: the weights role for its pods.

pod-identity: one EKS Pod Identity association per namespace (the environment's and each
release track's) for the engine service account, to the role the platform made; the fetch
step's AWS SDK finds the credentials through the Pod Identity agent. irsa: the service account
carries the role's ARN (eks.amazonaws.com/role-arn). Either way no Secret is copied anywhere,
and a canary track's namespace gets its access with the track.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.components.engines import ENGINE_SERVICE_ACCOUNT
from infra.components.k8s import Layer, LayerContext


class PlatformLinks(Layer):
    layer = "identity"

    def __init__(self, name: str, ctx: LayerContext, platform: pulumi.StackReference, namespaces: list[str],
                 service_accounts: list[pulumi.Resource], opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        mode = ctx.spec.model.weights.access_mode()
        if mode not in ("pod-identity", "irsa"):  # `secret`: nothing of the platform's to link (an on-prem
            self.register_outputs({})              # platform exports no role at all)
            return
        role = platform.require_output("weights_role_arn")
        cluster = platform.require_output("cluster_name")
        for ns in namespaces:
            if mode == "pod-identity":
                aws.eks.PodIdentityAssociation(
                    f"weights-{ns}", cluster_name=cluster, namespace=ns, service_account=ENGINE_SERVICE_ACCOUNT,
                    role_arn=role, tags={"pdstack.io/environment": ctx.spec.environment.name},
                    opts=pulumi.ResourceOptions(parent=self, depends_on=service_accounts, providers=[]))
            elif mode == "irsa":
                k8s.core.v1.ServiceAccountPatch(
                    f"weights-{ns}", metadata={"name": ENGINE_SERVICE_ACCOUNT, "namespace": ns,
                                               "annotations": {"eks.amazonaws.com/role-arn": role}},
                    opts=pulumi.ResourceOptions(parent=self, depends_on=service_accounts))
        self.register_outputs({})
