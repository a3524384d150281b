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
import pulumi_kubernetes as k8s

from infra import naming
from infra.components.k8s import Layer, LayerContext, yaml_render_directory
from infra.render.engine_args import JIT_CACHE_FOLDER, JIT_CACHE_MOUNT, WEIGHTS_MOUNT, jit_cache_env, weights_path
from infra.render.probes import fetch_waves
from infra.spec import StackSpec
from infra.weights import SAFE_NAME, SUMS_NAME, UNPINNED_WARNING, VERSION_ID, WAVE_ENV

VERIFIED_SHELL_MARKER = ".pdstack-verified"  # the aws-cli script's marker (infra/weights.py writes .json)

FETCHER_CONFIGMAP = "weights-fetcher"
FETCHER_MOUNT = "/opt/pdstack"
WEIGHTS_VOLUME = "weights-cache"
JIT_CACHE_VOLUME = "jit-cache"


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


# infra/weights.py wave_wait_seconds in shell: the wait before this node's first GET, from the same
# PDSTACK_WEIGHTS_ settings (whole numbers only: a label value never reaches $(( )) otherwise).
WAVE_WAIT_SHELL = [
    "wave_wait() {",
    '  [ -n "${PDSTACK_WEIGHTS_WAVES:-}" ] || return 0',
    "  for v in " + " ".join(f'"${{PDSTACK_WEIGHTS_{k}:-}}"' for k in WAVE_ENV) + "; do case \"$v\" in",
    "    ''|*[!0-9]*|0?*|??????????*) echo 'fetch wave settings must be whole numbers of at most 9 digits, no leading 0'"
    " >&2; exit 3;; esac; done",
    '  if [ "$PDSTACK_WEIGHTS_NODES_AT_ONCE" -eq 0 ] || [ "$PDSTACK_WEIGHTS_WAVES" -eq 0 ]; then',
    "    echo 'fetch wave settings: NODES_AT_ONCE and WAVES must be above 0' >&2; exit 3; fi",
    "  s=$(( (PDSTACK_WEIGHTS_FIRST_NODE + PDSTACK_WEIGHTS_GROUP_INDEX * PDSTACK_WEIGHTS_GROUP_NODES"
    " + PDSTACK_WEIGHTS_WORKER_INDEX) / PDSTACK_WEIGHTS_NODES_AT_ONCE % PDSTACK_WEIGHTS_WAVES"
    " * PDSTACK_WEIGHTS_WAVE_SECONDS ))",
    """  if [ "$s" -gt 0 ]; then echo "weights: waiting ${s}s for this node's fetch wave" >&2; sleep "$s"; fi""",
    "}",
]


