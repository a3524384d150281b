"""Both AWS platform stacks replayed into one moto account (tests/aws_replay.py: moto 5.2.5's server
on 127.0.0.1, the calls the pulumi-aws provider makes per resource, in the engine's creation order,
each citing the AWS API reference), and the breaks AWS's own rules refuse there: a malformed policy
document (IAM API Reference, PutRolePolicy: MalformedPolicyDocument), a bucket encrypted by a KMS
key that does not exist (AWS KMS API Reference, GenerateDataKey: NotFoundException), a second OIDC
provider for the same URL (IAM API Reference, CreateOpenIDConnectProvider: EntityAlreadyExists) and
a role trusting an OIDC provider not yet made (IAM: Invalid principal in policy).

moto does not evaluate IAM: nothing here says who may do what. What it does not model is in
tests/aws_replay.py NOT_MODELLED, and each skipped resource is listed with that reason.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from importlib.metadata import version

import pytest

from infra.recording import MOCK_ACCOUNT, MOCK_REGION, OfflineRun, RegisteredResource
from tests.aws_replay import MOTO_VERSION, NOT_MODELLED, REPLAYED, Replay, classify, clients, replay
from tests.conftest import shipped_run
from tests.servers import moto_s3
from tests.test_platform_order import is_cloud

PLATFORMS = ("platform-prod", "platform-dev")


@pytest.fixture(scope="module")
def moto_endpoint(monkeypatch_module):
    monkeypatch_module.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch_module.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    # moto loads AWS's managed policies only when told (moto/settings.py load_iam_aws_managed_policies):
    # with them, a role attaching one AWS does not publish is refused (NoSuchEntity)
    monkeypatch_module.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    with moto_s3() as url:
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture
def account(moto_endpoint):
    """An empty moto, and clients signed as the account the recordings' caller identity names,
    with the user's VPC (README "Objects that stay the user's") made in it."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST"))
    aws = clients(moto_endpoint, MOCK_ACCOUNT, MOCK_REGION)
    assert aws("sts").get_caller_identity()["Account"] == MOCK_ACCOUNT
    vpc = aws("ec2").create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    return aws, {recorded_vpc: vpc for recorded_vpc in users_vpcs()}


def users_vpcs() -> set[str]:
    """The VPC each recording names: prod's spec names it; dev's cluster exists, and its VPC is
    what the offline getCluster stand-in answers (infra/recording.py)."""
    found = set()
    for name in PLATFORMS:
        found |= {r.inputs["vpcId"] for r in shipped_run(name).of_type("aws:ec2/securityGroup:SecurityGroup")}
    return found


def types_of(run: OfflineRun) -> set[str]:
    return {r.type for r in run.resources if is_cloud(r)}


def test_moto_is_the_version_the_docstrings_cite():
    assert version("moto") == MOTO_VERSION


@pytest.mark.parametrize("name", PLATFORMS)
def test_every_cloud_resource_type_is_replayed_or_named_not_modelled(name):
    """A type the program gains must be given its calls (REPLAYED) or its reason (NOT_MODELLED)."""
    unclassified = sorted(t for t in types_of(shipped_run(name)) if classify(t) == "unclassified")
    assert not unclassified, f"add each to tests/aws_replay.py REPLAYED or NOT_MODELLED: {unclassified}"
    assert not set(REPLAYED) & set(NOT_MODELLED)


def test_a_type_in_neither_table_is_an_error_of_the_replay(account):
    aws, users = account
    stranger = RegisteredResource(type="aws:lambda/function:Function", name="fn", parent_urn="",
                                  urn="urn:pulumi:x::pdstack::aws:lambda/function:Function::fn", custom=True)
    done = replay(OfflineRun(resources=[stranger]), aws, users)
    assert "aws:lambda/function:Function is in neither REPLAYED nor NOT_MODELLED" in done.error_text()


def replay_both(aws, users, first: OfflineRun, second: OfflineRun) -> tuple[Replay, Replay]:
    return replay(first, aws, users), replay(second, aws, users)


