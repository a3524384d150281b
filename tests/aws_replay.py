"""The AWS part of a platform stack, replayed into moto's server (moto 5.2.5, pinned in pyproject's
test extra) with boto3: each resource the recording holds (infra/recording.py) becomes the AWS API
calls the pulumi-aws provider makes for it, in the order the engine creates them (the dependency
URNs each registration carries: tests/test_platform_order.py `graph`), each resource's outputs
(ids, ARNs) fed to the inputs that name it.

Why moto and not the provider: the real pulumi-aws provider cannot run here (its Go module is not
served), so the calls are written out per resource type below, each citing the AWS API reference
of the call. moto answers them with AWS's own rules where it models them:

- S3: bucket names, versioning, encryption, public access block, ownership controls, lifecycle
  rules (moto's S3 parses each configuration);
- KMS: keys and aliases; a bucket's SSE-KMS key must exist: S3 asks KMS for a data key at the
  first PutObject (Amazon S3 User Guide, "Using server-side encryption with AWS KMS keys"), which
  moto's S3 never does, so the replay makes that GenerateDataKey call itself;
- IAM: document syntax of identity policies (moto's IAMPolicyDocumentValidator:
  MalformedPolicyDocument: effects, actions, resource ARNs, condition operators) and of trust
  policies (its trust variant: sts actions only, no Resource; a missing Principal passes),
  AWS managed policies by ARN (moto carries AWS's list), one OIDC
  provider per URL (EntityAlreadyExists); a trust policy's federated principal must exist (IAM's
  CreateRole answers "MalformedPolicyDocument: Invalid principal in policy"; moto does not look, so
  the replay asks moto's IAM for the provider, GetOpenIDConnectProvider);
- EC2 security groups and their rules (InvalidPermission.Duplicate, a group in a VPC that exists);
- SQS queues and their attributes, EventBridge rules (moto parses each event pattern:
  InvalidEventPatternException) and their targets.

What moto does not model honestly is named in NOT_MODELLED with the reason, never replayed as if
it were checked. moto does not evaluate IAM: nothing here is an access-control check.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import boto3
from botocore.exceptions import ClientError
from pulumi.runtime.mocks import MockResourceArgs

from infra.recording import OfflineRun, RecordingMocks, RegisteredResource
from infra.render.manifests import unwrap
from tests.test_platform_order import graph, is_cloud

MOTO_VERSION = "5.2.5"  # pyproject.toml's test extra: moto[server]==5.2.5


class NeedsUnmodelled(Exception):
    """A replayed resource takes an output of one the replay does not model."""


class Inputs:
    """A resource's inputs as the provider would receive them: every value an input took from
    another resource (its property dependencies) replaced by what moto made for that resource."""

    def __init__(self, resource: RegisteredResource, made: dict[str, dict], mock_outputs: dict[str, dict],
                 skipped: dict[str, str]):
        self.resource = resource
        self._made = made
        self._plain = unwrap(resource.inputs)
        self._resolved: dict[str, Any] = {}
        for prop, value in self._plain.items():
            for urn in resource.property_dependencies.get(prop, ()):
                if urn in skipped and urn in mock_outputs:
                    raise NeedsUnmodelled(f"its {prop} comes from {urn.rsplit('::', 1)[1]} ({skipped[urn]})")
                for mock, real in _swaps(mock_outputs.get(urn, {}), made.get(urn, {})):
                    value = _replace(value, mock, real)
            self._resolved[prop] = value

    def get(self, prop: str, default: Any = None) -> Any:
        value = self._resolved.get(prop, default)
        return default if _is_unknown(value) else value

    def of_dependency(self, prop: str, output: str) -> Any:
        """`prop`'s value, or where the preview left it unknown (an output the mocks do not echo,
        such as a queue's URL), `output` of the one resource it came from, as moto made it."""
        value = self._resolved.get(prop)
        if value is not None and not _is_unknown(value):
            return value
        (urn,) = self.resource.property_dependencies[prop]
        return self._made[urn][output]


