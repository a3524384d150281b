"""The platform's charts as the pinned Kubernetes provider installs them: what their Helm hooks
would have made, where their controllers can schedule, which nodes their DaemonSets admit."""

from __future__ import annotations

import pytest

from infra import naming
from infra.platform_stack.catalog import controller, installed
from infra.platform_stack.program import platform_context
from infra.platform_stack.spec import load_platform_spec
from infra.spec_checks import load_spec
from tests.test_platform import context, onprem_twin_spec

POOL_ROLES = ("prefill", "decode", "colocated")


def test_the_dra_driver_is_installed_only_where_a_hosted_stack_makes_compute_domains():
    """The serving stack makes a ComputeDomain only for a pool whose groups span nodes of an NVLink
    domain (infra/components/engines.py uses_multi_node_nvlink); the DRA driver serves nothing
    else here (its GPU resources are off), so a platform hosting none runs no DRA driver."""
    dra = controller("nvidia-dra-driver-gpu")
    assert dra in installed(context("platform-prod"))  # prod: GB200 supernode, decode groups across nodes
    assert dra not in installed(context("platform-dev"))  # dev: H100, no supernode
    prod = load_spec("stacks/prod.yaml")
    flat = prod.model_copy(update={"hardware": prod.hardware.model_copy(update={"supernode": None})})
    spec = load_platform_spec("stacks/platform-prod.yaml")
    assert dra not in installed(platform_context(spec, [flat]))


def test_the_dra_controller_schedules_where_the_cluster_kind_has_nodes_for_it():
    """NVIDIA/k8s-dra-driver-gpu v25.12.0 deployments/helm/nvidia-dra-driver-gpu/values.yaml:
    `controller.affinity` requires a node labelled node-role.kubernetes.io/control-plane (and
    tolerates its taint). EKS shows no control-plane node, so there the controller would stay
    Pending: on AWS it must go to a node no GPU pool owns (the system nodes). Helm merges maps
    but replaces lists (helm.sh/helm/v3 pkg/chartutil/coalesce.go), so the chart's one
    nodeSelectorTerm is replaced, not added to. A kubeadm cluster (cloud: none) has control-plane
    nodes: the chart's default stays."""
    dra = controller("nvidia-dra-driver-gpu")
    on_eks = dra.values(context("platform-prod"))["controller"]
    terms = on_eks["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": naming.ROLE_LABEL, "operator": "NotIn",
                                            "values": list(POOL_ROLES)}]}]
    assert on_eks["tolerations"] == []  # no control-plane taint to tolerate on EKS
    prod = load_spec("stacks/prod.yaml")
    onprem = platform_context(onprem_twin_spec(), [prod])
    assert "controller" not in dra.values(onprem)


def matches(term: dict, labels: dict[str, str]) -> bool:
    """A nodeSelectorTerm's matchExpressions against a node's labels (k8s.io/component-helpers
    scheduling/corev1/nodeaffinity: In, NotIn (true without the label), Exists, DoesNotExist)."""
    for e in term["matchExpressions"]:
        value = labels.get(e["key"])
        ok = {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": value is not None, "DoesNotExist": value is None}[e["operator"]]
        if not ok:
            return False
    return True


def test_the_dra_controller_fits_an_eks_system_node_and_no_gpu_node():
    """The system node group is labelled pdstack.io/role: system (infra/platform_stack/cloud/aws.py);
    an existing cluster's CPU nodes carry no role label; every GPU pool's nodes carry their role."""
    on_eks = controller("nvidia-dra-driver-gpu").values(context("platform-prod"))["controller"]
    [term] = on_eks["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert matches(term, {naming.ROLE_LABEL: "system"}) and matches(term, {})
    assert not any(matches(term, {naming.ROLE_LABEL: role}) for role in POOL_ROLES)


@pytest.mark.parametrize("name", ["platform-prod", "platform-dev"])
def test_installed_rows_follow_what_the_hosted_stacks_use(name):
    ctx = context(name)
    assert ctx.compute_domains == (name == "platform-prod")
