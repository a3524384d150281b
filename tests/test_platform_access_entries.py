"""Who may reach the cluster (issue #38 item 20): `cloud.cluster_access` as EKS access entries and
access policy associations, and an existing cluster's authentication mode read, not assumed.

Sources: EKS API CreateAccessEntry and AssociateAccessPolicy (an association needs its entry:
ResourceNotFoundException; one entry per principal: ResourceInUseException), DescribeCluster
`accessConfig.authenticationMode` (pulumi-aws 7 eks.getCluster `access_configs`), EKS User Guide
"Review access policy permissions" (AmazonEKSClusterAdminPolicy, AmazonEKSAdminPolicy,
AmazonEKSEditPolicy, AmazonEKSViewPolicy) and "Change authentication mode to use access entries"
(CONFIG_MAP takes no access entries; the change is one-way).
"""

from __future__ import annotations

import pytest

import infra.recording as recording
from infra.offline import run_spec
from infra.platform_stack.spec import PlatformSpecError, load_platform_spec, parse_platform_spec
from infra.recording import OfflineRun
from infra.render.manifests import unwrap
from tests.test_platform_order import closure, graph

TEAM = "arn:aws:iam::123456789012:role/platform-team"
AUDIT = "arn:aws:iam::123456789012:user/tools/auditor"
ACCESS = [{"principal_arn": TEAM, "policy": "cluster-admin"},
          {"principal_arn": AUDIT, "policy": "view", "namespaces": ["prod", "observability"]}]


def with_access(name: str, access: list[dict]) -> dict:
    data = load_platform_spec(f"stacks/{name}.yaml").model_dump(mode="json", exclude_none=True)
    data["cloud"]["cluster_access"] = access
    return data


def entries(run: OfflineRun, type_: str) -> dict[str, dict]:
    return {unwrap(r.inputs)["principalArn"]: r for r in run.of_type(type_)}


@pytest.mark.parametrize("name", ["platform-prod", "platform-dev"])
def test_each_listed_principal_reaches_the_cluster_with_its_policy_after_what_it_names(name):
    """Each item is one access entry and one association of EKS's policy of that name, scoped to
    its namespaces or the whole cluster; the entry after the cluster this stack makes, the
    association after its entry (and so before it at `pulumi destroy`). Before, only the creator and
    CI got access: anyone else needed a hand-made entry no stack knew of."""
    run = run_spec(parse_platform_spec(with_access(name, ACCESS)))
    edges = graph(run)
    made = entries(run, "aws:eks/accessEntry:AccessEntry")
    associated = entries(run, "aws:eks/accessPolicyAssociation:AccessPolicyAssociation")
    policies = {p: unwrap(associated[p].inputs) for p in (TEAM, AUDIT)}
    assert policies[TEAM]["policyArn"] == "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
    assert policies[TEAM]["accessScope"] == {"type": "cluster"}
    assert policies[AUDIT]["policyArn"] == "arn:aws:eks::aws:cluster-access-policy/AmazonEKSViewPolicy"
    assert policies[AUDIT]["accessScope"] == {"type": "namespace", "namespaces": ["prod", "observability"]}
    cluster = load_platform_spec(f"stacks/{name}.yaml").cloud.cluster
    made_cluster = [r.urn for r in run.of_type("eks:index:Cluster")]
    assert len(made_cluster) == (cluster.mode == "create")
    for principal in (TEAM, AUDIT):
        assert unwrap(made[principal].inputs)["clusterName"] == cluster.name
        assert made[principal].urn in closure(edges, associated[principal].urn)
        assert set(made_cluster) <= closure(edges, made[principal].urn)


def test_every_access_policy_is_eks_own():
    """The four names map to EKS's access policies by the Kubernetes role each mirrors."""
    from infra.platform_stack.cloud.access import access_policy_arn

    assert {p: access_policy_arn(p).rsplit("/", 1)[1] for p in ("cluster-admin", "admin", "edit", "view")} == {
        "cluster-admin": "AmazonEKSClusterAdminPolicy", "admin": "AmazonEKSAdminPolicy",
        "edit": "AmazonEKSEditPolicy", "view": "AmazonEKSViewPolicy"}


def test_an_existing_cluster_in_config_map_mode_is_refused_naming_file_field_and_fix(monkeypatch):
    """eks.getCluster answers the existing cluster's mode; CONFIG_MAP takes no access entry (CI's,
    the nodes', the listed ones), so the preview stops before any is made, naming the spec file,
    the field and the one-way fix. Before, the mode was assumed and the first `pulumi up` failed at
    CreateAccessEntry."""
    cluster = recording._CALLS["aws:eks/getCluster:getCluster"]
    monkeypatch.setitem(recording._CALLS, "aws:eks/getCluster:getCluster",
                        lambda a: {**cluster(a), "accessConfigs": [{"authenticationMode": "CONFIG_MAP"}]})
    with pytest.raises(Exception) as refused:
        run_spec(parse_platform_spec(with_access("platform-dev", ACCESS)))
    message = str(refused.value)
    assert "invalid platform spec stacks/platform-dev.yaml" in message
    assert "cloud.cluster (mode: existing): cluster pdstack-dev's authentication mode is CONFIG_MAP" in message
    assert "Fix: aws eks update-cluster-config --name pdstack-dev --access-config " \
           "authenticationMode=API_AND_CONFIG_MAP" in message
    for mode in ("API", "API_AND_CONFIG_MAP"):
        monkeypatch.setitem(recording._CALLS, "aws:eks/getCluster:getCluster",
                            lambda a, mode=mode: {**cluster(a), "accessConfigs": [{"authenticationMode": mode}]})
        run = run_spec(parse_platform_spec(with_access("platform-dev", ACCESS)))
        assert {TEAM, AUDIT} <= set(entries(run, "aws:eks/accessEntry:AccessEntry"))


@pytest.mark.parametrize("item,problem", [
    ({"principal_arn": "arn:aws:iam::123456789012:group/ops", "policy": "view"},
     "cluster_access.0.principal_arn: 'arn:aws:iam::123456789012:group/ops' is not an IAM role or user ARN. Fix:"),
    ({"principal_arn": TEAM, "policy": "owner"}, "cluster_access.0.policy"),
    ({"principal_arn": TEAM, "policy": "cluster-admin", "namespaces": ["prod"]},
     "cluster_access.0: cluster-admin is the whole cluster's: it takes no namespaces. Fix:"),
    ({"principal_arn": TEAM, "policy": "edit", "namespaces": ["Prod"]},
     "cluster_access.0.namespaces: 'Prod' is not a namespace name (a DNS label). Fix:"),
])
def test_a_bad_item_is_refused_naming_file_and_field(item, problem):
    with pytest.raises(PlatformSpecError) as bad:
        parse_platform_spec(with_access("platform-prod", [item]), "stacks/platform-prod.yaml")
    assert str(bad.value).startswith("invalid platform spec stacks/platform-prod.yaml:")
    assert any(problem in p for p in bad.value.problems), bad.value.problems


def test_one_entry_per_principal():
    """EKS holds one access entry per principal: a second item for one is refused, not left to
    CreateAccessEntry's ResourceInUseException half way through `pulumi up`."""
    with pytest.raises(PlatformSpecError) as bad:
        parse_platform_spec(with_access("platform-prod", [ACCESS[0], {**ACCESS[1], "principal_arn": TEAM}]))
    assert any(f"cluster_access: {TEAM} listed more than once" in p for p in bad.value.problems), bad.value.problems