def _is_unknown(value: Any) -> bool:
    return type(value).__name__ == "Unknown"


def _swaps(mock: dict, real: dict) -> list[tuple[str, str]]:
    """(what the mocks answered, what moto answered) for each output both name, where they differ."""
    return [(mock[key], real[key]) for key in mock
            if key in real and isinstance(mock[key], str) and isinstance(real[key], str) and mock[key] != real[key]]


def _replace(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: _replace(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, old, new) for v in value]
    return value


def mock_outputs(r: RegisteredResource) -> dict:
    """What the offline run's mocks answered for `r` (infra/recording.py RecordingMocks), its id
    included: the values the recording holds wherever another input named `r`."""
    resource_id, state = RecordingMocks(lambda _: {}).new_resource(
        MockResourceArgs(r.type, r.name, r.inputs, custom=r.custom))
    return {**{k: v for k, v in unwrap(state).items() if k not in r.inputs}, "id": resource_id}


def physical_name(r: RegisteredResource, value: str | None) -> str:
    """The name given, or the one Pulumi's autonaming makes: the resource's name, a dash and seven
    random characters (pulumi-aws provider/resources.go, `AutoName(..., 7)`); here a hash of the
    URN, so a replay is the same each time."""
    return value or f"{r.name}-{hashlib.sha256(r.urn.encode()).hexdigest()[:7]}"


def pascal(value: Any) -> Any:
    """Pulumi's camelCase input names as the AWS API's members (S3's XML shapes)."""
    special = {"id": "ID", "kmsMasterKeyId": "KMSMasterKeyID", "sseAlgorithm": "SSEAlgorithm"}
    if isinstance(value, dict):
        return {special.get(k, k[:1].upper() + k[1:]): pascal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [pascal(v) for v in value]
    return value


# --- one function per resource type: the calls the provider makes, the outputs it keeps ----------

Clients = Callable[[str], Any]  # service name -> boto3 client on moto's endpoint


def s3_bucket(aws: Clients, i: Inputs) -> dict:
    """CreateBucket (Amazon S3 API Reference; no LocationConstraint in us-east-1)."""
    r = i.resource
    name = physical_name(r, i.get("bucket"))
    aws("s3").create_bucket(Bucket=name)
    return {"id": name, "bucket": name, "arn": f"arn:aws:s3:::{name}"}


def s3_versioning(aws: Clients, i: Inputs) -> dict:
    """PutBucketVersioning (Amazon S3 API Reference)."""
    bucket = i.get("bucket")
    aws("s3").put_bucket_versioning(Bucket=bucket, VersioningConfiguration=pascal(i.get("versioningConfiguration")))
    return {"id": bucket}


def s3_encryption(aws: Clients, i: Inputs) -> dict:
    """PutBucketEncryption (Amazon S3 API Reference), then for each SSE-KMS key the GenerateDataKey
    S3 makes at the first PutObject (AWS KMS API Reference; moto's S3 never calls KMS)."""
    bucket, rules = i.get("bucket"), pascal(i.get("rules"))
    aws("s3").put_bucket_encryption(Bucket=bucket, ServerSideEncryptionConfiguration={"Rules": rules})
    for rule in rules:
        key = rule.get("ApplyServerSideEncryptionByDefault", {}).get("KMSMasterKeyID")
        if key:
            aws("kms").generate_data_key(KeyId=key, KeySpec="AES_256")
    return {"id": bucket}


def s3_public_access_block(aws: Clients, i: Inputs) -> dict:
    """PutPublicAccessBlock (Amazon S3 API Reference)."""
    bucket = i.get("bucket")
    settings = {k: bool(i.get(k)) for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                            "restrictPublicBuckets")}
    aws("s3").put_public_access_block(Bucket=bucket, PublicAccessBlockConfiguration=pascal(settings))
    return {"id": bucket}


