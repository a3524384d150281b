"""One cloud module per provider behind one interface: what the platform needs from a cloud.

`build_cloud(spec, hosted)` picks the module the platform spec's `cloud.provider` names:
`aws` (infra/platform_stack/cloud/aws.py: EKS, S3, IAM with Pod Identity or IRSA, EC2NodeClasses,
managed node groups) and `none` (infra/platform_stack/cloud/onprem.py: an existing cluster, nothing
outside Kubernetes). Another cloud is one more module with the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi

from infra.platform_stack.spec import PlatformSpec
from infra.spec import StackSpec


@dataclass
class CloudOutputs:
    """What the controllers, the node layer and the serving stacks take from the cloud."""

    kubernetes: pulumi.ProviderResource | None  # None: the stack config's kubernetes:context
    kubeconfig: pulumi.Output | None
    cluster_name: str
    gateway_service_annotations: dict[str, str]
    exports: dict[str, object] = field(default_factory=dict)  # StackReference outputs (roles, buckets, ...)
    after_controllers: list = field(default_factory=list)  # callbacks(installs): objects needing the controllers' CRDs


def build_cloud(spec: PlatformSpec, hosted: list[StackSpec]) -> CloudOutputs:
    if spec.cloud.provider == "aws":
        from infra.platform_stack.cloud.aws import AwsCloud

        return AwsCloud("cloud", spec, hosted).outputs
    from infra.platform_stack.cloud.onprem import OnPrem

    return OnPrem("cloud", spec).outputs
