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
from infra.weights import SUMS_NAME

FETCHER_CONFIGMAP = "weights-fetcher"
FETCHER_MOUNT = "/opt/pdstack"
WEIGHTS_VOLUME = "weights-cache"


def fetcher_source() -> str:
    return (Path(__file__).resolve().parent.parent / "weights.py").read_text()


def aws_cli_fetch_script(spec: StackSpec) -> str:
    """Shell for an image with only `aws` and coreutils (amazon/aws-cli has no python3 or boto3).

    Sync what the node cache lacks, check every file with `sha256sum -c` against the sums
    written at upload; files that fail are deleted and fetched once more (a same-size corrupt
    file would otherwise survive `aws s3 sync`), and a second failure fails the pod.
    """
    w = spec.model.weights
    dest = f"{w.node_cache_path.rstrip('/')}/{w.prefix.strip('/')}"
    src = f"s3://{w.bucket}/{w.prefix.strip('/')}"
    aws = f"aws --only-show-errors --endpoint-url {w.endpoint_url} --region {w.region} s3"
    return "\n".join([
        "set -eu",
        f"mkdir -p {dest} && cd {dest}",
        f"{aws} cp {src}/{SUMS_NAME} .{SUMS_NAME}.new",
        f"fetch() {{ {aws} sync --exclude '{SUMS_NAME}*' --exclude '.{SUMS_NAME}*' {src} . ; }}",
        "fetch",
        f"if ! sha256sum -c --quiet .{SUMS_NAME}.new; then",
        f"  sha256sum -c .{SUMS_NAME}.new 2>/dev/null | sed -n 's/: FAILED.*$//p' | while read -r f; do rm -f \"$f\"; done",
        "  fetch",
        f"  sha256sum -c --quiet .{SUMS_NAME}.new",
        "fi",
        f"mv .{SUMS_NAME}.new {SUMS_NAME}",
    ]) + "\n"


def weights_init_container(spec: StackSpec) -> dict:
    """Init container: pull into the node cache, verify every sha256, fail on mismatch.

    `images.weights_fetcher_tool` says what the image holds: `aws-cli` runs the shell above,
    `python-boto3` runs infra/weights.py (shipped in a ConfigMap).
    """
    w = spec.model.weights
    if spec.images.weights_fetcher_tool == "aws-cli":
        command = ["/bin/sh", "-c", aws_cli_fetch_script(spec)]
    else:
        command = [
            "python3", f"{FETCHER_MOUNT}/weights.py", "fetch",
            "--endpoint", w.endpoint_url, "--region", w.region,
            "--bucket", w.bucket, "--prefix", w.prefix,
            "--dest", f"{w.node_cache_path.rstrip('/')}/{w.prefix.strip('/')}",
        ]
    return {
        "name": "fetch-weights",
        "image": spec.images.weights_fetcher,
        "command": command,
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
