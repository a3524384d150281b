"""An existing cluster (kubeadm on bare metal): nothing is created outside Kubernetes. The
weights live in the operator's S3-compatible store (access: secret), the load balancer is the
cluster's own (MetalLB or similar), the nodes are named in the inventories (nodes.mode: static)."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from infra.platform_stack.cloud.outputs import CloudOutputs
from infra.platform_stack.spec import PlatformSpec


class OnPrem(pulumi.ComponentResource):
    def __init__(self, name: str, spec: PlatformSpec, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pdstack:cloud:OnPrem", name, None, opts)
        provider = None
        if spec.cloud.kubeconfig_context:
            provider = k8s.Provider("cluster", context=spec.cloud.kubeconfig_context,
                                    opts=pulumi.ResourceOptions(parent=self))
        self.outputs = CloudOutputs(kubernetes=provider, kubeconfig=None, cluster_name=spec.name,
                                    gateway_service_annotations={})
        self.register_outputs({})
