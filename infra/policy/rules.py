"""The review rules of the policy pack, as pure functions over resources as Pulumi's analyzer
sees them: a type token and plain input properties (camelCase, secrets already unwrapped).

`policy/__main__.py` serves them to `pulumi preview --policy-pack policy`, and
`pdctl policy` runs the same functions on the offline preview. A resource rule returns
one message per problem with that resource; a stack rule sees every resource at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

from infra import naming

Level = Literal["mandatory", "advisory"]


@dataclass(frozen=True)
class Resource:
    type: str
    name: str
    props: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.props.get("kind", "") if self.type.startswith("kubernetes:") else ""

    @property
    def namespace(self) -> str:
        return (self.props.get("metadata") or {}).get("namespace", "")

    @property
    def object_name(self) -> str:
        return (self.props.get("metadata") or {}).get("name", self.name)

    def ref(self) -> str:
        return f"{self.kind or self.type} {self.object_name}"


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    level: Level
    check_resource: Callable[[Resource], list[str]] | None = None
    check_stack: Callable[[list[Resource]], list[str]] | None = None


# --- where pods are in a resource ----------------------------------------------------------


def pod_templates(res: Resource) -> Iterator[tuple[str, dict, dict]]:
    """(where, pod metadata, pod spec) for every pod a workload resource would run."""
    spec = res.props.get("spec") or {}
    kind = res.kind
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "Job", "ReplicaSet"):
        tpl = spec.get("template") or {}
        yield "template", tpl.get("metadata") or {}, tpl.get("spec") or {}
    elif kind == "CronJob":
        tpl = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
        yield "jobTemplate", tpl.get("metadata") or {}, tpl.get("spec") or {}
    elif kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        for key in ("leaderTemplate", "workerTemplate"):
            if lwt.get(key):
                yield key, lwt[key].get("metadata") or {}, lwt[key].get("spec") or {}
    elif kind == "Pod":
        yield "pod", res.props.get("metadata") or {}, spec


def containers(pod: dict) -> Iterator[dict]:
    yield from pod.get("initContainers") or []
    yield from pod.get("containers") or []


def _gpus(container: dict) -> bool:
    res = container.get("resources") or {}
    return any("nvidia.com/gpu" in (res.get(k) or {}) for k in ("requests", "limits"))


# --- resource rules ------------------------------------------------------------------------

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


_VERSION_TAG = re.compile(r":v?[0-9][^:/@]*$")  # a release's tag: v0.93.0, 1.14.1, 25.3.4-ubi9


# The annotation a platform workload carries when its images come from the platform spec (pdstack's
# own, e.g. Grafana), not from a project's published chart or manifests.
IMAGES_FROM_SPEC = "pdstack.io/images-from-spec"


def images_by_digest(res: Resource) -> list[str]:
    """pdstack's own workloads (every serving one; a platform one marked IMAGES_FROM_SPEC) name their
    images by digest: a spec's marked placeholder renders without one and is refused here. A platform
    controller's come from its project's published chart or manifests at the pinned version, which
    name them by that release's tag (prometheus-operator's bundle.yaml: `...:v0.93.0`); pinning those
    by digest needs the registry, so they must name a release tag at least (no `latest`, no bare name)."""
    from_spec = IMAGES_FROM_SPEC in ((res.props.get("metadata") or {}).get("annotations") or {})
    problems = []
    for where, _, pod in pod_templates(res):
        for c in containers(pod):
            image = c.get("image", "")
            if not (serving(res) or from_spec):
                if not (_DIGEST.search(image) or _VERSION_TAG.search(image)):
                    problems.append(f"{res.ref()} {where}/{c.get('name')}: platform image {image!r} names no release. "
                                    "Fix: the release's version tag or name@sha256:<digest>, in the row's values")
                continue
            if not _DIGEST.search(image):  # a spec's marked placeholder renders so (infra/images.py)
                problems.append(f"{res.ref()} {where}/{c.get('name')}: image {image!r} is not pinned by digest (a "
                                "placeholder: an image not built or not resolved). Fix: name@sha256:<digest> in the "
                                "stack spec's images (images.engines.<kind>.image for engines): "
                                "`pdctl images --write` pins the digest its registry serves")
    return problems


# Shapes of credentials that must never sit in plain text (outside a Secret): the one list every
# output is redacted with (infra/redaction.py).
_SECRET_ENV_NAME = re.compile(r"(^|_)(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|ACCESS_KEY)(_|$)")


def _secret_shapes(text: str) -> list[str]:
    from infra.redaction import secret_shapes

    return secret_shapes(text)


def no_plaintext_secrets(res: Resource) -> list[str]:
    """Secret values belong in a Kubernetes Secret (whose data Pulumi keeps encrypted)."""
    if res.kind == "Secret" or not res.type.startswith("kubernetes:"):
        return []
    problems = []
    if res.kind == "ConfigMap":
        for key, value in (res.props.get("data") or {}).items():
            for what in _secret_shapes(str(value)):
                problems.append(f"{res.ref()} data[{key}] holds a {what} in plain text. Fix: move it to a Secret")
    for where, meta, pod in pod_templates(res):
        for c in containers(pod):
            for env in c.get("env") or []:
                if "value" in env and _SECRET_ENV_NAME.search(env.get("name", "")):
                    problems.append(f"{res.ref()} {where}/{c.get('name')} env {env['name']} is set in plain text. "
                                    "Fix: valueFrom.secretKeyRef")
                elif "value" in env:
                    problems += [f"{res.ref()} {where}/{c.get('name')} env {env['name']} holds a {w}. Fix: valueFrom.secretKeyRef"
                                 for w in _secret_shapes(str(env["value"]))]
            for what in _secret_shapes(" ".join(map(str, [*(c.get("command") or []), *(c.get("args") or [])]))):
                problems.append(f"{res.ref()} {where}/{c.get('name')} command line holds a {what}. Fix: read it from a Secret")
        for key, value in (meta.get("annotations") or {}).items():
            problems += [f"{res.ref()} annotation {key} holds a {w}" for w in _secret_shapes(str(value))]
    return problems


def gpu_workloads_placed(res: Resource) -> list[str]:
    """A GPU pod has limits, selects its role's pool, and tolerates that pool's taint."""
    problems = []
    for where, meta, pod in pod_templates(res):
        gpu_containers = [c for c in containers(pod) if _gpus(c)]
        if not gpu_containers:
            continue
        for c in gpu_containers:
            limits = (c.get("resources") or {}).get("limits") or {}
            missing = [k for k in ("nvidia.com/gpu", "memory") if k not in limits]
            if missing:
                problems.append(f"{res.ref()} {where}/{c.get('name')}: no limits for {', '.join(missing)}. Fix: set resources.limits")
        role = (meta.get("labels") or {}).get(naming.ROLE_LABEL) or (pod.get("nodeSelector") or {}).get(naming.ROLE_LABEL)
        if (pod.get("nodeSelector") or {}).get(naming.ROLE_LABEL) != role or not role:
            problems.append(f"{res.ref()} {where}: GPU pod does not select its role's pool. "
                            f"Fix: nodeSelector {naming.ROLE_LABEL}: <prefill|decode|colocated>")
            continue
        tolerated = any(t.get("key") == naming.ROLE_LABEL and t.get("effect") in (naming.ROLE_TAINT_EFFECT, None, "")
                        and (t.get("operator") == "Exists" or t.get("value") == role)
                        for t in pod.get("tolerations") or [])
        if not tolerated:
            problems.append(f"{res.ref()} {where}: GPU pod does not tolerate the {role} pool's taint. "
                            f"Fix: toleration {naming.ROLE_LABEL}={role}:{naming.ROLE_TAINT_EFFECT}")
    return problems


_WILDCARD = "*"


PLATFORM_PART_OF = "pdstack-platform"  # the label the platform stack puts on every object it registers


def serving(res: Resource) -> bool:
    """Not an object of the platform stack. Its controllers need cluster-wide RBAC and run in
    namespaces their charts shape; the serving-only rules below do not judge them."""
    return ((res.props.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/part-of") != PLATFORM_PART_OF


def rbac_least_privilege(res: Resource) -> list[str]:
    """Namespaced roles only, no wildcards, and no grant that no pinned component's source asks for
    (infra/render/rbac.py: pinned/rbac-needs.json, derived by scripts/derive_rbac.py). Objects of the
    platform stack are not judged here (`serving`)."""
    from infra.render import rbac

    if not serving(res):
        return []
    if res.kind in ("ClusterRole", "ClusterRoleBinding"):
        return [f"{res.ref()}: cluster-wide RBAC. Fix: a Role and RoleBinding in the stack's namespace"]
    if res.kind != "Role":
        return []
    problems = []
    allowed = rbac.permitted("namespace")
    for i, rule in enumerate(res.props.get("rules") or []):
        for field in ("verbs", "resources", "apiGroups"):
            if _WILDCARD in (rule.get(field) or []):
                problems.append(f"{res.ref()} rules[{i}].{field} has '*'. Fix: name the {field} it needs")
        extra = sorted(rbac.granted([rule]) - allowed)
        extra = [t for t in extra if _WILDCARD not in t]
        if extra:
            shown = ", ".join(f"{v} {r}" + (f".{g}" if g else "") for g, r, v in extra)
            problems.append(f"{res.ref()} rules[{i}] grants {shown}, which no pinned component's source needs. "
                            "Fix: grant what infra/render/rbac.py derives for the component")
    return problems


def readiness_probes(res: Resource) -> list[str]:
    """Containers that serve have a readiness probe (LWS workers behind a leader serve nothing).
    A platform controller's pods are as its project publishes them (`serving`)."""
    if not serving(res):
        return []
    templates = list(pod_templates(res))
    has_leader = any(where == "leaderTemplate" for where, _, _ in templates)
    return [f"{res.ref()} {where}/{c.get('name')}: no readinessProbe; traffic may reach it before it serves"
            for where, _, pod in templates if not (has_leader and where == "workerTemplate")
            for c in pod.get("containers") or [] if not c.get("readinessProbe")]


