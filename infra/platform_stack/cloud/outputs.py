"""What the platform needs from a cloud: the one interface every provider's module fills in
(infra/platform_stack/cloud/aws.py, onprem.py). Its own module, below them and below the package's
`build_cloud`, which picks one: a provider's module imports this, never the package that imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi


@dataclass
class CloudOutputs:
    """What the controllers, the node layer and the serving stacks take from the cloud."""

    kubernetes: pulumi.ProviderResource | None  # None: the stack config's kubernetes:context
    kubeconfig: pulumi.Output | None
    cluster_name: str
    gateway_service_annotations: dict[str, str]
    exports: dict[str, object] = field(default_factory=dict)  # StackReference outputs (roles, buckets, ...)
    after_controllers: list = field(default_factory=list)  # callbacks(installs): objects needing the controllers' CRDs
    # What every controller's install comes after and goes before (the nodes its pods run on),
    # and, by catalog row, what that row's controller needs besides (its cloud identity).
    before_controllers: list[pulumi.Resource] = field(default_factory=list)
    before_controller: dict[str, list[pulumi.Resource]] = field(default_factory=dict)
    # By catalog row, chart values only the cloud knows (an existing cluster's VPC), over the row's own.
    controller_values: dict[str, dict] = field(default_factory=dict)
