"""What the platform's layers share: registering Kubernetes objects under one component."""

from __future__ import annotations

import pulumi

from infra.components.k8s import logical_name, register_manifest
from infra.policy.rules import PLATFORM_PART_OF


class PlatformLayer(pulumi.ComponentResource):
    """A layer of the platform stack; `layer` names it in previews (pdstack:<layer>:<Class>)."""

    layer = "platform"

    def __init__(self, name: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"pdstack:{self.layer}:{type(self).__name__}", name, None, opts)
        self.objects: list[dict] = []  # every Kubernetes object this layer registered (platform_objects)

    def add(self, manifest: dict, depends_on: list[pulumi.Resource] | None = None) -> pulumi.CustomResource:
        """Register one object, labelled as the platform's (the policy pack's serving-only rules skip it).

        A CustomResourceDefinition is retained when the stack deletes it (a `pulumi destroy`, a row
        removed from the catalog): deleting a CRD deletes every object of its kind in the cluster,
        every serving fleet's LeaderWorkerSets and routes with it. Helm never deletes a chart's CRDs
        for the same reason (helm.sh/docs/topics/charts, "Limitations on CRDs": "Deleting a CRD
        automatically deletes all of the CRD's contents across all namespaces in the cluster")."""
        metadata = manifest.setdefault("metadata", {})
        metadata["labels"] = {**(metadata.get("labels") or {}), "app.kubernetes.io/part-of": PLATFORM_PART_OF}
        self.objects.append(manifest)
        return register_manifest(logical_name(manifest), manifest, pulumi.ResourceOptions(
            parent=self, depends_on=depends_on or [],
            retain_on_delete=manifest.get("kind") == "CustomResourceDefinition"))
