"""The policy pack: each rule through pulumi-policy's own policy objects, once on a compliant
resource from a shipped stack and once on a copy broken on purpose; and the shipped stacks, their
placeholder images pinned, pass every mandatory rule.
"""

from __future__ import annotations

import json

import copy
import functools
from typing import Callable

import pytest
from pulumi_policy import (
    EnforcementLevel,
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
)

from infra import naming
from infra.policy.pack import policies
from infra.policy.rules import RULES, Resource
from infra.offline import run_spec
from infra.render.manifests import unwrap
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from twin.engine import stand_in_pins


@functools.cache
def pinned_run(stack: str):
    return run_spec(stand_in_pins(load_spec(stack_spec_path(stack))))


def shipped(stack: str) -> list[Resource]:
    """The stack's resources as the analyzer sees them (type, name, plain inputs), its placeholder
    images pinned (stand-in digests): placeholders are refused by "pinned by digest" on purpose
    (tests/test_images.py), and every other rule judges the spec as it will be deployed."""
    return [Resource(r.type, r.name, unwrap(r.inputs)) for r in pinned_run(stack).custom()]


def _opts() -> PolicyResourceOptions:
    return PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [])


def report(rule_name: str, resources: list[Resource]) -> list[str]:
    """Run one rule as the pulumi-policy analyzer would, collecting its violation messages."""
    (policy,) = [p for p in policies() if p.name == rule_name]
    found: list[str] = []
    collect = lambda message, urn=None: found.append(message)  # noqa: E731
    if isinstance(policy, ResourceValidationPolicy):
        for r in resources:
            policy.validate(ResourceValidationArgs(r.type, copy.deepcopy(r.props), f"urn:{r.name}", r.name, _opts(), None), collect)
    else:
        policy_resources = [PolicyResource(r.type, copy.deepcopy(r.props), f"urn:{r.name}", r.name, _opts(), None, None, [], {})
                            for r in resources]
        policy.validate(StackValidationArgs(policy_resources), collect)
    return found


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    return next(r for r in resources if r.kind == kind and r.object_name == name)


def broken(resources: list[Resource], kind: str, name: str, change: Callable[[dict], None]) -> list[Resource]:
    """A copy of the stack where one resource is changed (or dropped, when change returns False)."""
    out = []
    for r in resources:
        if r.kind == kind and r.object_name == name:
            props = copy.deepcopy(r.props)
            if change(props) is False:
                continue
            r = Resource(r.type, r.name, props)
        out.append(r)
    return out


def pod(props: dict, template: str = "template") -> dict:
    spec = props["spec"]
    if "leaderWorkerTemplate" in spec:
        return spec["leaderWorkerTemplate"][template]["spec"]
    return spec["template"]["spec"]


def container(props: dict, template: str = "template") -> dict:
    return pod(props, template)["containers"][0]


def add_env(props, name, value):
    container(props).setdefault("env", []).append({"name": name, "value": value})


def add_resource(resources, type_, name, props):
    return [*resources, Resource(type_, name, props)]


# (rule, stack, how to break it, what the message says)
BREAKS = [
    ("images-pinned-by-digest", "dev",
     lambda rs: broken(rs, "Deployment", "router", lambda p: container(p).update(image="docker.io/lmsysorg/sglang-router:latest")),
     "not pinned by digest"),
    ("no-plaintext-secrets", "dev",
     lambda rs: broken(rs, "ConfigMap", "kvcache-config", lambda p: p["data"].update(token="hf_" + "a1B2" * 9)),
     "Hugging Face token"),
    ("no-plaintext-secrets", "dev",
     lambda rs: broken(rs, "Deployment", "router", lambda p: add_env(p, "HF_TOKEN", "anything")),
     "HF_TOKEN is set in plain text"),
    ("gpu-workloads-placed", "prod",
     lambda rs: broken(rs, "LeaderWorkerSet", "engine-prefill", lambda p: pod(p, "workerTemplate").pop("tolerations")),
     "does not tolerate the prefill pool's taint"),
    ("gpu-workloads-placed", "prod",
     lambda rs: broken(rs, "LeaderWorkerSet", "engine-decode", lambda p: pod(p, "leaderTemplate").pop("nodeSelector")),
     "does not select its role's pool"),
    ("gpu-workloads-placed", "dev",
     lambda rs: broken(rs, "LeaderWorkerSet", "engine-decode",
                       lambda p: container(p, "workerTemplate")["resources"]["limits"].pop("memory")),
     "no limits for memory"),
    ("rbac-least-privilege", "dev",
     lambda rs: broken(rs, "Role", "router", lambda p: p["rules"][0].update(verbs=["*"])),
     "rules[0].verbs has '*'"),
    ("rbac-least-privilege", "dev",
     lambda rs: broken(rs, "Role", "router", lambda p: p["rules"][0]["verbs"].append("delete")),
     "grants delete pods, which no pinned component's source needs"),
    ("rbac-least-privilege", "dev",
     lambda rs: add_resource(rs, "kubernetes:rbac.authorization.k8s.io/v1:ClusterRole", "reader",
                             {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                              "metadata": {"name": "reader"}, "rules": []}),
     "cluster-wide RBAC"),
    ("readiness-probes", "dev",
     lambda rs: broken(rs, "Deployment", "router", lambda p: container(p).pop("readinessProbe")),
     "no readinessProbe"),
    ("namespace-default-deny", "dev",
     lambda rs: broken(rs, "NetworkPolicy", "default-deny", lambda p: False),
     "no default-deny NetworkPolicy"),
    ("namespace-default-deny", "dev",
     lambda rs: [r for r in rs if r.kind != "NetworkPolicy" or r.object_name == "default-deny"],
     "default-deny with no allowlist"),
    ("disruption-budgets", "dev",
     lambda rs: broken(rs, "PodDisruptionBudget", "router", lambda p: False),
     "Deployment router template: no PodDisruptionBudget"),
    ("disruption-budgets", "prod",
     lambda rs: broken(rs, "PodDisruptionBudget", "engine-decode", lambda p: p["spec"].update(maxUnavailable=1)),
     "lets a pod go, which breaks its whole group"),
    ("hop-timeouts", "dev",
     lambda rs: broken(rs, "LeaderWorkerSet", "engine-prefill", lambda p: container(p, "workerTemplate").update(
         env=[e for e in container(p, "workerTemplate")["env"] if not e["name"].startswith("SGLANG_DISAGGREGATION")])),
     "no prefill-to-decode KV timeout"),
    ("hop-timeouts", "dev",
     lambda rs: broken(rs, "HTTPRoute", "gateway", lambda p: p["spec"]["rules"][0].pop("timeouts")),
     "no request timeout (gateway to router)"),
]


