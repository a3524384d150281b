"""The AWS Load Balancer Controller's cloud side: its IAM policy, its identity, and the annotations
that hand the gateway's Service to it.

EKS's legacy in-tree controller (the cloud provider in kube-controller-manager) makes a load
balancer for every Service of type LoadBalancer it is not told to leave alone. The gateway's
Service is told so (`aws-load-balancer-type: external`), and the controller makes its NLB with
IP targets (the Envoy pods themselves, no node hop) in the scheme the platform spec names
(docs/guide/service/nlb.md and docs/guide/service/annotations.md of the pinned module).

Its policy is the one the controller's project publishes at the pinned version
(docs/install/iam_policy.json, read from the module at every preview), fenced to this account and
region: what the published policy grants on `*` is granted on this account's ARNs where IAM lets
the action be scoped so, and elsewhere under the region the call is made in.
"""

from __future__ import annotations

import json
import re

import pulumi
import pulumi_aws as aws

LOAD_BALANCER_CONTROLLER = "sigs.k8s.io/aws-load-balancer-controller"
IAM_POLICY = "docs/install/iam_policy.json"
NAMESPACE, SERVICE_ACCOUNT = "kube-system", "aws-load-balancer-controller"

# Actions of the published policy granted on `*` whose every call names a resource of a type IAM
# lets a policy scope (a required resource type in the Service Authorization Reference;
# tests/test_iam_definitions.py checks each against parliament's copy, and fails on one granted on
# `*` that is not here). An action whose resource is optional stays on `*`: a call that names none
# would match no ARN.
RESOURCE_TYPED = frozenset({
    "iam:CreateServiceLinkedRole", "iam:GetServerCertificate", "ec2:GetCoipPoolUsage", "ec2:GetSecurityGroupsForVpc",
    "acm:DescribeCertificate", "cognito-idp:DescribeUserPoolClient", "shield:DeleteProtection",
    "shield:DescribeProtection", "waf-regional:AssociateWebACL", "waf-regional:DisassociateWebACL",
    "waf-regional:GetWebACL", "waf-regional:GetWebACLForResource", "wafv2:AssociateWebACL", "wafv2:GetWebACL",
    "wafv2:GetWebACLForResource", "ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress",
    "ec2:CreateSecurityGroup", "ec2:DeleteSecurityGroup", "elasticloadbalancing:CreateTargetGroup",
    "elasticloadbalancing:CreateRule", "elasticloadbalancing:DeleteListener", "elasticloadbalancing:DeleteRule",
    "elasticloadbalancing:AddListenerCertificates", "elasticloadbalancing:ModifyListener",
    "elasticloadbalancing:ModifyRule", "elasticloadbalancing:RemoveListenerCertificates",
    "elasticloadbalancing:SetRulePriorities"})
# Services with one endpoint, in us-east-1: their calls carry aws:RequestedRegion us-east-1 from a
# cluster in any region (IAM User Guide, "AWS global condition context keys", aws:RequestedRegion),
# and their ARNs no region.
GLOBAL_SERVICES = {"iam": "us-east-1", "shield": "us-east-1"}
# IAM refuses an IAM ARN whose resource part does not start with one of its resource types
# (`arn:aws:iam::<account>:*`: MalformedPolicyDocument "IAM resource path must either be "*" or
# start with user/, role/, ...", as moto 5.2.5 iam/policy_validation.py answers too:
# tests/test_platform_aws_replay.py), so a typed iam action is granted on its own resource type's
# ARNs (Service Authorization Reference, IAM's actions table).
IAM_RESOURCE_TYPES = {"iam:CreateServiceLinkedRole": "role", "iam:GetServerCertificate": "server-certificate"}
_ARN = re.compile(r"^arn:aws:([a-z0-9-]+):([^:]*):([^:]*):")


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def _service(action: str) -> str:
    return action.split(":", 1)[0]


def _here(resource: str, region: str, account: str) -> str:
    """A published ARN pattern of any region and account (`arn:aws:ec2:*:*:...`) in this one's."""
    def fenced(m: re.Match) -> str:
        where = "" if m.group(1) in GLOBAL_SERVICES else (region if m.group(2) == "*" else m.group(2))
        return f"arn:aws:{m.group(1)}:{where}:{account if m.group(3) == '*' else m.group(3)}:"
    return _ARN.sub(fenced, resource)


def _with_condition(condition: dict | None, operator: str, key: str, values: list[str]) -> dict:
    merged = {op: dict(keys) for op, keys in (condition or {}).items()}
    merged.setdefault(operator, {})[key] = values
    return merged