def aws_cli_fetch_script() -> str:
    """Shell for an image with only `aws` and coreutils (amazon/aws-cli has no python3 or boto3).

    Constant text: what it fetches comes from PDSTACK_WEIGHTS_* in its environment, expanded
    inside double quotes only. Every line of SHA256SUMS (`<sha256> <version id>  <name>`) is
    checked against SAFE_NAME and VERSION_ID (and its name for symbolic links on its way) before
    any is used, and only those names are fetched, so nothing is written or removed outside the
    cache folder. Each file is fetched at the object version SHA256SUMS pins (`aws s3api
    get-object --version-id`: GetObject's versionId, S3 API Reference), so an upload cut half
    way, or going on, changes nothing this fetches. A SHA256SUMS all of whose lines are
    `<sha256>  <name>` (upload_weights before it pinned versions) is followed as then, each key's
    latest version checked by its sha256, saying so on stderr: an upgrade does not stop the pods
    that start next. Any other line, or the two shapes mixed, is refused.

    Verified once per manifest, as infra/weights.py does: the marker records SHA256SUMS's
    VersionId and ETag (from the same GetObject that read it) and each cached file's size; a
    start that finds them unchanged reads no file. Otherwise every file is checked with
    `sha256sum -c`, WORKERS slices at once; the missing or failing ones are fetched and checked
    again, and a second failure fails the pod. Everything but the finished files lives in a
    work folder of this run's own (mktemp), and a file enters the cache whole, by a rename: two
    fetches into one cache (two pods starting on one node) never write under each other.
    """
    sums, marker = SUMS_NAME, VERIFIED_SHELL_MARKER
    return "\n".join([
        "set -eu",
        "export LC_ALL=C",
        # global options only: --only-show-errors is an option of the `aws s3` transfer commands, and
        # `aws s3api` refuses it ("Unknown options"; awscli/customizations/s3/subcommands.py)
        'aws() { command aws --endpoint-url "$PDSTACK_WEIGHTS_ENDPOINT" --region "$PDSTACK_WEIGHTS_REGION" "$@"; }',
        'mkdir -p -- "$PDSTACK_WEIGHTS_DEST" && cd -- "$PDSTACK_WEIGHTS_DEST"',
        'work="$(mktemp -d .pdstack-fetch.XXXXXX)"',
        "trap 'rm -rf -- \"$work\"' EXIT",
        # the sums and, from the same answer, the version they are: what a verification is made against
        f'aws s3api get-object --bucket "$PDSTACK_WEIGHTS_BUCKET" --key "$PDSTACK_WEIGHTS_PREFIX/{sums}" '
        "--query '[VersionId,ETag]' --output text \"$work/sums\" > \"$work/state\"",
        # every line one of two shapes: `<sha256> <version id>  <name>`, or, all of them, `<sha256>  <name>` as
        # upload_weights wrote it before manifests pinned versions (each file's latest version, shown as `-`)
        f"if grep -Evxq -e {shlex.quote('[0-9a-f]{64} ' + VERSION_ID + '  ' + SAFE_NAME)} \"$work/sums\"; then",
        f"  if grep -Evxq -e {shlex.quote('[0-9a-f]{64}  ' + SAFE_NAME)} \"$work/sums\"; then",
        f'    echo "{sums}: a name that leaves the cache folder, or a line of neither shape (<sha256> <version id>  '
        '<name>, or <sha256>  <name> on every line); nothing fetched" >&2; exit 3',
        "  fi",
        f"  echo {shlex.quote(UNPINNED_WARNING)} >&2",
        "  sed 's/^\\([0-9a-f]*\\)  /\\1 -  /' \"$work/sums\" > \"$work/latest\" && mv -f \"$work/latest\" \"$work/sums\"",
        "fi",
        "while read -r _ _ f; do p=; for part in $(echo \"$f\" | tr / ' '); do p=\"${p:+$p/}$part\"",
        '  if [ -L "$p" ]; then echo "$p: a symbolic link in the weights cache; nothing is written through one" >&2; '
        "exit 3; fi",
        'done; done < "$work/sums"',
        # the same lines in `sha256sum -c` form
        "sed 's/^\\([0-9a-f]*\\) [^ ]* /\\1 /' \"$work/sums\" > \"$work/check\"",
        'sizes() { while read -r _ f; do if [ -f "$f" ]; then echo "$f $(wc -c < "$f")"; else echo "$f missing"; fi; '
        'done < "$work/check"; }',
        f'if [ -f {marker} ] && {{ cat "$work/state"; sizes; }} | cmp -s - {marker}; then',
        "  echo 'weights: verified before, for these object versions'; exit 0",
        "fi",
        f"rm -f {marker}",
        # $2 over WORKERS slices of the list $1 at once; each slice's output in $work/part.*.out
        "parallel() {",
        '  rm -f "$work"/part.*; split -n "l/$PDSTACK_WEIGHTS_WORKERS" "$1" "$work/part."',
        '  for part in "$work"/part.??; do [ -s "$part" ] && $2 "$part" > "$part.out" 2>/dev/null & done',
        "  wait",
        "}",
        # the names `sha256sum -c` reports missing or wrong, into $work/failed
        """verify() { parallel "$work/check" 'sha256sum -c'; cat "$work"/part.*.out | sed -n 's/: FAILED.*$//p' """
        '> "$work/failed"; rm -f "$work"/part.*; [ ! -s "$work/failed" ]; }',
        # each listed name at its pinned version, into the work folder, then renamed into place whole
        'fetch_listed() { while read -r v f; do mkdir -p -- "$(dirname -- "$f")" "$(dirname -- "$work/files/$f")"; '
        'if [ "$v" = - ]; then v=; fi; '
        'aws s3api get-object --bucket "$PDSTACK_WEIGHTS_BUCKET" --key "$PDSTACK_WEIGHTS_PREFIX/$f" '
        '${v:+--version-id "$v"} "$work/files/$f" > /dev/null && mv -f -- "$work/files/$f" "$f"; done < "$1"; }',
        *WAVE_WAIT_SHELL,
        "if ! verify; then",
        '  while read -r _ v f; do if grep -Fxq -e "$f" "$work/failed"; then echo "$v $f"; fi; done < "$work/sums" '
        '> "$work/fetch"',
        "  wave_wait",
        '  parallel "$work/fetch" fetch_listed; rm -f "$work"/part.*',
        """  verify || { sed 's/$/: sha256 does not match the manifest/' "$work/failed" >&2; exit 3; }""",
        "fi",
        f'{{ cat "$work/state"; sizes; }} > "$work/marker" && mv -f "$work/marker" {marker}',
        f'mv -f "$work/check" {sums}',
    ]) + "\n"


