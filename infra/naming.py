"""Names and labels shared by the layers, so that a selector and its target cannot drift."""

from __future__ import annotations

import re

# The naming rules of the systems we name things in, in one place.
# S3: docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html (3-63, lower case, digits, . and -).
S3_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
# Kubernetes: kubernetes.io/docs/concepts/overview/working-with-objects/names/ (RFC 1123 subdomain,
# 253 at most, each dot-separated label 63 at most) and .../labels/#syntax-and-character-set.
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


# Hugging Face repo ids (what --served-model-name and tokenizers take): huggingface_hub
# src/huggingface_hub/utils/_validators.py, validate_repo_id: REPO_ID_REGEX
# r"^(\b[\w\-.]+\b/)?\b[\w\-.]+\b$", at most 96 characters, no "--" or "..", not ending in ".git"
# (here in ASCII: \w would admit any Unicode letter).
_HF_REPO_ID = re.compile(r"(?=.{1,96}$)([A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?/)?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
# OCI image references: the grammar of github.com/distribution/reference (reference.go, regexp.go):
# [domain[:port]/]path-component(/path-component)*[:tag][@digest], path components lower-case
# alpha-numerics joined by '.', '_', '__' or runs of '-'; tags [\w][\w.-]{0,127}; here the digest is
# required and sha256 (pdstack pins every image by digest).
_DOMAIN = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])(?:\.(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9]))*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
OCI_DIGEST_REFERENCE = re.compile(rf"(?=.{{1,255}}@){_NAME}(?:{_TAG})?@sha256:[0-9a-f]{{64}}")
# A reference by tag alone (an image pdstack marks as a placeholder until its digest is resolved).
OCI_TAGGED_REFERENCE = re.compile(rf"(?=.{{1,255}}$){_NAME}{_TAG}")
# Pulumi's stack names: letters, digits, '_', '.', '-', 1 to 100 (the pinned CLI's
# sdk/go/common/tokens/stack_name.go, ParseStackName, pulumi v3.274.1), here not starting with
# '-' (any command line it reaches would read it as an option); a StackReference names
# <org>/<project>/<stack>, or fewer parts, each of the same characters.
_STACK_PART = r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,99}"
PULUMI_STACK_NAME = re.compile(_STACK_PART)
PULUMI_STACK_REFERENCE = re.compile(rf"{_STACK_PART}(/{_STACK_PART}){{0,2}}")
# Kubernetes label values: kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set
_LABEL_VALUE = re.compile(r"(?=.{0,63}$)(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
# A node-local folder pdstack mounts (hostPath) and names in scripts: absolute, normalised, each part
# of letters, digits, '.', '_' and '-' (not '.' or '..'), so it means the same to every tool.
_HOST_PATH = re.compile(r"(?:/(?!\.\.?(?:/|$))[A-Za-z0-9._-]+)+/?")


def is_hf_repo_id(name: str) -> bool:
    return bool(_HF_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name and not name.endswith(".git")


def is_label_value(value: str) -> bool:
    return bool(_LABEL_VALUE.fullmatch(value))


def is_host_path(path: str) -> bool:
    return bool(_HOST_PATH.fullmatch(path))


_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")


def release_store_url_problem(url: str) -> str | None:
    """Why `url` is not a release store (None if it is): `s3://bucket/prefix`, or a folder.
    Anything that starts like a URL (`s3:/bucket`, `S3://`, `s3//bucket`, `https://...`) is
    taken for a mistyped bucket, never for a folder of that name: a store in the wrong place
    would hold a lease and a history nobody else sees. A folder whose name has a colon is
    written `./name:x`."""
    if not url.strip():
        return "empty. Fix: s3://<bucket>/<prefix>, or a folder"
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not S3_BUCKET_NAME.fullmatch(bucket):
            return (f"{bucket!r} is not an S3 bucket name (3-63 lower-case letters, digits, '.' and '-'). "
                    "Fix: s3://<bucket>/<prefix>, e.g. s3://pdstack-releases/prod")
        if "//" in prefix or any(part in (".", "..") for part in prefix.split("/")):
            return f"the key prefix {prefix!r} has an empty, '.' or '..' part. Fix: e.g. s3://{bucket}/teams/inference"
        return None
    if _URL_SCHEME.match(url) or url.lower().startswith("s3//"):
        return ("not s3://bucket/prefix, and a release store is that or a folder. Fix: s3://<bucket>/<prefix> "
                "(two slashes, lower case), or ./<folder> for a folder whose name has a colon")
    return None


def is_dns_subdomain(name: str) -> bool:
    return bool(_DNS_SUBDOMAIN.fullmatch(name))


def is_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_NAME.fullmatch(name)) and (not prefix or is_dns_subdomain(prefix))

ROLE_LABEL = "pdstack.io/role"  # node pools, taints and pods: prefill | decode | colocated
RELEASE_LABEL = "pdstack.io/release"  # pods: the release revision they run (canary gates read it)
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LWS; "0" is the leader
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # set by LWS: which group (instance) a pod is in
# On engine pods that serve the engine's HTTP API: a group's leader, and every node of a pool whose
# nodes each serve their own ranks (infra/render/engine_args.py serves_on_every_node). What the
# router, the InferencePool, the engines' Services and the gateway's NetworkPolicy select.
SERVES_API_LABEL = "pdstack.io/serves-api"
ROLE_TAINT_EFFECT = "NoSchedule"
# On pod templates: a digest of the ConfigMaps the pods read at start (launch scripts, cache and
# router configs). Kubernetes restarts nothing when a mounted ConfigMap changes; a changed digest
# changes the template, so the controller rolls the pods and the new flags take effect.
CONFIG_HASH_ANNOTATION = "pdstack.io/config-hash"
# On a Secret the stack copies from the user's (`<namespace>/<name>`): where its values come from.
COPIED_FROM_ANNOTATION = "pdstack.io/copied-from"

ROUTER = "router"
ENCODER = "encoder"
GATEWAY = "gateway"
INFERENCE_POOL = "pdstack-pool"
MOONCAKE_MASTER = "mooncake-master"
LMCACHE_SERVER = "lmcache-server"
OTEL_COLLECTOR = "otel-collector"


def engine(role: str) -> str:
    """Name of a pool's LeaderWorkerSet. LWS also names its own headless Service (the pods' DNS
    subdomain, through which workers find their leader) after it: pdstack never uses this name
    for a Service of its own."""
    return f"engine-{role}"


def engine_http(role: str) -> str:
    """The Service over a pool's leaders, which serve HTTP (for operators and port-forwards;
    routers find engines through the Kubernetes API by label)."""
    return f"engine-{role}-http"


def service_dns(service: str, namespace: str) -> str:
    return f"{service}.{namespace}.svc.cluster.local"
