"""AWS: the EKS cluster (made here, or an existing one by name), the weights and release-store
buckets, the IAM roles pods and CI assume (EKS Pod Identity or IRSA; GitHub's OIDC for CI; no
stored key anywhere), Karpenter's roles, an EFA security group, one EC2NodeClass per GPU family
and role, and (nodes.mode: node-groups) EKS managed node groups."""

from __future__ import annotations

import functools
import json

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra import naming
from infra.components.engines import ENGINE_SERVICE_ACCOUNT
from infra.components.nodepools import role_taints
from infra.platform_stack.checks import nodes_needed
from infra.platform_stack.efa import efa_network_interfaces
from infra.platform_stack.cloud.interruption import interruption_queue, karpenter_queue_statement
from infra.platform_stack.cloud.access import access_policy_arn, cluster_access, entries_accepted
from infra.platform_stack.cloud.load_balancer import (gateway_service_annotations, load_balancer_controller_identity,
                                                      load_balancer_controller_statements, warn_untagged_subnets)
from infra.platform_stack.cloud.outputs import CloudOutputs
from infra.platform_stack.components.base import PlatformLayer
from infra.platform_stack.spec import NodeClassSpec, PlatformSpec
from infra.platform_stack.weight_cache import INSTANCE_STORE_GB
from infra.spec import REPO_ROOT, StackSpec, stack_spec_path
from infra.tracks import namespace_globs

KARPENTER_NAMESPACE, KARPENTER_SA = "kube-system", "karpenter"
GITHUB_OIDC = "token.actions.githubusercontent.com"
LOAD_BALANCER_ROW = "aws-load-balancer-controller"  # its catalog row (cloud/load_balancer.py: its IAM)


def ci_role_name(cluster: str) -> str:
    """The CI role's name: what .github/workflows/deploy.yml assumes for each environment."""
    return f"{cluster}-ci"


def namespace_conditions(hosted: list[StackSpec], key: str, value: str = "{}", excluded: str = "{}") -> list[dict]:
    """One IAM condition block per hosted environment: `key` (its value `value` with the namespace
    in place of {}) names the environment's namespace or one of its release tracks'
    (infra/tracks.py namespace_globs), nothing else. One block each, because one environment's
    exclusions must not reach another's namespace. `excluded` is the excluded patterns' value:
    where `value` already fixes how it starts, `*` may stand for that: an IRSA trust policy holds
    33 patterns per environment, and IAM's default quota for one is 2,048 characters (IAM User
    Guide, "IAM and AWS STS quotas")."""
    blocks = []
    for namespace in sorted({s.environment.namespace for s in hosted}):
        like, not_like = namespace_globs(namespace)
        blocks.append({"StringLike": {key: [value.format(p) for p in like]},
                       "StringNotLike": {key: [excluded.format(p) for p in not_like]}})
    return blocks


def policy(*statements: dict) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)}, sort_keys=True)


def pod_identity_trust(cluster_arn: str) -> str:
    """EKS Pod Identity's trust policy (docs.aws.amazon.com/eks/latest/userguide/pod-id-role.html):
    only the agent's service principal, only for this account's cluster."""
    return policy({"Effect": "Allow", "Principal": {"Service": "pods.eks.amazonaws.com"},
                   "Action": ["sts:AssumeRole", "sts:TagSession"],
                   "Condition": {"ArnEquals": {"aws:SourceArn": cluster_arn}}})


def irsa_trust(provider_arn: str, issuer: str, hosted: list[StackSpec], service_account: str) -> str:
    """IRSA: the cluster's OIDC tokens, for this service account in the environments' namespaces
    and their release tracks' only (sub = system:serviceaccount:<namespace>:<name>)."""
    host = issuer.removeprefix("https://")
    return policy(*({"Effect": "Allow", "Principal": {"Federated": provider_arn},
                     "Action": "sts:AssumeRoleWithWebIdentity",
                     "Condition": {"StringEquals": {f"{host}:aud": "sts.amazonaws.com"}, **block}}
                    for block in namespace_conditions(hosted, f"{host}:sub", f"system:serviceaccount:{{}}:{service_account}",
                                                      f"*:{{}}:{service_account}")))


def namespace_scope(hosted: list[StackSpec], service_account: str) -> list[dict]:
    """Pod Identity session tags (kubernetes-namespace, kubernetes-service-account) limit a role's
    permissions to the environments' namespaces, release tracks included: one condition block
    per environment."""
    return [{**block, "StringEquals": {"aws:PrincipalTag/kubernetes-service-account": service_account}}
            for block in namespace_conditions(hosted, "aws:PrincipalTag/kubernetes-namespace")]


