"""The platform's charts as the pinned Kubernetes provider installs them: what their Helm hooks
would have made, where their controllers can schedule, which nodes their DaemonSets admit."""

from __future__ import annotations

import dataclasses
import re

import pytest

from infra import naming
from infra.offline import run_spec
from infra.platform_stack.catalog import CATALOG, ENVOY_GATEWAY_CERTGEN_SECRETS, controller, installed
from infra.platform_stack.charts import chart_hooks
from infra.platform_stack.checks import controller_problems
from infra.platform_stack.modules import module_dir, module_file
from infra.platform_stack.program import platform_context
from infra.platform_stack.spec import load_platform_spec
from infra.platform_stack.efa import EFA_PLUGIN_LISTED_FROM, efa_plugin_problems
from infra.render.manifests import manifests, unwrap
from infra.spec_checks import load_spec
from tests.conftest import shipped_run
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


def listed_hooks(row) -> dict[str, frozenset[str]]:
    return {where: frozenset(hook.events) for hook in row.hooks for where in hook.where}


def test_every_hook_of_every_chart_is_listed_with_what_provides_what_it_makes():
    """The pinned provider renders charts with hooks off: pulumi-kubernetes provider
    v4.0.0-20260115033456-f47bc2d6f199 (engine/kubernetes/go.mod) pkg/provider/helm/v4/chart.go
    sets `cmd.DisableHooks = true` and registers only `release.Manifest` (Helm v3.18.6
    pkg/action/install.go keeps hooks apart, in `release.Hooks`). A hook never runs, so what it
    makes never exists unless something else makes it: Envoy Gateway v1.9.0's certgen Job made
    the TLS Secret its controller mounts, and without it no Gateway was ever programmed.
    Every hook in every chart source a pinned module carries (templates and values, subcharts
    too) must be listed on its row with what it makes and what provides that; a registry-only
    chart says where its hooks were read."""
    for row in CATALOG:
        if row.chart is None:
            continue
        if row.values_source:
            found = chart_hooks(module_dir(row.values_source.module) / row.values_source.path)
            assert found == listed_hooks(row), row.name
        else:
            assert row.hooks_read_from, f"{row.name}: say where its chart's hooks were read"
        for hook in row.hooks:
            assert hook.makes and hook.provided_by, (row.name, hook.where)
    assert listed_hooks(controller("envoy-gateway"))["templates/certgen.yaml"] == {"pre-install", "pre-upgrade"}


def test_a_hook_found_in_a_chart_that_its_row_does_not_list_is_seen(tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "job.yaml").write_text(
        'metadata:\n  annotations:\n    "helm.sh/hook": pre-install, pre-upgrade  # makes the Secret\n')
    (tmp_path / "templates" / "made.yaml").write_text("metadata:\n  annotations:\n    helm.sh/hook: {{ .Values.when }}\n")
    (tmp_path / "values.yaml").write_text("check:\n  jobAnnotations:\n    helm.sh/hook: post-install\n")
    assert chart_hooks(tmp_path) == {"templates/job.yaml": {"pre-install", "pre-upgrade"},
                                     "templates/made.yaml": {"{{ .Values.when }}"},
                                     "values.yaml:check.jobAnnotations": {"post-install"}}


@pytest.fixture(scope="module")
def prod_platform():
    return shipped_run("platform-prod")


def test_envoy_gateways_certgen_runs_as_a_job_the_stack_makes_before_the_chart(prod_platform):
    """Envoy Gateway v1.9.0: charts/gateway-helm/templates/certgen.yaml and certgen-rbac.yaml (the
    hook: `envoy-gateway certgen`, ENVOY_GATEWAY_NAMESPACE from the pod's namespace, a Role on
    secrets get/create/update, `--disable-topology-injector` when topologyInjector is off);
    internal/provider/kubernetes/secrets.go CertsToSecret (the Secrets it makes);
    templates/envoy-gateway-deployment.yaml (the controller mounts Secret `envoy-gateway`)."""
    row = controller("envoy-gateway")
    ns = row.namespace
    made = {(o["kind"], o["metadata"]["name"]): o for o in map(unwrap, manifests(prod_platform))
            if o["metadata"].get("namespace") == ns}
    job = made[("Job", "envoy-gateway-certgen")]
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["envoy-gateway", "certgen"]
    assert container["args"] == ["--disable-topology-injector"]
    assert row.values(context("platform-prod"))["topologyInjector"] == {"enabled": False}
    assert container["image"] == "docker.io/envoyproxy/gateway:v1.9.0"  # the chart's default: gateway:<Chart.Version>
    env = {e["name"]: e for e in container["env"]}
    assert env["ENVOY_GATEWAY_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is True
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in made
    binding = made[("RoleBinding", account)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": ns}]
    rules = made[("Role", binding["roleRef"]["name"])]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "update"]}]

    source = module_file(row.values_source.module, "internal/provider/kubernetes/secrets.go").read_text()
    assert set(re.findall(r'newSecret\(\s*corev1\.SecretType\w+,\s*"([^"]+)"', source)) == set(ENVOY_GATEWAY_CERTGEN_SECRETS)
    chart = module_dir(row.values_source.module) / row.values_source.path / "templates"
    mounted = set(re.findall(r"secretName:\s*(\S+)", (chart / "envoy-gateway-deployment.yaml").read_text()))
    assert mounted and mounted <= set(ENVOY_GATEWAY_CERTGEN_SECRETS)