def test_both_platform_stacks_replay_into_one_account_without_an_error(account):
    """prod (which makes the account's GitHub OIDC provider) then dev (which finds it by URL:
    #38 item 7) in one account: every call accepted, dev makes no second provider, and every
    resource not replayed is one NOT_MODELLED names."""
    aws, users = account
    prod, dev = replay_both(aws, users, shipped_run("platform-prod"), shipped_run("platform-dev"))
    for name, done in (("platform-prod", prod), ("platform-dev", dev)):
        assert not done.errors, f"{name}:\n{done.error_text()}"
        run = shipped_run(name)
        cloud = [r for r in run.resources if is_cloud(r) and classify(r.type) != "not AWS"]
        assert {r.urn for r in cloud} == set(done.made) | set(done.skipped), name
        for r in cloud:
            if r.urn in done.skipped:
                assert r.type in NOT_MODELLED or "not modelled" in done.skipped[r.urn], (r.urn, done.skipped[r.urn])
    providers = aws("iam").list_open_id_connect_providers()["OpenIDConnectProviderList"]
    assert [p["Arn"] for p in providers] == [f"arn:aws:iam::{MOCK_ACCOUNT}:oidc-provider/token.actions.githubusercontent.com"]
    # what the replay made is what each program asked for, read back from moto
    s3, kms = aws("s3"), aws("kms")
    buckets = [r.inputs["bucket"] for name in PLATFORMS for r in shipped_run(name).of_type("aws:s3/bucket:Bucket")]
    assert len(buckets) == 4
    for bucket in buckets:
        rule = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"][0]
        key = rule["ApplyServerSideEncryptionByDefault"]["KMSMasterKeyID"]
        assert kms.describe_key(KeyId=key)["KeyMetadata"]["KeyState"] == "Enabled", bucket
        assert kms.get_key_rotation_status(KeyId=key)["KeyRotationEnabled"], bucket
        assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled", bucket
        assert all(s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"].values()), bucket
    groups = aws("ec2").describe_security_groups(Filters=[{"Name": "tag:Name", "Values": ["pdstack-prod-efa"]}])
    (efa,) = groups["SecurityGroups"]
    assert [p["UserIdGroupPairs"][0]["GroupId"] for p in efa["IpPermissions"]] == [efa["GroupId"]]
    assert [p["UserIdGroupPairs"][0]["GroupId"] for p in efa["IpPermissionsEgress"]] == [efa["GroupId"]]
    rules = aws("events").list_rules()["Rules"]
    assert len(rules) == len(shipped_run("platform-prod").of_type("aws:cloudwatch/eventRule:EventRule")) + len(
        shipped_run("platform-dev").of_type("aws:cloudwatch/eventRule:EventRule"))


def test_what_the_replay_skips_is_listed_with_its_reason(account):
    """Not modelled is said, not silent: EKS (the cluster, access entries, Pod Identity, add-ons,
    node groups) and what takes an output of the cluster (the discovery tag on its security group)."""
    aws, users = account
    done = replay(shipped_run("platform-prod"), aws, users)
    skipped = {urn.rsplit("::", 1)[1]: why for urn, why in done.skipped.items()}
    assert skipped["pdstack-prod"].startswith("not modelled: pulumi-eks's remote component")
    assert "not replayed: its resourceId comes from pdstack-prod" in skipped["cluster-security-group-discovery"]
    assert {urn.split("::")[2].rsplit("$", 1)[-1] for urn in done.skipped} >= {
        "aws:eks/accessEntry:AccessEntry", "aws:eks/podIdentityAssociation:PodIdentityAssociation",
        "aws:eks/addon:Addon"}


def broken(run: OfflineRun, type_: str, name: str, change) -> OfflineRun:
    resources = [replace(r, inputs=change(dict(r.inputs))) if (r.type, r.name) == (type_, name) else r
                 for r in run.resources]
    assert resources != run.resources
    return OfflineRun(resources=resources, exports=run.exports)


def test_a_malformed_policy_document_is_refused(account):
    """IAM API Reference, PutRolePolicy: MalformedPolicyDocument (moto's IAMPolicyDocumentValidator:
    "Policy statement must contain resources")."""
    aws, users = account

    def without_resources(inputs):
        document = json.loads(inputs["policy"])
        for statement in document["Statement"]:
            statement.pop("Resource", None)
        return {**inputs, "policy": json.dumps(document)}

    run = broken(shipped_run("platform-prod"), "aws:iam/rolePolicy:RolePolicy", "weights-reader", without_resources)
    done = replay(run, aws, users)
    assert "weights-reader (aws:iam/rolePolicy:RolePolicy): An error occurred (MalformedPolicyDocument)" in done.error_text()
    assert len(done.errors) == 1, done.error_text()


def test_a_bucket_encrypted_by_a_key_that_does_not_exist_is_refused(account):
    """AWS KMS API Reference, GenerateDataKey: NotFoundException, what S3 meets at the first
    PutObject to a bucket whose SSE-KMS key is missing."""
    aws, users = account
    missing = f"arn:aws:kms:{MOCK_REGION}:{MOCK_ACCOUNT}:key/00000000-0000-0000-0000-000000000000"

    def other_key(inputs):
        rules = json.loads(json.dumps(inputs["rules"]))
        rules[0]["applyServerSideEncryptionByDefault"]["kmsMasterKeyId"] = missing
        return {**inputs, "rules": rules}

    type_ = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
    done = replay(broken(shipped_run("platform-prod"), type_, "weights", other_key), aws, users)
    assert f"(NotFoundException) when calling the GenerateDataKey operation: Key '{missing}' does not exist" in (
        done.error_text())
    assert len(done.errors) == 1, done.error_text()


def test_a_second_stack_creating_the_accounts_oidc_provider_collides(account):
    """#38 item 7 as it was: dev creating GitHub's OIDC provider as prod does (prod's registration
    put in dev's recording: the spec check now refuses two creating specs of one account before any
    recording); IAM holds one per URL (IAM API Reference, CreateOpenIDConnectProvider:
    EntityAlreadyExists)."""
    aws, users = account
    prod_run, dev_run = shipped_run("platform-prod"), shipped_run("platform-dev")
    (provider,) = prod_run.of_type("aws:iam/openIdConnectProvider:OpenIdConnectProvider")
    as_before = replace(provider, urn=provider.urn.replace("platform-prod", "platform-dev"))
    prod, dev = replay_both(aws, users, prod_run, OfflineRun(resources=[*dev_run.resources, as_before]))
    assert not prod.errors, prod.error_text()
    assert "github (aws:iam/openIdConnectProvider:OpenIdConnectProvider): An error occurred (EntityAlreadyExists)" in (
        dev.error_text())


def test_the_stack_finding_the_provider_runs_after_the_one_making_it(account):
    """dev's CI role trusts the provider it looks up; in an account where prod has not made it yet,
    IAM's CreateRole refuses the trust policy (Invalid principal in policy; here NoSuchEntity from
    GetOpenIDConnectProvider, since moto does not check principals)."""
    aws, users = account
    done = replay(shipped_run("platform-dev"), aws, users)
    assert "ci (aws:iam/role:Role): An error occurred (NoSuchEntity) when calling the GetOpenIDConnectProvider" in (
        done.error_text())


# Events as EC2 and AWS Health send them (Amazon EC2 User Guide, "Spot Instance interruption
# notices", "EC2 instance rebalance recommendations", "Amazon EventBridge events for EC2 instance
# state changes"; AWS Health User Guide, "Monitoring AWS Health events with Amazon EventBridge"):
# source, detail-type and the detail fields the rules match on. (event, should reach the queue)
EVENTS = [
    (("aws.ec2", "EC2 Spot Instance Interruption Warning", {"instance-id": "i-0a1b2c3d4e5f60718",
                                                           "instance-action": "terminate"}), True),
    (("aws.ec2", "EC2 Instance Rebalance Recommendation", {"instance-id": "i-0a1b2c3d4e5f60718"}), True),
    (("aws.ec2", "EC2 Instance State-change Notification", {"instance-id": "i-0a1b2c3d4e5f60718",
                                                           "state": "shutting-down"}), True),
    (("aws.ec2", "EC2 Instance State-change Notification", {"instance-id": "i-0a1b2c3d4e5f60718",
                                                           "state": "running"}), False),
    (("aws.health", "AWS Health Event", {"service": "EC2", "eventTypeCategory": "scheduledChange",
                                         "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED"}), True),
    (("aws.health", "AWS Health Event", {"service": "EC2", "eventTypeCategory": "issue"}), False),
]


def test_the_interruption_rules_send_what_karpenter_acts_on_to_its_queue(account):
    """moto's EventBridge matches each event against the replayed rules' patterns and sends a
    match to the rule's SQS target (PutEvents, Amazon EventBridge API Reference). moto does not
    check the queue policy (no IAM evaluation): this shows the patterns and targets, not that
    EventBridge may send."""
    aws, users = account
    done = replay(shipped_run("platform-prod"), aws, users)
    assert not done.errors, done.error_text()
    (queue,) = shipped_run("platform-prod").of_type("aws:sqs/queue:Queue")
    url = aws("sqs").get_queue_url(QueueName=queue.inputs["name"])["QueueUrl"]
    for (source, detail_type, detail), delivered in EVENTS:
        answer = aws("events").put_events(Entries=[{"Source": source, "DetailType": detail_type,
                                                    "Detail": json.dumps(detail)}])
        assert answer["FailedEntryCount"] == 0
        messages = aws("sqs").receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
        for message in messages:
            aws("sqs").delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
        assert [json.loads(m["Body"])["detail-type"] for m in messages] == ([detail_type] if delivered else []), (
            detail_type, detail)