def s3_ownership(aws: Clients, i: Inputs) -> dict:
    """PutBucketOwnershipControls (Amazon S3 API Reference)."""
    bucket = i.get("bucket")
    aws("s3").put_bucket_ownership_controls(Bucket=bucket, OwnershipControls={"Rules": [pascal(i.get("rule"))]})
    return {"id": bucket}


def s3_lifecycle(aws: Clients, i: Inputs) -> dict:
    """PutBucketLifecycleConfiguration (Amazon S3 API Reference)."""
    bucket = i.get("bucket")
    aws("s3").put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": pascal(i.get("rules"))})
    return {"id": bucket}


def s3_policy(aws: Clients, i: Inputs) -> dict:
    """PutBucketPolicy (Amazon S3 API Reference). moto 5.2.5 stores the document unparsed: its
    syntax is parliament's to judge (tests/test_iam_definitions.py), not this replay's."""
    bucket = i.get("bucket")
    aws("s3").put_bucket_policy(Bucket=bucket, Policy=i.get("policy"))
    return {"id": bucket}


def kms_key(aws: Clients, i: Inputs) -> dict:
    """CreateKey, then EnableKeyRotation where asked (AWS KMS API Reference). moto 5.2.5 stores a
    key policy without parsing it; the program sets none (KMS's default key policy)."""
    kms = aws("kms")
    args = {"Description": i.get("description", ""), "KeyUsage": i.get("keyUsage", "ENCRYPT_DECRYPT"),
            "KeySpec": i.get("customerMasterKeySpec", "SYMMETRIC_DEFAULT")}
    if i.get("policy"):
        args["Policy"] = i.get("policy")
    key = kms.create_key(**args)["KeyMetadata"]
    if i.get("enableKeyRotation"):
        kms.enable_key_rotation(KeyId=key["KeyId"])
    return {"id": key["KeyId"], "keyId": key["KeyId"], "arn": key["Arn"]}


def kms_alias(aws: Clients, i: Inputs) -> dict:
    """CreateAlias (AWS KMS API Reference)."""
    name = i.get("name")
    aws("kms").create_alias(AliasName=name, TargetKeyId=i.of_dependency("targetKeyId", "keyId"))
    return {"id": name, "name": name}


def federated_principals(document: dict) -> list[str]:
    found = []
    for statement in document.get("Statement", []):
        federated = (statement.get("Principal") or {}).get("Federated", []) if isinstance(
            statement.get("Principal"), dict) else []
        found += [federated] if isinstance(federated, str) else federated
    return [arn for arn in found if ":oidc-provider/" in arn]


def iam_role(aws: Clients, i: Inputs) -> dict:
    """CreateRole, PutRolePolicy per inline policy, AttachRolePolicy per managed policy (IAM API
    Reference). IAM refuses a trust policy naming an OIDC provider that does not exist
    ("Invalid principal in policy"); moto does not look, so GetOpenIDConnectProvider asks."""
    iam, r = aws("iam"), i.resource
    name = physical_name(r, i.get("name"))
    trust = i.get("assumeRolePolicy")
    for provider in federated_principals(json.loads(trust)):
        iam.get_open_id_connect_provider(OpenIDConnectProviderArn=provider)
    args = {"RoleName": name, "AssumeRolePolicyDocument": trust, "Path": i.get("path", "/")}
    if i.get("description"):
        args["Description"] = i.get("description")
    role = iam.create_role(**args)["Role"]
    for inline in i.get("inlinePolicies") or []:
        iam.put_role_policy(RoleName=name, PolicyName=inline["name"], PolicyDocument=inline["policy"])
    for arn in i.get("managedPolicyArns") or []:
        iam.attach_role_policy(RoleName=name, PolicyArn=arn)
    return {"id": name, "name": name, "arn": role["Arn"], "uniqueId": role["RoleId"]}


