"""platform-prod's Kubernetes part as the twin applies it, and the nodes it lands on: kwok nodes
made from prod's spec with the labels and taints EKS, Karpenter, NFD and the GPU operator would
give them. Pure apart from `rendered_chart` (the pinned Helm) and the module files it reads.

Where each object comes from (`Rendered.origin`):
- `stack`: what the platform program registers itself (infra/platform_stack/program.py
  platform_objects, through the offline mocks): CRDs, namespaces, the prometheus-operator bundle,
  the certgen hook's Job, the GatewayClass, Prometheus, Grafana, the EC2NodeClasses.
- `chart <row>`: each `helm.v4.Chart` the program registers, rendered with the values it
  registered, from the chart's source in the pinned module (infra/platform_stack/charts.py
  prepared_chart), by the Helm library the pinned Kubernetes provider embeds (twin/helm), hooks
  left out as the provider leaves them (`DisableHooks`).
- `operator gpu-operator`: what the GPU operator makes at run time from its ClusterPolicy for the
  device plugin, GFD and dcgm-exporter (it does not run on the twin): its asset files at the
  pinned module (assets/state-device-plugin/, assets/gpu-feature-discovery/,
  assets/state-dcgm-exporter/: account, roles, ConfigMap, Service, DaemonSet) with what the
  operator sets (controllers/object_controls.go applyCommonDaemonsetConfig: the ClusterPolicy's
  daemonsets.tolerations and priorityClassName; its namespace; the image from the ClusterPolicy).
- `stand-in <row>`: rows whose chart no pinned module carries (infra/platform_stack/catalog.py
  `unchecked`): only what decides where their pods go, from the source each line cites, labelled
  STAND_IN_LABEL. KEDA's chart is not made at all (NOT_RENDERED says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from infra import naming
from infra.platform_stack.catalog import Controller, controller
from infra.platform_stack.efa import EFA_PLUGIN_LISTED_FROM, chart_version
from infra.platform_stack.spec import PlatformSpec
from infra.spec import StackSpec

STAND_IN_LABEL = "twin.pdstack.io/stand-in-for"
GPU_OPERATOR = "gpu-operator"
EFA_PLUGIN = "aws-efa-k8s-device-plugin"
DRA_DRIVER = "nvidia-dra-driver-gpu"
NOT_RENDERED = {
    "keda": "its chart lives in kedacore/charts, in no pinned module; the twin runs KEDA's operator from its "
            "module's own config/manager instead (twin/dataplane.py)",
}

# The GPU operator's operands the GPU nodes need, as (asset folder, ClusterPolicy spec key):
# github.com/NVIDIA/gpu-operator at the commit twin/platform/go.mod pins. The operator applies each
# folder's files (its account, roles, ConfigMap, Service, the DaemonSet), OpenShift's only there.
GPU_OPERATOR_OPERANDS = (
    ("assets/state-device-plugin", "devicePlugin"),
    ("assets/gpu-feature-discovery", "gfd"),
    ("assets/state-dcgm-exporter", "dcgmExporter"),
)
FILLED = "FILLED BY THE OPERATOR"  # the assets' placeholder for what the operator sets


@dataclass
class Rendered:
    objects: list[dict] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)  # "Kind namespace/name" -> where it came from
    not_rendered: dict[str, str] = field(default_factory=dict)  # row -> why

    def add(self, objects: list[dict], origin: str) -> None:
        for obj in objects:
            self.objects.append(obj)
            self.origin[ident(obj)] = origin


def ident(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{obj['kind']} {meta['namespace'] + '/' if meta.get('namespace') else ''}{meta['name']}"


def chart_objects(row: Controller, namespace: str, values: dict, kube_version: str) -> list[dict]:
    """The row's chart rendered from its pinned source with `values`, for release `row.name` in
    `namespace` (helm.v4.Chart names the release after the resource) on a cluster at Kubernetes
    `kube_version` (the provider renders for the cluster it talks to), hooks left out."""
    from infra.platform_stack.charts import prepared_chart
    from twin.identities import rendered_chart

    templates = rendered_chart(prepared_chart(row), row.name, namespace, f"{row.name}'s chart", values, kube_version)
    out = [d for docs in templates.values() for d in docs
           if "helm.sh/hook" not in ((d.get("metadata") or {}).get("annotations") or {})]
    for obj in out:  # the provider puts a namespaced object without one in the release's (apply_on_twin
        obj["metadata"].setdefault("namespace", namespace)  # takes it off the cluster-wide kinds)
    return out


def gpu_operator_operands(cluster_policy: dict, namespace: str) -> list[dict]:
    """What the GPU operator would make for its operands from `cluster_policy` (see the module's
    docstring): each asset file but OpenShift's, in the operator's namespace."""
    from infra.platform_stack.catalog import GPU_OPERATOR as MODULE
    from infra.platform_stack.modules import module_dir

    spec = cluster_policy["spec"]
    common = spec.get("daemonsets") or {}
    out = []
    for folder, key in GPU_OPERATOR_OPERANDS:
        part = spec.get(key) or {}
        if part.get("enabled") is False:
            continue
        image = f"{part['repository']}/{part['image']}:{part['version']}" if part.get("repository") else None
        for path in sorted((module_dir(MODULE) / folder).glob("*.yaml")):
            if "openshift" in path.name:
                continue
            for obj in (d for d in yaml.safe_load_all(path.read_text()) if d):
                obj = _filled(obj, namespace)
                if obj["kind"] == "DaemonSet":
                    pod = obj["spec"]["template"]["spec"]
                    if common.get("priorityClassName"):
                        pod["priorityClassName"] = common["priorityClassName"]
                    if common.get("tolerations"):
                        pod["tolerations"] = common["tolerations"]
                    for container in pod.get("initContainers", []) + pod["containers"]:
                        if image and container.get("image", FILLED) == FILLED:
                            container["image"] = image
                out.append(obj)
    return out


def _filled(node, namespace: str, key: str | None = None):
    """An asset with the operator's namespace where it says FILLED (metadata, subjects, selectors)."""
    if isinstance(node, dict):
        return {k: _filled(v, namespace, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_filled(v, namespace, key) for v in node]
    return namespace if node == FILLED and key in ("namespace", "matchNames") else node


def _affinity(*terms: list[dict]) -> dict:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}


