"""The typed spec of a per-cluster `platform` stack (data only: fields and their own rules).

A platform spec is a YAML file with `kind: platform` beside the serving specs (stacks/), named
by its Pulumi stack. It says which cloud holds the cluster (or that it is an existing on-prem
one), which serving environments it hosts (their specs size the node layer and scope the
identities), how GPU nodes come to exist (`nodes.mode`) and the typed values of each
controller in the catalog (infra/platform_stack/catalog.py). Rules spanning the platform and the
serving specs live in infra/platform_stack/checks.py.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from infra.inputs import InputError, Strict, load_yaml_mapping, validation_problems
from infra.spec import SpecError
from infra.spec._base import repeated
from infra.images import ImageRef
from infra.naming import PULUMI_STACK_NAME, S3_BUCKET_NAME, is_dns_subdomain, is_label_key, is_label_value

PositiveInt = Annotated[int, Field(gt=0)]
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-\d")
_AMI_ALIAS = re.compile(r"(al2023|bottlerocket)@(v\d{8}|v?\d+\.\d+\.\d+)")  # pinned: never @latest
# EC2 resource ids: the type's prefix and 8 (older ids) to 17 hexadecimal digits (EC2 user guide, "Resource IDs").
_RESERVATION, _VPC, _SUBNET = (re.compile(rf"{prefix}-[0-9a-f]{{8,17}}") for prefix in ("cr", "vpc", "subnet"))
# An Availability Zone's name: its region's and a letter (EC2 user guide, "Regions and Zones"), as
# DescribeCapacityReservations' AvailabilityZone and DescribeSubnets' AvailabilityZone give it.
_ZONE = re.compile(r"[a-z]{2}(-[a-z]+)+-\d[a-z]")
_GITHUB_REPO = re.compile(r"[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}")
_ACCOUNT = re.compile(r"\d{12}")


def is_ec2_tag_value(value: str) -> bool:
    """An EC2 tag value Karpenter can select by. AWS docs, "Tag naming limits and requirements"
    (EC2 user guide): at most 256 Unicode characters; letters, digits, spaces and _ . : / = + - @;
    the aws: prefix is reserved. Karpenter refuses an empty one in a selector term
    (karpenter-provider-aws v1.14.1 EC2NodeClass CRD: "empty tag keys or values aren't supported")."""
    return (0 < len(value) <= 256 and not value.lower().startswith("aws:")
            and all(c in " _.:/=+-@" or unicodedata.category(c)[0] in "LN" for c in value))


def _check(pattern, fix: str):
    def check(cls, v):
        if v is not None and not (pattern(v) if callable(pattern) else pattern.fullmatch(v)):
            raise ValueError(f"{str(v)[:80]!r} {fix}")
        return v
    return classmethod(check)


def _each(check):
    """A field validator for a list: `check` (a `_check`) on each item."""
    return classmethod(lambda cls, v: [check.__func__(cls, item) for item in v])


def _zone_map(key, fix: str):
    """A field validator for a map of an EC2 resource id (matching `key`, else `fix`) to its
    Availability Zone's name."""
    def check(cls, v: dict[str, str]) -> dict[str, str]:
        for item, zone in v.items():
            if not key.fullmatch(item):
                raise ValueError(f"{item[:80]!r} {fix}")
            if not _ZONE.fullmatch(zone):
                raise ValueError(f"{item}: {zone[:80]!r} is not an Availability Zone name. Fix: e.g. us-east-1a")
        return v
    return classmethod(check)


_INSTANCE_TYPE = _check(is_label_value, "is not an instance type (a node label value). Fix: e.g. p5.48xlarge")


class HostedEnvironment(Strict):
    """A serving environment this cluster runs: its spec sizes the nodes and scopes identities."""

    spec: str = Field(description="The serving spec, relative to the project (e.g. stacks/prod.yaml).")
    stack: str | None = Field(None, description="Its Pulumi stack name; default the spec's environment.name.")
    _stack = field_validator("stack")(_check(PULUMI_STACK_NAME, "is not a Pulumi stack name (letters, digits, '_', "
                                                                "'.', '-', 100 at most). Fix: e.g. prod"))
    inventory: str | None = Field(None, description="nodes.mode static: the inventory naming its nodes by role "
                                                    "(the same file `pdctl preflight` reads).")