def ec2_node_class(spec: PlatformSpec, family: NodeClassSpec, role: str, node_role: str,
                   efa_security_group: str | None) -> dict:
    discovery = {"karpenter.sh/discovery": spec.cloud.cluster.discovery()}
    reservations = family.capacity_reservations.by_role.get(role, [])
    node_spec: dict = {
        "role": node_role,
        "amiSelectorTerms": [{"alias": family.ami_alias}],
        "subnetSelectorTerms": [{"tags": discovery}],
        "securityGroupSelectorTerms": [{"tags": discovery}] + ([{"id": efa_security_group}] if efa_security_group else []),
        "blockDeviceMappings": [{"deviceName": "/dev/xvda", "rootVolume": True, "ebs": {
            "volumeSize": f"{family.root_volume_gib}Gi", "volumeType": "gp3", "encrypted": True}}],
        "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1},
        "tags": {"pdstack.io/role": role, "pdstack.io/node-class": family.name},
    }
    if family.instance_store_raid0:
        node_spec["instanceStorePolicy"] = "RAID0"
    if family.efa_interfaces:
        # Karpenter attaches EFA only when the NodeClaim requests vpc.amazonaws.com/efa or the node
        # class lists networkInterfaces (karpenter-provider-aws v1.14.1 pkg/providers/instance/
        # instance.go getEFACountForInstance); a static NodePool's NodeClaims carry no pod requests,
        # so without this list the GB200 racks would come up with no EFA device at all. One list for
        # every type of the family (checks.py refuses types whose layouts differ).
        node_spec["networkInterfaces"] = efa_network_interfaces(family.instance_types[0], family.efa_interfaces)
    if reservations:
        node_spec["capacityReservationSelectorTerms"] = [{"id": r} for r in reservations]
    return {"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass",
            "metadata": {"name": f"{family.name}-{role}", "labels": {"pdstack.io/role": role}}, "spec": node_spec}


def instance_profile_statements(cluster: str, region: str, account: str) -> list[dict]:
    """What Karpenter's controller needs to make, tag, fill and delete the instance profile of each
    EC2NodeClass, scoped to the profiles it makes for this cluster.

    It creates each profile with the tags EC2NodeClass.InstanceProfileTags lists
    (karpenter-provider-aws v1.14.1 pkg/apis/v1/ec2nodeclass.go: `kubernetes.io/cluster/<name>:
    owned`, `eks:eks-cluster-name`, `karpenter.k8s.aws/ec2nodeclass: <class>`,
    `topology.kubernetes.io/region`). A create is judged by the tags in the request
    (aws:RequestTag; a resource that does not exist yet has no aws:ResourceTag), everything after
    by the profile's own tags: the statements of the project's controller policy at v1.14.1
    (website getting-started cloudformation.yaml, IAMIntegrationPolicy), in this account."""
    owned = f"kubernetes.io/cluster/{cluster}"
    profiles = f"arn:aws:iam::{account}:instance-profile/*"
    request = {"StringEquals": {f"aws:RequestTag/{owned}": "owned", "aws:RequestTag/eks:eks-cluster-name": cluster,
                                "aws:RequestTag/topology.kubernetes.io/region": region},
               "StringLike": {"aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"}}
    existing = {"StringEquals": {f"aws:ResourceTag/{owned}": "owned", "aws:ResourceTag/topology.kubernetes.io/region": region},
                "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*"}}
    return [
        {"Effect": "Allow", "Action": "iam:CreateInstanceProfile", "Resource": profiles, "Condition": request},
        {"Effect": "Allow", "Action": "iam:TagInstanceProfile", "Resource": profiles, "Condition": {
            "StringEquals": {**request["StringEquals"], **existing["StringEquals"]},
            "StringLike": {**request["StringLike"], **existing["StringLike"]}}},
        {"Effect": "Allow", "Action": ["iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile",
                                       "iam:DeleteInstanceProfile"], "Resource": profiles, "Condition": existing},
        {"Effect": "Allow", "Action": "iam:GetInstanceProfile", "Resource": profiles},
        {"Effect": "Allow", "Action": "iam:ListInstanceProfiles", "Resource": "*"},  # a List has no resource type
    ]


# What Karpenter launches, and tags as it launches (karpenter-provider-aws v1.14.1
# pkg/utils/utils.go GetTags: `kubernetes.io/cluster/<name>: owned`, `karpenter.sh/nodepool`,
# `eks:eks-cluster-name`, on the fleet request, its instances, volumes, network interfaces, and
# on each launch template).
KARPENTER_MADE = ("fleet", "instance", "volume", "network-interface", "launch-template", "spot-instances-request")
# The EC2 reads Karpenter makes (its EC2API interface, pkg/aws/sdk.go), in the cluster's region.
KARPENTER_EC2_READS = ("DescribeCapacityReservations", "DescribeImages", "DescribeInstances", "DescribeInstanceStatus",
                       "DescribeInstanceTypeOfferings", "DescribeInstanceTypes", "DescribeLaunchTemplates",
                       "DescribePlacementGroups", "DescribeSecurityGroups", "DescribeSpotPriceHistory",
                       "DescribeSubnets")


def pricing_region(region: str) -> str:
    """Where Karpenter calls the pricing API from a cluster in `region`: the API has endpoints in
    four regions only (karpenter-provider-aws v1.14.1 pkg/providers/pricing/pricing.go NewAPI)."""
    for prefix, endpoint in (("ap-", "ap-south-1"), ("cn-", "cn-northwest-1"), ("eu-", "eu-central-1")):
        if region.startswith(prefix):
            return endpoint
    return "us-east-1"


