"""One cloud module per provider behind one interface: what the platform needs from a cloud.

`build_cloud(spec, hosted)` picks the module the platform spec's `cloud.provider` names:
`aws` (infra/platform_stack/cloud/aws.py: EKS, S3, IAM with Pod Identity or IRSA, EC2NodeClasses,
managed node groups) and `none` (infra/platform_stack/cloud/onprem.py: an existing cluster, nothing
outside Kubernetes). Another cloud is one more module with the same outputs
(infra/platform_stack/cloud/outputs.py `CloudOutputs`).
"""

from __future__ import annotations

from infra.platform_stack.cloud.outputs import CloudOutputs
from infra.platform_stack.spec import PlatformSpec
from infra.spec import StackSpec


def build_cloud(spec: PlatformSpec, hosted: list[StackSpec]) -> CloudOutputs:
    if spec.cloud.provider == "aws":
        from infra.platform_stack.cloud.aws import AwsCloud

        return AwsCloud("cloud", spec, hosted).outputs
    from infra.platform_stack.cloud.onprem import OnPrem

    return OnPrem("cloud", spec).outputs
