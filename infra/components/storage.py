"""Weights storage: the fetch-and-verify step each engine pod runs before its engine.

The bucket lives on any S3-compatible endpoint (named by URL in the spec); on AWS the platform
stack makes it (infra/platform_stack/cloud/aws.py) and `scripts/upload_weights` fills it. The cache
lives where `model.weights.cache` says (infra/platform_stack/weight_cache.py). This layer
ships infra/weights.py in a ConfigMap and gives engines the init container that runs it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pulumi

from infra.components.k8s import Layer, LayerContext
from infra.render.engine_args import WEIGHTS_MOUNT, weights_path
from infra.spec import StackSpec
from infra.weights import SAFE_NAME, SUMS_NAME

VERIFIED_SHELL_MARKER = ".pdstack-verified"  # the aws-cli script's marker (infra/weights.py writes .json)

FETCHER_CONFIGMAP = "weights-fetcher"
FETCHER_MOUNT = "/opt/pdstack"
WEIGHTS_VOLUME = "weights-cache"


def fetcher_source() -> str:
    return (Path(__file__).resolve().parent.parent / "weights.py").read_text()


def fetch_env(spec: StackSpec) -> list[dict]:
    """The spec's values reach the fetch step as environment variables, never as text inside a
    script: the script is the same for every spec, so no spec string can become a command."""
    w = spec.model.weights
    values = {"ENDPOINT": w.endpoint_url, "REGION": w.region, "BUCKET": w.bucket, "PREFIX": w.prefix.strip("/"),
              "DEST": weights_path(spec), "WORKERS": str(FETCH_WORKERS)}
    return [{"name": f"PDSTACK_WEIGHTS_{k}", "value": v} for k, v in values.items()]


FETCH_WORKERS = 8  # files hashed and fetched at once; the init container's CPU limit below is 8


def aws_cli_fetch_script() -> str:
    """Shell for an image with only `aws` and coreutils (amazon/aws-cli has no python3 or boto3).

    Constant text: what it fetches comes from PDSTACK_WEIGHTS_* in its environment, expanded
    inside double quotes only. Every name in SHA256SUMS is checked against SAFE_NAME (and for
    symbolic links on its way) before any is used, and only those names are fetched, so nothing
    is written or removed outside the cache folder.

    Verified once per object version, as infra/weights.py does: the marker records the manifest's
    VersionId and ETag, every object's ETag and size, and each cached file's size; a start that
    finds them unchanged reads no file. Otherwise every file is checked with `sha256sum -c`,
    WORKERS slices at once; the missing or failing ones are fetched (to a .partial file, then
    renamed) and checked again, and a second failure fails the pod.
    """
    sums, marker = SUMS_NAME, VERIFIED_SHELL_MARKER
    return "\n".join([
        "set -eu",
        "export LC_ALL=C",
        'aws() { command aws --only-show-errors --endpoint-url "$PDSTACK_WEIGHTS_ENDPOINT" '
        '--region "$PDSTACK_WEIGHTS_REGION" "$@"; }',
        'src="s3://$PDSTACK_WEIGHTS_BUCKET/$PDSTACK_WEIGHTS_PREFIX"',
        'mkdir -p -- "$PDSTACK_WEIGHTS_DEST" && cd -- "$PDSTACK_WEIGHTS_DEST"',
        f'aws s3 cp "$src/{sums}" .{sums}.new',
        f"if grep -Evxq -e {shlex.quote('[0-9a-f]{64}  ' + SAFE_NAME)} .{sums}.new; then",
        f'  echo "{sums}: a name that leaves the cache folder, or not a sha256 line; nothing fetched" >&2; exit 3',
        "fi",
        "while read -r _ f; do p=; for part in $(echo \"$f\" | tr / ' '); do p=\"${p:+$p/}$part\"",
        '  if [ -L "$p" ]; then echo "$p: a symbolic link in the weights cache; nothing is written through one" >&2; '
        "exit 3; fi",
        f"done; done < .{sums}.new",
        # what the bucket holds now and what this node holds: the marker is both, as last verified
        f'aws s3api head-object --bucket "$PDSTACK_WEIGHTS_BUCKET" --key "$PDSTACK_WEIGHTS_PREFIX/{sums}" '
        "--query '[VersionId,ETag]' --output text > .pdstack-state.new",
        'aws s3api list-objects-v2 --bucket "$PDSTACK_WEIGHTS_BUCKET" --prefix "$PDSTACK_WEIGHTS_PREFIX/" '
        "--query 'Contents[].[Key,ETag,Size]' --output text >> .pdstack-state.new",
        'sizes() { while read -r _ f; do if [ -f "$f" ]; then echo "$f $(wc -c < "$f")"; else echo "$f missing"; fi; '
        f"done < .{sums}.new; }}",
        f"if [ -f {marker} ] && {{ cat .pdstack-state.new; sizes; }} | cmp -s - {marker}; then",
        f"  rm -f .pdstack-state.new .{sums}.new; echo 'weights: verified before, for these object versions'; exit 0",
        "fi",
        f"rm -f {marker}",
        # $2 over WORKERS slices of the list $1 at once; each slice's output in .pdstack-part.*.out
        "parallel() {",
        '  rm -f .pdstack-part.*; split -n "l/$PDSTACK_WEIGHTS_WORKERS" "$1" .pdstack-part.',
        '  for part in .pdstack-part.??; do [ -s "$part" ] && $2 "$part" > "$part.out" 2>/dev/null & done',
        "  wait",
        "}",
        # the names `sha256sum -c` reports missing or wrong, into .pdstack-failed
        f"verify() {{ parallel .{sums}.new 'sha256sum -c'; cat .pdstack-part.*.out | sed -n 's/: FAILED.*$//p' "
        "> .pdstack-failed; rm -f .pdstack-part.*; [ ! -s .pdstack-failed ]; }",
        'fetch_listed() { while read -r f; do mkdir -p -- "$(dirname -- "$f")"; rm -f -- "$f.partial"; '
        'aws s3 cp "$src/$f" "$f.partial" && mv -f -- "$f.partial" "$f"; done < "$1"; }',
        "if ! verify; then",
        "  parallel .pdstack-failed fetch_listed; rm -f .pdstack-part.*",
        "  verify || { sed 's/$/: sha256 does not match the manifest/' .pdstack-failed >&2; exit 3; }",
        "fi",
        f"{{ cat .pdstack-state.new; sizes; }} > {marker}.tmp && mv {marker}.tmp {marker}",
        f"mv .{sums}.new {sums} && rm -f .pdstack-state.new .pdstack-failed",
    ]) + "\n"


def weights_init_container(spec: StackSpec) -> dict:
    """Init container: pull into the node cache, verify every sha256, fail on mismatch.

    `images.weights_fetcher_tool` says what the image holds: `aws-cli` runs the shell above,
    `python-boto3` runs infra/weights.py (shipped in a ConfigMap).
    """
    w = spec.model.weights
    if spec.images.weights_fetcher_tool == "aws-cli":
        command = ["/bin/sh", "-c", aws_cli_fetch_script()]
    else:
        command = ["python3", f"{FETCHER_MOUNT}/weights.py", "fetch"]  # its options from the environment
    return {
        "name": "fetch-weights",
        "image": spec.images.weights_fetcher,
        "command": command,
        "env": fetch_env(spec),
        # pod-identity / irsa: the AWS SDK's default chain finds the role's credentials (EKS Pod
        # Identity's agent, or IRSA's web identity token); only `secret` reads a stored key.
        **({"envFrom": [{"secretRef": {"name": w.credentials_secret}}]} if w.access_mode() == "secret" else {}),
        "volumeMounts": [
            {"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT},
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
