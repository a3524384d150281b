"""twin/platform_prod.py without a twin: the DaemonSet controller's placement rule, prod's kwok
nodes, what the provider sends, and the twin's Helm as the platform needs it (tests/twin/
test_platform_prod_on_twin.py applies them on the twin)."""

from __future__ import annotations

import pytest

from infra.platform_stack.catalog import controller
from infra.platform_stack.efa import EFA_PLUGIN_LISTED_FROM
from infra.platform_stack.spec import load_platform_spec
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from twin import build
from twin.identities import _MANIFEST_SEPARATOR
from twin.platform_prod import (DRA_DRIVER, EFA_PLUGIN, GPU_OPERATOR_NODE_LABELS, NFD_GPU_LABELS, dra_driver_stand_in,
                                efa_plugin_listed, efa_plugin_stand_in, prod_gpu_nodes, prod_system_nodes, tolerates,
                                why_not_on, without_nulls)


@pytest.fixture(scope="module")
def prod_nodes():
    platform = load_platform_spec("stacks/platform-prod.yaml")
    return prod_gpu_nodes(load_spec(stack_spec_path("prod")), platform), prod_system_nodes(platform)


def test_a_toleration_matches_a_taint_as_kubernetes_says():
    """k8s.io/api v0.34.4 core/v1 toleration.go ToleratesTaint: an empty effect matches every
    effect, an empty key with Exists matches every taint, Equal compares the value (the operator
    defaults to Equal)."""
    taint = {"key": "pdstack.io/role", "value": "decode", "effect": "NoSchedule"}
    assert tolerates({"key": "pdstack.io/role", "value": "decode", "effect": "NoSchedule"}, taint)
    assert tolerates({"key": "pdstack.io/role", "value": "decode"}, taint)  # Equal by default, any effect
    assert tolerates({"operator": "Exists"}, taint)
    assert tolerates({"key": "pdstack.io/role", "operator": "Exists", "effect": "NoSchedule"}, taint)
    assert not tolerates({"key": "pdstack.io/role", "value": "prefill", "effect": "NoSchedule"}, taint)
    assert not tolerates({"key": "pdstack.io/role", "operator": "Exists", "effect": "NoExecute"}, taint)
    assert not tolerates({"key": "nvidia.com/gpu", "operator": "Exists"}, taint)


def test_a_daemonsets_pod_goes_where_its_selector_affinity_and_tolerations_admit(prod_nodes):
    """pkg/controller/daemon/daemon_controller.go predicates at v1.34.4: nodeSelector, required
    node affinity (terms ORed, expressions ANDed), and every NoSchedule/NoExecute taint tolerated;
    PreferNoSchedule and the node-condition taints the controller tolerates itself
    (AddOrUpdateDaemonPodTolerations) keep no pod off."""
    gpu, system = prod_nodes
    node = gpu[0]
    role = node["metadata"]["labels"]["pdstack.io/role"]
    tolerations = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                   {"key": "pdstack.io/role", "value": role, "effect": "NoSchedule"}]
    assert why_not_on({"tolerations": tolerations}, node) is None
    assert why_not_on({"tolerations": tolerations[:1]}, node) == \
        f"untolerated taint pdstack.io/role={role}:NoSchedule"
    assert why_not_on({}, system[0]) is None
    cordoned = {**system[0], "spec": {"taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
        {"key": "example.com/maintenance", "value": "disk", "effect": "PreferNoSchedule"}]}}
    assert why_not_on({}, cordoned) is None
    assert why_not_on({"nodeSelector": {"nvidia.com/gpu.deploy.device-plugin": "true"}}, system[0]) == \
        "nodeSelector nvidia.com/gpu.deploy.device-plugin=true not on the node"
    either = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [system[0]["metadata"]["name"]]}]}]}}}}
    assert why_not_on({**either, "tolerations": tolerations}, node) is None
    assert why_not_on(either, system[0]) is None
    assert why_not_on(either, system[1]).startswith("required node affinity matches no term: ")