def iam_role_policy(aws: Clients, i: Inputs) -> dict:
    """PutRolePolicy (IAM API Reference)."""
    role, name = i.get("role"), physical_name(i.resource, i.get("name"))
    aws("iam").put_role_policy(RoleName=role, PolicyName=name, PolicyDocument=i.get("policy"))
    return {"id": f"{role}:{name}", "name": name}


def iam_policy(aws: Clients, i: Inputs) -> dict:
    """CreatePolicy (IAM API Reference)."""
    args = {"PolicyName": physical_name(i.resource, i.get("name")), "PolicyDocument": i.get("policy"),
            "Path": i.get("path", "/")}
    if i.get("description"):
        args["Description"] = i.get("description")
    policy = aws("iam").create_policy(**args)["Policy"]
    return {"id": policy["Arn"], "arn": policy["Arn"], "name": policy["PolicyName"]}


def iam_role_policy_attachment(aws: Clients, i: Inputs) -> dict:
    """AttachRolePolicy (IAM API Reference)."""
    aws("iam").attach_role_policy(RoleName=i.get("role"), PolicyArn=i.get("policyArn"))
    return {"id": f"{i.get('role')}-{i.resource.name}"}


def iam_oidc_provider(aws: Clients, i: Inputs) -> dict:
    """CreateOpenIDConnectProvider (IAM API Reference): one provider per URL in an account."""
    arn = aws("iam").create_open_id_connect_provider(
        Url=i.get("url"), ClientIDList=i.get("clientIdLists") or [],
        ThumbprintList=i.get("thumbprintLists") or [])["OpenIDConnectProviderArn"]
    return {"id": arn, "arn": arn}