class SystemNodesSpec(Strict):
    """create: the managed node group every pod without a GPU runs on."""

    instance_types: list[str] = Field(["m7i.2xlarge"], min_length=1, description="CPU instance types.")
    _types = field_validator("instance_types")(_each(_INSTANCE_TYPE))
    count: int = Field(3, ge=2, description="Nodes (two at least: the controllers run two replicas each).")


class ClusterSpec(Strict):
    mode: Literal["create", "existing"] = Field(
        "create", description="create: an EKS cluster made by this stack; existing: one found by name.")
    system_nodes: SystemNodesSpec = Field(
        SystemNodesSpec(), description="create: an untainted managed node group for what needs no GPU (Karpenter, "
                                       "CoreDNS, the controllers, Envoy, Prometheus, the routers and pickers). "
                                       "Karpenter cannot start the node it runs on.")
    name: str
    _name = field_validator("name")(_check(_DNS_LABEL, "is not a cluster name (a DNS label). Fix: e.g. pdstack-prod"))
    vpc_id: str | None = Field(None, description="create: the VPC; its private subnets host the nodes.")
    private_subnet_ids: list[str] = Field([], description="Subnets of the nodes (create: the control plane's too); "
                                                          "node-groups mode needs them in both modes.")
    _vpc = field_validator("vpc_id")(_check(_VPC, "is not a VPC id. Fix: vpc-<8 or 17 hex digits>"))
    _subnets = field_validator("private_subnet_ids")(_each(_check(_SUBNET, "is not a subnet id. Fix: subnet-<8 or 17 "
                                                                           "hex digits>")))
    subnet_zones: dict[str, str] = Field(
        {}, description="private subnet id -> its Availability Zone (us-east-1a; DescribeSubnets' AvailabilityZone). "
                        "node-groups mode: a Capacity Block's group is made in its block's zone's subnets only.")
    _subnet_zones = field_validator("subnet_zones")(_zone_map(_SUBNET, "is not a subnet id. Fix: subnet-<8 or 17 "
                                                                       "hex digits>"))

    def subnets_in(self, zone: str) -> list[str]:
        """The private subnets subnet_zones places in `zone`, in the listed order."""
        return [s for s in self.private_subnet_ids if self.subnet_zones.get(s) == zone]

    endpoint_public_access: bool = Field(False, description="create: a public API endpoint (else private only).")
    discovery_tag: str | None = Field(None, description="Value of karpenter.sh/discovery on the subnets and "
                                                        "security groups node classes select; default the name.")
    _tag = field_validator("discovery_tag")(_check(is_ec2_tag_value, (
        "is not an EC2 tag value (1-256 letters, digits, spaces and _ . : / = + - @, not aws:...). "
        "Fix: e.g. pdstack-prod")))

    def discovery(self) -> str:
        return self.discovery_tag or self.name


class BucketsSpec(Strict):
    weights: str = Field(description="The model weights bucket (versioned, KMS, private, TLS only).")
    release_store: str = Field(description="The release store bucket every actor shares.")
    _names = field_validator("weights", "release_store")(_check(S3_BUCKET_NAME, "is not an S3 bucket name. Fix: "
                                                                               "3-63 lower-case letters, digits, '-'"))
    noncurrent_version_days: PositiveInt = Field(
        30, description="Days an overwritten weight file's old version is kept (a rollback's window).")


class CISpec(Strict):
    """CI's identity: GitHub Actions' OIDC tokens, no stored key."""

    github_repository: str
    _repo = field_validator("github_repository")(_check(_GITHUB_REPO, "is not owner/name. Fix: e.g. example/pdstack"))
    environments: list[str] = Field(min_length=1, description="GitHub deployment environments allowed to deploy "
                                                              "(the token's sub: repo:<repo>:environment:<name>).")
    oidc_provider: Literal["create", "existing"] = Field(
        description="The account's IAM OIDC provider for GitHub's tokens (IAM holds one per URL in an account): "
                    "create (this stack makes it, and keeps it at `pulumi destroy`) or existing (another stack or "
                    "you made it). One platform spec per account creates it.")
    runs_on: list[str] = Field(
        ["ubuntu-24.04"], min_length=1,
        description="The runner labels of the CI job that deploys these environments (.github/workflows/deploy.yml "
                    "passes them to its job): a GitHub-hosted runner reaches only a public API endpoint; a private-only "
                    "one needs a self-hosted runner inside the VPC, e.g. [self-hosted, pdstack-prod].")