def test_prods_gpu_nodes_carry_what_eks_karpenter_nfd_and_the_gpu_operator_put_there(prod_nodes):
    """One node per NVLink domain of each pool, each of prod's instance type, pool, taints and
    rack (its Capacity Block and that block's zone, stacks/platform-prod.yaml), with NFD's NVIDIA
    PCI label and the GPU operator's gpu.present and deploy labels, which the GPU DaemonSets'
    selectors name; the system node group untainted, pdstack.io/role=system."""
    gpu, system = prod_nodes
    platform = load_platform_spec("stacks/platform-prod.yaml")
    blocks = platform.cloud.node_classes[0].capacity_reservations
    by_pool: dict[str, list[dict]] = {}
    for node in gpu:
        by_pool.setdefault(node["metadata"]["labels"]["pdstack.io/role"], []).append(node)
    assert {role: len(nodes) for role, nodes in by_pool.items()} == {r: len(b) for r, b in blocks.by_role.items()}
    for role, nodes in by_pool.items():
        assert [n["metadata"]["labels"]["karpenter.k8s.aws/capacity-reservation-id"] for n in nodes] == \
            blocks.by_role[role]
        assert len({n["metadata"]["labels"]["nvidia.com/gpu.clique"] for n in nodes}) == len(nodes)
        for n in nodes:
            labels = n["metadata"]["labels"]
            assert labels["node.kubernetes.io/instance-type"] == "p6e-gb200.36xlarge"
            assert labels["topology.kubernetes.io/zone"] == blocks.zones[labels["karpenter.k8s.aws/capacity-reservation-id"]]
            assert labels["karpenter.sh/nodepool"] == f"pdstack-prod-{role}"
            assert labels.items() >= {**NFD_GPU_LABELS, **GPU_OPERATOR_NODE_LABELS}.items()
            assert {t["key"] for t in n["spec"]["taints"]} == {"pdstack.io/role", "nvidia.com/gpu"}
    assert len(system) == platform.cloud.cluster.system_nodes.count
    assert all(n["metadata"]["labels"]["pdstack.io/role"] == "system" and not n["spec"]["taints"] for n in system)


def test_the_efa_stand_in_lists_the_types_of_its_chart_version():
    """infra/platform_stack/efa.py: p6e-gb200.36xlarge is listed from chart v0.5.14 on, so the
    plugin's affinity at v0.5.6 (fault #3) lists it not, and the catalog's version does."""
    assert "p6e-gb200.36xlarge" not in efa_plugin_listed("v0.5.6")
    assert efa_plugin_listed(controller(EFA_PLUGIN).chart.version) == sorted(EFA_PLUGIN_LISTED_FROM)
    (ds,) = efa_plugin_stand_in(controller(EFA_PLUGIN), "kube-system", {"tolerations": [{"operator": "Exists"}]},
                                version="v0.5.6")
    [term] = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"][0]["values"] == efa_plugin_listed("v0.5.6")


def test_the_dra_controller_keeps_its_charts_affinity_unless_the_values_replace_it(prod_nodes):
    """Fault #2: with no values the controller requires a control-plane node (none of prod's
    nodes); with platform-prod's values it fits the system nodes and no GPU node."""
    gpu, system = prod_nodes
    row = controller(DRA_DRIVER)
    default, _ = dra_driver_stand_in(row, "x", {})
    assert all(why_not_on(default["spec"]["template"]["spec"], n) for n in gpu + system)
    from tests.test_platform import context
    given, plugin = dra_driver_stand_in(row, "x", row.values(context("platform-prod")))
    assert all(why_not_on(given["spec"]["template"]["spec"], n) is None for n in system)
    assert all(why_not_on(given["spec"]["template"]["spec"], n) for n in gpu)
    assert all(why_not_on(plugin["spec"]["template"]["spec"], n) is None for n in gpu)


def test_null_map_values_are_not_sent_as_the_provider_sends_none():
    """pulumi-kubernetes Create reads inputs with SkipNulls (see without_nulls): the GPU
    operator chart's `plugin:` (null) is no key; list items stay as they are."""
    assert without_nulls({"spec": {"validator": {"plugin": None, "image": "v"}, "args": [{"a": None}]}}) == \
        {"spec": {"validator": {"image": "v"}, "args": [{}]}}


def test_helm_splits_a_templates_text_where_a_separator_follows_trimmed_whitespace():
    """helm.sh/helm/v3 v3.18.6 pkg/releaseutil/manifest.go SplitManifests: `(?:^|\\s*\\n)---\\s*`,
    so cert-manager's `{{- ... }}` leaving `---# comment` on a line is two manifests."""
    text = "kind: Role\nmetadata: {name: a}\n---# Permission to approve\nkind: Role\nmetadata: {name: b}\n"
    assert [d.strip().splitlines()[-1] for d in _MANIFEST_SEPARATOR.split(text) if d.strip()] == \
        ["metadata: {name: a}", "metadata: {name: b}"]


def test_a_changed_program_source_of_the_twins_builds_anew(tmp_path, monkeypatch):
    """twin/helm's main.go is ours, not a pinned module: its change must give a new cache key
    (it kept the old binary, which took no values file, when the key hashed go.mod and go.sum
    only); a module with no Go file of its own keeps its key."""
    folder = tmp_path / "helm"
    folder.mkdir()
    (folder / "go.mod").write_text("module x\n")
    (folder / "go.sum").write_text("")
    monkeypatch.setattr(build, "TWIN_SRC", tmp_path)
    module = build.GoModule("helm")
    bare = module.key()
    (folder / "main.go").write_text("package main\n")
    first = module.key()
    (folder / "main.go").write_text("package main\n// changed\n")
    assert len({bare, first, module.key()}) == 3
