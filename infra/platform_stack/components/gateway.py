"""The GatewayClass serving stacks name, and the EnvoyProxy it carries: how Envoy Gateway
exposes every Gateway of the class (the cloud's load balancer, client source IPs kept)."""

from __future__ import annotations

import pulumi

from infra.platform_stack.components.base import PlatformLayer
from infra.platform_stack.spec import PlatformSpec

CLASS_PROXY = "pdstack-class"


def gateway_class_manifests(spec: PlatformSpec, namespace: str, service_annotations: dict[str, str]) -> list[dict]:
    proxy = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyProxy",
        "metadata": {"name": CLASS_PROXY, "namespace": namespace},
        "spec": {"provider": {"type": "Kubernetes", "kubernetes": {"envoyService": {
            "type": "LoadBalancer",
            # Local: the load balancer sends only to nodes running an Envoy pod, so the client's
            # address reaches Envoy and the environments' CIDR allowlists can act on it.
            "externalTrafficPolicy": "Local",
            "annotations": dict(service_annotations)}}}},
    }
    gateway_class = {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
        "metadata": {"name": spec.gateway_class},
        "spec": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller",
                 "parametersRef": {"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "name": CLASS_PROXY,
                                   "namespace": namespace}},
    }
    return [proxy, gateway_class]


class GatewayPlatform(PlatformLayer):
    layer = "gateway"

    def __init__(self, name: str, spec: PlatformSpec, namespace: str, service_annotations: dict[str, str],
                 after: list[pulumi.Resource], opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, opts)
        for manifest in gateway_class_manifests(spec, namespace, service_annotations):
            self.add(manifest, after)
        self.register_outputs({"gateway_class": spec.gateway_class})