class CapacityReservations(Strict):
    """Reservations selected per role, so decode groups and the rollout surge always find whole
    racks and prefill cannot take them."""

    by_role: dict[Literal["prefill", "decode", "colocated"], list[str]] = Field(
        {}, description="role -> capacity reservation ids (cr-...) its node class selects.")
    zones: dict[str, str] = Field(
        {}, description="reservation id -> its Availability Zone (DescribeCapacityReservations' AvailabilityZone): "
                        "a reservation, a Capacity Block too, holds instances of one zone. node-groups mode needs "
                        "each Capacity Block's.")

    @field_validator("by_role")
    @classmethod
    def _ids(cls, v):
        for role, ids in v.items():
            for i in ids:
                if not _RESERVATION.fullmatch(i):
                    raise ValueError(f"{role}: {i!r} is not a capacity reservation id. Fix: cr-<hex>")
        return v
    _zones = field_validator("zones")(_zone_map(_RESERVATION, "is not a capacity reservation id. Fix: cr-<hex>"))


class NodeClassSpec(Strict):
    """One EC2NodeClass per GPU family and role (the role's reservations and taints differ)."""

    name: str = Field(description="The family's name; each role's class is <name>-<role>. Serving specs name it "
                                  "in hardware.node_class.name.")
    _name = field_validator("name")(_check(_DNS_LABEL, "is not a name (a DNS label). Fix: e.g. gb200"))
    ami_alias: str = Field(description="Karpenter amiSelectorTerms alias, pinned: al2023@vYYYYMMDD (EKS-optimized "
                                       "accelerated AL2023: NVIDIA driver, EFA installer) or bottlerocket@x.y.z.")
    _alias = field_validator("ami_alias")(_check(_AMI_ALIAS, "is not a pinned AMI alias. Fix: e.g. al2023@v20260115 "
                                                            "(never @latest: a new AMI would replace every node)"))
    instance_types: list[str] = Field(min_length=1)
    _types = field_validator("instance_types")(_each(_INSTANCE_TYPE))
    instance_store_raid0: bool = Field(True, description="instanceStorePolicy RAID0: the NVMe instance stores as one "
                                                         "array (the weight cache lives on it).")
    efa_interfaces: Annotated[int, Field(ge=0)] = Field(
        0, description="EFA devices to attach (networkInterfaces): one efa-only interface per network card.")
    root_volume_gib: PositiveInt = 200
    capacity_reservations: CapacityReservations = CapacityReservations()


# An IAM role or user of an account (IAM User Guide, "IAM identifiers": a path, then a name of
# letters, digits and +=,.@_-, 64 characters for a role and a user): what an EKS access entry names.
_PRINCIPAL = re.compile(r"arn:aws:iam::\d{12}:(role|user)/([\w+=,.@-]+/)*[\w+=,.@-]{1,64}")
# EKS's access policies by the Kubernetes role each mirrors (EKS User Guide, "Review access policy
# permissions": cluster-admin, admin, edit, view).
ACCESS_POLICIES = {"cluster-admin": "AmazonEKSClusterAdminPolicy", "admin": "AmazonEKSAdminPolicy",
                   "edit": "AmazonEKSEditPolicy", "view": "AmazonEKSViewPolicy"}