# --- stack rules ---------------------------------------------------------------------------


def _of_kind(resources: list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r.kind == kind]


def namespace_default_deny(resources: list[Resource]) -> list[str]:
    problems = []
    policies = _of_kind(resources, "NetworkPolicy")
    for ns in [n for n in _of_kind(resources, "Namespace") if serving(n)]:
        name = ns.object_name
        mine = [p for p in policies if p.namespace == name]
        deny = [p for p in mine if (p.props.get("spec") or {}).get("podSelector") in ({}, None)
                and {"Ingress", "Egress"} <= set((p.props.get("spec") or {}).get("policyTypes") or [])
                and not (p.props.get("spec") or {}).get("ingress") and not (p.props.get("spec") or {}).get("egress")]
        if not deny:
            problems.append(f"Namespace {name}: no default-deny NetworkPolicy (podSelector {{}}, Ingress and Egress, "
                            "no rules). Fix: add one, then allow each needed flow explicitly")
        elif len(mine) == len(deny):
            problems.append(f"Namespace {name}: default-deny with no allowlist: nothing could talk. "
                            "Fix: add NetworkPolicies for the flows the service needs")
    return problems


def _selects(selector: dict, labels: dict) -> bool:
    match = (selector or {}).get("matchLabels") or {}
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


SERVING_COMPONENTS = ("engine", "router", "encoder")  # app.kubernetes.io/component of what serves requests


