"""Every IAM policy the stacks make, judged by AWS's own definitions of IAM actions, resource
types and condition keys (the Service Authorization Reference, as parliament 1.6.4 ships it in
parliament/iam_definition.json, pinned in pyproject.toml's `test` extra), and Karpenter's
controller policy against the calls the pinned controller can make.

What parliament cannot judge is named here with the reason, not skipped in silence:
- a trust policy's principal (parliament knows SAML and a few named web identity providers, not
  an IAM OIDC provider's ARN): checked here for IAM's ARN shape instead;
- an OIDC provider's own condition keys (`<provider>:aud`, `<provider>:sub`): IAM defines them
  per provider (IAM User Guide, "Available keys for AWS OIDC federation"), not per action;
- AWS-owned public SSM parameters, whose ARN has no account (`arn:aws:ssm:<region>::parameter/
  aws/service/...`, AWS Systems Manager User Guide, "Working with public parameters"): parliament
  requires an account where the definition has one;
- the AWS managed policies a role attaches (`managedPolicyArns`): not actions, and not in the
  definitions.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import re

import parliament  # pinned in the test extra
import pytest

from infra.offline import run_spec
from infra.platform_stack.spec import load_platform_spec, parse_platform_spec
from infra.recording import OfflineRun
from infra.render.manifests import unwrap
from tests.conftest import shipped_run

KARPENTER = "github.com/aws/karpenter-provider-aws"
OIDC_CONDITION = re.compile(r"^[a-z0-9.-]+\.[a-z]+(/[^:]*)?:(aud|sub|amr)$")  # <provider host[/path]>:<claim>
OIDC_PROVIDER_ARN = re.compile(r"^arn:aws:iam::\d{12}:oidc-provider/[a-z0-9.-]+(/[A-Za-z0-9_./-]+)?$")
PUBLIC_PARAMETERS = re.compile(r"^arn:aws:ssm:[a-z0-9-]+::parameter/aws/service/")
# What AWS defines that parliament 1.6.4's copy of the definitions predates (a policy the AWS Load
# Balancer Controller's project publishes grants it), and where AWS defines it.
NEWER_THAN_PARLIAMENT = {
    "UNKNOWN_ACTION Unknown action elasticloadbalancing:ModifyIpPools":
        "ELB's ModifyIpPools API (botocore 1.44.18 elbv2 2015-12-01 service model: "
        "test_what_parliament_does_not_know_aws_defines)",
    "UNKNOWN_CONDITION_FOR_ACTION Unknown condition elasticloadbalancing:CreateAction for action "
    "elasticloadbalancing:AddTags":
        "ELB User Guide, \"ELB API permissions to tag resources during creation\": AddTags under "
        "elasticloadbalancing:CreateAction",
}


@functools.cache
def stack_runs() -> dict[str, OfflineRun]:
    irsa = load_platform_spec("stacks/platform-prod.yaml").model_dump(mode="json", exclude_none=True)
    irsa["cloud"]["weights_access"] = "irsa"
    dev_irsa = load_platform_spec("stacks/platform-dev.yaml").model_dump(mode="json", exclude_none=True)
    dev_irsa["cloud"]["weights_access"] = "irsa"
    return {"platform-prod": shipped_run("platform-prod"), "platform-dev": shipped_run("platform-dev"),
            "platform-dev irsa": run_spec(parse_platform_spec(dev_irsa)),
            "prod": shipped_run("prod"), "dev": shipped_run("dev")}


def policies(run: OfflineRun) -> list[tuple[str, str, object, str]]:
    """(resource, kind, document, the role's ARN) for every IAM document a run registers:
    identity policies, trust policies, and inline policies of a role."""
    from infra.recording import MOCK_ACCOUNT

    found = []
    for r in run.custom():
        if not r.type.startswith("aws:iam/"):
            continue
        inputs = unwrap(r.inputs)
        role_arn = f"arn:aws:iam::{MOCK_ACCOUNT}:role/{inputs.get('name')}"
        for key, kind in (("policy", "identity"), ("assumeRolePolicy", "trust")):
            if key in inputs:
                found.append((f"{r.type} {r.name}", kind, inputs[key], role_arn))
        for inline in inputs.get("inlinePolicies") or []:
            found.append((f"{r.type} {r.name} inline", "identity", inline.get("policy"), role_arn))
    return found


def satisfied_elsewhere(document: dict, action: str, required: str) -> bool:
    """IAM authorizes each resource of a request against every statement (IAM User Guide, "Policy
    evaluation logic"): an action's required resource type may be granted by another statement
    than the one parliament looked at (RunInstances: the subnet in one, the instance in another)."""
    for st in document["Statement"]:
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        resources = st.get("Resource", []) if isinstance(st.get("Resource"), list) else [st.get("Resource")]
        if st["Effect"] == "Allow" and any(fnmatch.fnmatchcase(action, a) for a in actions) and any(
                r == "*" or required != "*" and parliament.is_arn_strictly_valid("", required, r) for r in resources):
            return True
    return False


def problems_of(document: dict) -> list[str]:
    """parliament's findings on an identity policy, less what IAM itself would grant (above) and
    what parliament cannot judge (the module's docstring)."""
    found = []
    for finding in parliament.analyze_policy_string(json.dumps(document)).findings:
        if finding.issue == "RESOURCE_MISMATCH":
            detail = [d for d in finding.detail if not satisfied_elsewhere(document, d["action"], d["required_format"])
                      and not (d["action"] == "ssm:GetParameter" and any(
                          PUBLIC_PARAMETERS.match(r) for st in document["Statement"]
                          for r in ([st["Resource"]] if isinstance(st["Resource"], str) else st["Resource"])))]
            if detail:
                found.append(f"RESOURCE_MISMATCH {detail}")
        elif finding.issue == "UNKNOWN_CONDITION_FOR_ACTION" and OIDC_CONDITION.match(finding.detail.split()[2]):
            continue
        elif f"{finding.issue} {finding.detail}" in NEWER_THAN_PARLIAMENT:
            continue
        else:
            found.append(f"{finding.issue} {finding.detail}")
    return found


def as_identity(trust: dict, role_arn: str) -> tuple[dict, list[str]]:
    """A trust policy as parliament reads policies (it wants a Resource; a trust policy's resource
    is the role itself), and what its principals break of IAM's identifiers."""
    document, problems = copy.deepcopy(trust), []
    for st in document["Statement"]:
        principal = st.pop("Principal")
        for federated in ([principal["Federated"]] if isinstance(principal.get("Federated"), str)
                          else principal.get("Federated", [])):
            if not OIDC_PROVIDER_ARN.match(federated):
                problems.append(f"Federated principal {federated!r} is not an IAM OIDC provider ARN")
        st["Resource"] = role_arn
    return document, problems


@pytest.mark.parametrize("stack", ["platform-prod", "platform-dev", "platform-dev irsa", "prod", "dev"])
def test_every_iam_policy_keeps_to_aws_definitions(stack):
    """Unknown actions and condition keys, a condition on an action that has no such key, a
    resource of the wrong type for its action, `*` where the action takes a resource type:
    what parliament finds in any policy is a failure here. It found, in Karpenter's controller
    policy before: `iam:ListInstanceProfiles` granted on instance-profile ARNs, a resource type
    the action does not have (so it matched nothing, and the listing was denied); `ec2:Describe*`
    and `ec2:RunInstances`, `CreateFleet`, `TerminateInstances` on `*`."""
    docs = policies(stack_runs()[stack])
    unknown = [name for name, _, doc, _ in docs if not isinstance(doc, str)]
    assert unknown == [], f"not known offline, so not checked: {unknown}"
    found = []
    for name, kind, doc, role_arn in docs:
        document = json.loads(doc)
        if kind == "trust":
            document, principal_problems = as_identity(document, role_arn)
            found += [f"{name}: {p}" for p in principal_problems]
        found += [f"{name}: {p}" for p in problems_of(document)]
    if stack.startswith("platform"):
        assert docs
    assert found == []


def test_the_check_finds_what_aws_would_refuse():
    """The bite: a condition key the action does not have, an action that does not exist, a
    resource of another type, each reported."""
    def issues(*statements):
        return " ".join(problems_of({"Version": "2012-10-17", "Statement": list(statements)}))

    assert "UNKNOWN_CONDITION_FOR_ACTION" in issues(
        {"Effect": "Allow", "Action": "ec2:TerminateInstances", "Resource": "arn:aws:ec2:us-east-1:*:instance/*",
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}})
    assert "UNKNOWN_ACTION" in issues({"Effect": "Allow", "Action": "ec2:TerminateInstance", "Resource": "*"})
    assert "RESOURCE_MISMATCH" in issues(
        {"Effect": "Allow", "Action": "iam:ListInstanceProfiles", "Resource": "arn:aws:iam::*:instance-profile/*"})
    assert "RESOURCE_STAR" in issues({"Effect": "Allow", "Action": "ec2:TerminateInstances", "Resource": "*"})


def test_the_actions_the_policy_pack_lets_go_unscoped_have_no_resource_type():
    """infra/policy/rules.py UNSCOPABLE_LISTS: `*` is the only resource IAM lets these be granted
    on (no resource type in the definitions) and no condition key fences them."""
    from infra.policy.rules import UNSCOPABLE_LISTS

    from parliament.statement import get_privilege_info  # the entry parliament's analysis reads

    for action in UNSCOPABLE_LISTS:
        privilege = get_privilege_info(*action.split(":"))
        assert privilege["access_level"] == "List", action
        assert [t["resource_type"] for t in privilege["resource_types"]] == [""], action
        assert not any(t["condition_keys"] for t in privilege["resource_types"]), action


# --- Karpenter's controller policy ---------------------------------------------------------------
#
# karpenter-provider-aws publishes its controller policy in its getting-started CloudFormation,
# under website/, a Go module of its own that the module proxy does not serve; no package this
# project can pin carries it, so the policy is not compared with it here (README, "Not verified
# here"). What is checked: every call the pinned controller can make is granted (its SDK
# interfaces, below), and every action that changes or ends an instance, a launch template or an
# instance profile acts only on what this cluster's Karpenter tagged as its own.

# What Karpenter v1.14.1 can call that pdstack's policy does not grant, and why nothing calls it.
NOT_MODELLED = {
    "arc-zonal-shift:GetManagedResource": "zonal shift off: the chart's settings.enableZonalShift is false",
}
# Actions that change or end something that already exists: each must be fenced to what this
# cluster's Karpenter made (the tag karpenter-provider-aws v1.14.1 puts on all it launches:
# pkg/providers/instance, "kubernetes.io/cluster/<name>": "owned", with karpenter.sh/nodepool).
CHANGES_WHAT_EXISTS = {"ec2:TerminateInstances", "ec2:DeleteLaunchTemplate", "iam:DeleteInstanceProfile",
                       "iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile", "iam:TagInstanceProfile"}


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def karpenter_policy(stack: str) -> tuple[dict, str, str, str]:
    run = stack_runs()[stack]
    (found,) = [r for r in run.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "karpenter-controller"]
    spec = load_platform_spec(f"stacks/{stack}.yaml")
    return json.loads(unwrap(found.inputs)["policy"]), spec.cloud.cluster.name, spec.cloud.region, spec


@pytest.mark.parametrize("stack", ["platform-prod", "platform-dev"])
def test_karpenter_changes_only_what_its_cluster_made(stack):
    """Every grant of an action that changes or ends an existing instance, launch template or
    instance profile is conditioned on this cluster's ownership tag, and the tagging of new
    resources only at their creation. Before: `ec2:TerminateInstances` and `ec2:CreateTags` on
    every instance in the region (any cluster's, anyone's); and `pricing:GetProducts` fenced to the
    cluster's region, where Karpenter never calls it (pkg/providers/pricing/pricing.go NewAPI in
    the pinned module), so prices outside us-east-1 were refused."""
    from infra.platform_stack.cloud.aws import pricing_region

    document, cluster, region, spec = karpenter_policy(stack)
    owned = f"kubernetes.io/cluster/{cluster}"
    unfenced = []
    for st in document["Statement"]:
        assert st["Effect"] == "Allow"
        keys = {k for op in (st.get("Condition") or {}).values() for k in op}
        for action in _listed(st["Action"]):
            if action in CHANGES_WHAT_EXISTS and not any(owned in k for k in keys):
                unfenced.append(f"{action} on {st['Resource']} under {st.get('Condition')}")
            if action == "ec2:CreateTags" and not ({"ec2:CreateAction"} <= keys or any(owned in k for k in keys)):
                unfenced.append(f"{action} on {st['Resource']} under {st.get('Condition')}")
    assert unfenced == []
    (pricing,) = [st for st in document["Statement"] if st["Action"] == "pricing:GetProducts"]
    assert pricing["Condition"]["StringEquals"]["aws:RequestedRegion"] == pricing_region(region) == "us-east-1"
    assert pricing_region("eu-west-1") == "eu-central-1" and pricing_region("ap-northeast-1") == "ap-south-1"


def test_what_the_policy_leaves_ungranted_is_switched_off():
    """NOT_MODELLED holds only while the chart values leave zonal shift off
    (karpenter-provider-aws v1.14.1 charts/karpenter/values.yaml settings); the interruption queue
    is on, and its calls are granted on that queue alone."""
    from infra.platform_stack.cloud.interruption import interruption_queue_arn

    from infra.platform_stack.catalog import controller
    from infra.platform_stack.program import hosted_environments, platform_context

    spec = load_platform_spec("stacks/platform-prod.yaml")
    settings = controller("karpenter").values(platform_context(spec, [h.spec for h in hosted_environments(spec)]))[
        "settings"]
    assert settings["interruptionQueue"] and not settings.get("enableZonalShift")
    document, cluster, region, _ = karpenter_policy("platform-prod")
    (queue,) = [st for st in document["Statement"] if any(a.startswith("sqs:") for a in _listed(st["Action"]))]
    assert queue["Resource"] == interruption_queue_arn(region, "000000000000", cluster)
    assert sorted(queue["Action"]) == ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"]


def test_every_call_karpenter_makes_is_granted():
    """The AWS calls Karpenter v1.14.1 can make are its SDK interfaces (pkg/aws/sdk.go in the
    pinned module, read from the Go module cache): each is granted, or is one NOT_MODELLED
    names, or is declared and never called (iam:GetRole: only the test fake implements it;
    timestream: the project's own test metrics; sqs:SendMessage: only its e2e suite sends,
    test/pkg/environment/aws/expectations.go, and EventBridge fills the queue)."""
    from infra.platform_stack.modules import module_file

    text = module_file(KARPENTER, "pkg/aws/sdk.go").read_text()
    prefixes = {"EC2": "ec2", "IAM": "iam", "EKS": "eks", "Pricing": "pricing", "SSM": "ssm", "SQS": "sqs",
                "ARCZonalShift": "arc-zonal-shift", "TimestreamWrite": "timestream"}
    calls = {f"{prefixes[api]}:{method}" for api, body in re.findall(r"type (\w+)API interface \{(.*?)\n\}", text, re.S)
             for method in re.findall(r"^\s*(\w+)\(", body, re.M)}
    assert {"ec2:CreateFleet", "ec2:TerminateInstances", "iam:CreateInstanceProfile", "pricing:GetProducts"} <= calls
    document, *_ = karpenter_policy("platform-prod")
    patterns = [a for st in document["Statement"] for a in _listed(st["Action"])]
    granted = {c for c in calls if any(fnmatch.fnmatchcase(c, p) for p in patterns)}
    off = {c for c in calls if c.split(":")[0] in {a.split(":")[0] for a in NOT_MODELLED}}  # the queue, zonal shift
    assert calls - granted - off - {"iam:GetRole", "timestream:WriteRecords", "sqs:SendMessage"} == set()


# --- the AWS Load Balancer Controller's policy ---------------------------------------------------

def test_what_parliament_does_not_know_aws_defines():
    """NEWER_THAN_PARLIAMENT's action is an API operation of ELB (botocore's elbv2 service model,
    the definition the AWS SDKs are generated from)."""
    import botocore.session

    assert "ModifyIpPools" in botocore.session.get_session().get_service_model("elbv2").operation_names


def _without_region(condition: dict | None) -> str:
    kept = {op: {k: v for k, v in keys.items() if k != "aws:RequestedRegion"} for op, keys in (condition or {}).items()}
    return json.dumps({op: keys for op, keys in kept.items() if keys}, sort_keys=True)


def test_the_load_balancer_controllers_policy_is_its_projects_in_this_account():
    """The controller's policy is the one its project publishes at the pinned version
    (docs/install/iam_policy.json of sigs.k8s.io/aws-load-balancer-controller, read from the Go
    module cache): every action under the same conditions, none added. Fenced to this account and
    region: each ARN names the account, each `*` carries aws:RequestedRegion, and each action moved
    from `*` onto ARNs (cloud/load_balancer.py RESOURCE_TYPED) has a resource type IAM's
    definitions require of every call, so no call of it names none and is denied. Before, the
    stack made neither this policy nor the controller: EKS's legacy in-tree controller made the
    gateway's NLB."""
    from parliament.statement import get_privilege_info

    from infra.platform_stack.cloud.load_balancer import IAM_POLICY, LOAD_BALANCER_CONTROLLER, RESOURCE_TYPED
    from infra.platform_stack.modules import module_file
    from infra.recording import MOCK_ACCOUNT

    published = json.loads(module_file(LOAD_BALANCER_CONTROLLER, IAM_POLICY).read_text())
    spec = load_platform_spec("stacks/platform-prod.yaml")
    (found,) = [r for r in stack_runs()["platform-prod"].of_type("aws:iam/rolePolicy:RolePolicy")
                if r.name == "aws-load-balancer-controller"]
    ours = json.loads(unwrap(found.inputs)["policy"])

    def grants(document: dict) -> set[tuple[str, str, str]]:
        return {(st["Effect"], a, _without_region(st.get("Condition")))
                for st in document["Statement"] for a in _listed(st["Action"])}

    assert grants(ours) == grants(published)
    unfenced = []
    for st in ours["Statement"]:
        for resource in _listed(st["Resource"]):
            if resource == "*":
                if spec.cloud.region not in st["Condition"]["StringEquals"]["aws:RequestedRegion"]:
                    unfenced.append(f"{st['Action']} on *")
            elif resource.split(":")[4] != MOCK_ACCOUNT or resource.split(":")[3] not in ("", spec.cloud.region):
                unfenced.append(f"{st['Action']} on {resource}")
    assert unfenced == []
    on_star = {a for st in published["Statement"] if st["Resource"] == "*" for a in _listed(st["Action"])}
    assert RESOURCE_TYPED <= on_star
    optional = [a for a in RESOURCE_TYPED
                if not any(t["resource_type"].endswith("*") for t in get_privilege_info(*a.split(":"))["resource_types"])]
    assert optional == []