class ClusterAccessSpec(Strict):
    """Who may reach the cluster's API besides CI and the nodes: an EKS access entry and its access
    policy association."""

    principal_arn: str = Field(description="An IAM role or user (arn:aws:iam::<account>:role/<name>).")
    _principal = field_validator("principal_arn")(_check(_PRINCIPAL, "is not an IAM role or user ARN. Fix: e.g. "
                                                                     "arn:aws:iam::123456789012:role/platform-team"))
    policy: Literal["cluster-admin", "admin", "edit", "view"] = Field(
        description="EKS's access policy, as the Kubernetes role of that name: cluster-admin (everything), admin, "
                    "edit or view.")
    namespaces: list[str] = Field([], description="Only these namespaces (the association's namespace scope); "
                                                  "empty: the whole cluster. Not for cluster-admin.")
    _namespaces = field_validator("namespaces")(_each(_check(_DNS_LABEL, "is not a namespace name (a DNS label). "
                                                                         "Fix: e.g. prod")))

    @model_validator(mode="after")
    def _cluster_wide(self):
        if self.policy == "cluster-admin" and self.namespaces:
            raise ValueError("cluster-admin is the whole cluster's: it takes no namespaces. Fix: policy admin for "
                             "these namespaces, or drop namespaces")
        return self


class AwsSpec(Strict):
    provider: Literal["aws"] = "aws"
    region: str
    _region = field_validator("region")(_check(_REGION, "is not an AWS region. Fix: e.g. us-east-1"))
    account_id: str | None = Field(None, description="The AWS account the stack deploys into (checked against the "
                                                     "credentials' at `pulumi up`); what tells platform specs in "
                                                     "different accounts apart (ci.oidc_provider).")
    _account = field_validator("account_id")(_check(_ACCOUNT, "is not an AWS account id. Fix: its 12 digits"))
    cluster: ClusterSpec
    buckets: BucketsSpec
    weights_access: Literal["pod-identity", "irsa"] = Field(
        "pod-identity", description="How pods get AWS credentials: EKS Pod Identity or IRSA; never a stored key.")
    ci: CISpec | None = None
    node_classes: list[NodeClassSpec] = Field(min_length=1)
    gateway_load_balancer: Literal["internet-facing", "internal"] = Field(
        "internet-facing", description="Scheme of the NLB in front of Envoy (the AWS Load Balancer Controller's).")
    cluster_access: list[ClusterAccessSpec] = Field(
        [], description="Who may reach the cluster (EKS access entries). CI's role and the nodes' get theirs from "
                        "the stack, and a created cluster's creator keeps admin; an existing cluster must take access "
                        "entries (authentication mode API or API_AND_CONFIG_MAP).")

    @field_validator("cluster_access")
    @classmethod
    def _one_entry_each(cls, v: list[ClusterAccessSpec]) -> list[ClusterAccessSpec]:
        """EKS holds one access entry per principal (CreateAccessEntry: ResourceInUseException)."""
        twice = repeated([a.principal_arn for a in v])
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once: EKS holds one access entry per principal. "
                             "Fix: one item each (its policy the widest it needs)")
        return v


class OnPremSpec(Strict):
    """An existing cluster (kubeadm, bare metal): nothing is created outside Kubernetes."""

    provider: Literal["none"] = "none"
    kubeconfig_context: str | None = Field(None, description="kubectl context of the cluster; default the stack "
                                                             "config's kubernetes:context.")


class NodeGroupSpec(Strict):
    role: Literal["prefill", "decode", "colocated"]
    environment: str
    node_class: str = Field(description="A node_classes name: its AMI, instance types, EFA and reservations.")
    placement_group: bool = Field(True, description="A cluster placement group (EFA wants one). Not for a "
                                                    "capacity_block group: AWS places a block's instances itself "
                                                    "(its reservation's PlacementGroupArn).")
    capacity_block: bool = Field(False, description="The group's instances come from EC2 Capacity Blocks for ML.")


class NodesSpec(Strict):
    mode: Literal["karpenter", "node-groups", "static"] = Field(
        "karpenter", description="karpenter: NodePools per environment and role (the serving stacks); node-groups: "
                                 "EKS managed node groups (this stack); static: existing nodes named in each "
                                 "environment's inventory, labelled and tainted by role.")
    node_groups: list[NodeGroupSpec] = []


class ImagesSpec(Strict):
    """Each pinned by digest or marked a placeholder (infra/images.py)."""

    grafana: ImageRef
    grafana_sidecar: ImageRef = Field(description="kiwigrid/k8s-sidecar: copies the dashboards the serving stacks "
                                                  "publish (ConfigMaps labelled grafana_dashboard) into Grafana.")
    prometheus_adapter: ImageRef | None = None
    efa_device_plugin: ImageRef | None = None