def disruption_budgets(resources: list[Resource]) -> list[str]:
    """Every engine and router workload has exactly one PDB; a multi-node group's lets none go."""
    problems = []
    pdbs = _of_kind(resources, "PodDisruptionBudget")
    workloads = [*_of_kind(resources, "Deployment"), *_of_kind(resources, "LeaderWorkerSet")]
    for res in workloads:
        if ((res.props.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component") not in SERVING_COMPONENTS:
            continue
        for where, meta, _ in pod_templates(res):
            labels = meta.get("labels") or {}
            covering = [p for p in pdbs if p.namespace == res.namespace and _selects((p.props.get("spec") or {}).get("selector"), labels)]
            if not covering:
                problems.append(f"{res.ref()} {where}: no PodDisruptionBudget selects its pods. Fix: add one")
                break
            if len(covering) > 1:
                problems.append(f"{res.ref()} {where}: selected by {len(covering)} PDBs "
                                f"({', '.join(p.object_name for p in covering)}), so none of its pods can be evicted. "
                                "Fix: narrow the selectors to one workload each")
            size = ((res.props.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size", 1)
            if res.kind == "LeaderWorkerSet" and size > 1:
                loose = [p.object_name for p in covering if (p.props.get("spec") or {}).get("maxUnavailable") not in (0, "0", "0%")]
                if loose:
                    problems.append(f"{res.ref()}: {int(size)}-node groups, but PDB {', '.join(loose)} lets a pod go, "
                                    "which breaks its whole group. Fix: maxUnavailable: 0 (replace groups by rollout)")
            break  # leader and worker templates share the PDB check
    return problems


_KV_HOP_ENV = ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT")


def hop_timeouts(resources: list[Resource]) -> list[str]:
    """Every hop of a request has a timeout. (No KV bandwidth quota is demanded: the
    egress-bandwidth annotation cannot shape EFA/RDMA traffic; infra/render/kvcache_config.py.)"""
    problems = []
    launch_data = {c.object_name: json.dumps(c.props.get("data") or {}) for c in _of_kind(resources, "ConfigMap")}
    for res in _of_kind(resources, "LeaderWorkerSet"):
        for where, meta, pod in pod_templates(res):
            role = (meta.get("labels") or {}).get(naming.ROLE_LABEL)
            if role not in ("prefill", "decode"):
                continue
            env = {e.get("name") for c in pod.get("containers") or [] for e in c.get("env") or []}
            scripts = " ".join(launch_data.get(v.get("configMap", {}).get("name", ""), "") for v in pod.get("volumes") or [])
            if not env & set(_KV_HOP_ENV) and "kv_lease_duration" not in scripts:
                problems.append(f"{res.ref()} {where}: no prefill-to-decode KV timeout. "
                                "Fix: set timeouts.router_to_prefill (SGLang) or timeouts.prefill_to_decode_kv (vLLM), "
                                "rendered by infra/render/engine_args.py")
            break
    for route in _of_kind(resources, "HTTPRoute"):
        for i, rule in enumerate((route.props.get("spec") or {}).get("rules") or []):
            if not (rule.get("timeouts") or {}).get("request"):
                problems.append(f"{route.ref()} rules[{i}]: no request timeout (gateway to router). "
                                "Fix: set timeouts.gateway_to_router")
    for cm in _of_kind(resources, "ConfigMap"):
        script = json.dumps(cm.props.get("data") or {})
        if cm.object_name == f"{naming.ROUTER}-launch" and "sglang_router" in script and "--request-timeout-secs" not in script:
            problems.append(f"{cm.ref()}: the router has no request timeout (the whole request). "
                            "Fix: set timeouts.gateway_to_router")
    return problems


_BUCKET_TYPES = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
_ENCRYPTION = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
               "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2")
_PUBLIC_ACLS = ("public-read", "public-read-write", "authenticated-read")


def weights_bucket_private_versioned(resources: list[Resource]) -> list[str]:
    """Applies to buckets the stack creates (pdstack's stacks use an existing bucket, which
    `scripts/upload_weights` checks against the endpoint itself)."""
    problems = []
    buckets = [r for r in resources if r.type in _BUCKET_TYPES]
    versioning = [r for r in resources if r.type.startswith("aws:s3/bucketVersioning")]
    blocks = [r for r in resources if r.type == "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"]
    for bucket in buckets:
        ident = bucket.props.get("bucket") or bucket.name
        refers = lambda r: r.props.get("bucket") in (ident, bucket.name)  # noqa: E731
        if bucket.props.get("acl") in _PUBLIC_ACLS:
            problems.append(f"bucket {ident}: acl {bucket.props['acl']}. Fix: private")
        inline = (bucket.props.get("versioning") or {}).get("enabled") is True
        separate = any(refers(v) and ((v.props.get("versioningConfiguration") or {}).get("status") == "Enabled") for v in versioning)
        if not (inline or separate):
            problems.append(f"bucket {ident}: versioning is not enabled. Fix: a BucketVersioningV2 with status Enabled")
        flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
        if not any(refers(b) and all(b.props.get(f) is True for f in flags) for b in blocks):
            problems.append(f"bucket {ident}: public access is not blocked. Fix: a BucketPublicAccessBlock with all four flags")
        encryption = [r for r in resources if r.type in _ENCRYPTION and refers(r)]
        kms = any((rule.get("applyServerSideEncryptionByDefault") or {}).get("sseAlgorithm") == "aws:kms"
                  for r in encryption for rule in r.props.get("rules") or [])
        if not kms:
            problems.append(f"bucket {ident}: not encrypted with a KMS key. Fix: a BucketServerSideEncryptionConfiguration "
                            "with sseAlgorithm aws:kms")
        if not any(refers(r) and _denies_plain_http(r.props.get("policy")) for r in resources
                   if r.type == "aws:s3/bucketPolicy:BucketPolicy"):
            problems.append(f"bucket {ident}: requests without TLS are not refused. Fix: a BucketPolicy denying s3:* "
                            "when aws:SecureTransport is false")
    return problems


def _json(text) -> dict:
    """A policy document given as JSON text or a mapping; anything else (a value preview cannot
    know yet) is no document."""
    if isinstance(text, dict):
        return text
    try:
        found = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _statements(document) -> list[dict]:
    found = _json(document).get("Statement") or []
    return found if isinstance(found, list) else [found]


def _denies_plain_http(document) -> bool:
    return any(st.get("Effect") == "Deny" and (st.get("Condition") or {}).get("Bool", {}).get("aws:SecureTransport")
               == "false" for st in _statements(document))


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


# Actions IAM's definitions give no resource type (Service Authorization Reference; checked against
# parliament's copy in tests/test_iam_definitions.py): `*` is the only resource they can be granted
# on, and none has a condition key that would fence it. They list names and nothing else.
UNSCOPABLE_LISTS = frozenset({"iam:ListInstanceProfiles"})


def iam_scoped(res: Resource) -> list[str]:
    """Roles are assumed by named principals under conditions (a cluster, a repository's
    environment, service accounts); their policies grant no action on every resource without a
    condition, and never every action."""
    problems = []
    if res.type == "aws:iam/role:Role":
        for st in _statements(res.props.get("assumeRolePolicy")):
            principal = st.get("Principal")
            if principal == "*" or (isinstance(principal, dict) and "*" in _listed(principal.get("AWS", []))):
                problems.append(f"role {res.name}: anyone may assume it. Fix: name the principal")
            federated = isinstance(principal, dict) and "Federated" in principal
            pods = isinstance(principal, dict) and principal.get("Service") == "pods.eks.amazonaws.com"
            if (federated or pods) and not st.get("Condition"):
                problems.append(f"role {res.name}: a web identity or Pod Identity trust without a condition lets any "
                                "token or cluster assume it. Fix: condition on the subject or the cluster")
    if res.type in ("aws:iam/rolePolicy:RolePolicy", "aws:iam/policy:Policy"):
        for st in _statements(res.props.get("policy")):
            if st.get("Effect") != "Allow":
                continue
            actions = _listed(st.get("Action", []))
            if "*" in actions or any(a.endswith(":*") for a in actions if isinstance(a, str)):
                problems.append(f"policy {res.name}: grants {', '.join(a for a in actions if a.endswith('*'))}. "
                                "Fix: name the actions")
            if "*" in _listed(st.get("Resource", [])) and not st.get("Condition") \
                    and not set(actions) <= UNSCOPABLE_LISTS:
                problems.append(f"policy {res.name}: {', '.join(actions)} on every resource without a condition. "
                                "Fix: name the resources, or condition them (region, tags)")
    return problems


_STATIC_KEY_NAMES = re.compile(r"^(AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN)$")


def copied_into_a_track(res: Resource) -> bool:
    """A Secret the stack copies, under its own name, from the environment's namespace into one of
    its release tracks' (`<namespace>-r<revision>`, infra/tracks.py track_namespace), as the
    annotation naming its source says: the user's Secret, in another namespace."""
    annotations = (res.props.get("metadata") or {}).get("annotations") or {}
    namespace, _, name = annotations.get(naming.COPIED_FROM_ANNOTATION, "").partition("/")
    return bool(namespace) and name == res.object_name and \
        re.fullmatch(re.escape(namespace) + r"-r[1-9][0-9]*", res.namespace) is not None


def no_static_credentials(resources: list[Resource]) -> list[str]:
    """No long-lived cloud key is made or handed to a pod: no IAM user access key, no Secret holding
    one, no container reading one; AWS access goes through roles (Pod Identity, IRSA, OIDC). A
    Secret the user provides for a store outside AWS (weights.access: secret) is named by the spec,
    not made here, and is reported only when a stack creates it; its copies into the release
    tracks' namespaces (infra/components/storage.py) are the user's Secret still."""
    problems = []
    for r in resources:
        if r.type in ("aws:iam/accessKey:AccessKey", "aws:iam/userLoginProfile:UserLoginProfile"):
            problems.append(f"{r.type.split(':')[-1]} {r.name}: a long-lived IAM credential. Fix: a role assumed "
                            "through Pod Identity, IRSA or OIDC")
        if r.kind == "Secret" and not copied_into_a_track(r):
            keys = {**(r.props.get("data") or {}), **(r.props.get("stringData") or {})}
            found = [k for k in keys if _STATIC_KEY_NAMES.match(k)]
            if found:
                problems.append(f"Secret {r.object_name}: holds {', '.join(found)}. Fix: weights.access pod-identity "
                                "or irsa")
        for where, _meta, pod in pod_templates(r):
            for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                for env in c.get("env") or []:
                    if _STATIC_KEY_NAMES.match(env.get("name", "")) and "value" in env:
                        problems.append(f"{r.ref()} {where} container {c.get('name')}: {env['name']} in plain "
                                        "text. Fix: a role (pod-identity, irsa)")
    return problems


RULES: tuple[Rule, ...] = (
    Rule("images-pinned-by-digest", "Serving images are pinned by digest; platform images by a release at least.",
         "mandatory", images_by_digest),
    Rule("no-plaintext-secrets", "No secret, API key or token in plain text outside a Secret.", "mandatory",
         no_plaintext_secrets),
    Rule("gpu-workloads-placed", "GPU pods have limits, select their role's pool and tolerate its taint.",
         "mandatory", gpu_workloads_placed),
    Rule("rbac-least-privilege", "Namespaced RBAC without wildcards, granting only what a component's source needs.", "mandatory", rbac_least_privilege),
    Rule("readiness-probes", "Serving containers have a readiness probe.", "advisory", readiness_probes),
    Rule("namespace-default-deny", "Each namespace is default-deny with an explicit allowlist.", "mandatory",
         check_stack=namespace_default_deny),
    Rule("disruption-budgets", "Engines and routers have PDBs; multi-node groups stay whole.", "mandatory",
         check_stack=disruption_budgets),
    Rule("hop-timeouts", "Every hop of a request has its timeout.", "mandatory", check_stack=hop_timeouts),
    Rule("weights-bucket-private-versioned", "Buckets are private, versioned, KMS-encrypted and TLS-only.", "mandatory",
         check_stack=weights_bucket_private_versioned),
    Rule("iam-scoped", "IAM roles are assumed under conditions; policies name their actions and resources.",
         "mandatory", iam_scoped),
    Rule("no-static-credentials", "No long-lived cloud key is created or given to a pod.", "mandatory",
         check_stack=no_static_credentials),
)


@dataclass(frozen=True)
class Violation:
    rule: str
    level: Level
    message: str


def evaluate_offline(run) -> list[Violation]:
    """Every rule over an offline run's registrations (infra/offline.py), secrets unwrapped in memory."""
    from infra.render.manifests import unwrap  # not at import: the policy pack itself does without it

    return evaluate([Resource(r.type, r.name, unwrap(r.inputs)) for r in run.custom()])


def evaluate(resources: list[Resource], rules: tuple[Rule, ...] = RULES) -> list[Violation]:
    """Every rule over a stack's resources, as the policy pack would report them."""
    found = []
    for rule in rules:
        if rule.check_resource:
            found += [Violation(rule.name, rule.level, m) for r in resources for m in rule.check_resource(r)]
        if rule.check_stack:
            found += [Violation(rule.name, rule.level, m) for m in rule.check_stack(resources)]
    return found