def karpenter_controller_statements(cluster: str, region: str, account: str, node_role_arn: str) -> list[dict]:
    """Karpenter's controller policy: the project's own at v1.14.1 (website getting-started
    cloudformation.yaml: NodeLifecyclePolicy, IAMIntegrationPolicy, EKSIntegrationPolicy,
    ResourceDiscoveryPolicy) in this region and account. It launches from, tags and deletes only
    what carries this cluster's `owned` tag and a NodePool's; it terminates nothing else.

    The pricing API is fenced to the region Karpenter calls it in (pricing_region), not the
    cluster's: the cluster's region refused every price lookup outside us-east-1. Not
    granted, as nothing here calls it: ARC zonal shift (settings.enableZonalShift is false). The
    interruption queue's calls are granted on its queue only (cloud/interruption.py)."""
    def ec2(resource: str) -> str:
        return f"arn:aws:ec2:{region}:*:{resource}/*"

    owned = {f"aws:ResourceTag/kubernetes.io/cluster/{cluster}": "owned"}
    of_a_nodepool = {"aws:ResourceTag/karpenter.sh/nodepool": "*"}
    tagged = {f"aws:RequestTag/kubernetes.io/cluster/{cluster}": "owned", "aws:RequestTag/eks:eks-cluster-name": cluster}
    for_a_nodepool = {"aws:RequestTag/karpenter.sh/nodepool": "*"}
    made = [ec2(r) for r in KARPENTER_MADE]
    launch = ["ec2:RunInstances", "ec2:CreateFleet"]
    return [
        {"Effect": "Allow", "Action": launch, "Resource": [
            f"arn:aws:ec2:{region}::image/*", f"arn:aws:ec2:{region}::snapshot/*", ec2("security-group"),
            ec2("subnet"), ec2("capacity-reservation"), ec2("placement-group")]},
        {"Effect": "Allow", "Action": launch, "Resource": ec2("launch-template"),
         "Condition": {"StringEquals": owned, "StringLike": of_a_nodepool}},
        {"Effect": "Allow", "Action": [*launch, "ec2:CreateLaunchTemplate"], "Resource": made,
         "Condition": {"StringEquals": tagged, "StringLike": for_a_nodepool}},
        {"Effect": "Allow", "Action": "ec2:CreateTags", "Resource": made, "Condition": {
            "StringEquals": {**tagged, "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"]},
            "StringLike": for_a_nodepool}},
        # After launch: the node's name and its NodeClaim (pkg/controllers/nodeclaim/tagging), no other key.
        {"Effect": "Allow", "Action": "ec2:CreateTags", "Resource": ec2("instance"), "Condition": {
            "StringEquals": owned, "StringLike": of_a_nodepool,
            "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": cluster},
            "ForAllValues:StringEquals": {"aws:TagKeys": ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]}}},
        {"Effect": "Allow", "Action": ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
         "Resource": [ec2("instance"), ec2("launch-template")],
         "Condition": {"StringEquals": owned, "StringLike": of_a_nodepool}},
        {"Effect": "Allow", "Action": "iam:PassRole", "Resource": node_role_arn,
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
        *instance_profile_statements(cluster, region, account),
        {"Effect": "Allow", "Action": "eks:DescribeCluster", "Resource": f"arn:aws:eks:{region}:{account}:cluster/{cluster}"},
        {"Effect": "Allow", "Action": [f"ec2:{a}" for a in KARPENTER_EC2_READS], "Resource": "*",
         "Condition": {"StringEquals": {"aws:RequestedRegion": region}}},
        {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": f"arn:aws:ssm:{region}::parameter/aws/service/*"},
        {"Effect": "Allow", "Action": "pricing:GetProducts", "Resource": "*",
         "Condition": {"StringEquals": {"aws:RequestedRegion": pricing_region(region)}}},
        karpenter_queue_statement(region, account, cluster),
    ]


def raid0_user_data() -> str:
    """A managed node group's user data (base64 MIME) asking nodeadm to join the instance stores
    as one RAID0 array at /mnt/k8s-disks/0, where the weight cache lives: what Karpenter's
    instanceStorePolicy RAID0 does for the node classes (NodeConfig spec.instance.localStorage,
    awslabs/amazon-eks-ami nodeadm; EKS merges its own NodeConfig part after this one)."""
    import base64

    return base64.b64encode("\r\n".join([
        "MIME-Version: 1.0", 'Content-Type: multipart/mixed; boundary="PDSTACK"', "", "--PDSTACK",
        "Content-Type: application/node.eks.aws", "", "apiVersion: node.eks.aws/v1alpha1", "kind: NodeConfig",
        "spec:", "  instance:", "    localStorage:", "      strategy: RAID0", "", "--PDSTACK--", ""]).encode()).decode()


def accelerated_ami_type(instance_types: list[str]) -> str:
    """The EKS-optimized accelerated AL2023 AMI for the group's architecture: Graviton and Grace
    families (c7g, g5g, p6e-gb200) are arm64, the rest x86_64. A managed node group without one
    gets EKS's default, a standard AMI with no NVIDIA driver."""
    import re

    family = instance_types[0].split(".")[0]
    arm = re.fullmatch(r"[a-z]+\d+[a-z]*g[a-z]*", family) or re.search(r"-g[bh]\d+", family)
    return "AL2023_ARM_64_NVIDIA" if arm else "AL2023_x86_64_NVIDIA"


def check_account(expected: str, actual: str) -> str:
    """At `pulumi up`, the credentials reach the account the spec says (STS GetCallerIdentity):
    the spec's account is what tells two platform specs' accounts apart (checks.py
    oidc_provider_problems)."""
    if actual != expected:
        raise ValueError(f"cloud.account_id is {expected}, but the AWS credentials reach account {actual}. "
                         "Fix: use credentials of that account, or correct cloud.account_id")
    return actual


def node_classes_needed(spec: PlatformSpec, hosted: list[StackSpec]) -> list[tuple[NodeClassSpec, str]]:
    """(family, role) for every pool of every hosted environment, by the family its spec names."""
    families = {f.name: f for f in spec.cloud.node_classes}
    wanted = sorted({(s.hardware.node_class.name, role) for s in hosted for role in s.deployment.pools()})
    return [(families[name], role) for name, role in wanted if name in families]


class AwsCloud(pulumi.ComponentResource):
    def __init__(self, name: str, spec: PlatformSpec, hosted: list[StackSpec],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("pdstack:cloud:AwsCloud", name, None, opts)
        self.spec, self.hosted = spec, hosted
        c = spec.cloud
        child = pulumi.ResourceOptions(parent=self)
        self.cluster_name = c.cluster.name
        self.account_id = aws.get_caller_identity_output().account_id
        if c.account_id:
            self.account_id.apply(functools.partial(check_account, c.account_id))
        # What names the cluster by name (an access entry, a Pod Identity association, a node group,
        # an add-on: no Output, so no edge unless made here) is made after the cluster this stack
        # makes, and deleted before it.
        self.cluster_made: list[pulumi.Resource] = []
        # What every controller needs before its pods can run and be drained again (the nodes
        # without GPUs, the Pod Identity agent), and what a row's controller needs besides (its
        # role, policy and association): made first, deleted after (CloudOutputs).
        self.before_controllers: list[pulumi.Resource] = []
        self.before_controller: dict[str, list[pulumi.Resource]] = {}

        # --- the cluster --------------------------------------------------------------------
        if c.cluster.mode == "create":
            import pulumi_eks as eks

            cluster = eks.Cluster(
                c.cluster.name, name=c.cluster.name, vpc_id=c.cluster.vpc_id,
                private_subnet_ids=c.cluster.private_subnet_ids, version=spec.kubernetes_version,
                endpoint_private_access=True, endpoint_public_access=c.cluster.endpoint_public_access,
                authentication_mode="API", create_oidc_provider=c.weights_access == "irsa",
                skip_default_node_group=True,
                # The serving stacks' NetworkPolicies (default deny, then what each hop needs) are
                # enforced only when the VPC CNI's network policy agent is on; it is off by default.
                vpc_cni_options=eks.VpcCniOptionsArgs(enable_network_policy=True), opts=child)
            kubeconfig = cluster.kubeconfig_json
            self.cluster_made = [cluster]
            self.entries_cluster: pulumi.Input[str] = c.cluster.name  # made with authentication_mode API
            # EKS's ARN for the name (Service Authorization Reference, Amazon EKS, resource type
            # `cluster`): known before the cluster is, so the roles that trust it are made meanwhile.
            cluster_arn = pulumi.Output.concat(f"arn:aws:eks:{c.region}:", self.account_id,
                                               f":cluster/{c.cluster.name}")
            self.cluster_security_group = cluster.eks_cluster.vpc_config.cluster_security_group_id
            vpc_id = (pulumi.Output.from_input(c.cluster.vpc_id) if c.cluster.vpc_id
                      else cluster.eks_cluster.vpc_config.vpc_id)  # pulumi-eks's default VPC
            oidc_arn, oidc_issuer = cluster.oidc_provider_arn, cluster.oidc_issuer
            self.before_controllers.append(aws.eks.Addon(
                "eks-pod-identity-agent", cluster_name=c.cluster.name, addon_name="eks-pod-identity-agent",
                opts=self.in_cluster()))
            # The node classes find their security groups by the discovery tag (ec2_node_class): the
            # security group EKS makes for a new cluster (control plane <-> nodes) must carry it,
            # and nothing else would tag it, since it does not exist before this `pulumi up`.
            aws.ec2.Tag("cluster-security-group-discovery", resource_id=self.cluster_security_group,
                        key="karpenter.sh/discovery", value=c.cluster.discovery(), opts=child)
        else:
            found = aws.eks.get_cluster_output(name=c.cluster.name)
            # pulumi-aws 7 (eks/get_cluster.py, GetClusterResult): a list, `certificate_authorities`.
            kubeconfig = pulumi.Output.all(found.endpoint, found.certificate_authorities[0].data).apply(
                lambda a: self.kubeconfig(a[0], a[1]))
            cluster_arn = found.arn
            spec_file = str(stack_spec_path(spec.name).relative_to(REPO_ROOT))
            # What an access entry names the cluster by: its name, once its mode takes entries.
            self.entries_cluster = found.access_configs.apply(
                functools.partial(entries_accepted, c.cluster.name, spec_file=spec_file))
            vpc_id = found.vpc_config.vpc_id
            self.cluster_security_group = found.vpc_config.cluster_security_group_id
            oidc_issuer = found.identities[0].oidcs[0].issuer
            oidc_arn = (aws.iam.get_open_id_connect_provider_output(url=oidc_issuer).arn
                        if c.weights_access == "irsa" else None)
        self.provider = k8s.Provider("cluster", kubeconfig=kubeconfig, opts=child)

        # --- buckets ------------------------------------------------------------------------
        # The buckets outlive a `pulumi destroy` (the weights and the release history are the
        # user's), and so does what they need: their key (a deleted key leaves every object it
        # encrypted unreadable), its alias and the settings that keep them private and versioned.
        kept = pulumi.ResourceOptions(parent=self, retain_on_delete=True)
        self.kms = aws.kms.Key("buckets", description="pdstack weights and release store", enable_key_rotation=True,
                               deletion_window_in_days=30, opts=kept)
        aws.kms.Alias("buckets", name=f"alias/{c.cluster.name}-pdstack", target_key_id=self.kms.key_id, opts=kept)
        self.weights = self.bucket("weights", c.buckets.weights, noncurrent_days=c.buckets.noncurrent_version_days)
        self.releases = self.bucket("release-store", c.buckets.release_store, noncurrent_days=None)

        # --- identities ---------------------------------------------------------------------
        weights_read = policy(*(
            {**statement, **scope} for statement in (
                {"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
                 "Resource": f"arn:aws:s3:::{c.buckets.weights}/*"},
                {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketVersioning"],
                 "Resource": f"arn:aws:s3:::{c.buckets.weights}"},
                {"Effect": "Allow", "Action": ["kms:Decrypt"], "Resource": "${kms}"})
            for scope in self.scopes(ENGINE_SERVICE_ACCOUNT)))
        trust = (cluster_arn.apply(pod_identity_trust) if c.weights_access == "pod-identity" else
                 pulumi.Output.all(oidc_arn, oidc_issuer).apply(
                     lambda a: irsa_trust(a[0], a[1], hosted, ENGINE_SERVICE_ACCOUNT)))
        self.weights_role = aws.iam.Role("weights-reader", name=f"{c.cluster.name}-weights-reader",
                                         assume_role_policy=trust, opts=child)
        aws.iam.RolePolicy("weights-reader", role=self.weights_role.name,
                           policy=self.kms.arn.apply(lambda arn: weights_read.replace("${kms}", arn)), opts=child)
        exports: dict[str, object] = {"weights_role_arn": self.weights_role.arn}
        if c.ci:
            exports.update(self.ci_identities())
        exports.update(self.karpenter_identities(cluster_arn))
        cluster_access(c.cluster_access, self.entries_cluster, self.in_cluster)
        if LOAD_BALANCER_ROW not in spec.controllers.user_installed:
            warn_untagged_subnets(vpc_id, c.gateway_load_balancer)
            self.before_controller[LOAD_BALANCER_ROW] = load_balancer_controller_identity(
                c.cluster.name, cluster_arn.apply(pod_identity_trust),
                self.account_id.apply(lambda a: policy(*load_balancer_controller_statements(c.region, a))),
                child, self.in_cluster())
        if c.cluster.mode == "create":
            self.system_nodes_and_storage(cluster_arn)

        # --- fabric and node classes --------------------------------------------------------
        efa_sg = None
        if any(f.efa_interfaces for f in c.node_classes):
            sg = aws.ec2.SecurityGroup("efa", description="EFA: all traffic between the GPU nodes", vpc_id=vpc_id,
                                       tags={"Name": f"{c.cluster.name}-efa"}, opts=child)
            # EFA needs every protocol to and from the group itself (EC2 User Guide, EFA security groups)
            aws.vpc.SecurityGroupIngressRule("efa-in", security_group_id=sg.id, ip_protocol="-1",
                                             referenced_security_group_id=sg.id, opts=child)
            aws.vpc.SecurityGroupEgressRule("efa-out", security_group_id=sg.id, ip_protocol="-1",
                                            referenced_security_group_id=sg.id, opts=child)
            efa_sg = sg.id
        self.efa_security_group = efa_sg
        for family in c.node_classes:
            for itype in family.instance_types:
                self.check_instance_store(itype)
        exports.update({"cluster_name": c.cluster.name, "weights_bucket": c.buckets.weights,
                        "release_store_bucket": c.buckets.release_store, "kms_key_arn": self.kms.arn,
                        "weights_access": c.weights_access})
        if spec.nodes.mode == "node-groups":
            self.node_groups()

        self.outputs = CloudOutputs(kubernetes=self.provider, kubeconfig=kubeconfig, cluster_name=c.cluster.name,
                                    gateway_service_annotations=gateway_service_annotations(c.gateway_load_balancer),
                                    controller_values={LOAD_BALANCER_ROW: {"vpcId": vpc_id}}, exports=exports,
                                    after_controllers=[self.register_node_classes],
                                    before_controllers=self.before_controllers,
                                    before_controller=self.before_controller)
        self.register_outputs({})

    # --- pieces -------------------------------------------------------------------------------

    def kubeconfig(self, endpoint: str, ca: str) -> str:
        """A kubeconfig that asks `aws eks get-token` for a short-lived token: no stored credential."""
        c = self.spec.cloud
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": c.cluster.name,
            "clusters": [{"name": c.cluster.name, "cluster": {"server": endpoint, "certificate-authority-data": ca}}],
            "contexts": [{"name": c.cluster.name, "context": {"cluster": c.cluster.name, "user": c.cluster.name}}],
            "users": [{"name": c.cluster.name, "user": {"exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws",
                "args": ["eks", "get-token", "--cluster-name", c.cluster.name, "--region", c.region]}}}]})

    def scopes(self, service_account: str) -> list[dict]:
        """What each statement of a pod-facing policy is repeated under: one condition per environment."""
        if self.spec.cloud.weights_access != "pod-identity":
            return [{}]  # IRSA's trust policy names the service accounts itself
        return [{"Condition": block} for block in namespace_scope(self.hosted, service_account)]

    def in_cluster(self, *after: pulumi.Resource) -> pulumi.ResourceOptions:
        """Options of what names the cluster this stack makes (and `after`, what else it names)."""
        return pulumi.ResourceOptions(parent=self, depends_on=[*self.cluster_made, *after])

    def bucket(self, name: str, bucket: str, noncurrent_days: int | None) -> aws.s3.Bucket:
        child = pulumi.ResourceOptions(parent=self, retain_on_delete=True)  # kept, as the key is (above)
        b = aws.s3.Bucket(name, bucket=bucket, opts=child)
        aws.s3.BucketOwnershipControls(name, bucket=b.bucket, rule={"object_ownership": "BucketOwnerEnforced"},
                                       opts=child)
        aws.s3.BucketPublicAccessBlock(name, bucket=b.bucket, block_public_acls=True, block_public_policy=True,
                                       ignore_public_acls=True, restrict_public_buckets=True, opts=child)
        aws.s3.BucketVersioning(name, bucket=b.bucket, versioning_configuration={"status": "Enabled"}, opts=child)
        aws.s3.BucketServerSideEncryptionConfiguration(name, bucket=b.bucket, rules=[{
            "apply_server_side_encryption_by_default": {"sse_algorithm": "aws:kms",
                                                        "kms_master_key_id": self.kms.arn},
            "bucket_key_enabled": True}], opts=child)
        aws.s3.BucketPolicy(name, bucket=b.bucket, policy=policy({
            "Sid": "TLSOnly", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
            "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}}}), opts=child)
        if noncurrent_days:
            aws.s3.BucketLifecycleConfiguration(name, bucket=b.bucket, rules=[{
                "id": "old-versions", "status": "Enabled", "filter": {},
                "noncurrent_version_expiration": {"noncurrent_days": noncurrent_days}}], opts=child)
        return b

    def ci_identities(self) -> dict:
        """GitHub Actions' OIDC tokens, per repository and deployment environment, assume CI's role;
        CI reaches the release store through it and the cluster through an EKS access entry."""
        c, child = self.spec.cloud, pulumi.ResourceOptions(parent=self)
        # IAM holds one OIDC provider per URL in an account: one platform stack makes it
        # (`ci.oidc_provider: create`), the others find it (`existing`; checks.py refuses two
        # committed specs in one account that both make it). Kept at `pulumi destroy`: the other
        # stacks' CI roles trust it.
        if c.ci.oidc_provider == "create":
            provider_arn = aws.iam.OpenIdConnectProvider(
                "github", url=f"https://{GITHUB_OIDC}", client_id_lists=["sts.amazonaws.com"],
                opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True)).arn
        else:
            provider_arn = aws.iam.get_open_id_connect_provider_output(url=f"https://{GITHUB_OIDC}").arn
        subjects = [f"repo:{c.ci.github_repository}:environment:{e}" for e in c.ci.environments]
        ci = aws.iam.Role("ci", name=ci_role_name(c.cluster.name), assume_role_policy=provider_arn.apply(lambda arn: policy({
            "Effect": "Allow", "Principal": {"Federated": arn}, "Action": "sts:AssumeRoleWithWebIdentity",
            "Condition": {"StringEquals": {f"{GITHUB_OIDC}:aud": "sts.amazonaws.com", f"{GITHUB_OIDC}:sub": subjects}}})),
            opts=child)
        store = self.spec.cloud.buckets.release_store
        aws.iam.RolePolicy("ci", role=ci.name, policy=pulumi.Output.all(self.kms.arn, self.weights_role.arn).apply(
            lambda a: policy(
                {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"], "Resource": f"arn:aws:s3:::{store}/*"},
                {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": f"arn:aws:s3:::{store}"},
                {"Effect": "Allow", "Action": ["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"], "Resource": a[0]},
                # By ARN: the cluster, and the associations in it (the serving stack makes one per
                # release track's namespace). A tag condition would need a tag nothing sets.
                {"Effect": "Allow", "Action": ["eks:DescribeCluster", "eks:CreatePodIdentityAssociation",
                                               "eks:ListPodIdentityAssociations"],
                 "Resource": f"arn:aws:eks:{c.region}:*:cluster/{c.cluster.name}"},
                {"Effect": "Allow", "Action": ["eks:DescribePodIdentityAssociation", "eks:DeletePodIdentityAssociation",
                                               "eks:UpdatePodIdentityAssociation", "eks:TagResource",
                                               "eks:UntagResource"],  # the serving stack tags each one
                 "Resource": f"arn:aws:eks:{c.region}:*:podidentityassociation/{c.cluster.name}/*"},
                {"Effect": "Allow", "Action": "iam:PassRole", "Resource": a[1]})), opts=child)
        entry = aws.eks.AccessEntry("ci", cluster_name=self.entries_cluster, principal_arn=ci.arn,
                                    opts=self.in_cluster())
        # An access policy is associated with an existing entry (EKS AssociateAccessPolicy:
        # ResourceNotFoundException otherwise); at `pulumi destroy` the association goes first.
        aws.eks.AccessPolicyAssociation("ci", cluster_name=c.cluster.name, principal_arn=ci.arn,
                                        policy_arn=access_policy_arn("cluster-admin"),
                                        access_scope={"type": "cluster"}, opts=self.in_cluster(entry))
        return {"ci_role_arn": ci.arn, "release_store_writer_role_arn": ci.arn}

    def karpenter_identities(self, cluster_arn) -> dict:
        """Karpenter's node role (EC2NodeClass.spec.role) with its access entry, and its controller's
        role through Pod Identity (kube-system/karpenter)."""
        c, child = self.spec.cloud, pulumi.ResourceOptions(parent=self)
        node = self.node_iam_role("karpenter-node", child, "AmazonSSMManagedInstanceCore")
        self.node_role = node
        node_entry = aws.eks.AccessEntry("karpenter-node", cluster_name=self.entries_cluster, principal_arn=node.arn,
                                         type="EC2_LINUX", opts=self.in_cluster())
        # A node class names the role by name; its nodes join through the entry, and Karpenter
        # removes the role from the class's instance profiles before the class goes.
        self.node_class_needs: list[pulumi.Resource] = [node, node_entry]
        if self.spec.nodes.mode != "karpenter":
            return {"node_role_arn": node.arn}
        controller = aws.iam.Role("karpenter-controller", name=f"{c.cluster.name}-karpenter",
                                  assume_role_policy=cluster_arn.apply(pod_identity_trust), opts=child)
        controller_policy = aws.iam.RolePolicy(
            "karpenter-controller", role=controller.name, policy=pulumi.Output.all(self.account_id, node.arn).apply(
                lambda a: policy(*karpenter_controller_statements(c.cluster.name, c.region, a[0], a[1]))), opts=child)
        association = aws.eks.PodIdentityAssociation(
            "karpenter", cluster_name=c.cluster.name, namespace=KARPENTER_NAMESPACE, service_account=KARPENTER_SA,
            role_arn=controller.arn, opts=self.in_cluster())
        queue = interruption_queue(c.cluster.name, c.region, self.account_id, child)
        # Before its pods start (the Pod Identity webhook injects credentials at admission; the
        # controller looks its queue up at start), and after they stop: it finalizes the node
        # classes' nodes with these (test_platform_order).
        self.before_controller["karpenter"] = [controller, controller_policy, association, node, node_entry, *queue]
        return {"node_role_arn": node.arn, "karpenter_role_arn": controller.arn}

    def node_iam_role(self, name: str, opts: pulumi.ResourceOptions, *extra_policies: str) -> aws.iam.Role:
        """An EC2 instance role a node joins the cluster with (kubelet, VPC CNI, image pulls)."""
        return aws.iam.Role(name, name=f"{self.spec.cloud.cluster.name}-{name}", assume_role_policy=policy(
            {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}),
            managed_policy_arns=[f"arn:aws:iam::aws:policy/{p}" for p in (
                "AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryPullOnly",
                *extra_policies)], opts=opts)

    def system_nodes_and_storage(self, cluster_arn) -> None:
        """What a new cluster lacks before anything else can run: nodes without GPUs (the cluster
        is made with no default node group, and Karpenter cannot start the node it runs on), the
        EBS CSI driver (not built into EKS since 1.23) and a default StorageClass, so Prometheus's
        volume claims bind. An existing cluster has its own: README lists them as the user's.
        Every controller comes after these, and goes before them: its pods are drained from
        these nodes, and Prometheus's volumes deleted through this driver."""
        c, child = self.spec.cloud, pulumi.ResourceOptions(parent=self)
        system = c.cluster.system_nodes
        role = self.node_iam_role("system-node", child)
        # A managed node group's role gets its access entry from EKS itself (the Karpenter node
        # role's is made above, since no node group names it).
        system_group = aws.eks.NodeGroup(
            "system", cluster_name=c.cluster.name, node_role_arn=role.arn, subnet_ids=c.cluster.private_subnet_ids,
            instance_types=list(system.instance_types), capacity_type="ON_DEMAND",
            scaling_config={"min_size": system.count, "max_size": system.count, "desired_size": system.count},
            labels={naming.ROLE_LABEL: "system"}, opts=self.in_cluster())
        ebs = aws.iam.Role("ebs-csi", name=f"{c.cluster.name}-ebs-csi", assume_role_policy=cluster_arn.apply(
            pod_identity_trust), managed_policy_arns=["arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"],
            opts=child)
        # After the nodes: the add-on's controller needs somewhere to run before EKS calls it active.
        driver = aws.eks.Addon(
            "aws-ebs-csi-driver", cluster_name=c.cluster.name, addon_name="aws-ebs-csi-driver",
            pod_identity_associations=[{"role_arn": ebs.arn, "service_account": "ebs-csi-controller-sa"}],
            opts=self.in_cluster(system_group))
        storage = ClusterStorage("storage", pulumi.ResourceOptions(parent=self, providers=[self.provider]))
        self.before_controllers += [system_group, driver, storage]

    def check_instance_store(self, itype: str) -> None:
        """At `pulumi up`, DescribeInstanceTypes must agree with the table the spec check used."""
        expected = INSTANCE_STORE_GB.get(itype)
        if expected is None:
            return

        def agree(total):
            if total is not None and int(total) < expected:
                raise ValueError(f"{itype}: DescribeInstanceTypes reports {total} GB of instance store, below the "
                                 f"{expected} GB infra/platform_stack/weight_cache.py assumes. Fix: correct the table")
            return total
        aws.ec2.get_instance_type_output(instance_type=itype).total_instance_storage.apply(agree)

    def register_node_classes(self, installs: dict) -> list[dict]:
        """EC2NodeClasses, once Karpenter's CRDs exist (its row's install)."""
        karpenter = installs.get("karpenter")
        if karpenter is None:
            return []
        made = []
        for family, role in node_classes_needed(self.spec, self.hosted):
            manifest = ec2_node_class(self.spec, family, role, f"{self.spec.cloud.cluster.name}-karpenter-node",
                                      self.efa_security_group if family.efa_interfaces else None)
            # After the controller, not only its CRDs: the class carries Karpenter's termination
            # finalizer, which the running controller removes at `pulumi destroy` once it has
            # terminated the class's nodes and deleted its instance profiles and launch templates
            # (karpenter-provider-aws v1.14.1 pkg/controllers/nodeclass/controller.go finalize).
            karpenter.add(manifest, karpenter.ready() + self.node_class_needs)
            made.append(manifest)
        return made

    def node_groups(self) -> None:
        """nodes.mode node-groups: EKS managed node groups per environment and role, labelled and
        tainted as a NodePool's nodes are, sized for the pool's maximum plus the rollout surge.
        A role on Capacity Blocks gets one group per block: a launch template targets one
        reservation (capacity-block market), so each block's nodes come from it
        (checks.py refuses a role whose nodes do not split evenly over its blocks)."""
        c = self.spec.cloud
        families = {f.name: f for f in c.node_classes}
        by_env = {s.environment.name: s for s in self.hosted}
        for group in self.spec.nodes.node_groups:
            family = families[group.node_class]
            nodes = nodes_needed(by_env[group.environment], group.role)
            name = f"{group.environment}-{group.role}"
            if not group.capacity_block:
                placement = (aws.ec2.PlacementGroup(name, strategy="cluster", opts=pulumi.ResourceOptions(parent=self))
                             if group.placement_group else None)
                self.node_group(name, group, family, nodes, placement, None, c.cluster.private_subnet_ids)
                continue
            # A block is a reservation of one Availability Zone, placed by AWS (EC2 API, botocore
            # 1.44.18 ec2 2016-11-15 CapacityReservation: AvailabilityZone, PlacementGroupArn):
            # its group gets that zone's subnets and no placement group of ours.
            blocks, zones = family.capacity_reservations.by_role[group.role], family.capacity_reservations.zones
            for i, block in enumerate(blocks):
                self.node_group(f"{name}-{i}", group, family, nodes // len(blocks), None, block,
                                c.cluster.subnets_in(zones[block]))

    def node_group(self, name: str, group, family: NodeClassSpec, nodes: int, placement, block: str | None,
                   subnets: list[str]) -> None:
        c, child = self.spec.cloud, pulumi.ResourceOptions(parent=self)
        # Interfaces a launch template lists get only the security groups listed here: the
        # cluster's (control plane <-> nodes) as well as EFA's, or the nodes never join.
        groups = [self.cluster_security_group] + ([self.efa_security_group] if self.efa_security_group else [])
        template = aws.ec2.LaunchTemplate(
            name, network_interfaces=[
                {"network_card_index": n["networkCardIndex"], "device_index": n["deviceIndex"],
                 "interface_type": "efa" if n["interfaceType"] == "efa-only" and n["networkCardIndex"] == 0
                 else n["interfaceType"], "security_groups": groups}
                for n in efa_network_interfaces(family.instance_types[0], family.efa_interfaces)] or None,
            placement={"group_name": placement.name} if placement else None,
            instance_market_options={"market_type": "capacity-block"} if block else None,
            capacity_reservation_specification=(
                {"capacity_reservation_target": {"capacity_reservation_id": block}} if block else None),
            user_data=raid0_user_data() if family.instance_store_raid0 else None,
            metadata_options={"http_tokens": "required", "http_put_response_hop_limit": 1}, opts=child)
        aws.eks.NodeGroup(
            name, cluster_name=c.cluster.name, node_role_arn=self.node_role.arn,
            ami_type=accelerated_ami_type(family.instance_types),
            subnet_ids=subnets, instance_types=list(family.instance_types),
            capacity_type="CAPACITY_BLOCK" if block else "ON_DEMAND",
            scaling_config={"min_size": nodes, "max_size": nodes, "desired_size": nodes},
            labels={naming.ROLE_LABEL: group.role, "pdstack.io/environment": group.environment},
            taints=[{"key": t["key"], "value": t["value"], "effect": "NO_SCHEDULE"} for t in role_taints(group.role)],
            launch_template={"id": template.id, "version": template.latest_version.apply(str)},
            opts=self.in_cluster(*self.node_class_needs))  # its nodes join through the node role's entry


class ClusterStorage(PlatformLayer):
    """The default StorageClass of a cluster this stack made: encrypted gp3 through the EBS CSI
    driver, bound where the pod lands (a volume lives in one availability zone)."""

    layer = "cloud"

    def __init__(self, name: str, opts: pulumi.ResourceOptions):
        super().__init__(name, opts)
        self.add({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {
            "name": "gp3", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": "ebs.csi.aws.com", "parameters": {"type": "gp3", "encrypted": "true"},
            "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete", "allowVolumeExpansion": True})
        self.register_outputs({})