class ControllerValues(Strict):
    """Values pdstack sets on each controller (typed here; infra/platform_stack/values.py checks each
    against the chart's own defaults or schema at the pinned version)."""

    karpenter_replicas: PositiveInt = 2
    envoy_gateway_replicas: PositiveInt = 2
    prometheus_retention: str = Field("15d", pattern=r"^\d+[dhw]$")
    prometheus_storage_gib: PositiveInt = 200
    prometheus_scrape_interval_seconds: PositiveInt = 15
    gpu_driver_preinstalled: bool = Field(
        True, description="The GPU nodes carry the NVIDIA driver and Container Toolkit (EKS accelerated AMIs do; "
                          "on-prem hosts: README, \"An existing on-prem cluster\"): the GPU operator installs "
                          "neither, and `pdctl preflight` checks both on each host. false: the operator installs both.")
    cert_manager_replicas: PositiveInt = 2
    chart_source: Literal["registry", "pinned-modules"] = Field(
        "registry", description="registry: each chart as its project publishes it (catalog.py's repository and "
                                "version); pinned-modules: rendered from the chart's source in the Go module "
                                "pinned in twin/*/go.mod, prepared as its release does (infra/platform_stack/"
                                "charts.py), for clusters that reach no chart registry (air-gapped, the twin).")
    user_installed: list[str] = Field(
        [], description="Catalog rows the cluster already has (installed by you, e.g. from your own mirror): "
                        "pdstack installs neither their chart nor their CRDs.")


class PlatformSpec(Strict):
    kind: Literal["platform"]
    name: str
    _name = field_validator("name")(_check(_DNS_LABEL, "is not a stack name (a DNS label). Fix: e.g. platform-prod"))
    kubernetes_version: str = Field("1.34", pattern=r"^1\.\d+$")
    environments: list[HostedEnvironment] = Field(min_length=1)
    cloud: AwsSpec | OnPremSpec = Field(discriminator="provider")
    nodes: NodesSpec = NodesSpec()
    images: ImagesSpec
    controllers: ControllerValues = ControllerValues()
    gateway_class: str = Field("envoy-gateway", description="The GatewayClass serving stacks name.")
    _class = field_validator("gateway_class")(_check(is_dns_subdomain, "is not an object name. Fix: envoy-gateway"))
    monitoring_namespace: str = Field("monitoring", description="Namespace of Prometheus and Grafana.")
    _monitoring = field_validator("monitoring_namespace")(_check(_DNS_LABEL, "is not a namespace name (a DNS label). "
                                                                            "Fix: e.g. monitoring"))
    prometheus_selector: dict[str, str] = Field(
        {"app.kubernetes.io/part-of": "pdstack"},
        description="Labels of the monitors and rules Prometheus selects (pdstack's layers carry them).")

    @field_validator("prometheus_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        """matchLabels of Prometheus's selectors and labels on every monitor: Kubernetes label keys and values."""
        for key, value in v.items():
            if not is_label_key(key):
                raise ValueError(f"{key[:80]!r} is not a Kubernetes label key ([prefix/]name, the name 63 at most). "
                                 "Fix: e.g. app.kubernetes.io/part-of")
            if not is_label_value(value):
                raise ValueError(f"{key}: {value[:80]!r} is not a Kubernetes label value (63 at most: letters, digits, "
                                 "'-', '_', '.', alphanumeric at each end). Fix: e.g. pdstack")
        return v


class PlatformSpecError(SpecError):
    def __init__(self, problems: list[str], path: str | Path | None = None):
        super().__init__(problems)
        self.args = (f"invalid platform spec{f' {path}' if path else ''}:\n" + "\n".join(f"  - {p}" for p in problems),)


def parse_platform_spec(data: object, path: str | Path | None = None) -> PlatformSpec:
    """`path`: the file it came from, named in the error."""
    try:
        return PlatformSpec.model_validate(data)
    except ValidationError as exc:
        raise PlatformSpecError(validation_problems(exc, PlatformSpec), path) from None


def load_platform_spec(path: str | Path) -> PlatformSpec:
    try:
        data = load_yaml_mapping(path, "platform spec")
    except InputError as exc:
        raise PlatformSpecError([str(exc)]) from None
    return parse_platform_spec(data, path)