def fenced_statements(published: dict, region: str, account: str) -> list[dict]:
    """The published statements in this account and region. A statement on `*` is split: its
    resource-typed actions (RESOURCE_TYPED) on every ARN of this account in the region, of their
    services and of the load balancers they act on; the rest on `*` under aws:RequestedRegion (the
    cluster's, and us-east-1 for a global service's calls)."""
    out = []
    for st in published["Statement"]:
        resources = _listed(st["Resource"])
        if resources != ["*"]:
            out.append({**st, "Resource": [_here(r, region, account) for r in resources]})
            continue
        actions = _listed(st["Action"])
        typed = [a for a in actions if a in RESOURCE_TYPED]
        if typed:
            services = sorted({_service(a) for a in typed} | {"elasticloadbalancing"})
            iam_types = sorted({IAM_RESOURCE_TYPES[a] for a in typed if _service(a) == "iam"})
            out.append({**st, "Action": typed, "Resource": [
                arn for s in services for arn in (
                    [f"arn:aws:iam::{account}:{t}/*" for t in iam_types] if s == "iam"
                    else [_here(f"arn:aws:{s}:*:*:*", region, account)])]})
        rest = [a for a in actions if a not in RESOURCE_TYPED]
        if rest:
            regions = sorted({region} | {GLOBAL_SERVICES[_service(a)] for a in rest if _service(a) in GLOBAL_SERVICES})
            out.append({**st, "Action": rest, "Condition": _with_condition(
                st.get("Condition"), "StringEquals", "aws:RequestedRegion", regions)})
    return out


def load_balancer_controller_statements(region: str, account: str) -> list[dict]:
    """The controller's published policy at the pinned version, fenced (fenced_statements)."""
    from infra.platform_stack.modules import module_file

    published = json.loads(module_file(LOAD_BALANCER_CONTROLLER, IAM_POLICY).read_text())
    return fenced_statements(published, region, account)


def gateway_service_annotations(scheme: str) -> dict[str, str]:
    """The gateway's Service, for the controller (pinned module docs/guide/service/annotations.md):
    `external` makes the in-tree controller ignore it and this one take it; `ip` targets the Envoy
    pods (the serving stack's EnvoyProxy adds preserve_client_ip, which IP targets lack by default);
    the scheme is said, since the controller's default is internal."""
    return {"service.beta.kubernetes.io/aws-load-balancer-type": "external",
            "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
            "service.beta.kubernetes.io/aws-load-balancer-scheme": scheme}


# The tag the controller picks a scheme's subnets by (docs/deploy/subnet_discovery.md, "Subnet Role Tag").
SUBNET_ROLE_TAG = {"internet-facing": "kubernetes.io/role/elb", "internal": "kubernetes.io/role/internal-elb"}


def untagged_subnets_warning(scheme: str, vpc_id: str, tagged: list[str] | None) -> str | None:
    """What `pulumi preview` says when no subnet of the VPC carries the scheme's role tag: the
    controller then takes one subnet per zone among those whose route table matches the scheme
    (a route to an internet gateway for internet-facing; subnet_discovery.md, from v2.12.1), which
    may be subnets no one meant for the gateway. The VPC and its subnets are the user's."""
    if tagged:
        return None
    tag = SUBNET_ROLE_TAG[scheme]
    return (f"no subnet of {vpc_id} is tagged {tag}=1: the AWS Load Balancer Controller will put the gateway's "
            f"{scheme} NLB in the subnets whose route tables look {'public' if scheme == 'internet-facing' else 'private'}"
            f", one per zone. Fix: tag the subnets meant for it ({tag}=1)")


def warn_untagged_subnets(vpc_id: pulumi.Output, scheme: str) -> None:
    """At every preview: EC2 DescribeSubnets for the VPC's subnets carrying the scheme's role tag."""
    found = vpc_id.apply(lambda vpc: aws.ec2.get_subnets_output(filters=[
        {"name": "vpc-id", "values": [vpc]}, {"name": f"tag:{SUBNET_ROLE_TAG[scheme]}", "values": ["1", ""]}]))
    pulumi.Output.all(vpc_id, found.ids).apply(
        lambda a: (message := untagged_subnets_warning(scheme, a[0], a[1])) and pulumi.log.warn(message))


def load_balancer_controller_identity(cluster: str, trust: pulumi.Output, policy: pulumi.Output,
                                      opts: pulumi.ResourceOptions,
                                      in_cluster: pulumi.ResourceOptions) -> list[pulumi.Resource]:
    """Its role (`policy`: load_balancer_controller_statements as a document) through EKS Pod Identity (kube-system/aws-load-balancer-controller, as Karpenter's):
    what its pods need before they start (the agent injects credentials at admission), and after
    they stop (the controller deletes the NLBs of Services that go)."""
    role = aws.iam.Role("aws-load-balancer-controller", name=f"{cluster}-load-balancer-controller",
                        assume_role_policy=trust, opts=opts)
    role_policy = aws.iam.RolePolicy("aws-load-balancer-controller", role=role.name, policy=policy, opts=opts)
    association = aws.eks.PodIdentityAssociation(
        "aws-load-balancer-controller", cluster_name=cluster, namespace=NAMESPACE, service_account=SERVICE_ACCOUNT,
        role_arn=role.arn, opts=in_cluster)
    return [role, role_policy, association]
