"""The AWS Load Balancer Controller: installed on AWS from its pinned module, and the gateway's
Service handed to it, not to EKS's legacy in-tree controller (issue #38 item 10).

Sources: sigs.k8s.io/aws-load-balancer-controller at the version twin/platform/go.mod pins (chart
3.2.2), read from the Go module cache: helm/aws-load-balancer-controller (values.yaml, crds/),
docs/guide/service/nlb.md and annotations.md (how a Service names the controller, its target type
and scheme), docs/deploy/installation.md (region and VPC when instance metadata is out of reach).
"""

from __future__ import annotations

import functools

import pulumi
import pytest

import infra.recording as recording
from infra.offline import run_spec
from infra.platform_stack.catalog import controller, installed
from infra.platform_stack.cloud.load_balancer import LOAD_BALANCER_CONTROLLER, untagged_subnets_warning
from infra.platform_stack.modules import module_file
from infra.platform_stack.program import platform_context
from infra.platform_stack.spec import load_platform_spec, parse_platform_spec
from infra.platform_stack.values import values_problems
from infra.recording import OfflineRun
from infra.render.manifests import unwrap
from infra.spec_checks import load_spec
from tests.conftest import shipped_run
from tests.test_platform import context, onprem_twin_spec

ROW = "aws-load-balancer-controller"
DOCS = "docs/guide/service/annotations.md"


@functools.cache
def platform_run(name: str, scheme: str | None = None) -> OfflineRun:
    """The shipped platform stack's run, or a variant whose gateway load balancer is `scheme`."""
    if not scheme:
        return shipped_run(name)
    data = load_platform_spec(f"stacks/{name}.yaml").model_dump(mode="json", exclude_none=True)
    data["cloud"]["gateway_load_balancer"] = scheme
    return run_spec(parse_platform_spec(data))


def gateway_service_annotations(run: OfflineRun) -> dict[str, str]:
    (proxy,) = run.by_kind("EnvoyProxy")
    return proxy["spec"]["provider"]["kubernetes"]["envoyService"]["annotations"]


@pytest.mark.parametrize("name,scheme", [("platform-prod", None), ("platform-prod", "internal"),
                                         ("platform-dev", None)])
def test_the_gateways_service_is_the_load_balancer_controllers(name, scheme):
    """`aws-load-balancer-type: external` makes the in-tree controller ignore the Service and
    this controller take it; `nlb-target-type: ip` sends to the Envoy pods; the scheme is said,
    since the controller's own default is internal (nlb.md, "Secure by default"). Each is checked
    against the pinned module's annotation docs. Before: `aws-load-balancer-type: nlb`, the legacy
    in-tree controller's value, and `aws-load-balancer-internal`, the deprecated way to say the
    scheme."""
    run = platform_run(name, scheme)
    expected = scheme or load_platform_spec(f"stacks/{name}.yaml").cloud.gateway_load_balancer
    annotations = gateway_service_annotations(run)
    assert annotations == {"service.beta.kubernetes.io/aws-load-balancer-type": "external",
                           "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
                           "service.beta.kubernetes.io/aws-load-balancer-scheme": expected}
    docs = module_file(LOAD_BALANCER_CONTROLLER, DOCS).read_text()
    assert "annotation set to either `nlb-ip` or `external`" in docs
    assert "`ip` mode will route traffic directly to the pod IP" in docs
    assert "Valid values are `internal`, `internet-facing`" in docs
    assert "aws-load-balancer-internal" in docs and "deprecated, in favor of [aws-load-balancer-scheme]" in docs


@pytest.mark.parametrize("name", ["platform-prod", "platform-dev"])
def test_the_controller_is_installed_with_values_its_chart_knows(name):
    """The row installs on AWS (both platforms: a created and an existing cluster), its CRDs from
    the chart's crds/ in the module (what `helm install` applies), and its values, the VPC the cloud
    gives it included, are ones its chart's values.yaml knows. The region and VPC are said: the
    nodes' instance metadata answers one hop (httpPutResponseHopLimit 1), and without them the
    controller cannot start (installation.md). Its webhook certificate is cert-manager's."""
    run = platform_run(name)
    (chart,) = [r for r in run.of_type("kubernetes:helm.sh/v4:Chart") if r.name == ROW]
    values = unwrap(chart.inputs)["values"]
    spec = load_platform_spec(f"stacks/{name}.yaml")
    assert values["clusterName"] == spec.cloud.cluster.name and values["region"] == spec.cloud.region
    assert values["vpcId"]  # the spec's VPC, or the existing cluster's (eks.getCluster)
    assert values["enableCertManager"] is True
    assert values_problems(ROW, values) == []
    crds = {d["spec"]["group"] + "/" + d["spec"]["names"]["kind"] for d in run.by_kind("CustomResourceDefinition")}
    assert {"elbv2.k8s.aws/TargetGroupBinding", "elbv2.k8s.aws/IngressClassParams"} <= crds
    association = [unwrap(r.inputs) for r in run.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")
                   if r.name == ROW]
    assert [(a["namespace"], a["serviceAccount"]) for a in association] == [
        (controller(ROW).namespace, values["serviceAccount"]["name"])]


def test_not_installed_off_aws():
    """An on-prem cluster's own load balancer (MetalLB or similar) serves the gateway."""
    assert controller(ROW) in installed(context("platform-prod"))
    assert controller(ROW) not in installed(platform_context(onprem_twin_spec(), [load_spec("stacks/dev.yaml")]))


def test_preview_says_when_no_subnet_carries_the_schemes_role_tag(monkeypatch):
    """The VPC and its subnets are the user's (README, "Objects that stay the user's"). The
    controller picks a scheme's subnets by their role tag, and where no subnet has it, by route
    table (docs/deploy/subnet_discovery.md): so each preview asks EC2 for the VPC's subnets with
    the tag and says, naming tag and VPC, when there are none."""
    asked, warned = [], []
    monkeypatch.setitem(recording._CALLS, "aws:ec2/getSubnets:getSubnets",
                        lambda a: asked.append(a) or {"ids": [], "id": "none"})
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *a, **k: warned.append(message))
    data = load_platform_spec("stacks/platform-prod.yaml").model_dump(mode="json", exclude_none=True)
    data["cloud"]["gateway_load_balancer"] = "internal"
    run_spec(parse_platform_spec(data))
    vpc = data["cloud"]["cluster"]["vpc_id"]
    assert [a["filters"] for a in asked] == [[{"name": "vpc-id", "values": [vpc]},
                                              {"name": "tag:kubernetes.io/role/internal-elb", "values": ["1", ""]}]]
    assert [w for w in warned if "kubernetes.io/role/internal-elb=1" in w and vpc in w]
    assert untagged_subnets_warning("internet-facing", vpc, ["subnet-0a1b2c3d4e5f60799"]) is None
    docs = module_file(LOAD_BALANCER_CONTROLLER, "docs/deploy/subnet_discovery.md").read_text()
    assert "`kubernetes.io/role/elb`" in docs and "`kubernetes.io/role/internal-elb`" in docs