def ec2_security_group(aws: Clients, i: Inputs) -> dict:
    """CreateSecurityGroup (Amazon EC2 API Reference), then RevokeSecurityGroupEgress of the
    allow-all rule EC2 gives a new group in a VPC, as the provider does (terraform-provider-aws
    internal/service/ec2/vpc_security_group.go, resourceSecurityGroupCreate: the group holds only
    the rules its program declares)."""
    ec2, r = aws("ec2"), i.resource
    args = {"GroupName": physical_name(r, i.get("name")), "Description": i.get("description", "Managed by Pulumi"),
            "VpcId": i.get("vpcId")}
    if i.get("tags"):
        args["TagSpecifications"] = [{"ResourceType": "security-group",
                                      "Tags": [{"Key": k, "Value": v} for k, v in i.get("tags").items()]}]
    group = ec2.create_security_group(**args)["GroupId"]
    ec2.revoke_security_group_egress(GroupId=group, IpPermissions=[
        {"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}])
    return {"id": group, "arn": f"arn:aws:ec2:::security-group/{group}"}


def _permission(i: Inputs) -> dict:
    """One rule of aws:vpc/securityGroup{In,E}gressRule as EC2's IpPermission."""
    permission: dict[str, Any] = {"IpProtocol": str(i.get("ipProtocol"))}
    if i.get("fromPort") is not None:
        permission["FromPort"] = int(i.get("fromPort"))
    if i.get("toPort") is not None:
        permission["ToPort"] = int(i.get("toPort"))
    described = {"Description": i.get("description")} if i.get("description") else {}
    if i.get("cidrIpv4"):
        permission["IpRanges"] = [{"CidrIp": i.get("cidrIpv4"), **described}]
    if i.get("cidrIpv6"):
        permission["Ipv6Ranges"] = [{"CidrIpv6": i.get("cidrIpv6"), **described}]
    if i.get("referencedSecurityGroupId"):
        permission["UserIdGroupPairs"] = [{"GroupId": i.get("referencedSecurityGroupId"), **described}]
    if i.get("prefixListId"):
        permission["PrefixListIds"] = [{"PrefixListId": i.get("prefixListId"), **described}]
    return permission


def ec2_rule(direction: str) -> Callable[[Clients, Inputs], dict]:
    """AuthorizeSecurityGroupIngress or AuthorizeSecurityGroupEgress (Amazon EC2 API Reference)."""
    def authorize(aws: Clients, i: Inputs) -> dict:
        call = getattr(aws("ec2"), f"authorize_security_group_{direction}")
        rules = call(GroupId=i.get("securityGroupId"), IpPermissions=[_permission(i)])["SecurityGroupRules"]
        return {"id": rules[0]["SecurityGroupRuleId"]}
    return authorize


def ec2_tag(aws: Clients, i: Inputs) -> dict:
    """CreateTags (Amazon EC2 API Reference)."""
    resource = i.of_dependency("resourceId", "id")
    aws("ec2").create_tags(Resources=[resource], Tags=[{"Key": i.get("key"), "Value": i.get("value")}])
    return {"id": f"{resource},{i.get('key')}"}


SQS_ATTRIBUTES = {"messageRetentionSeconds": "MessageRetentionPeriod", "sqsManagedSseEnabled": "SqsManagedSseEnabled",
                  "kmsMasterKeyId": "KmsMasterKeyId", "visibilityTimeoutSeconds": "VisibilityTimeout",
                  "delaySeconds": "DelaySeconds", "receiveWaitTimeSeconds": "ReceiveMessageWaitTimeSeconds",
                  "maxMessageSize": "MaximumMessageSize", "policy": "Policy", "fifoQueue": "FifoQueue"}


def _attribute(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def sqs_queue(aws: Clients, i: Inputs) -> dict:
    """CreateQueue (Amazon SQS API Reference), its settings as queue attributes."""
    sqs, name = aws("sqs"), physical_name(i.resource, i.get("name"))
    attributes = {SQS_ATTRIBUTES[k]: _attribute(i.get(k)) for k in SQS_ATTRIBUTES if i.get(k) is not None}
    url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return {"id": url, "url": url, "arn": arn, "name": name}


def sqs_queue_policy(aws: Clients, i: Inputs) -> dict:
    """SetQueueAttributes Policy (Amazon SQS API Reference). moto 5.2.5 parses the document as JSON
    and no further: its syntax is parliament's to judge (tests/test_iam_definitions.py)."""
    url = i.of_dependency("queueUrl", "url")
    aws("sqs").set_queue_attributes(QueueUrl=url, Attributes={"Policy": i.get("policy")})
    return {"id": url}


def events_rule(aws: Clients, i: Inputs) -> dict:
    """PutRule (Amazon EventBridge API Reference); moto parses the event pattern."""
    name = physical_name(i.resource, i.get("name"))
    args = {"Name": name, "State": i.get("state", "ENABLED")}
    for key, member in (("eventPattern", "EventPattern"), ("scheduleExpression", "ScheduleExpression"),
                        ("description", "Description"), ("eventBusName", "EventBusName")):
        if i.get(key):
            args[member] = i.get(key)
    arn = aws("events").put_rule(**args)["RuleArn"]
    return {"id": name, "name": name, "arn": arn}


def events_target(aws: Clients, i: Inputs) -> dict:
    """PutTargets (Amazon EventBridge API Reference): a failed entry is an error."""
    rule, target = i.of_dependency("rule", "name"), physical_name(i.resource, i.get("targetId"))
    answer = aws("events").put_targets(Rule=rule, Targets=[{"Id": target, "Arn": i.get("arn")}])
    if answer.get("FailedEntryCount"):
        raise ValueError(f"PutTargets failed: {answer['FailedEntries']}")
    return {"id": f"{rule}-{target}", "targetId": target}


# type -> (the calls, the function making them)
REPLAYED: dict[str, tuple[str, Callable[[Clients, Inputs], dict]]] = {
    "aws:s3/bucket:Bucket": ("s3:CreateBucket", s3_bucket),
    "aws:s3/bucketV2:BucketV2": ("s3:CreateBucket", s3_bucket),
    "aws:s3/bucketVersioning:BucketVersioning": ("s3:PutBucketVersioning", s3_versioning),
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration": (
        "s3:PutBucketEncryption, kms:GenerateDataKey", s3_encryption),
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": ("s3:PutPublicAccessBlock", s3_public_access_block),
    "aws:s3/bucketOwnershipControls:BucketOwnershipControls": ("s3:PutBucketOwnershipControls", s3_ownership),
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration": (
        "s3:PutBucketLifecycleConfiguration", s3_lifecycle),
    "aws:s3/bucketPolicy:BucketPolicy": ("s3:PutBucketPolicy", s3_policy),
    "aws:kms/key:Key": ("kms:CreateKey, kms:EnableKeyRotation", kms_key),
    "aws:kms/alias:Alias": ("kms:CreateAlias", kms_alias),
    "aws:iam/role:Role": ("iam:GetOpenIDConnectProvider, iam:CreateRole, iam:PutRolePolicy, iam:AttachRolePolicy",
                          iam_role),
    "aws:iam/rolePolicy:RolePolicy": ("iam:PutRolePolicy", iam_role_policy),
    "aws:iam/policy:Policy": ("iam:CreatePolicy", iam_policy),
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment": ("iam:AttachRolePolicy", iam_role_policy_attachment),
    "aws:iam/openIdConnectProvider:OpenIdConnectProvider": ("iam:CreateOpenIDConnectProvider", iam_oidc_provider),
    "aws:ec2/securityGroup:SecurityGroup": ("ec2:CreateSecurityGroup, ec2:RevokeSecurityGroupEgress",
                                            ec2_security_group),
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": ("ec2:AuthorizeSecurityGroupIngress",
                                                                  ec2_rule("ingress")),
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": ("ec2:AuthorizeSecurityGroupEgress", ec2_rule("egress")),
    "aws:ec2/tag:Tag": ("ec2:CreateTags", ec2_tag),
    "aws:sqs/queue:Queue": ("sqs:CreateQueue", sqs_queue),
    "aws:sqs/queuePolicy:QueuePolicy": ("sqs:SetQueueAttributes", sqs_queue_policy),
    "aws:cloudwatch/eventRule:EventRule": ("events:PutRule", events_rule),
    "aws:cloudwatch/eventTarget:EventTarget": ("events:PutTargets", events_target),
}

_EKS = "moto 5.2.5's EKS models clusters, node groups and Fargate profiles only"
NOT_MODELLED: dict[str, str] = {
    "eks:index:Cluster": "pulumi-eks's remote component: the cluster, its IAM roles, security groups and VPC CNI "
                         "add-on are made by the component's own program, which the recording does not see; "
                         f"{_EKS}, without access config or network policy",
    "aws:eks/accessEntry:AccessEntry": f"EKS access entries: {_EKS} (no CreateAccessEntry)",
    "aws:eks/accessPolicyAssociation:AccessPolicyAssociation": f"EKS access policies: {_EKS} (no AssociateAccessPolicy)",
    "aws:eks/podIdentityAssociation:PodIdentityAssociation": f"EKS Pod Identity: {_EKS} "
                                                              "(no CreatePodIdentityAssociation)",
    "aws:eks/addon:Addon": f"EKS add-ons: {_EKS} (no CreateAddon)",
    "aws:eks/nodeGroup:NodeGroup": "its cluster is pulumi-eks's (not modelled); moto's CreateNodegroup checks no "
                                   "instance type, AMI or capacity",
}
# Packages whose resources call no AWS API: the replay has nothing to send for them.
NOT_AWS = ("kubernetes:", "random:", "pulumi:")


def classify(type_: str) -> str:
    if type_ in REPLAYED:
        return "replayed"
    if type_ in NOT_MODELLED:
        return "not modelled"
    if type_.startswith(NOT_AWS):
        return "not AWS"
    return "unclassified"


@dataclass
class Replay:
    made: dict[str, dict] = field(default_factory=dict)              # urn -> outputs moto gave
    calls: list[tuple[str, str]] = field(default_factory=list)       # (urn, the calls)
    skipped: dict[str, str] = field(default_factory=dict)            # urn -> why not replayed
    errors: list[tuple[str, str]] = field(default_factory=list)      # (urn, what AWS's rules refused)

    def error_text(self) -> str:
        return "\n".join(f"{urn.rsplit('::', 1)[1]} ({urn.split('::')[2].rsplit('$', 1)[-1]}): {e}"
                         for urn, e in self.errors)


def creation_order(run: OfflineRun) -> list[RegisteredResource]:
    """Every resource, each after all it depends on (the engine's graph), ties by URN."""
    edges = graph(run)
    by_urn = {r.urn: r for r in run.resources}
    waiting = {urn: set(deps) for urn, deps in edges.items()}
    order: list[RegisteredResource] = []
    while waiting:
        ready = sorted(urn for urn, deps in waiting.items() if not deps)
        if not ready:
            raise ValueError(f"a dependency cycle among {sorted(waiting)}")
        for urn in ready:
            order.append(by_urn[urn])
            del waiting[urn]
        for deps in waiting.values():
            deps.difference_update(ready)
    return order


def replay(run: OfflineRun, aws: Clients, users: dict[str, str] | None = None,
           into: Replay | None = None) -> Replay:
    """Send the AWS calls for each cloud resource of `run`, in creation order. `users` maps values
    the recording holds for what stays the user's (the VPC) to what the test made in moto for it.
    A refused call is an error of that resource; what needs a refused or skipped resource is skipped."""
    result = into or Replay()
    mocks = {r.urn: mock_outputs(r) for r in run.resources if is_cloud(r)}
    for r in creation_order(run):
        if not is_cloud(r):
            continue
        kind = classify(r.type)
        if kind == "not modelled":
            result.skipped[r.urn] = f"not modelled: {NOT_MODELLED[r.type]}"
            continue
        if kind != "replayed":
            result.errors.append((r.urn, f"type {r.type} is in neither REPLAYED nor NOT_MODELLED "
                                         "(tests/aws_replay.py): say which calls make it, or why moto cannot"))
            continue
        failed = [urn for urn in r.depends_on_urns if any(urn == e for e, _ in result.errors)]
        if failed:
            result.skipped[r.urn] = f"needs {failed[0].rsplit('::', 1)[1]}, which was refused"
            continue
        calls, make = REPLAYED[r.type]
        try:
            inputs = Inputs(_users(r, users or {}), result.made, mocks, result.skipped)
            result.made[r.urn] = make(aws, inputs)
            result.calls.append((r.urn, calls))
        except NeedsUnmodelled as why:
            result.skipped[r.urn] = f"not replayed: {why}"
        except (ClientError, ValueError) as refused:
            result.errors.append((r.urn, str(refused)))
    return result


def _users(r: RegisteredResource, users: dict[str, str]) -> RegisteredResource:
    inputs = r.inputs
    for recorded, made in users.items():
        inputs = _replace(inputs, recorded, made)
    return replace(r, inputs=inputs)


def clients(endpoint: str, account: str, region: str) -> Clients:
    """boto3 clients on moto's endpoint with credentials of `account` (STS AssumeRole into a role
    of that account: moto keys each account's state by the credentials a request signs with)."""
    sts = boto3.client("sts", endpoint_url=endpoint, region_name=region)
    credentials = sts.assume_role(RoleArn=f"arn:aws:iam::{account}:role/platform-team",
                                  RoleSessionName="replay")["Credentials"]
    session = boto3.Session(aws_access_key_id=credentials["AccessKeyId"],
                            aws_secret_access_key=credentials["SecretAccessKey"],
                            aws_session_token=credentials["SessionToken"], region_name=region)
    made: dict[str, Any] = {}

    def client(service: str):
        if service not in made:
            made[service] = session.client(service, endpoint_url=endpoint)
        return made[service]

    return client
