"""The controllers every serving stack relies on, as data: one row per install.

Each row names the version, how it is installed (a Helm chart by repository and version, or
manifests from a pinned Go module), where its chart's own values (values.yaml, and
values.schema.json where the chart has one) live at that version (a Go module pinned in
twin/*/go.mod; `scripts/platform_sources.py` extracts them into infra/platform_stack/pinned/ with
their origin), which CRD files it brings (registered as ordinary Kubernetes resources, so an
upgrade reaches the cluster and the policy pack sees them; charts are installed with
skipCrds), the typed values pdstack sets (from the platform spec), and which values carry the
tolerations of DaemonSets that must run on the GPU nodes.

A row whose chart no registry this project reaches carries has `values_source=None` and says
why in `unchecked`: its values are set but not checked against the chart.

Each row lists its chart's Helm hooks (`hooks`): the pinned Kubernetes provider installs a chart
without them (`Hook` says why), so what a hook makes is made here, or the row says why nothing
needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from infra.naming import ROLE_LABEL
from infra.platform_stack.spec import PlatformSpec

KARPENTER = "github.com/aws/karpenter-provider-aws"
ENVOY_GATEWAY = "github.com/envoyproxy/gateway"
GATEWAY_API = "sigs.k8s.io/gateway-api"
GIE = "sigs.k8s.io/gateway-api-inference-extension"
KEDA = "github.com/kedacore/keda/v2"
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator"
LWS = "sigs.k8s.io/lws"
CERT_MANAGER = "github.com/cert-manager/cert-manager"
GPU_OPERATOR = "github.com/NVIDIA/gpu-operator"
LOAD_BALANCER_CONTROLLER = "sigs.k8s.io/aws-load-balancer-controller"

# Why a row's values cannot be checked: the Go module proxy answers 403 for these modules
# (`go list -m -versions <module>`), and no other registry this project reaches carries them.
_PROXY_REFUSES = "the Go module proxy refuses {} (403), and its chart is in no registry this project reaches"


@dataclass(frozen=True)
class Source:
    """A file (or folder) inside a Go module, at the version twin/*/go.mod pins."""

    module: str
    path: str


@dataclass(frozen=True)
class Chart:
    repo: str  # a Helm repository URL, or an oci:// registry path
    name: str
    version: str


@dataclass(frozen=True)
class PlatformContext:
    """What values are derived from: the platform spec, the serving specs it hosts and the
    tolerations every GPU node's taints call for (infra/platform_stack/taints.py)."""

    spec: PlatformSpec
    gpu_tolerations: tuple[dict, ...]
    fabrics: frozenset[str]  # efa | infiniband | roce, over the hosted environments
    scalers: frozenset[str] = frozenset({"keda"})  # keda | hpa, over the hosted environments that autoscale
    compute_domains: bool = False  # some hosted environment's pool makes a ComputeDomain (IMEX across nodes)
    karpenter_gates: dict[str, bool] = field(default_factory=dict)


Values = Callable[[PlatformContext], dict]


@dataclass(frozen=True)
class Hook:
    """A Helm hook of a row's chart: objects annotated `helm.sh/hook`, which Helm creates around
    an install instead of with it. helm.v4.Chart never creates them: the pinned provider
    (pulumi-kubernetes provider v4.0.0-20260115033456-f47bc2d6f199, engine/kubernetes/go.mod)
    renders with `DisableHooks = true` (pkg/provider/helm/v4/chart.go) and registers only the
    release's manifest. So a hook's Job never runs, and what it would make exists only if the
    stack makes it (`objects`, registered before the chart, which waits for them) or nothing
    needs it (`provided_by` says why)."""

    where: tuple[str, ...]  # the chart's files carrying the annotation, or `values.yaml:<path>` of a value setting it
    events: tuple[str, ...]  # its helm.sh/hook events
    makes: str  # what running it leaves in the cluster
    provided_by: str  # what makes that here, or why nothing needs it
    objects: Callable[[Controller, PlatformContext], list[dict]] | None = None


@dataclass(frozen=True)
class Controller:
    name: str
    version: str
    namespace: str
    what_for: str
    chart: Chart | None = None
    manifests: Source | None = None  # plain manifests (CRDs included) instead of a chart
    values: Values = lambda ctx: {}
    values_source: Source | None = None  # the chart folder in a pinned module: values.yaml, values.schema.json
    unchecked: str | None = None  # why the values are not checked, when values_source is None
    crds: tuple[Source, ...] = ()
    # (group, kind) of CRDs only the chart carries (in its crds/ folder; no pinned module has them):
    # the chart installs those itself, kept on delete like the rest (components/controllers.py).
    chart_crds: tuple[tuple[str, str], ...] = ()
    gpu_toleration_paths: tuple[str, ...] = ()  # dotted values paths: tolerations of GPU-node DaemonSets
    enabled: Callable[[PlatformContext], bool] = lambda ctx: True
    # Rows whose kinds this row's chart renders, or whose webhooks its objects pass: installed
    # after them (their CRDs and running controllers), deleted before them.
    after: tuple[str, ...] = ()
    hooks: tuple[Hook, ...] = ()  # every Helm hook of the chart at this version (tests/test_charts.py finds them)
    # A chart in no pinned module: where its hooks were read (repository, tag, commit, folder).
    hooks_read_from: str | None = None


def _tolerations(ctx: PlatformContext) -> list[dict]:
    return [dict(t) for t in ctx.gpu_tolerations]


def _aws(ctx: PlatformContext) -> bool:
    return ctx.spec.cloud.provider == "aws"


def karpenter_values(ctx: PlatformContext) -> dict:
    from infra.platform_stack.cloud.interruption import interruption_queue_name  # pulumi_aws: only where it is used

    c = ctx.spec.cloud
    return {
        "replicas": ctx.spec.controllers.karpenter_replicas,
        # the queue the cloud layer makes (cloud/interruption.py), which the controller reads from its start
        "settings": {"clusterName": c.cluster.name, "interruptionQueue": interruption_queue_name(c.cluster.name),
                     # karpenter-provider-aws v1.14.1 charts/karpenter/values.yaml settings.featureGates
                     "featureGates": {"staticCapacity": ctx.karpenter_gates.get("staticCapacity", False),
                                      "reservedCapacity": ctx.karpenter_gates.get("reservedCapacity", False)}},
    }


# The roles of GPU pools, whose nodes carry them as naming.ROLE_LABEL (infra/components/nodepools.py).
POOL_ROLES = ("prefill", "decode", "colocated")


def dra_driver_values(ctx: PlatformContext) -> dict:
    values = {"resources": {"gpus": {"enabled": False}},  # GPUs stay with the device plugin: ComputeDomains only
              "kubeletPlugin": {"tolerations": _tolerations(ctx)}}
    if _aws(ctx):
        # The chart's controller.affinity (v25.12.0 values.yaml) requires a control-plane node,
        # which EKS never shows: the controller goes to a node no GPU pool owns instead (the system
        # node group, pdstack.io/role: system; an existing cluster's unlabelled CPU nodes). Helm
        # replaces lists, so this term replaces the chart's; no control-plane taint to tolerate.
        values["controller"] = {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": ROLE_LABEL, "operator": "NotIn", "values": list(POOL_ROLES)}]}]}}},
            "tolerations": []}
    return values


# What Envoy Gateway's certgen makes (v1.9.0 internal/provider/kubernetes/secrets.go CertsToSecret):
# kubernetes.io/tls Secrets with ca.crt, tls.crt and tls.key from one new CA (the controller's,
# the proxies' and the rate limiter's), and the Opaque envoy-oidc-hmac (hmac-secret), in the
# controller's namespace. It never overwrites one that exists (no --overwrite).
ENVOY_GATEWAY_CERTGEN_SECRETS = ("envoy-gateway", "envoy", "envoy-rate-limit", "envoy-oidc-hmac")


def envoy_gateway_values(ctx: PlatformContext) -> dict:
    return {"deployment": {"replicas": ctx.spec.controllers.envoy_gateway_replicas},
            "config": {"envoyGateway": {"extensionApis": {"enableBackend": True}}},
            # Its webhook is a hook too, never installed (the row's hooks); pdstack routes nothing by zone.
            "topologyInjector": {"enabled": False}}


def envoy_gateway_certgen(row: Controller, ctx: PlatformContext) -> list[dict]:
    """The chart's certgen hook as plain objects (charts/gateway-helm/templates/certgen.yaml and
    certgen-rbac.yaml at v1.9.0): the same command, image and permissions, with the chart's own
    security contexts and cluster domain (its values.yaml at that version). Its Secrets' keys
    never pass through Pulumi. Without a TTL, the finished Job stays, so `pulumi refresh` does not
    find it gone and run it again (it would change nothing: certgen keeps existing Secrets)."""
    from infra.platform_stack.values import pinned_chart  # reads pinned/, which imports nothing of the catalog

    defaults = pinned_chart(row.name)["defaults"]
    job = defaults["certgen"]["job"]
    name = f"{row.name}-certgen"  # the chart's {{ eg.fullname }}-certgen for release envoy-gateway
    meta = {"name": name, "namespace": row.namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta), "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "update"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": row.namespace}]},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": dict(meta), "spec": {
            "backoffLimit": 1, "completions": 1, "parallelism": 1,
            "template": {"metadata": {"labels": {"app": "certgen"}}, "spec": {
                "automountServiceAccountToken": True,
                "securityContext": job["pod"]["securityContext"],
                "containers": [{
                    "name": "envoy-gateway-certgen",
                    # the chart's default image: docker.io/envoyproxy/gateway:{{ .Chart.Version }} (_helpers.tpl)
                    "image": f"docker.io/envoyproxy/gateway:{row.chart.version}",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["envoy-gateway", "certgen"],
                    "args": [] if envoy_gateway_values(ctx)["topologyInjector"]["enabled"]
                    else ["--disable-topology-injector"],
                    "env": [{"name": "ENVOY_GATEWAY_NAMESPACE",
                             "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
                            {"name": "KUBERNETES_CLUSTER_DOMAIN", "value": defaults["kubernetesClusterDomain"]}],
                    "securityContext": job["securityContext"]}],
                "restartPolicy": "Never",
                "serviceAccountName": name}}}},
    ]


def load_balancer_controller_values(ctx: PlatformContext) -> dict:
    """The AWS Load Balancer Controller (its chart's values.yaml in the pinned module). Its region
    is said (and the cloud layer says its VPC, cloud/aws.py): the nodes' instance metadata answers
    one hop only (httpPutResponseHopLimit 1), which a pod's network namespace already is
    (docs/deploy/installation.md, "Using the Amazon EC2 instance metadata server version 2").
    Its webhook certificate comes from cert-manager: the chart's other way makes a new CA at every
    render, a change at every `pulumi up`. No service mutator webhook: it would take every Service
    of type LoadBalancer, and fail each Service's creation while the controller is down
    (serviceMutatorWebhookConfig.failurePolicy: Fail); the gateway's Service names the controller
    itself (cloud/load_balancer.py). pdstack makes no Ingress: no IngressClass or its params."""
    from infra.platform_stack.cloud.load_balancer import SERVICE_ACCOUNT

    return {"clusterName": ctx.spec.cloud.cluster.name, "region": ctx.spec.cloud.region,
            "serviceAccount": {"name": SERVICE_ACCOUNT},
            "enableCertManager": True, "enableServiceMutatorWebhook": False,
            "createIngressClassResource": False, "ingressClassParams": {"create": False}}


# Hooks that make nothing the stack needs, by why.
_AT_DELETE = "nothing at install: it runs when the release is deleted"
_CRDS_OURS = ("the row's CRDs, registered by the stack from the pinned module (an upgrade of the row "
              "upgrades them)")


def gpu_operator_values(ctx: PlatformContext) -> dict:
    preinstalled = ctx.spec.controllers.gpu_driver_preinstalled
    return {
        # EKS accelerated AMIs carry the driver and the container toolkit; on-prem hosts may not.
        "driver": {"enabled": not preinstalled},
        "toolkit": {"enabled": not preinstalled},
        "daemonsets": {"tolerations": _tolerations(ctx)},
        "gfd": {"enabled": True},  # publishes nvidia.com/gpu.clique, which NVLink placement selects on
        # The operator makes dcgm-exporter's ServiceMonitor from these (ClusterPolicy); it carries the
        # labels the platform's Prometheus selects monitors by, or the DCGM_* series the dashboards
        # and `pdctl cost` read would never be scraped.
        "dcgmExporter": {"enabled": True, "serviceMonitor": {
            "enabled": True, "additionalLabels": dict(ctx.spec.prometheus_selector)}},
        "node-feature-discovery": {"worker": {"tolerations": _tolerations(ctx)}},
    }


CATALOG: tuple[Controller, ...] = (
    Controller(
        "cert-manager", "v1.21.2", "cert-manager", "certificates for the gateway's TLS listeners and webhooks",
        chart=Chart("oci://quay.io/jetstack/charts", "cert-manager", "v1.21.2"),
        values=lambda ctx: {"replicaCount": ctx.spec.controllers.cert_manager_replicas, "crds": {"enabled": False}},
        values_source=Source(CERT_MANAGER, "deploy/charts/cert-manager"),
        hooks=(Hook(tuple(f"values.yaml:startupapicheck.{v}" for v in ("jobAnnotations", "rbac.annotations",
                                                                       "serviceAccount.annotations")),
                    ("post-install",), "nothing: the startupapicheck Job waits until the API accepts a Certificate",
                    "nothing needs it: it only waits, and the stack makes no cert-manager object (the "
                    "gateway's TLS Secret is the user's)"),),
        crds=tuple(Source(CERT_MANAGER, f"deploy/crds/{n}.yaml") for n in (
            "acme.cert-manager.io_challenges", "acme.cert-manager.io_orders", "cert-manager.io_certificaterequests",
            "cert-manager.io_certificates", "cert-manager.io_clusterissuers", "cert-manager.io_issuers"))),
    Controller(
        "karpenter", "1.14.1", "kube-system", "GPU node pools (StaticCapacity, ReservedCapacity gates)",
        chart=Chart("oci://public.ecr.aws/karpenter", "karpenter", "1.14.1"),
        values=karpenter_values, values_source=Source(KARPENTER, "charts/karpenter"),
        crds=tuple(Source(KARPENTER, f"pkg/apis/crds/{n}.yaml") for n in (
            "karpenter.sh_nodepools", "karpenter.sh_nodeclaims", "karpenter.k8s.aws_ec2nodeclasses",
            "karpenter.sh_nodeoverlays")),
        enabled=lambda ctx: _aws(ctx) and ctx.spec.nodes.mode == "karpenter"),
    Controller(
        "lws", "v0.9.0", "lws-system", "LeaderWorkerSet: every engine group",
        chart=Chart("oci://registry.k8s.io/lws/charts", "lws", "0.9.0"),
        values_source=Source(LWS, "charts/lws"),
        crds=(Source(LWS, "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"),
              Source(LWS, "config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml"))),
    Controller(
        "keda", "2.20.2", "keda", "ScaledObjects on each pool's LeaderWorkerSet",
        chart=Chart("https://kedacore.github.io/charts", "keda", "2.20.2"),
        values=lambda ctx: {"crds": {"install": False}},
        enabled=lambda ctx: "keda" in ctx.scalers,
        unchecked="KEDA's chart lives in kedacore/charts, which is no Go module; github.com/kedacore/keda/v2 "
                  "(pinned) carries only its CRDs",
        hooks_read_from="github:kedacore/charts keda 2.20.2 (cbb9bb8ce0809dc9048f72302f7c09765d66ed56) keda/: no hooks",
        crds=tuple(Source(KEDA, f"config/crd/bases/{n}.yaml") for n in (
            "keda.sh_scaledobjects", "keda.sh_scaledjobs", "keda.sh_triggerauthentications",
            "keda.sh_clustertriggerauthentications", "eventing.keda.sh_cloudeventsources",
            "eventing.keda.sh_clustercloudeventsources"))),
    Controller(
        "envoy-gateway", "v1.9.0", "envoy-gateway-system", "the Gateway, its policies (API keys, rate limits)",
        chart=Chart("oci://docker.io/envoyproxy", "gateway-helm", "v1.9.0"),
        values=envoy_gateway_values,
        values_source=Source(ENVOY_GATEWAY, "charts/gateway-helm"),
        hooks=(Hook(("templates/certgen.yaml", "templates/certgen-rbac.yaml"), ("pre-install", "pre-upgrade"),
                    f"Secrets {', '.join(ENVOY_GATEWAY_CERTGEN_SECRETS)}: the controller mounts envoy-gateway, "
                    "the proxies and the rate limiter the others",
                    "the same certgen, run as a Job the stack makes before the chart", envoy_gateway_certgen),
               Hook(("templates/envoy-proxy-topology-injector-webhook.yaml",), ("pre-install", "pre-upgrade"),
                    "the MutatingWebhookConfiguration that writes each Envoy pod's zone (zone-aware routing)",
                    "nothing needs it: pdstack routes by no zone, so the injector is off (topologyInjector)")),
        crds=(*(Source(GATEWAY_API, f"config/crd/standard/gateway.networking.k8s.io_{n}.yaml") for n in (
            "gatewayclasses", "gateways", "httproutes", "grpcroutes", "referencegrants", "backendtlspolicies")),
              *(Source(ENVOY_GATEWAY, f"charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_{n}.yaml")
                for n in ("backends", "backendtrafficpolicies", "clienttrafficpolicies", "envoyextensionpolicies",
                          "envoypatchpolicies", "envoyproxies", "httproutefilters", "securitypolicies")),
              Source(GIE, "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"))),
    Controller(
        # The gateway's NLB, instead of EKS's legacy in-tree controller. Its chart's source carries
        # no hook; its CRDs are those `helm install` applies from the chart's crds/.
        "aws-load-balancer-controller", "v3.2.2", "kube-system", "the gateway's NLB (its Service of type LoadBalancer)",
        chart=Chart("https://aws.github.io/eks-charts", "aws-load-balancer-controller", "3.2.2"),
        values=load_balancer_controller_values,
        values_source=Source(LOAD_BALANCER_CONTROLLER, "helm/aws-load-balancer-controller"),
        crds=tuple(Source(LOAD_BALANCER_CONTROLLER, f"helm/aws-load-balancer-controller/crds/{n}.yaml")
                   for n in ("crds", "gateway-crds")),
        after=("cert-manager",), enabled=_aws),
    Controller(
        "prometheus-operator", "v0.93.0", "monitoring", "Prometheus, PodMonitors, ServiceMonitors, PrometheusRules",
        manifests=Source(PROMETHEUS_OPERATOR, "bundle.yaml")),
    Controller(
        "prometheus-adapter", "v0.12.0", "monitoring", "scaler: hpa only: external metrics from Prometheus",
        chart=Chart("https://prometheus-community.github.io/helm-charts", "prometheus-adapter", "4.11.0"),
        values=lambda ctx: {"prometheus": {"url": f"http://prometheus-operated.{ctx.spec.monitoring_namespace}.svc",
                                           "port": 9090}},
        unchecked=_PROXY_REFUSES.format("sigs.k8s.io/prometheus-adapter"),
        hooks_read_from="github:prometheus-community/helm-charts prometheus-adapter 4.11.0 "
                        "(cfa7307424fd2e3572e0580287676c386fc91604) charts/prometheus-adapter: no hooks",
        enabled=lambda ctx: "hpa" in ctx.scalers),
    Controller(
        "gpu-operator", "v25.3.4", "gpu-operator", "device plugin, GPU feature discovery (clique labels), "
                                                   "dcgm-exporter",
        chart=Chart("https://helm.ngc.nvidia.com/nvidia", "gpu-operator", "v25.3.4"),
        values=gpu_operator_values, values_source=Source(GPU_OPERATOR, "deployments/gpu-operator"),
        crds=(Source(GPU_OPERATOR, "deployments/gpu-operator/crds/nvidia.com_clusterpolicies.yaml"),
              Source(GPU_OPERATOR, "deployments/gpu-operator/crds/nvidia.com_nvidiadrivers.yaml"),
              Source(GPU_OPERATOR, "deployments/gpu-operator/charts/node-feature-discovery/crds/nfd-api-crds.yaml")),
        gpu_toleration_paths=("daemonsets.tolerations", "node-feature-discovery.worker.tolerations"),
        hooks=(Hook(("templates/upgrade_crd.yaml",), ("pre-upgrade",), "the chart's CRDs, applied again", _CRDS_OURS),
               Hook(("templates/cleanup_crd.yaml",), ("pre-delete",), "the CRDs deleted",
                    "nothing: the stack keeps CRDs when it deletes them (PlatformLayer.add)"),
               Hook(("charts/node-feature-discovery/templates/post-delete-job.yaml",), ("post-delete",),
                    "NFD's node labels removed", _AT_DELETE))),
    Controller(
        "nvidia-dra-driver-gpu", "25.12.0", "nvidia-dra-driver-gpu", "ComputeDomains: IMEX channels across a rack",
        chart=Chart("https://helm.ngc.nvidia.com/nvidia", "nvidia-dra-driver-gpu", "25.12.0"),
        values=dra_driver_values,
        unchecked=_PROXY_REFUSES.format("github.com/NVIDIA/k8s-dra-driver-gpu"),
        # deployments/helm/nvidia-dra-driver-gpu/crds/ at v25.12.0
        chart_crds=(("resource.nvidia.com", "ComputeDomain"), ("resource.nvidia.com", "ComputeDomainClique")),
        hooks_read_from="github:NVIDIA/k8s-dra-driver-gpu v25.12.0 (0882da8720c28763137e0987778ec476ec4cf8df) "
                        "deployments/helm/nvidia-dra-driver-gpu: no hooks",
        gpu_toleration_paths=("kubeletPlugin.tolerations",), enabled=lambda ctx: ctx.compute_domains),
    Controller(
        # The chart's DaemonSet runs only on the instance types its values list
        # (supportedInstanceLabels); p6e-gb200 is listed from chart v0.5.14 on, so v0.5.6 never
        # ran on it. infra/platform_stack/efa.py holds every EFA node class to the pinned version.
        "aws-efa-k8s-device-plugin", "v0.5.20", "kube-system", "EFA devices (vpc.amazonaws.com/efa)",
        chart=Chart("https://aws.github.io/eks-charts", "aws-efa-k8s-device-plugin", "v0.5.30"),
        values=lambda ctx: {"tolerations": _tolerations(ctx)},
        unchecked="the chart lives in aws/eks-charts, which is no Go module and in no registry this project reaches",
        hooks_read_from="github:aws/eks-charts (bfe91c4b9257c80f754ad4b3d6a9a3c239b2b8ec) "
                        "stable/aws-efa-k8s-device-plugin: no hooks",
        gpu_toleration_paths=("tolerations",), enabled=lambda ctx: "efa" in ctx.fabrics),
    Controller(
        "network-operator", "25.4.0", "nvidia-network-operator", "InfiniBand/RoCE: OFED, RDMA device plugin",
        chart=Chart("https://helm.ngc.nvidia.com/nvidia", "network-operator", "25.4.0"),
        # Its NFD subchart is off: the GPU operator runs NFD, whose CRDs are that row's.
        values=lambda ctx: {"operator": {"tolerations": _tolerations(ctx)}, "nfd": {"enabled": False}},
        unchecked=_PROXY_REFUSES.format("github.com/Mellanox/network-operator"),
        gpu_toleration_paths=("operator.tolerations",),
        # deployment/network-operator/crds/ at v25.4.0: what its CRD hook would apply
        chart_crds=(("mellanox.com", "NicClusterPolicy"), ("mellanox.com", "HostDeviceNetwork"),
                    ("mellanox.com", "IPoIBNetwork"), ("mellanox.com", "MacvlanNetwork"),
                    ("k8s.cni.cncf.io", "NetworkAttachmentDefinition")),
        hooks_read_from="github:Mellanox/network-operator v25.4.0 (8d20dc73b105cffd40434c5ea52e31975557cefa) "
                        "deployment/network-operator",
        hooks=(Hook(("templates/upgrade-crd-hook.yaml",), ("pre-install", "pre-upgrade"),
                    "the CRDs of the operator and its enabled subcharts, applied from its image",
                    "the chart's own crds/, installed with it (chart_crds: skipCrds off)"),
               Hook(("templates/keep-ncp-hook.yaml",), ("pre-install", "pre-upgrade"),
                    "an existing NicClusterPolicy marked to outlive the release",
                    "nothing: the NicClusterPolicy is the user's, and the stack deletes none"),
               Hook(("charts/node-feature-discovery/templates/post-delete-job.yaml",), ("post-delete",),
                    "NFD's node labels removed", _AT_DELETE),
               Hook(("charts/sriov-network-operator/templates/pre-delete-webooks.yaml",), ("pre-delete",),
                    "the SR-IOV operator's webhooks removed", _AT_DELETE)),
        enabled=lambda ctx: bool(ctx.fabrics & {"infiniband", "roce"})),
)


def installed(ctx: PlatformContext) -> list[Controller]:
    """The rows this platform installs: those its hosted environments need, less those the
    cluster already has (`controllers.user_installed`)."""
    return [row for row in CATALOG if row.enabled(ctx) and row.name not in ctx.spec.controllers.user_installed]


def controller(name: str) -> Controller:
    return next(c for c in CATALOG if c.name == name)


def modules_used() -> list[str]:
    """Every Go module the catalog reads from (for `scripts/platform_sources.py`)."""
    found = {s.module for c in CATALOG for s in (*c.crds, c.manifests, c.values_source) if s}
    return sorted(found)
