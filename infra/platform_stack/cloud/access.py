"""Who may reach an EKS cluster's API: access entries and their access policy associations.

The platform spec lists people and tools (`cloud.cluster_access`); CI's role and the nodes' role
get theirs where the cloud layer makes those roles (cloud/aws.py). Each entry names its cluster by
name, and each association its entry by principal: neither is an Output, so each is made after
what it names and deleted before it (tests/test_platform_order.py).

An existing cluster takes access entries only in authentication mode API or API_AND_CONFIG_MAP
(EKS User Guide, "Change authentication mode to use access entries"; CreateAccessEntry refuses
them under CONFIG_MAP): its mode is read (DescribeCluster accessConfig.authenticationMode,
eks.getCluster) and a CONFIG_MAP cluster refused at preview, before any entry is made.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.platform_stack.spec import ACCESS_POLICIES, ClusterAccessSpec, PlatformSpecError

ENTRY_MODES = ("API", "API_AND_CONFIG_MAP")


def access_policy_arn(policy: str) -> str:
    """The ARN of EKS's access policy for a Kubernetes role name (spec.ACCESS_POLICIES)."""
    return f"arn:aws:eks::aws:cluster-access-policy/{ACCESS_POLICIES[policy]}"


def entries_accepted(cluster: str, access_configs: list | None, spec_file: str) -> str:
    """`cluster`, once its authentication mode (eks.getCluster accessConfigs, the first) takes
    access entries; else the spec is refused, naming its file and field."""
    mode = (access_configs or [{}])[0]
    mode = mode.get("authentication_mode") if isinstance(mode, dict) else getattr(mode, "authentication_mode", None)
    if mode not in ENTRY_MODES:
        raise PlatformSpecError([
            f"cloud.cluster (mode: existing): cluster {cluster}'s authentication mode is {mode or 'not reported'}, "
            "and access entries (CI's role, the nodes' role, cloud.cluster_access) need API or API_AND_CONFIG_MAP. "
            f"Fix: aws eks update-cluster-config --name {cluster} --access-config authenticationMode=API_AND_CONFIG_MAP "
            "(a one-way change: CONFIG_MAP cannot be set again)"], spec_file)
    return cluster


def logical_name(principal_arn: str) -> str:
    """A Pulumi name per principal: its account and role or user path (unique, as principals are)."""
    return "access-" + principal_arn.removeprefix("arn:aws:iam::").replace(":", "-").replace("/", "-")


def cluster_access(items: list[ClusterAccessSpec], cluster_name: pulumi.Input[str],
                   in_cluster) -> list[pulumi.Resource]:
    """One access entry per item (after the cluster: `in_cluster(*after)` gives the options of what
    names it) and its policy's association (after its entry), scoped to the item's namespaces."""
    made: list[pulumi.Resource] = []
    for item in items:
        name = logical_name(item.principal_arn)
        entry = aws.eks.AccessEntry(name, cluster_name=cluster_name, principal_arn=item.principal_arn,
                                    opts=in_cluster())
        scope = {"type": "namespace", "namespaces": list(item.namespaces)} if item.namespaces else {"type": "cluster"}
        made += [entry, aws.eks.AccessPolicyAssociation(
            name, cluster_name=cluster_name, principal_arn=item.principal_arn,
            policy_arn=access_policy_arn(item.policy), access_scope=scope, opts=in_cluster(entry))]
    return made