@pytest.mark.parametrize("rule,stack,breaker,message", BREAKS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BREAKS)])
def test_rule_passes_the_shipped_resource_and_fails_the_broken_one(rule, stack, breaker, message):
    resources = shipped(stack)
    assert report(rule, resources) == []
    found = report(rule, breaker(resources))
    assert any(message in m for m in found), found


def test_a_pod_under_two_pdbs_is_reported():
    resources = shipped("dev")
    pdb = find(resources, "PodDisruptionBudget", "router")
    twin = Resource(pdb.type, "pdb-twin", {**copy.deepcopy(pdb.props), "metadata": {**pdb.props["metadata"], "name": "twin"}})
    found = report("disruption-budgets", [*resources, twin])
    assert any("selected by 2 PDBs" in m for m in found), found


BUCKET = ("aws:s3/bucketV2:BucketV2", "weights", {"bucket": "pdstack-weights"})
VERSIONING = ("aws:s3/bucketVersioningV2:BucketVersioningV2", "weights-versioning",
              {"bucket": "pdstack-weights", "versioningConfiguration": {"status": "Enabled"}})
BLOCK = ("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", "weights-block",
         {"bucket": "pdstack-weights", "blockPublicAcls": True, "blockPublicPolicy": True,
          "ignorePublicAcls": True, "restrictPublicBuckets": True})


ENCRYPTION = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", "weights-sse",
              {"bucket": "pdstack-weights", "rules": [{"applyServerSideEncryptionByDefault": {
                  "sseAlgorithm": "aws:kms", "kmsMasterKeyId": "arn:aws:kms:us-east-1:1:key/k"}}]})
