"""One way to turn a Kubernetes manifest (a plain dict) into a Pulumi resource.

Layers build manifests as dicts, in the shape `kubectl apply` takes, and hand them to
`Layer.add`. Built-in kinds map to their typed pulumi-kubernetes class, everything else
(CRDs: Karpenter, LeaderWorkerSet, Gateway API, Prometheus operator, KEDA) goes through
`apiextensions.CustomResource`. What the mocks record is exactly what the provider gets,
so offline rendering and the real `pulumi up` share this path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import naming
from infra.spec import StackSpec

KIND_CLASSES: dict[tuple[str, str], type[pulumi.CustomResource]] = {
    ("v1", "Namespace"): k8s.core.v1.Namespace,
    ("v1", "ConfigMap"): k8s.core.v1.ConfigMap,
    ("v1", "Secret"): k8s.core.v1.Secret,
    ("v1", "Service"): k8s.core.v1.Service,
    ("v1", "ServiceAccount"): k8s.core.v1.ServiceAccount,
    ("apps/v1", "Deployment"): k8s.apps.v1.Deployment,
    ("apps/v1", "DaemonSet"): k8s.apps.v1.DaemonSet,
    ("policy/v1", "PodDisruptionBudget"): k8s.policy.v1.PodDisruptionBudget,
    ("networking.k8s.io/v1", "NetworkPolicy"): k8s.networking.v1.NetworkPolicy,
    ("rbac.authorization.k8s.io/v1", "Role"): k8s.rbac.v1.Role,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): k8s.rbac.v1.RoleBinding,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): k8s.autoscaling.v2.HorizontalPodAutoscaler,
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): k8s.rbac.v1.ClusterRole,
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): k8s.rbac.v1.ClusterRoleBinding,
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): k8s.apiextensions.v1.CustomResourceDefinition,
    ("storage.k8s.io/v1", "StorageClass"): k8s.storage.v1.StorageClass,
}


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def logical_name(manifest: dict) -> str:
    """Pulumi resource name: kind and object name, unique within a stack."""
    return f"{manifest['kind'].lower()}-{manifest['metadata']['name']}"


def yaml_render_directory() -> str | None:
    """Where the stack's `kubernetes:renderYamlToDirectory` has the provider write each object as
    YAML instead of sending it to a cluster (None: sent)."""
    return pulumi.Config("kubernetes").get("renderYamlToDirectory")


@dataclass(frozen=True)
class LayerContext:
    """What every layer needs besides the spec: where it goes and how it is labelled."""

    spec: StackSpec
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    release: str = "unreleased"  # the release revision being applied (config pdstack:release)
    name_prefix: str = ""  # Pulumi names of a release track's resources ("r7-"), unique in the stack
    provider: Any = None  # the platform stack's cluster (a kubernetes Provider), else the stack config's context

    def pod_labels(self, **extra: str) -> dict[str, str]:
        """Labels for pod templates: the stack's, the release's (canary gates read it), extras."""
        return {**self.labels, naming.RELEASE_LABEL: self.release, **extra}

    def metadata(self, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": {**self.labels, "app.kubernetes.io/component": component, **extra_labels},
        }


def disruption_budget(ctx: LayerContext, name: str, component: str, match_labels: dict[str, str],
                      max_unavailable: int, **labels: str) -> dict:
    """A PDB over exactly one workload's pods (a pod under two PDBs cannot be evicted at all)."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": ctx.metadata(name, component, **labels),
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": dict(match_labels)}},
    }


class Layer(pulumi.ComponentResource):
    """Base of the system's layers. `layer` names it in previews and resource types."""

    layer: str = "layer"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        if ctx.provider is not None:
            opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(providers=[ctx.provider]))
        super().__init__(f"pdstack:{self.layer}:{type(self).__name__}", name, None, opts)
        self.ctx = ctx
        self.spec = ctx.spec

    def add(self, manifest: dict, depends_on: list[pulumi.Resource] | None = None,
            ignore_changes: list[str] | None = None) -> pulumi.CustomResource:
        """Register one manifest. `ignore_changes` names fields another controller owns
        (an autoscaler's replica count), so `pulumi up` does not undo what it did."""
        opts = pulumi.ResourceOptions(parent=self, depends_on=depends_on or [], ignore_changes=ignore_changes)
        return register_manifest(self.ctx.name_prefix + logical_name(manifest), manifest, opts)


def register_manifest(name: str, manifest: dict, opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    """One manifest as a Pulumi resource: its typed class for built-in kinds, else a CustomResource."""
    api_version, kind = manifest["apiVersion"], manifest["kind"]
    body = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}
    cls = KIND_CLASSES.get((api_version, kind))
    if cls is None:
        return k8s.apiextensions.CustomResource(name, api_version=api_version, kind=kind, opts=opts, **body)
    return cls(name, opts=opts, **{_snake(k): v for k, v in body.items()})


def config_hash(*configs: dict[str, str]) -> str:
    """The digest naming.CONFIG_HASH_ANNOTATION carries: of every ConfigMap's data a pod reads."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:16]