def wave_env(spec: StackSpec, role: str) -> list[dict]:
    """A pool's pods' fetch-wave settings (infra/weights.py WAVE_ENV): the pool's place in the fleet
    from the spec, the pod's group and worker index from the labels LWS puts on it."""
    waves = fetch_waves(spec)
    values = {"FIRST_NODE": waves.first_node[role], "GROUP_NODES": waves.group_nodes[role],
              "NODES_AT_ONCE": waves.nodes_at_once, "WAVES": waves.waves, "WAVE_SECONDS": waves.wave_seconds}
    labels = {"GROUP_INDEX": naming.LWS_GROUP_INDEX_LABEL, "WORKER_INDEX": naming.LWS_WORKER_INDEX_LABEL}
    assert {*values, *labels} == set(WAVE_ENV)
    return ([{"name": f"PDSTACK_WEIGHTS_{k}", "value": str(v)} for k, v in values.items()]
            + [{"name": f"PDSTACK_WEIGHTS_{k}", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
               for k, label in labels.items()])


def weights_init_container(spec: StackSpec, role: str | None = None) -> dict:
    """Init container: pull into the node cache, verify every sha256, fail on mismatch.

    `images.weights_fetcher_tool` says what the image holds: `aws-cli` runs the shell above,
    `python-boto3` runs infra/weights.py (shipped in a ConfigMap). A pool's pods (`role`) fetch in
    their wave; a pod outside the pools (a dedicated encoder) fetches at once.
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
        "env": fetch_env(spec) + (wave_env(spec, role) if role else []),
        # pod-identity / irsa: the AWS SDK's default chain finds the role's credentials (EKS Pod
        # Identity's agent, or IRSA's web identity token); only `secret` reads a stored key.
        **({"envFrom": [{"secretRef": {"name": w.credentials_secret}}]} if w.access_mode() == "secret" else {}),
        "volumeMounts": [
            {"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT},
            {"name": FETCHER_CONFIGMAP, "mountPath": FETCHER_MOUNT, "readOnly": True},
        ],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "8", "memory": "8Gi"}},
    }


def jit_cache_host_path(spec: StackSpec) -> str:
    """The node's compiled-kernel cache: in the weights' node cache folder (on the same node-local
    store), one folder per engine build, since a kernel compiled by one build is not another's."""
    return f"{spec.model.weights.node_cache_path.rstrip('/')}/{JIT_CACHE_FOLDER}/{spec.engine.kind}-{spec.engine.version}"


def weights_volumes(spec: StackSpec) -> list[dict]:
    """The node-local store's volumes every engine pod has: the weights and the compiled-kernel cache."""
    return [
        {"name": WEIGHTS_VOLUME, "hostPath": {"path": spec.model.weights.node_cache_path, "type": "DirectoryOrCreate"}},
        {"name": JIT_CACHE_VOLUME, "hostPath": {"path": jit_cache_host_path(spec), "type": "DirectoryOrCreate"}},
        {"name": FETCHER_CONFIGMAP, "configMap": {"name": FETCHER_CONFIGMAP}},
    ]


def engine_cache_mounts(spec: StackSpec) -> tuple[list[dict], dict[str, str]]:
    """The engine container's mounts of the node-local store, and the environment that points its
    kernel caches at it (infra/render/engine_args.py jit_cache_env)."""
    return ([{"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT, "readOnly": True},
             {"name": JIT_CACHE_VOLUME, "mountPath": JIT_CACHE_MOUNT}], jit_cache_env(spec.engine.kind))


def credentials_copy(ctx: LayerContext, source_namespace: str, data, secret_type) -> dict:
    """The user's weights credentials Secret as a release track's namespace gets it: the same
    name (what the init container's envFrom reads), the values read from the environment's
    namespace, and where they came from (the Secret to rotate)."""
    name = ctx.spec.model.weights.credentials_secret
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {**ctx.metadata(name, "storage"),
                     "annotations": {naming.COPIED_FROM_ANNOTATION: f"{source_namespace}/{name}"}},
        "type": secret_type,
        "data": data,
    }


class Storage(Layer):
    """`credentials_from`: the environment's namespace, where this layer serves a release track's
    (with `access: secret`, the user's credentials Secret is read there and copied into the
    track's namespace, which the rollout makes and nothing else fills)."""

    layer = "storage"

    def __init__(self, name: str, ctx: LayerContext, opts: pulumi.ResourceOptions | None = None,
                 credentials_from: str | None = None):
        super().__init__(name, ctx, opts)
        self.fetcher = self.add({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": ctx.metadata(FETCHER_CONFIGMAP, "storage"),
            "data": {"weights.py": fetcher_source()},
        })
        w = ctx.spec.model.weights
        if credentials_from and w.access_mode() == "secret":
            self.add(credentials_copy(ctx, credentials_from, *self._user_secret(credentials_from)))
        self.register_outputs({"bucket": w.bucket})

    def _user_secret(self, namespace: str) -> tuple:
        """The data and type of the user's Secret in `namespace`, read (a `get`: the provider marks
        its data secret in the state). Rendering to YAML, the provider reads no cluster
        (pulumi-kubernetes v4 provider.go Read: in yamlRenderMode it answers the object's name only,
        and fails where the cluster is unreachable), so nothing is read: the copy has no values."""
        if yaml_render_directory():
            return None, None
        name = self.ctx.spec.model.weights.credentials_secret
        source = k8s.core.v1.Secret.get(f"{self.ctx.name_prefix}user-secret-{name}", f"{namespace}/{name}",
                                        opts=pulumi.ResourceOptions(parent=self))
        return source.data, source.type