TLS_ONLY = ("aws:s3/bucketPolicy:BucketPolicy", "weights-policy", {"bucket": "pdstack-weights", "policy": json.dumps({
    "Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": "*",
                                            "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]})})


def test_weights_bucket_private_and_versioned():
    ok = [Resource(*BUCKET), Resource(*VERSIONING), Resource(*BLOCK), Resource(*ENCRYPTION), Resource(*TLS_ONLY)]
    assert report("weights-bucket-private-versioned", ok) == []
    plain = [Resource(*BUCKET), Resource(*VERSIONING), Resource(*BLOCK)]
    found = report("weights-bucket-private-versioned", plain)
    assert any("KMS" in m for m in found) and any("without TLS" in m for m in found)
    suspended = [Resource(*BUCKET), Resource(VERSIONING[0], VERSIONING[1], {**VERSIONING[2], "versioningConfiguration": {"status": "Suspended"}}), Resource(*BLOCK)]
    assert any("versioning is not enabled" in m for m in report("weights-bucket-private-versioned", suspended))
    public = [Resource(BUCKET[0], BUCKET[1], {**BUCKET[2], "acl": "public-read"}), Resource(*VERSIONING)]
    found = report("weights-bucket-private-versioned", public)
    assert any("acl public-read" in m for m in found) and any("public access is not blocked" in m for m in found)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_shipped_stacks_pass_every_mandatory_rule(stack):
    resources = shipped(stack)
    for rule in RULES:
        if rule.level == "mandatory":
            assert report(rule.name, resources) == [], rule.name


def test_every_rule_has_a_level_the_cli_enforces():
    levels = {p.name: p.enforcement_level for p in policies()}
    assert set(levels) == {r.name for r in RULES}
    assert levels["images-pinned-by-digest"] == EnforcementLevel.MANDATORY
    assert levels["readiness-probes"] == EnforcementLevel.ADVISORY
    tested = {b[0] for b in BREAKS} | {"weights-bucket-private-versioned", "iam-scoped", "no-static-credentials"}
    assert tested == set(levels), "every rule needs a breaking case"


# --- RBAC: what the workloads' service accounts may do ------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_rbac_is_namespaced_read_only_and_without_wildcards(stack):
    resources = shipped(stack)
    kinds = {r.kind for r in resources}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    for role in [r for r in resources if r.kind == "Role"]:
        for rule in role.props["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert set(rule["verbs"]) <= {"get", "list", "watch"}
    (binding,) = [r for r in resources if r.kind == "RoleBinding"]
    assert [s["name"] for s in binding.props["subjects"]] == [naming.ROUTER]
    engine_sa = find(resources, "ServiceAccount", "engine")
    assert engine_sa.props["automountServiceAccountToken"] is False


def test_iam_roles_scoped_and_no_static_credentials():
    """Pod Identity's trust (docs.aws.amazon.com/eks/latest/userguide/pod-id-role.html: principal
    pods.eks.amazonaws.com, sts:AssumeRole + sts:TagSession) must carry a condition on the cluster,
    else any cluster in any account could bind the role; an access key or a Secret holding one is
    a static credential."""
    trust = lambda cond: json.dumps({"Statement": [{"Effect": "Allow", "Principal": {  # noqa: E731
        "Service": "pods.eks.amazonaws.com"}, "Action": ["sts:AssumeRole", "sts:TagSession"], **cond}]})
    scoped = Resource("aws:iam/role:Role", "r", {"assumeRolePolicy": trust(
        {"Condition": {"ArnEquals": {"aws:SourceArn": "arn:aws:eks:us-east-1:1:cluster/c"}}})})
    assert report("iam-scoped", [scoped]) == []
    assert any("without a condition" in m for m in report("iam-scoped", [
        Resource("aws:iam/role:Role", "r", {"assumeRolePolicy": trust({})})]))
    star = Resource("aws:iam/rolePolicy:RolePolicy", "p", {"policy": json.dumps({"Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})})
    assert len(report("iam-scoped", [star])) == 2
    key = Resource("aws:iam/accessKey:AccessKey", "k", {"user": "ci"})
    secret = Resource("kubernetes:core/v1:Secret", "s", {"kind": "Secret", "metadata": {"name": "s"},
                                                          "stringData": {"AWS_SECRET_ACCESS_KEY": "x"}})
    assert len(report("no-static-credentials", [key, secret])) == 2


def test_the_users_weights_credentials_copied_into_each_release_track_pass_and_no_other_secret_does():
    """With `access: secret` each release track's namespace gets a copy of the user's Secret from
    the environment's namespace (infra/components/storage.py), which holds AWS_ACCESS_KEY_ID: the
    user's key for a store outside AWS, not one the stack makes. dev with two tracks passes every
    mandatory rule; a Secret holding such a key is still reported when its annotation names a
    source it was not copied from (another Secret, or a namespace whose track it is not in)."""
    from infra.tracks import plan_tracks

    spec = stand_in_pins(load_spec(stack_spec_path("dev")))
    data = spec.model_dump(mode="json")
    run = run_spec(spec, tracks=plan_tracks([(1, 90, data), (2, 10, data)]))
    resources = [Resource(r.type, r.name, unwrap(r.inputs)) for r in run.custom()]
    copies = [r for r in resources if r.kind == "Secret" and "AWS_ACCESS_KEY_ID" in (r.props.get("data") or {})]
    assert [c.namespace for c in copies] == ["pdstack-dev-r1", "pdstack-dev-r2"]
    for rule in RULES:
        if rule.level == "mandatory":
            assert report(rule.name, resources) == [], rule.name

    def annotated(source: str, namespace: str = "pdstack-dev-r1") -> Resource:
        props = copy.deepcopy(copies[0].props)
        props["metadata"] |= {"namespace": namespace, "annotations": {naming.COPIED_FROM_ANNOTATION: source}}
        return Resource(copies[0].type, copies[0].name, props)

    for wrong in (annotated("pdstack-dev/other-secret"), annotated("pdstack-prod/weights-s3-credentials"),
                  annotated("pdstack-dev/weights-s3-credentials", namespace="pdstack-dev"),
                  annotated("pdstack-dev/weights-s3-credentials", namespace="pdstack-dev-research")):
        assert report("no-static-credentials", [wrong]) == [
            "Secret weights-s3-credentials: holds AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY. Fix: weights.access "
            "pod-identity or irsa"], wrong.props["metadata"]