def _stand_in(kind: str, name: str, namespace: str, row: Controller, pod: dict) -> dict:
    labels = {"app.kubernetes.io/name": name, STAND_IN_LABEL: row.name}
    workload = {"apiVersion": "apps/v1", "kind": kind,
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
                "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                         "template": {"metadata": {"labels": dict(labels)}, "spec": pod}}}
    if kind == "Deployment":
        workload["spec"]["replicas"] = 1
    return workload


def stand_in_image(row: Controller) -> str:
    """An image name that says what it stands in for (kwok pulls nothing; `.invalid` resolves nowhere)."""
    return f"stand-in.twin.invalid/{row.name}:{row.version}"


def efa_plugin_listed(version: str) -> list[str]:
    """The instance types chart `version` of the EFA device plugin lists, of those pdstack knows
    (infra/platform_stack/efa.py EFA_PLUGIN_LISTED_FROM)."""
    return sorted(t for t, first in EFA_PLUGIN_LISTED_FROM.items() if chart_version(first) <= chart_version(version))


def efa_plugin_stand_in(row: Controller, namespace: str, values: dict, version: str | None = None) -> list[dict]:
    """aws/eks-charts stable/aws-efa-k8s-device-plugin templates/daemonset.yaml: a DaemonSet that
    requires node.kubernetes.io/instance-type In the values' supportedInstanceLabels.values, with the
    values' tolerations (infra/platform_stack/efa.py cites the rule; the list is its table)."""
    version = version or row.chart.version
    pod = {"affinity": _affinity([{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                   "values": efa_plugin_listed(version)}]),
           "tolerations": values.get("tolerations", []), "priorityClassName": "system-node-critical",
           "containers": [{"name": row.name, "image": stand_in_image(row)}]}
    return [_stand_in("DaemonSet", row.name, namespace, row, pod)]


# Kept by hand, as no pinned package carries the chart (listed in upstream/PROVENANCE.json's hand_kept
# with DRA_DEFAULTS_ORIGIN): the controller requires a control-plane node and tolerates its taint; the
# kubelet plugin requires one of NFD's NVIDIA PCI label, NFD's NVIDIA CPU vendor or the GPU
# operator's nvidia.com/gpu.present. Helm replaces lists and merges maps, so the values the stack
# gives (infra/platform_stack/catalog.py dra_driver_values) replace these where they set them.
DRA_DEFAULTS_ORIGIN = (
    "NVIDIA/k8s-dra-driver-gpu deployments/helm/nvidia-dra-driver-gpu/values.yaml, read at commit "
    "0540432be8e21852e061da15577f7e2c5694877e (v25.12.0's own commit, which the catalog row names, was not "
    "readable here; the controller's affinity is the one tests/test_charts.py cites for v25.12.0)")
DRA_CONTROLLER_DEFAULTS = {
    "affinity": _affinity([{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]),
    "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}],
}
DRA_KUBELET_PLUGIN_DEFAULTS = {
    "affinity": _affinity([{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In", "values": ["true"]}],
                          [{"key": "feature.node.kubernetes.io/cpu-model.vendor_id", "operator": "In",
                            "values": ["NVIDIA"]}],
                          [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]),
    "tolerations": [],
}


def dra_driver_stand_in(row: Controller, namespace: str, values: dict) -> list[dict]:
    """The DRA driver's controller Deployment and kubelet plugin DaemonSet, placed as its chart
    places them with `values` (DRA_CONTROLLER_DEFAULTS, DRA_KUBELET_PLUGIN_DEFAULTS)."""
    image = stand_in_image(row)
    out = []
    for kind, part, defaults in (("Deployment", "controller", DRA_CONTROLLER_DEFAULTS),
                                 ("DaemonSet", "kubelet-plugin", DRA_KUBELET_PLUGIN_DEFAULTS)):
        given = values.get("controller" if part == "controller" else "kubeletPlugin") or {}
        pod = {"affinity": given.get("affinity", defaults["affinity"]),
               "tolerations": given.get("tolerations", defaults["tolerations"]),
               "priorityClassName": "system-node-critical",
               "containers": [{"name": part, "image": image}]}
        out.append(_stand_in(kind, f"{row.name}-{part}", namespace, row, pod))
    return out


STAND_INS = {EFA_PLUGIN: efa_plugin_stand_in, DRA_DRIVER: dra_driver_stand_in}


def platform_render(spec: PlatformSpec) -> Rendered:
    """Every Kubernetes object of the platform stack for `spec`, each with where it came from."""
    from infra.platform_stack.program import build_platform
    from infra.recording import manifest_of, record
    from infra.render.manifests import as_rendered

    run = record(lambda: build_platform(spec), stack=spec.name)
    out = Rendered()
    out.add([as_rendered(m) for m in (manifest_of(r) for r in run.custom()) if m], "stack")  # no secret value
    for chart in (r for r in run.custom() if r.type == "kubernetes:helm.sh/v4:Chart"):
        row, namespace, values = controller(chart.name), chart.inputs["namespace"], chart.inputs.get("values") or {}
        if row.name in STAND_INS:
            out.add(STAND_INS[row.name](row, namespace, values), f"stand-in {row.name}")
        elif row.values_source is None:
            out.not_rendered[row.name] = NOT_RENDERED.get(row.name, row.unchecked or "no pinned source")
        else:
            objects = chart_objects(row, namespace, values, spec.kubernetes_version)
            out.add(objects, f"chart {row.name}")
            if row.name == GPU_OPERATOR:
                (policy,) = [o for o in objects if o["kind"] == "ClusterPolicy"]
                out.add(gpu_operator_operands(policy, namespace), f"operator {row.name}")
    return out


# --- the nodes: prod's, as EKS, Karpenter, NFD and the GPU operator label them ----------------------

NODES_LABEL_VALUE = "platform-prod"  # twin.nodes.TWIN_LABEL's value on these nodes (removed by it)
# The GPU operator labels a node nvidia.com/gpu.present=true when NFD found an NVIDIA PCI device on
# it (controllers/state_manager.go gpuNodeLabels: feature.node.kubernetes.io/pci-10de.present, NFD's
# pci source), then each operand's nvidia.com/gpu.deploy.<operand>=true for the default (container)
# workload (gpuStateLabels), which its DaemonSets' nodeSelectors name. The DRA kubelet plugin's
# affinity names the same two (DRA_KUBELET_PLUGIN_DEFAULTS).
NFD_GPU_LABELS = {"feature.node.kubernetes.io/pci-10de.present": "true"}
GPU_OPERATOR_NODE_LABELS = {"nvidia.com/gpu.present": "true", **{f"nvidia.com/gpu.deploy.{operand}": "true" for operand in (
    "driver", "gpu-feature-discovery", "container-toolkit", "device-plugin", "dcgm", "dcgm-exporter",
    "node-status-exporter", "operator-validator")}}
# The system node group's instances (infra/platform_stack/spec.py SystemNodesSpec): vCPUs and memory
# (AWS, "Amazon EC2 instance type specifications", general purpose) and pods (amazon-eks-ami
# eni-max-pods.txt: the VPC CNI's ENIs x (IPv4 addresses - 1) + 2).
SYSTEM_INSTANCES = {"m7i.2xlarge": {"cpu": "8", "memory": "32Gi", "pods": "58"}}


def prod_gpu_nodes(serving: StackSpec, platform: PlatformSpec) -> list[dict]:
    """One node of each NVLink domain of each GPU pool (every node of a rack carries the same labels
    and taints but its name; the whole of prod's 72 would be 72 pods per DaemonSet), as Karpenter
    launches it from the pool's EC2NodeClass in the rack's Capacity Block
    (karpenter-provider-aws v1.14.1 pkg/apis/v1/labels.go: ec2nodeclass, capacity-reservation-id;
    the zone and region of the block), with NFD's and the GPU operator's labels (above)."""
    from infra.components.nodepools import nodepool_manifest
    from twin.nodes import TWIN_LABEL, pool_nodes

    reservations = [f.capacity_reservations for f in platform.cloud.node_classes if f.capacity_reservations]
    out = []
    for role in serving.deployment.pools():
        node_class = nodepool_manifest(serving, role, {})["spec"]["template"]["spec"]["nodeClassRef"]["name"]
        blocks = [b for cr in reservations for b in cr.by_role.get(role, [])]
        zones = {b: z for cr in reservations for b, z in cr.zones.items()}
        seen: set[str] = set()
        label = serving.hardware.supernode.topology_label if serving.hardware.supernode else None
        for node in pool_nodes(serving, role):
            labels = node["metadata"]["labels"]
            rack = labels.get(label, labels["kubernetes.io/hostname"]) if label else labels["kubernetes.io/hostname"]
            if rack in seen:
                continue
            name = f"{NODES_LABEL_VALUE}-{node['metadata']['name']}"
            block = blocks[len(seen)] if len(seen) < len(blocks) else None
            seen.add(rack)
            family, size = labels["node.kubernetes.io/instance-type"].split(".", 1)
            labels.update({TWIN_LABEL: NODES_LABEL_VALUE, "kubernetes.io/hostname": name,
                           "topology.kubernetes.io/region": platform.cloud.region,
                           "karpenter.k8s.aws/ec2nodeclass": node_class,
                           "karpenter.k8s.aws/instance-family": family, "karpenter.k8s.aws/instance-size": size,
                           **NFD_GPU_LABELS, **GPU_OPERATOR_NODE_LABELS})
            if block:
                labels.update({"karpenter.k8s.aws/capacity-reservation-id": block,
                               "topology.kubernetes.io/zone": zones.get(block, labels["topology.kubernetes.io/zone"])})
            node["metadata"]["name"] = name
            out.append(node)
    return out


def prod_system_nodes(platform: PlatformSpec) -> list[dict]:
    """The system managed node group (infra/platform_stack/cloud/aws.py system_nodes_and_storage:
    labelled pdstack.io/role=system, untainted), with the labels EKS gives a managed node group's
    nodes (eks.amazonaws.com/nodegroup, eks.amazonaws.com/capacityType)."""
    from twin.nodes import KWOK_ANNOTATION, TWIN_LABEL

    system = platform.cloud.cluster.system_nodes
    itype = system.instance_types[0]
    resources = {**SYSTEM_INSTANCES[itype], "ephemeral-storage": "100Gi"}
    zones = sorted(set(platform.cloud.cluster.subnet_zones.values())) or ["twin-a"]
    out = []
    for i in range(system.count):
        name = f"{NODES_LABEL_VALUE}-system-{i}"
        labels = {naming.ROLE_LABEL: "system", "eks.amazonaws.com/nodegroup": "system",
                  "eks.amazonaws.com/capacityType": "ON_DEMAND", "node.kubernetes.io/instance-type": itype,
                  "kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux", "kubernetes.io/hostname": name,
                  "topology.kubernetes.io/region": platform.cloud.region,
                  "topology.kubernetes.io/zone": zones[i % len(zones)], TWIN_LABEL: NODES_LABEL_VALUE}
        out.append({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": labels, "annotations": dict(KWOK_ANNOTATION)},
                    "spec": {"taints": []}, "status": {"capacity": resources, "allocatable": resources}})
    return out


# --- where a DaemonSet's pods go: the DaemonSet controller's own rule --------------------------------

def _matches_expression(e: dict, labels: dict[str, str]) -> bool:
    value = labels.get(e["key"])
    op, values = e["operator"], e.get("values") or []
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and value.lstrip("-").isdigit():
        return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
    return False


def _term_matches(term: dict, node: dict) -> bool:
    fields = {"metadata.name": node["metadata"]["name"]}
    if not term.get("matchExpressions") and not term.get("matchFields"):
        return False  # an empty term matches nothing
    return (all(_matches_expression(e, node["metadata"].get("labels") or {}) for e in term.get("matchExpressions") or [])
            and all(_matches_expression(e, fields) for e in term.get("matchFields") or []))


def tolerates(toleration: dict, taint: dict) -> bool:
    """k8s.io/api core/v1 Toleration.ToleratesTaint (toleration.go) at v0.34.4."""
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


# What the DaemonSet controller adds to every pod it makes (k8s.io/kubernetes v1.34.4
# pkg/controller/daemon/util/daemonset_util.go AddOrUpdateDaemonPodTolerations; the
# network-unavailable one only for hostNetwork pods, left out here).
DAEMON_POD_TOLERATIONS = [
    *({"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute"} for k in ("not-ready", "unreachable")),
    *({"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoSchedule"}
      for k in ("disk-pressure", "memory-pressure", "pid-pressure", "unschedulable")),
]


def why_not_on(pod_spec: dict, node: dict) -> str | None:
    """Why a DaemonSet's pod may not run on `node`, or None: the DaemonSet controller's predicates
    (k8s.io/kubernetes v1.34.4 pkg/controller/daemon/daemon_controller.go predicates: the node name,
    the pod's nodeSelector and required node affinity (component-helpers nodeaffinity
    GetRequiredNodeAffinity), and no NoSchedule or NoExecute taint the pod does not tolerate)."""
    labels = node["metadata"].get("labels") or {}
    wrong = {k: v for k, v in (pod_spec.get("nodeSelector") or {}).items() if labels.get(k) != v}
    if wrong:
        return "nodeSelector " + ", ".join(f"{k}={v}" for k, v in sorted(wrong.items())) + " not on the node"
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
    if required is not None and not any(_term_matches(t, node) for t in required):
        return "required node affinity matches no term: " + " | ".join(
            " and ".join(f"{e['key']} {e['operator']} {e.get('values', '')}".strip() for e in t.get("matchExpressions") or [])
            for t in required)
    tolerations = (pod_spec.get("tolerations") or []) + DAEMON_POD_TOLERATIONS
    for taint in node["spec"].get("taints") or []:
        if taint["effect"] in ("NoSchedule", "NoExecute") and not any(tolerates(t, taint) for t in tolerations):
            return f"untolerated taint {taint['key']}={taint.get('value', '')}:{taint['effect']}"
    return None


# --- on the twin --------------------------------------------------------------------------------

APPLIED_BY = "twin.pdstack.io/applied-by"  # on every object apply_on_twin applies (remove_from_twin's)
WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


@dataclass
class OnTwin:
    applied: list[dict] = field(default_factory=list)  # as applied, for remove_from_twin
    rejected: dict[str, str] = field(default_factory=dict)  # object -> the API server's reason
    twins_own: list[str] = field(default_factory=list)  # already on the twin, made by the twin: left alone


def _scoped_kinds(kubeconfig) -> set[str]:
    """Kinds the API server serves cluster-wide (its discovery: `kubectl api-resources`)."""
    from twin.api import kubectl
    done = kubectl("api-resources", "--namespaced=false", "--no-headers", kubeconfig_path=kubeconfig)
    return {line.split()[-1] for line in done.stdout.splitlines() if line.strip()}


def without_nulls(node):
    """An object as the provider sends it: its Create reads the inputs with SkipNulls, so a key
    whose value is null is no key (pulumi-kubernetes provider v4.0.0-20260115033456-f47bc2d6f199
    pkg/provider/provider.go Create; pulumi sdk v3 go/common/resource/plugin/rpc.go
    UnmarshalProperties). A chart's `key:` with nothing under it (the GPU operator's
    validator.plugin) is YAML's null, which the API server refuses for an object field."""
    if isinstance(node, dict):
        return {k: without_nulls(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [without_nulls(v) for v in node]
    return node


def apply_on_twin(rendered: Rendered, kubeconfig=None) -> OnTwin:
    """Apply the render as the provider would: the CRDs the twin lacks first (CRDs the twin has are
    from the same pinned modules and stay as they are), then everything else by server-side apply
    with strict validation, admission webhooks last (their servers run nowhere on the twin, and a
    webhook with failurePolicy Fail would refuse what it matches: the render's own objects go
    before it, as a real install's are admitted while its webhooks' pods start). An object the
    twin already has that this did not apply (the twin's own Karpenter and LWS accounts and
    webhooks, whose names the charts share) is left alone and named."""
    import json as _json

    from twin import fleet
    from twin.api import kubectl
    from twin.paths import KUBECONFIG

    kubeconfig = kubeconfig or KUBECONFIG
    out = OnTwin()
    objects = [fleet.with_placeholder_secrets(without_nulls(o)) for o in rendered.objects]
    for obj in objects:
        obj["metadata"].setdefault("labels", {})[APPLIED_BY] = NODES_LABEL_VALUE
    have = {c["metadata"]["name"] for c in fleet.get("crd", kubeconfig=kubeconfig)}
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition" and o["metadata"]["name"] not in have]
    out.twins_own += [ident(o) for o in objects if o["kind"] == "CustomResourceDefinition" and o not in crds]
    if crds:
        result = fleet.apply_each_pass(crds, kubeconfig)
        out.rejected.update(result.rejected)
        out.applied += [o for o in crds if ident(o) not in result.rejected]
        kubectl("wait", "--for=condition=Established", "--timeout=120s",
                *(f"crd/{o['metadata']['name']}" for o in crds if ident(o) not in result.rejected),
                kubeconfig_path=kubeconfig)
    scoped = _scoped_kinds(kubeconfig)
    rest = [o for o in objects if o["kind"] != "CustomResourceDefinition"]
    for obj in rest:
        if obj["kind"] in scoped:
            obj["metadata"].pop("namespace", None)
    found = kubectl("get", "--ignore-not-found", "-o", "json", "-f", "-", kubeconfig_path=kubeconfig,
                    input=yaml.safe_dump_all(rest), check=False)
    items = _json.loads(found.stdout).get("items", []) if found.stdout.strip() else []
    theirs = {ident(i) for i in items if APPLIED_BY not in (i["metadata"].get("labels") or {})}
    out.twins_own += sorted(theirs)
    rest = [o for o in rest if ident(o) not in theirs]
    for batch in ([o for o in rest if o["kind"] not in WEBHOOK_KINDS], [o for o in rest if o["kind"] in WEBHOOK_KINDS]):
        result = fleet.apply_each_pass(batch, kubeconfig)
        out.rejected.update(result.rejected)
        out.applied += [o for o in batch if ident(o) not in result.rejected]
    return out


def remove_from_twin(on_twin: OnTwin, kubeconfig=None) -> None:
    """Delete what apply_on_twin applied, webhooks first, but its CRDs (kept, as the stack keeps
    them: infra/platform_stack/components/base.py PlatformLayer.add); it returns once the
    namespaces it made are gone, so the next test's objects there never meet a terminating one."""
    from twin.api import kubectl
    from twin.paths import KUBECONFIG

    kubeconfig = kubeconfig or KUBECONFIG
    made = [o for o in on_twin.applied if o["kind"] != "CustomResourceDefinition"]
    for batch in ([o for o in made if o["kind"] in WEBHOOK_KINDS], [o for o in made if o["kind"] not in WEBHOOK_KINDS]):
        if batch:
            kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", kubeconfig_path=kubeconfig,
                    input=yaml.safe_dump_all(batch), check=False)
    namespaces = [f"namespace/{o['metadata']['name']}" for o in made if o["kind"] == "Namespace"]
    if namespaces:
        kubectl("wait", "--for=delete", "--timeout=180s", *namespaces, kubeconfig_path=kubeconfig, check=False)


# --- what the twin shows: every GPU node's DaemonSets, every controller bound ---------------------

def daemonset_pod_nodes(daemonset: dict, pods: list[dict]) -> dict[str, dict]:
    """node -> this DaemonSet's pod meant for it (bound, or pending with the controller's
    matchFields metadata.name affinity for it)."""
    out = {}
    for pod in pods:
        owners = pod["metadata"].get("ownerReferences") or []
        if not any(o["kind"] == "DaemonSet" and o["uid"] == daemonset["metadata"]["uid"] for o in owners):
            continue
        node = pod["spec"].get("nodeName")
        if not node:
            terms = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                     .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
            node = next((f["values"][0] for t in terms for f in t.get("matchFields") or []
                         if f["key"] == "metadata.name"), None)
        if node:
            out[node] = pod
    return out


def daemonset_problems(daemonsets: list[dict], gpu_nodes: list[dict], pods: list[dict], events) -> list[str]:
    """Each GPU node a DaemonSet has no bound pod on, and why: the DaemonSet controller's rule
    (why_not_on) where it keeps the pod off the node, else the scheduler's events for the pod
    it made, or the DaemonSet's own (FailedCreate) where it made none (`events(namespace, name)`)."""
    problems = []
    for ds in daemonsets:
        where = f"DaemonSet {ds['metadata']['namespace']}/{ds['metadata']['name']}"
        placed = daemonset_pod_nodes(ds, pods)
        for node in gpu_nodes:
            name = node["metadata"]["name"]
            pod = placed.get(name)
            if pod is not None and pod["spec"].get("nodeName"):
                continue
            why = why_not_on(ds["spec"]["template"]["spec"], node)
            if why is None:
                why = (f"its pod {pod['metadata']['name']} is not bound: "
                       f"{'; '.join(events(pod['metadata']['namespace'], pod['metadata']['name'])) or 'no event'}"
                       if pod is not None else "admitted by its rule, but the DaemonSet controller made no pod: "
                       + ("; ".join(events(ds["metadata"]["namespace"], ds["metadata"]["name"])) or "no event"))
            problems.append(f"{where}: no pod on GPU node {name}: {why}")
    return problems


def deployment_problems(deployments: list[dict], pods: list[dict], events) -> list[str]:
    """Each Deployment with fewer bound pods than its replicas, naming each unbound pod and the
    scheduler's events for it."""
    problems = []
    for dep in deployments:
        ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
        selector = dep["spec"]["selector"].get("matchLabels") or {}
        mine = [p for p in pods if p["metadata"]["namespace"] == ns and not p["metadata"].get("deletionTimestamp")
                and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
        bound = [p for p in mine if p["spec"].get("nodeName")]
        want = dep["spec"].get("replicas", 1)
        if len(bound) < want:
            unbound = [p for p in mine if not p["spec"].get("nodeName")]
            problems.append(f"Deployment {ns}/{name}: {len(bound)}/{want} pods bound" + "".join(
                f"; {p['metadata']['name']}: {'; '.join(events(ns, p['metadata']['name'])) or 'no event'}"
                for p in unbound) + ("" if unbound else "; no pod made (its ReplicaSet's events say why)"))
    return problems


def not_ready_reason(pod: dict) -> str:
    """Why a bound pod is not Ready, as the kubelet (the twin's, twin/kubelet.py) reports it."""
    for status in (pod.get("status") or {}).get("initContainerStatuses", []) + \
            (pod.get("status") or {}).get("containerStatuses", []):
        waiting = (status.get("state") or {}).get("waiting")
        if waiting:
            return f"{status['name']}: {waiting.get('reason')}: {waiting.get('message', '')}".strip()
    for condition in (pod.get("status") or {}).get("conditions", []):
        if condition["status"] != "True" and condition.get("message"):
            return f"{condition['type']}: {condition['message']}"
    return f"phase {(pod.get('status') or {}).get('phase')}"
