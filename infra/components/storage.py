"""Weights storage: the fetch-and-verify step each engine pod runs before its engine.

The bucket lives on any S3-compatible endpoint (named by URL in the spec); it is made and
filled by `scripts/upload_weights`, which also makes it private and versioned. This layer
ships infra/weights.py in a ConfigMap and gives engines the init container that runs it.
"""

from __future__ import annotations

from pathlib import Path

import pulumi

from infra.components.k8s import Layer, LayerContext
from infra.spec import StackSpec

FETCHER_CONFIGMAP = "weights-fetcher"
FETCHER_MOUNT = "/opt/pdstack"
WEIGHTS_VOLUME = "weights-cache"


def fetcher_source() -> str:
    return (Path(__file__).resolve().parent.parent / "weights.py").read_text()


def weights_init_container(spec: StackSpec) -> dict:
    """Init container: pull into the node cache, verify every sha256, fail on mismatch."""
    w = spec.model.weights
    return {
        "name": "fetch-weights",
        "image": spec.images.weights_fetcher,
        "command": [
            "python3", f"{FETCHER_MOUNT}/weights.py", "fetch",
            "--endpoint", w.endpoint_url, "--region", w.region,
            "--bucket", w.bucket, "--prefix", w.prefix,
            "--dest", f"{w.node_cache_path.rstrip('/')}/{w.prefix.strip('/')}",
        ],
        "envFrom": [{"secretRef": {"name": w.credentials_secret}}],
        "volumeMounts": [
            {"name": WEIGHTS_VOLUME, "mountPath": w.node_cache_path},
            {"name": FETCHER_CONFIGMAP, "mountPath": FETCHER_MOUNT, "readOnly": True},
        ],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "8", "memory": "8Gi"}},
    }


def weights_volumes(spec: StackSpec) -> list[dict]:
    return [
        {"name": WEIGHTS_VOLUME, "hostPath": {"path": spec.model.weights.node_cache_path, "type": "DirectoryOrCreate"}},
        {"name": FETCHER_CONFIGMAP, "configMap": {"name": FETCHER_CONFIGMAP}},
    ]


class Storage(Layer):
    layer = "storage"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None):
        super().__init__(name, ctx, opts)
        self.fetcher = self.add({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": ctx.metadata(FETCHER_CONFIGMAP, "storage"),
            "data": {"weights.py": fetcher_source()},
        })
        self.register_outputs({"bucket": ctx.spec.model.weights.bucket})