def test_the_gateway_chart_waits_for_its_certgen_job(monkeypatch):
    """A pre-install hook runs before the release's objects: the chart depends on the Job, whose
    completion Pulumi awaits (pulumi-kubernetes await logic for batch/v1 Job)."""
    from infra.platform_stack.components import controllers

    waits_for, chart = {}, controllers.k8s.helm.v4.Chart

    def recording(name, *args, opts=None, **kwargs):
        waits_for[name] = {d._name for d in opts.depends_on}
        return chart(name, *args, opts=opts, **kwargs)

    monkeypatch.setattr(controllers.k8s.helm.v4, "Chart", recording)
    run_spec(load_platform_spec("stacks/platform-prod.yaml"))
    assert {"job-envoy-gateway-certgen", "rolebinding-envoy-gateway-certgen"} <= waits_for["envoy-gateway"]
    assert not any("certgen" in d for name, deps in waits_for.items() if name != "envoy-gateway" for d in deps)


EFA = "aws-efa-k8s-device-plugin"


@pytest.mark.parametrize("name", ["platform-prod", "platform-dev"])
def test_every_efa_node_class_instance_type_is_one_the_pinned_efa_chart_schedules_on(name):
    """aws/eks-charts stable/aws-efa-k8s-device-plugin templates/daemonset.yaml (v0.5.30): the
    plugin's DaemonSet requires node.kubernetes.io/instance-type In supportedInstanceLabels.values.
    p6e-gb200.36xlarge is listed from chart v0.5.14 on (aws/eks-charts #1236), so at v0.5.6 every
    prod engine pod would have stayed Pending on vpc.amazonaws.com/efa. The chart is in no pinned
    package: which version lists a type is the hand-kept table of infra/platform_stack/efa.py."""
    spec = load_platform_spec(f"stacks/{name}.yaml")
    efa_types = {t for family in spec.cloud.node_classes if family.efa_interfaces for t in family.instance_types}
    assert efa_types and efa_types <= set(EFA_PLUGIN_LISTED_FROM)
    assert efa_plugin_problems(spec, controller(EFA).chart.version) == []
    assert controller_problems(context(name)) == []


def test_an_efa_instance_type_the_pinned_chart_does_not_list_stops_the_preview(monkeypatch):
    """With the chart at v0.5.6 (before p6e-gb200 was listed, aws/eks-charts #1236 at v0.5.14)
    the platform is refused, naming the node class, the type, both versions and the fix; dev's
    p5.48xlarge is listed from the chart's first version (v0.4.2, #1040) and passes."""
    from infra.platform_stack import catalog

    row = controller(EFA)
    old = dataclasses.replace(row, chart=dataclasses.replace(row.chart, version="v0.5.6"))
    monkeypatch.setattr(catalog, "CATALOG", tuple(old if r is row else r for r in catalog.CATALOG))
    [problem] = controller_problems(context("platform-prod"))
    assert problem.startswith("cloud.node_classes[gb200].instance_types: p6e-gb200.36xlarge: the EFA device "
                              "plugin's chart v0.5.6 does not list it (it is listed from v0.5.14 on)")
    assert "Fix: aws-efa-k8s-device-plugin's chart at v0.5.14 or later" in problem
    assert controller_problems(context("platform-dev")) == []


def test_an_efa_instance_type_the_table_does_not_know_is_refused_not_passed():
    """A type missing from the hand-kept table cannot be held to the chart: refused, naming the
    table and the fix, rather than assumed listed."""
    spec = load_platform_spec("stacks/platform-dev.yaml")
    family = spec.cloud.node_classes[0]
    assert family.efa_interfaces
    other = spec.model_copy(update={"cloud": spec.cloud.model_copy(update={"node_classes": [
        family.model_copy(update={"instance_types": ["p9.48xlarge"]})]})})
    [problem] = efa_plugin_problems(other, "v0.5.30")
    assert problem.startswith(f"cloud.node_classes[{family.name}].instance_types: p9.48xlarge: not in the table")
    assert "EFA_PLUGIN_LISTED_FROM" in problem and "Fix: add it" in problem

