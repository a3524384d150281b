"""The platform stack: its catalog against the charts' own values, the GPU DaemonSets against
the nodes' taints, node classes against Karpenter's rules, the weight cache against the array,
and the serving stacks' references against what some stack creates."""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from infra.components.nodepools import role_taints
from infra.offline import run_spec
from infra.planning.capacity import pool_capacity
from infra.platform_stack.catalog import CATALOG, controller, installed
from infra.platform_stack.charts import prepared_chart
from infra.platform_stack.checks import controller_problems, platform_problems
from infra.platform_stack.cloud.aws import ec2_node_class
from infra.platform_stack.efa import EFA_CARDS, efa_layout_problems, efa_network_interfaces
from infra.platform_stack.program import Hosted, hosted_environments, platform_context, platform_objects
from infra.platform_stack.spec import OnPremSpec, PlatformSpec, load_platform_spec, parse_platform_spec
from infra.platform_stack.taints import gpu_node_taints, tolerates
from infra.platform_stack.values import dig, pinned_chart, values_problems
from infra.render.manifests import manifests, unwrap
from infra.rollout.preflight import HostEntry, Inventory
from infra.spec import REPO_ROOT, SpecError
from infra.spec_checks import load_spec, parse_spec
from tests.conftest import shipped_run

PLATFORMS = ["platform-prod", "platform-dev"]


def context(name: str):
    spec = load_platform_spec(f"stacks/{name}.yaml")
    return platform_context(spec, [h.spec for h in hosted_environments(spec)])


@pytest.mark.parametrize("name", PLATFORMS)
def test_a_shipped_platform_stack_is_run_once_for_every_test_that_reads_it(name):
    """tests/conftest.py shipped_run serves both kinds of stack: the platform's run took seconds
    (Pulumi's SDK serializing its charts' values and CRDs), and ten test files made their own,
    this one in each test that read it."""
    run = shipped_run(name)
    assert run is shipped_run(name)
    assert run.of_type("kubernetes:helm.sh/v4:Chart") and run.exports


@pytest.mark.parametrize("name", PLATFORMS)
def test_values_accepted_by_each_chart_at_its_pinned_version(name):
    """Helm ignores a value its chart does not know and checks the merged values against the
    chart's values.schema.json (helm.sh/helm/v3 pkg/chartutil/jsonschema.go); here an unknown key
    is an error too. Charts: cert-manager v1.21.2 deploy/charts/cert-manager (with its schema),
    karpenter-provider-aws v1.14.1 charts/karpenter, lws v0.9.0 charts/lws, envoyproxy/gateway
    v1.9.0 charts/gateway-helm/values.tmpl.yaml, NVIDIA/gpu-operator deployments/gpu-operator."""
    ctx = context(name)
    checked = [row for row in CATALOG if row.values_source and row.enabled(ctx)]
    assert {r.name for r in checked} >= {"cert-manager", "lws", "envoy-gateway", "gpu-operator"}
    for row in checked:
        assert values_problems(row.name, row.values(ctx)) == [], row.name


def test_a_misspelt_value_and_a_schema_violation_are_refused():
    assert values_problems("gpu-operator", {"daemonset": {"tolerations": []}}) == [
        "gpu-operator (github.com/NVIDIA/gpu-operator@v0.0.0-20250917190837-d73a0086a6ba "
        "deployments/gpu-operator/values.yaml): daemonset: the chart has no such value"]
    assert any("values.schema.json" in p for p in values_problems("cert-manager", {"replicaCount": "two"}))


def test_every_row_is_checked_or_says_why_not():
    for row in CATALOG:
        if row.chart is None:
            assert row.manifests is not None, row.name  # manifests as published: no values to check
            continue
        assert bool(row.values_source) != bool(row.unchecked), row.name
        if row.values_source:
            assert pinned_chart(row.name)["origin"]["module"] == row.values_source.module


@pytest.mark.parametrize("name", PLATFORMS)
def test_gpu_daemonsets_tolerate_every_pool_taint(name):
    """Every DaemonSet that must run on GPU nodes tolerates the taints the pools put on them
    (k8s.io/api core/v1 toleration.go ToleratesTaint: key, value, effect). The GPU operator's own
    default (daemonsets.tolerations: nvidia.com/gpu Exists) does not tolerate the role taint, so
    without pdstack's values no device plugin, GFD or dcgm-exporter would run on a pool's nodes."""
    ctx = context(name)
    taints = gpu_node_taints([h.spec for h in hosted_environments(ctx.spec)])
    role_taint = next(t for t in taints if t["key"] == "pdstack.io/role")
    default = pinned_chart("gpu-operator")["defaults"]["daemonsets"]["tolerations"]
    assert not tolerates(default, role_taint)
    rows = [r for r in CATALOG if r.gpu_toleration_paths and r.enabled(ctx)]
    assert {"gpu-operator", "aws-efa-k8s-device-plugin"} <= {r.name for r in rows}
    assert ("nvidia-dra-driver-gpu" in {r.name for r in rows}) == ctx.compute_domains
    for row in rows:
        values = row.values(ctx)
        for path in row.gpu_toleration_paths:
            for taint in taints:
                assert tolerates(dig(values, path), taint), (row.name, path, taint)


def test_efa_is_attached_to_static_nodeclaims_by_the_node_class():
    """karpenter-provider-aws v1.14.1 pkg/providers/instance/instance.go getEFACountForInstance:
    EFA interfaces are added only if the NodeClaim requests vpc.amazonaws.com/efa or the node class
    sets networkInterfaces. Static NodePools' NodeClaims carry no pod requests, so the class must.
    Its CEL rules (pkg/apis/v1/ec2nodeclass.go): a primary {0, 0, interface}, unique (card, device),
    at most one efa-only per card."""
    spec = load_platform_spec("stacks/platform-prod.yaml")
    family = spec.cloud.node_classes[0]
    nc = ec2_node_class(spec, family, "decode", "node-role", "sg-0123456789abcdef0")["spec"]
    nics = nc["networkInterfaces"]
    assert {"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"} in nics
    efa = [n for n in nics if n["interfaceType"] == "efa-only"]
    assert len(efa) == family.efa_interfaces == 4
    assert len({n["networkCardIndex"] for n in efa}) == len(efa)
    assert len({(n["networkCardIndex"], n["deviceIndex"]) for n in nics}) == len(nics)
    assert nc["instanceStorePolicy"] == "RAID0"
    assert nc["capacityReservationSelectorTerms"] == [{"id": i} for i in family.capacity_reservations.by_role["decode"]]
    assert efa_network_interfaces(family.instance_types[0], 0) == []


def test_weight_cache_must_live_on_the_array_and_fit():
    """instanceStorePolicy RAID0 puts the array at /mnt/k8s-disks/0 on AL2023 (amazon-eks-ami
    setup-local-disks, maybe_raid0: array_mount_point="${MNT_DIR}/0"); elsewhere is the root volume."""
    data = load_spec("stacks/prod.yaml").model_dump(mode="json")
    data["model"]["weights"]["node_cache_path"] = "/mnt/weights"
    with pytest.raises(SpecError, match="not on the instance-store array"):
        parse_spec(data)
    data = load_spec("stacks/prod.yaml").model_dump(mode="json")
    data["model"]["weights"]["size_gib"] = 12000  # x2 copies > p6e-gb200.36xlarge's 22.5 TB
    with pytest.raises(SpecError, match="does not fit p6e-gb200.36xlarge's instance store"):
        parse_spec(data)
    data = load_spec("stacks/prod.yaml").model_dump(mode="json")
    data["model"]["weights"]["access"] = "secret"
    with pytest.raises(SpecError, match="static AWS key"):
        parse_spec(data)


def test_static_inventory_must_cover_max_and_surge():
    spec = load_platform_spec("stacks/platform-dev.yaml").model_copy(update={"nodes": load_platform_spec(
        "stacks/platform-dev.yaml").nodes.model_copy(update={"mode": "static"})})
    dev = load_spec("stacks/dev.yaml")
    hosts = lambda n: [HostEntry(name=f"h{i}-{r}", address="127.0.0.1", role=r)  # noqa: E731
                       for r in ("prefill", "decode") for i in range(n)]
    inv = lambda n: Inventory(key_file="k", known_hosts="h", hosts=hosts(n))  # noqa: E731
    problems = platform_problems(spec, [Hosted(dev, "dev", inv(1))])
    assert any("the inventory names 1 prefill nodes; the pool needs 2" in p for p in problems), problems
    assert platform_problems(spec, [Hosted(dev, "dev", inv(2))]) == []


@pytest.fixture(scope="module")
def prod_runs():
    return shipped_run("platform-prod"), shipped_run("prod")


def user_provided(spec) -> set[tuple[str, str, str]]:
    """Objects the serving stack refers to that no stack creates: what README's "Objects that stay
    the user's" names, found through the spec fields it names, each where the user keeps it (the
    environment's namespace; a release track's gets copies)."""
    namespace = spec.environment.namespace
    found = {("Secret", namespace, spec.access.tls_secret_name),  # cert-manager Certificate against your issuer, or yours
             ("Namespace", "", "envoy-gateway-system")}  # made by the Envoy Gateway chart at install (namespace.yaml)
    if spec.model.weights.access_mode() == "secret":  # a store outside AWS
        found.add(("Secret", namespace, spec.model.weights.credentials_secret))
    return found


def references(manifest: dict) -> set[tuple[str, str]]:
    """What a manifest names that must exist elsewhere: Secrets, service accounts, ConfigMaps,
    the GatewayClass, node classes, PriorityClasses, namespaces of cross-namespace refs."""
    found = set()

    def walk(node, key=None):
        if isinstance(node, dict):
            if key == "secretRef" or key == "secretKeyRef":
                found.add(("Secret", node.get("name")))
            if key == "configMap" or key == "configMapRef":
                found.add(("ConfigMap", node.get("name")))
            if key == "secret" and "secretName" in node:
                found.add(("Secret", node["secretName"]))
            if node.get("kind") == "Secret" and key is None and "name" in node and "apiVersion" not in node:
                found.add(("Secret", node["name"]))
            if key == "nodeClassRef":
                found.add((node.get("kind"), node.get("name")))
            for k, v in node.items():
                if k == "serviceAccountName":
                    found.add(("ServiceAccount", v))
                elif k == "gatewayClassName":
                    found.add(("GatewayClass", v))
                elif k == "priorityClassName":
                    found.add(("PriorityClass", v))
                else:
                    walk(v, k)
        elif isinstance(node, list):
            for item in node:
                walk(item, key if key in ("certificateRefs",) else None)
    walk(manifest)
    for ref in (manifest.get("spec") or {}).get("listeners", []) or []:
        for cert in (ref.get("tls") or {}).get("certificateRefs", []):
            found.add(("Secret", cert["name"]))
    return {f for f in found if f[1]}


NAMESPACED_REFERENCES = ("Secret", "ConfigMap", "ServiceAccount")  # named from an object in its own namespace


def located(kind: str, name: str, manifest: dict) -> tuple[str, str, str]:
    """(kind, namespace, name) of an object `manifest` makes or names: a Secret, ConfigMap or
    service account is looked up in the namespace of the object naming it; other kinds are
    cluster-wide or named across namespaces ("")."""
    return kind, (manifest["metadata"].get("namespace") or "") if kind in NAMESPACED_REFERENCES else "", name


def unresolved(platform, serving, spec) -> tuple[list, set]:
    """What `serving` refers to, in each namespace it refers to it from, that neither stack makes
    there nor README names as the user's, and everything it refers to."""
    made = {located(m["kind"], m["metadata"]["name"], m) for run in (platform, serving) for m in map(unwrap, manifests(run))}
    wanted = {located(kind, name, m) for m in map(unwrap, manifests(serving)) for kind, name in references(m)}
    return sorted(wanted - made - user_provided(spec)), wanted


# A cluster-internal address: <service>.<namespace>.svc[.cluster.local] (Kubernetes DNS for
# Services and Pods, "Namespaces of Services").
IN_CLUSTER_HOST = re.compile(r"(?<![A-Za-z0-9.-])([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)"
                             r"\.svc(?:\.cluster\.local)?(?![A-Za-z0-9-])")


def user_endpoints(spec) -> set[tuple[str, str]]:
    """The in-cluster services README's "Objects that stay the user's" names through spec fields:
    the trace backend (observability.otlp_endpoint, e.g. Tempo's distributor; unset: no tracing),
    the S3-compatible store of the weights (model.weights.endpoint_url, e.g. MinIO) and of the
    release history (environment.release_store.endpoint_url). pdstack makes none of them."""
    urls = (spec.observability.otlp_endpoint, spec.model.weights.endpoint_url,
            spec.environment.release_store.endpoint_url)
    return {(m.group(1), m.group(2)) for url in urls if url for m in IN_CLUSTER_HOST.finditer(url)}


def unresolved_services(platform, serving, spec) -> tuple[list, set]:
    """Each in-cluster service a serving stack's objects send to (by its DNS name) that no stack
    makes and no user's field names, and all it sends to. prometheus-operator makes the governing
    Service `prometheus-operated` beside each Prometheus (pkg/prometheus/server/operator.go)."""
    made = set()
    for m in (unwrap(m) for run in (platform, serving) for m in manifests(run)):
        if m["kind"] == "Service":
            made.add((m["metadata"]["name"], m["metadata"].get("namespace", "")))
        if m["kind"] == "Prometheus":
            made.add(("prometheus-operated", m["metadata"]["namespace"]))
    wanted = {(h.group(1), h.group(2)) for m in map(unwrap, manifests(serving))
              for h in IN_CLUSTER_HOST.finditer(json.dumps(m))}
    return sorted(wanted - made - user_endpoints(spec)), wanted


@pytest.mark.parametrize("env", ["prod", "dev"])
def test_every_in_cluster_service_a_serving_stack_sends_to_is_made_or_named_the_users(env):
    """Before, the reference check saw only objects named by reference (Secrets, ConfigMaps,
    classes), not the services a stack sends to by address: prod's trace backend
    (tempo-distributor.observability) and dev's MinIO (minio.storage) were neither made by a stack
    nor named the user's. Now each is made by a stack or comes from a spec field README names."""
    spec = load_spec(f"stacks/{env}.yaml")
    missing, wanted = unresolved_services(shipped_run(Path(spec.platform.spec).stem), shipped_run(env), spec)
    assert missing == [], missing
    assert wanted & user_endpoints(spec) == {"prod": {("tempo-distributor", "observability")},
                                             "dev": {("minio", "storage")}}[env]
    assert ("prometheus-operated", "monitoring") in wanted


def test_nothing_in_the_serving_stack_refers_to_an_object_no_stack_creates(prod_runs):
    platform, serving = prod_runs
    missing, wanted = unresolved(platform, serving, load_spec("stacks/prod.yaml"))
    assert missing == [], missing
    assert ("GatewayClass", "", "envoy-gateway") in wanted and ("EC2NodeClass", "", "gb200-decode") in wanted
    # the weights fetch reads no Secret: its role comes through Pod Identity, one association per namespace
    assert not any(k == "Secret" and "weights" in n for k, _, n in wanted)
    assert [r.inputs["namespace"] for r in serving.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")] \
        == ["pdstack-prod"]


def test_dev_refers_to_nothing_but_what_its_platform_makes_and_readme_names():
    """dev on an existing cluster with weights in an S3-compatible store (access: secret): its
    credentials Secret is the user's, as README says; nothing else is missing."""
    spec = load_spec("stacks/dev.yaml")
    missing, wanted = unresolved(shipped_run(Path(spec.platform.spec).stem), shipped_run("dev"), spec)
    assert missing == [], missing
    assert ("Secret", spec.environment.namespace, spec.model.weights.credentials_secret) in wanted


def test_dev_with_release_tracks_refers_to_nothing_missing_in_any_namespace():
    """Each release track serves from a namespace of its own, which the rollout makes; its engine
    pods read the weights credentials (envFrom) there. Before, the Secret stood only in the
    environment's namespace, where the user keeps it, and no engine of a track could start (a
    pod naming a Secret its namespace lacks stays in CreateContainerConfigError). Now each
    track's Storage reads the user's Secret in the environment's namespace (`Secret.get`) and
    copies it into the track's namespace, in the rollout's first step, before its engines."""
    from tests.conftest import stack_data

    from infra import naming
    from infra.recording import fake_secret
    from infra.render.manifests import manifest_of
    from infra.rollout.steps import step_of
    from infra.tracks import plan_tracks

    spec = load_spec("stacks/dev.yaml")
    name, env_ns = spec.model.weights.credentials_secret, spec.environment.namespace
    tracks = plan_tracks([(1, 90, stack_data("dev")), (2, 10, stack_data("dev"))])
    serving = run_spec(spec, tracks=tracks)
    missing, wanted = unresolved(shipped_run(Path(spec.platform.spec).stem), serving, spec)
    assert missing == [], missing
    copies = {r.inputs["metadata"]["namespace"]: r for r in serving.custom()
              if r.type == "kubernetes:core/v1:Secret" and r.inputs["metadata"]["name"] == name}
    assert sorted(copies) == [t.namespace for t in tracks] and all(("Secret", ns, name) in wanted for ns in copies)
    read = base64.b64encode(fake_secret(f"{env_ns}/{name}").encode()).decode()  # the mocks' answer to that read
    for namespace, copy in copies.items():
        secret = unwrap(copy.inputs)
        assert secret["metadata"]["annotations"] == {naming.COPIED_FROM_ANNOTATION: f"{env_ns}/{name}"}
        assert secret["data"] == {"AWS_ACCESS_KEY_ID": read, "AWS_SECRET_ACCESS_KEY": read}
        assert step_of(copy, manifest_of(copy)) == "initialise environment"
        engines = [m for m in map(unwrap, manifests(serving)) if m["kind"] == "LeaderWorkerSet"
                   and m["metadata"]["namespace"] == namespace]
        fetches = [c for m in engines for t in m["spec"]["leaderWorkerTemplate"].values() if isinstance(t, dict)
                   for c in t.get("spec", {}).get("initContainers", []) if c["name"] == "fetch-weights"]
        assert fetches and all(c["envFrom"] == [{"secretRef": {"name": name}}] for c in fetches)


@pytest.mark.parametrize("serving_stack", ["prod", "dev"])
def test_every_custom_resource_kind_a_serving_stack_makes_has_its_crd_from_the_platform(serving_stack):
    """A kind with no built-in schema at the stack's Kubernetes version (kubernetes-validate's) is a
    custom resource: its CRD must come from the platform stack that hosts the environment, as a
    CRD it registers or from a chart that installs its own (a row's `chart_crds`). ComputeDomain
    was in none: the DRA driver's chart ran with skipCrds and no module carries the CRD."""
    from infra.platform_stack.catalog import controller as row_named
    from infra.render.manifests import _validator

    spec = load_spec(f"stacks/{serving_stack}.yaml")
    platform = shipped_run(Path(spec.platform.spec).stem)
    kinds = {(m["apiVersion"].split("/")[0], m["kind"]) for m in map(unwrap, manifests(shipped_run(serving_stack)))
             if "/" in m["apiVersion"] and _validator(m["kind"], m["apiVersion"], spec.environment.kubernetes_version)
             is None}
    crds = {(d["spec"]["group"], d["spec"]["names"]["kind"]) for d in map(unwrap, manifests(platform))
            if d["kind"] == "CustomResourceDefinition"}
    charted = {r.name for r in platform.of_type("kubernetes:helm.sh/v4:Chart") if not r.inputs.get("skipCrds")}
    from_charts = {gk for name in charted for gk in row_named(name).chart_crds}
    assert kinds and kinds - crds - from_charts == set(), sorted(kinds - crds - from_charts)
    if any(kind == "ComputeDomain" for _, kind in kinds):
        assert ("resource.nvidia.com", "ComputeDomain") in from_charts


def test_a_crd_a_chart_installs_is_kept_when_the_stack_deletes_it():
    import pulumi

    from infra.platform_stack.components.controllers import CRD_TYPE, retain_crds

    def transformed(type_):
        return retain_crds(pulumi.ResourceTransformArgs(True, type_, "x", {}, pulumi.ResourceOptions()))

    assert transformed(CRD_TYPE).opts.retain_on_delete is True
    assert transformed("kubernetes:apps/v1:DaemonSet") is None


def test_platform_preview_lists_what_a_fresh_account_needs(prod_runs):
    platform, _ = prod_runs
    types = {r.type for r in platform.custom()}
    for needed in ("eks:index:Cluster", "aws:s3/bucket:Bucket", "aws:iam/role:Role", "aws:kms/key:Key",
                   "aws:eks/podIdentityAssociation:PodIdentityAssociation", "aws:ec2/securityGroup:SecurityGroup",
                   "kubernetes:helm.sh/v4:Chart", "kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition",
                   "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", "kubernetes:gateway.networking.k8s.io/v1:GatewayClass",
                   "kubernetes:monitoring.coreos.com/v1:Prometheus"):
        assert needed in types, needed
    # Before anything else can run on a new cluster: nodes without GPUs (untainted: the controllers
    # tolerate no GPU pool's taint, and Karpenter cannot start the node it runs on), and the EBS
    # CSI driver with a default StorageClass for Prometheus's volume claims.
    (cluster,) = platform.of_type("eks:index:Cluster")
    assert cluster.inputs["vpcCniOptions"]["enableNetworkPolicy"] is True  # else the NetworkPolicies do nothing
    groups = {r.name: r.inputs for r in platform.of_type("aws:eks/nodeGroup:NodeGroup")}
    assert "taints" not in groups["system"] and groups["system"]["scalingConfig"]["minSize"] >= 2
    addons = {r.inputs["addonName"]: r.inputs for r in platform.of_type("aws:eks/addon:Addon")}
    assert addons["aws-ebs-csi-driver"]["podIdentityAssociations"][0]["serviceAccount"] == "ebs-csi-controller-sa"
    (storage,) = [unwrap(m) for m in manifests(platform) if unwrap(m)["kind"] == "StorageClass"]
    assert storage["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    prometheus = [unwrap(m) for m in manifests(platform) if unwrap(m)["kind"] == "Prometheus"]
    assert "storageClassName" not in prometheus[0]["spec"]["storage"]["volumeClaimTemplate"]["spec"]  # the default
    charts = {r.inputs.get("chart") for r in platform.of_type("kubernetes:helm.sh/v4:Chart")}
    with_own_crds = {row.chart.name for row in CATALOG if row.chart and row.chart_crds}
    assert all(r.inputs.get("skipCrds") == (r.inputs["chart"].rsplit("/", 1)[-1] not in with_own_crds)
               for r in platform.of_type("kubernetes:helm.sh/v4:Chart"))
    assert "oci://public.ecr.aws/karpenter/karpenter" in charts
    crds = {unwrap(m)["metadata"]["name"] for m in manifests(platform) if unwrap(m)["kind"] == "CustomResourceDefinition"}
    assert {"leaderworkersets.leaderworkerset.x-k8s.io", "scaledobjects.keda.sh", "inferencepools.inference.networking.k8s.io",
            "podmonitors.monitoring.coreos.com", "ec2nodeclasses.karpenter.k8s.aws", "certificates.cert-manager.io"} <= crds
    names = [r.urn for r in platform.resources]
    assert len(names) == len(set(names))


def test_platform_passes_bucket_iam_and_credential_rules(prod_runs):
    from infra.policy.rules import evaluate_offline

    platform, serving = prod_runs
    rules = {"weights-bucket-private-versioned", "iam-scoped", "no-static-credentials"}
    assert [v for v in evaluate_offline(platform) if v.rule in rules] == []
    assert [v for v in evaluate_offline(serving) if v.rule in rules] == []


@pytest.mark.parametrize("stack", ["platform-prod", "platform-dev"])
def test_the_whole_policy_pack_passes_each_platform_stack(stack):
    """`pulumi preview --policy-pack policy` of a platform stack is not blocked: every rule, not a
    chosen few. A controller's own pods (prometheus-operator's bundle.yaml names its image by
    release tag and has no readiness probe) are judged as their project publishes them; an image
    with no release at all is still refused (the bite). Grafana's placeholder image is pinned first
    (tests/test_images.py shows the pack refusing it)."""
    from infra.policy.rules import Resource, evaluate, evaluate_offline
    from twin.engine import stand_in_pins

    run = run_spec(stand_in_pins(load_platform_spec(f"stacks/{stack}.yaml")))
    assert evaluate_offline(run) == []
    resources = [Resource(r.type, r.name, unwrap(r.inputs)) for r in run.custom()]
    (operator,) = [r for r in resources if r.props.get("metadata", {}).get("name") == "prometheus-operator"
                   and r.type.endswith(":Deployment")]
    container = operator.props["spec"]["template"]["spec"]["containers"][0]
    for unpinned in ("quay.io/prometheus-operator/prometheus-operator", "quay.io/prometheus-operator/x:latest"):
        container["image"] = unpinned
        assert [v.rule for v in evaluate(resources)] == ["images-pinned-by-digest"], unpinned


def test_karpenter_gates_follow_the_pools():
    ctx = context("platform-prod")  # GB200 decode: static pools on reserved capacity
    values = controller("karpenter").values(ctx)
    assert values["settings"]["featureGates"] == {"staticCapacity": True, "reservedCapacity": True}


@pytest.mark.parametrize("name,ok", [("platform-prod", True), ("acme/pdstack/platform-prod", True),
                                     ("acme/platform-prod", True), ("pdstack/platform-prod", False)])
def test_the_platform_stack_is_named_as_pulumi_reads_a_stack_reference(name, ok):
    """Pulumi reads `a/b` as <org>/<stack> (github.com/pulumi/pulumi/pkg/v3 v3.274.1,
    backend/diy/store.go: a two-part reference is org and name), so the shipped
    `pdstack/platform-dev` named an organization "pdstack": the real engine's file backend
    refused it ("organization name must be 'organization'"), and in Pulumi Cloud it is another
    organization's stack. The spec refuses it with the fix."""
    from infra.spec import SpecError
    from infra.spec_checks import parse_spec
    from tests.conftest import stack_data

    data = stack_data("prod")
    data["platform"]["stack"] = name
    if ok:
        assert parse_spec(data).platform.name() == "platform-prod"
    else:
        with pytest.raises(SpecError, match=r"platform\.stack: .*Fix: the stack's name alone"):
            parse_spec(data)


def test_a_canary_tracks_pods_get_their_weights_access_without_a_copied_secret():
    """During a rollout, revision 2 serves from its own namespace beside revision 1
    (infra/tracks.py). Its engine pods reach the weights bucket through EKS Pod Identity, with no
    Secret copied into the new namespace: the serving stack makes one association per track's
    namespace for the engine ServiceAccount, to the role the platform stack exports
    (infra/components/platform_links.py), and the platform's weights-reader policy admits each
    track's namespace by the session tags EKS Pod Identity sets (kubernetes-namespace,
    kubernetes-service-account: docs.aws.amazon.com/eks/latest/userguide/pod-id-abac.html).
    IAM is not evaluated here (nothing here can, moto neither): the policy's namespace patterns are
    matched as IAM matches them (iam_condition_holds)."""
    import json

    from infra.components.engines import ENGINE_SERVICE_ACCOUNT
    from infra.tracks import plan_tracks
    from tests.conftest import stack_data

    spec = load_spec("stacks/prod.yaml")
    tracks = plan_tracks([(1, 90, stack_data("prod")), (2, 10, stack_data("prod"))])
    serving = run_spec(spec, tracks=tracks)
    track_namespaces = [t.namespace for t in tracks]
    associations = serving.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")
    assert sorted(r.inputs["namespace"] for r in associations) == sorted(track_namespaces)
    assert {r.inputs["serviceAccount"] for r in associations} == {ENGINE_SERVICE_ACCOUNT}
    objects = [unwrap(m) for m in manifests(serving)]
    for lws in (o for o in objects if o["kind"] == "LeaderWorkerSet"):
        assert lws["metadata"]["namespace"] in track_namespaces
        for template in ("leaderTemplate", "workerTemplate"):
            pod = lws["spec"]["leaderWorkerTemplate"].get(template)
            if pod:
                assert pod["spec"]["serviceAccountName"] == ENGINE_SERVICE_ACCOUNT
    wanted = set().union(*(references(o) for o in objects))
    assert not any(kind == "Secret" and "weights" in name for kind, name in wanted), wanted
    assert "aws_secret_access_key" not in json.dumps(objects).lower()

    platform = shipped_run("platform-prod")
    (reader,) = [r for r in platform.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "weights-reader"]
    statements = json.loads(reader.inputs["policy"])["Statement"]
    for namespace in track_namespaces:
        assert iam_allows(statements, "s3:GetObject", pod_identity_tags(namespace)), namespace
    assert not iam_allows(statements, "s3:GetObject", pod_identity_tags("kube-system"))
    assert not iam_allows(statements, "s3:GetObject", pod_identity_tags(track_namespaces[0], "default"))


# --- IAM's own matching, for the policies pdstack writes (nothing here evaluates IAM; moto neither) --


@functools.cache
def _iam_glob(pattern: str) -> re.Pattern:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern), re.S)


def iam_string_like(value: str, pattern: str) -> bool:
    """IAM's StringLike, as the IAM User Guide states it ("IAM JSON policy elements: Condition
    operators", String condition operators): case-sensitive, `*` a run of any characters (none
    included), `?` exactly one, every other character itself. Not fnmatch: IAM has no `[...]`."""
    return _iam_glob(pattern).fullmatch(value) is not None


def iam_condition_holds(condition: dict, context: dict[str, str]) -> bool:
    """A Condition block, as the IAM User Guide evaluates it ("Creating a condition with multiple
    context keys or values"): every operator and every key must hold; a key's several values are
    ORed, and NORed under a negated operator (StringNotLike holds when no value matches, and when
    the key is absent)."""
    for operator, keys in condition.items():
        negated = operator.startswith("StringNot")
        match = {"StringEquals": str.__eq__, "StringLike": iam_string_like}[operator.replace("Not", "")]
        for key, values in keys.items():
            hit = key in context and any(match(context[key], v) for v in ([values] if isinstance(values, str) else values))
            if hit == negated:
                return False
    return True


def iam_allows(statements: list[dict], action: str, context: dict[str, str]) -> bool:
    """Whether an Allow statement naming `action` holds for `context` (no Deny is written here)."""
    return any(s["Effect"] == "Allow" and action in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
               and iam_condition_holds(s.get("Condition", {}), context) for s in statements)


def pod_identity_tags(namespace: str, service_account: str = "engine") -> dict[str, str]:
    """The session tags EKS Pod Identity sets (docs.aws.amazon.com/eks/latest/userguide/pod-id-abac.html)."""
    return {"aws:PrincipalTag/kubernetes-namespace": namespace,
            "aws:PrincipalTag/kubernetes-service-account": service_account}


NOT_TRACKS = ["research", "rogue", "", "0", "01", "1x", "x1", "-1", "1-", "12345", "1-canary", "9999a"]


def test_the_weights_reader_admits_each_release_track_namespace_and_no_other_namespace():
    """Issue #36 item 7: `<namespace>-r*` admitted `pdstack-prod-research` and `pdstack-prod-rogue`
    to the weights, by Pod Identity's tag condition and (the only gate there) IRSA's trust. Now
    exactly the environment's namespace and `<namespace>-r<revision>` (infra/tracks.py
    track_namespace; 1 to 9999, the room spec.NAMESPACE_MAX leaves) are admitted: every one of
    those, and no other name of up to three characters after `-r` (each DNS-label character, every
    combination), nor the named ones. Matched as IAM matches (iam_condition_holds above)."""
    import itertools
    import string

    from infra.platform_stack.cloud.aws import irsa_trust
    from infra.tracks import track_namespace

    spec = load_spec("stacks/prod.yaml")
    ns = spec.environment.namespace
    platform = shipped_run("platform-prod")
    (reader,) = [r for r in platform.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "weights-reader"]
    statements = json.loads(reader.inputs["policy"])["Statement"]
    host = "oidc.eks.us-east-1.amazonaws.com/id/0123456789ABCDEF0123456789ABCDEF"
    trust = irsa_trust(f"arn:aws:iam::123456789012:oidc-provider/{host}", f"https://{host}", [spec], "engine")

    def by_pod_identity(namespace: str) -> bool:
        return iam_allows(statements, "s3:GetObject", pod_identity_tags(namespace))

    def by_irsa(namespace: str, service_account: str = "engine") -> bool:
        return iam_allows(json.loads(trust)["Statement"], "sts:AssumeRoleWithWebIdentity", {
            f"{host}:aud": "sts.amazonaws.com", f"{host}:sub": f"system:serviceaccount:{namespace}:{service_account}"})

    tracks = [ns] + [track_namespace(ns, revision) for revision in range(1, 10000)]
    assert all(map(by_pod_identity, tracks)) and all(map(by_irsa, tracks))
    named = [f"{ns}-r{suffix}" for suffix in NOT_TRACKS] + [f"{ns}r1", f"{ns}-1", "kube-system", ns[:-1]]
    assert [n for n in named if by_pod_identity(n) or by_irsa(n)] == []
    assert not by_irsa(ns, "default") and not by_irsa(track_namespace(ns, 7), "engine-x")
    alphabet = string.ascii_lowercase + string.digits + "-"  # what a namespace (a DNS label) may hold
    for size in range(4):
        for suffix in map("".join, itertools.product(alphabet, repeat=size)):
            track = re.fullmatch(r"[1-9][0-9]*", suffix) is not None
            assert by_pod_identity(f"{ns}-r{suffix}") == track, suffix
            if size < 3:  # the trust's patterns are the same ones around the service account's name
                assert by_irsa(f"{ns}-r{suffix}") == track, suffix
    # IAM's default quota for a trust policy, whitespace not counted (IAM User Guide, "IAM and AWS STS quotas")
    assert len(re.sub(r"\s", "", trust)) <= 2048


def test_a_revision_no_track_namespace_pattern_admits_is_refused():
    from infra.spec import SpecError
    from infra.tracks import plan_tracks
    from tests.conftest import stack_data

    assert [t.namespace for t in plan_tracks([(9999, 100, stack_data("prod"))])] == ["pdstack-prod-r9999"]
    with pytest.raises(SpecError, match="revision 10000 has more than 4 digits"):
        plan_tracks([(9999, 100, stack_data("prod")), (10000, 0, stack_data("prod"))])


# EKS's names for taint effects and the Kubernetes effects EKS writes on the nodes for them: the
# valid values are pulumi-aws 7.51.1's (eks/_inputs.py, NodeGroupTaintArgs.effect); the mapping is
# EKS's (User Guide, "Recipe: Prevent pods from being scheduled on specific nodes"), not checked here.
EKS_TAINT_EFFECTS = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}


def engine_pod_specs(run) -> dict[str, dict]:
    """Role -> the engine pods' spec (workers' template; a leader's differs only in its command)."""
    return {m["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]["pdstack.io/role"]:
            m["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
            for m in map(unwrap, manifests(run)) if m["kind"] == "LeaderWorkerSet"}


def assert_pods_land_on(pod: dict, labels: dict, taints: list[dict], what: str) -> None:
    """The scheduler's rules for one node: every taint tolerated (tolerates), every nodeSelector
    label carried, leaving out the labels the kubelet sets on every node itself."""
    assert all(tolerates(pod.get("tolerations", []), t) for t in taints), (what, taints, pod.get("tolerations"))
    wanted = {k: v for k, v in pod.get("nodeSelector", {}).items() if not k.startswith("kubernetes.io/")}
    assert wanted.items() <= labels.items(), (what, wanted, labels)


def test_node_groups_mode_makes_one_managed_group_a_pool_whose_nodes_its_pods_land_on(monkeypatch):
    """nodes.mode node-groups (what EKS recommends for GB200): one EKS managed node group per
    environment and role, with the role label and taints a NodePool's nodes carry, EFA through
    its launch template and a cluster placement group (prefill; decode's Capacity Blocks are
    placed by AWS), decode from Capacity Blocks, sized for
    the pool's maximum plus the rollout surge in whole NVLink domains. The serving stack then
    makes no NodePool, and its engine pods tolerate the groups' taints and select their labels."""
    import base64

    import botocore.session

    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": "prefill", "environment": "prod", "node_class": "gb200"},
        {"role": "decode", "environment": "prod", "node_class": "gb200", "capacity_block": True}]}
    platform_spec = PlatformSpec.model_validate(data)
    platform = run_spec(platform_spec)
    groups = {r.urn.rsplit("::", 1)[-1]: r.inputs for r in platform.of_type("aws:eks/nodeGroup:NodeGroup")
              if r.name != "system"}  # the CPU nodes a new cluster gets in every mode
    blocks = platform_spec.cloud.node_classes[0].capacity_reservations.by_role["decode"]
    assert sorted(groups) == [f"prod-decode-{i}" for i in range(len(blocks))] + ["prod-prefill"]  # a group a block
    prod = load_spec("stacks/prod.yaml")
    rack = prod.hardware.supernode.gpus // prod.hardware.gpus_per_node
    role_of = {name: name.removeprefix("prod-").split("-")[0] for name in groups}
    for role in ("prefill", "decode"):
        pool, cap = prod.deployment.pools()[role], pool_capacity(prod, role)
        mine = [g for name, g in groups.items() if role_of[name] == role]
        nodes = sum(g["scalingConfig"]["desiredSize"] for g in mine)
        assert all(g["scalingConfig"]["minSize"] == g["scalingConfig"]["desiredSize"] == g["scalingConfig"]["maxSize"]
                   for g in mine)
        assert nodes >= (cap.max_instances + cap.surge_instances) * pool.nodes_per_instance(prod.hardware.gpus_per_node)
        assert all(g["scalingConfig"]["desiredSize"] % rack == 0 for g in mine) or role == "prefill"  # whole domains
        assert {g["capacityType"] for g in mine} == {"CAPACITY_BLOCK" if role == "decode" else "ON_DEMAND"}
        assert all(g["instanceTypes"] == ["p6e-gb200.36xlarge"] for g in mine)
    templates = {r.urn.rsplit("::", 1)[-1]: r.inputs for r in platform.of_type("aws:ec2/launchTemplate:LaunchTemplate")}
    # each decode group's instances come from its own block, on the capacity-block market
    assert [(t["instanceMarketOptions"]["marketType"], t["capacityReservationSpecification"][
        "capacityReservationTarget"]["capacityReservationId"]) for n, t in sorted(templates.items())
        if n.startswith("prod-decode")] == [("capacity-block", b) for b in blocks]
    assert "instanceMarketOptions" not in templates["prod-prefill"]
    for name, template in templates.items():
        efa = [n for n in template["networkInterfaces"] if n["interfaceType"] in ("efa", "efa-only")]
        assert len(efa) == 4, (name, template["networkInterfaces"])  # the node class's efa_interfaces
        assert ("placement" in template) == (name == "prod-prefill")  # a Capacity Block is placed by AWS
        # the cluster's security group beside EFA's on every interface: listed groups replace the default
        assert all(len(n["securityGroups"]) == 2 for n in template["networkInterfaces"]), name
        assert "strategy: RAID0" in base64.b64decode(template["userData"]).decode()  # the weight cache's array
    # Grace is arm64: the accelerated AL2023 AMI for it, a value the pinned botocore's EKS model lists
    ami_types = botocore.session.get_session().get_service_model("eks").shape_for("AMITypes").enum
    assert {g["amiType"] for g in groups.values()} == {"AL2023_ARM_64_NVIDIA"} and "AL2023_ARM_64_NVIDIA" in ami_types
    assert len(platform.of_type("aws:ec2/placementGroup:PlacementGroup")) == 1

    import infra.platform_stack.spec as platform_spec_module

    monkeypatch.setattr(platform_spec_module, "load_platform_spec", lambda path: platform_spec)
    serving = run_spec(prod)
    assert not [r for r in serving.custom() if "karpenter" in r.type]
    pods = engine_pod_specs(serving)
    for name, group in groups.items():
        taints = [{**t, "effect": EKS_TAINT_EFFECTS[t["effect"]]} for t in group["taints"]]
        assert_pods_land_on(pods[role_of[name]], group["labels"], taints, name)


def test_static_mode_patches_each_listed_node_so_its_pools_pods_land_on_it():
    """nodes.mode static (kubeadm, on-prem): each node the inventory names gets one NodePatch with
    its role label, the role's taints and, where given, its NVLink domain as the clique label;
    a node without a role is left alone. The serving pods tolerate and select what is patched."""
    spec = load_platform_spec("stacks/platform-dev.yaml")
    spec = spec.model_copy(update={"nodes": spec.nodes.model_copy(update={"mode": "static"})})
    dev = load_spec("stacks/dev.yaml")
    hosts = [HostEntry(name=f"gpu-{r}-{i}", address="127.0.0.1", role=r, clique=f"rack-{i}")
             for r in ("prefill", "decode") for i in range(2)] + [HostEntry(name="login", address="127.0.0.1")]
    objects = platform_objects(spec, [Hosted(dev, "dev", Inventory(key_file="k", known_hosts="h", hosts=hosts))])
    patched = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Node"}
    assert sorted(patched) == sorted(h.name for h in hosts if h.role)
    pods = engine_pod_specs(shipped_run("dev"))
    for name, node in patched.items():
        role = node["metadata"]["labels"]["pdstack.io/role"]
        assert node["metadata"]["labels"]["nvidia.com/gpu.clique"] == "rack-" + name[-1]
        assert node["spec"]["taints"] == role_taints(role)
        assert_pods_land_on(pods[role], node["metadata"]["labels"], node["spec"]["taints"], name)


@pytest.mark.parametrize("name", PLATFORMS)
def test_each_platform_stack_previews_offline(name, capsys):
    """`pdctl preview --offline --stack platform-dev` ended in "unexpected error": the existing
    cluster's look-up read `certificate_authority`, which pulumi-aws 7.51.1's GetClusterResult
    (eks/get_cluster.py) does not have (it is the list `certificate_authorities`); the offline
    stand-in answered with the old name too, so no test saw it."""
    from infra.cli import main

    assert main(["preview", "--offline", "--stack", name]) == 0, capsys.readouterr().err


def onprem_twin_spec(**controllers) -> PlatformSpec:
    """dev's cluster as an existing one (cloud: none), its controllers' values as given (also the
    platform tests/twin/test_platform_on_twin.py applies)."""
    spec = load_platform_spec(REPO_ROOT / "stacks" / "platform-dev.yaml")
    return spec.model_copy(update={"cloud": OnPremSpec(),
                                   "controllers": spec.controllers.model_copy(update=controllers)})


def test_keda_and_the_metrics_adapter_are_installed_only_for_the_scaler_a_hosted_stack_uses():
    dev = load_spec("stacks/dev.yaml")
    spec = load_platform_spec("stacks/platform-dev.yaml")
    hpa = dev.model_copy(update={"deployment": dev.deployment.model_copy(update={
        "autoscaling": dev.deployment.autoscaling.model_copy(update={"scaler": "hpa"})})})
    fixed = dev.model_copy(update={"deployment": dev.deployment.model_copy(update={
        "autoscaling": dev.deployment.autoscaling.model_copy(update={"enabled": False})})})

    def rows(serving):
        return {r.name for r in installed(platform_context(spec, serving))} & {"keda", "prometheus-adapter"}

    assert rows([dev]) == {"keda"}
    assert rows([hpa]) == {"prometheus-adapter"}
    assert rows([dev, hpa]) == {"keda", "prometheus-adapter"}
    assert rows([fixed]) == set()


def test_charts_from_pinned_modules_refuse_a_row_whose_chart_no_module_carries():
    """chart_source: pinned-modules renders each chart from its source in a pinned module; a row
    whose chart is only in a registry (KEDA's, the EFA plugin's) must be the user's, said so."""
    dev = load_spec("stacks/dev.yaml")
    spec = onprem_twin_spec(chart_source="pinned-modules")
    problems = controller_problems(platform_context(spec, [dev]))
    assert sorted(p.split("but ")[1].split("'s chart")[0] for p in problems) == [
        "aws-efa-k8s-device-plugin", "keda"]  # dev's fabric is EFA; it makes no ComputeDomain (no DRA driver)
    assert all("Fix: install it yourself" in p and "controllers.user_installed" in p for p in problems)

    spec = onprem_twin_spec(chart_source="pinned-modules",
                            user_installed=["aws-efa-k8s-device-plugin", "keda", "nvidia-dra-driver-gpu"])
    assert controller_problems(platform_context(spec, [dev])) == []
    assert controller_problems(platform_context(onprem_twin_spec(user_installed=["kedaa"]), [dev])) == [
        "controllers.user_installed: 'kedaa' is no controller of the catalog. Fix: one of "
        + ", ".join(r.name for r in CATALOG)]


def test_a_user_installed_row_gets_neither_chart_nor_crds():
    dev = load_spec("stacks/dev.yaml")
    spec = onprem_twin_spec(user_installed=["lws"])
    objects = platform_objects(spec, [Hosted(dev, "dev", None)])
    crds = {o["metadata"]["name"] for o in objects if o["kind"] == "CustomResourceDefinition"}
    assert "leaderworkersets.leaderworkerset.x-k8s.io" not in crds
    assert "gateways.gateway.networking.k8s.io" in crds
    assert not any(o["kind"] == "Namespace" and o["metadata"]["name"] == "lws-system" for o in objects)


def test_a_chart_from_its_module_is_stamped_as_its_release_and_made_once(tmp_path):
    """The source's Chart.yaml carries a placeholder version (cert-manager v0.0.0, Envoy Gateway
    v0.0.0-latest) and Envoy Gateway's values are a template whose ${...} its release fills: the
    prepared copy has the pinned version, the row's appVersion and values whose placeholders are
    null, so the chart's own default image (docker.io/envoyproxy/gateway:<Chart.Version>) applies."""
    for row in CATALOG:
        if not row.values_source:
            continue
        folder = prepared_chart(row, tmp_path)
        meta = yaml.safe_load((folder / "Chart.yaml").read_text())
        origin = json.loads((folder / "ORIGIN.json").read_text())
        assert (meta["version"], meta["appVersion"]) == (origin["version"], row.version), row.name
        assert origin["module"] == row.values_source.module and origin["path"] == row.values_source.path
        assert (folder / "values.yaml").is_file() and (folder / "templates").is_dir(), row.name
        assert not list(tmp_path.glob(f".{row.name}-*")), "a work folder was left behind"
    envoy = controller("envoy-gateway")
    values = yaml.safe_load((prepared_chart(envoy, tmp_path) / "values.yaml").read_text())
    assert values["global"]["images"]["envoyGateway"]["image"] is None
    assert "${" not in (prepared_chart(envoy, tmp_path) / "values.yaml").read_text()
    folder = prepared_chart(envoy, tmp_path)
    (folder / "marker").write_text("")
    assert (prepared_chart(envoy, tmp_path) / "marker").exists()  # made once per version
    (folder / "ORIGIN.json").write_text("{}")  # another origin: made again
    assert not (prepared_chart(envoy, tmp_path) / "marker").exists()


def test_a_chart_copy_that_fails_or_was_killed_half_way_leaves_no_work_folder(tmp_path, monkeypatch):
    """A copy that fails (here: the disk refuses the stamp) removes its work folder and leaves no
    chart; one a killed run left (its pid in the folder's name, that process gone) is removed by
    the next copy of that row; a running copy's (a live pid) is left alone."""
    import subprocess

    from infra.platform_stack import charts

    envoy = controller("envoy-gateway")
    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = tmp_path / f".{envoy.name}-{dead.pid}-x1"
    running = tmp_path / f".{envoy.name}-{os.getpid()}-x2"
    for folder in (abandoned, running):
        (folder / "chart").mkdir(parents=True)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(charts, "_stamp", disk_full)
    with pytest.raises(OSError):
        prepared_chart(envoy, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name]
    monkeypatch.undo()
    assert (prepared_chart(envoy, tmp_path) / "ORIGIN.json").is_file()
    assert sorted(p.name for p in tmp_path.glob(".*")) == [running.name]


def test_platform_crds_are_kept_when_the_stack_deletes_them(monkeypatch):
    """Deleting a CRD deletes every object of its kind, fleets included: Pulumi keeps it."""
    from infra.platform_stack.components import base

    seen, register = {}, base.register_manifest

    def recording(name, manifest, opts):
        seen.setdefault(manifest["kind"], opts.retain_on_delete)
        return register(name, manifest, opts)

    monkeypatch.setattr(base, "register_manifest", recording)
    dev = load_spec("stacks/dev.yaml")
    platform_objects(onprem_twin_spec(), [Hosted(dev, "dev", None)])
    assert seen["CustomResourceDefinition"] is True
    assert seen["Namespace"] is False


def test_parsed_module_files_are_kept_per_version_and_a_broken_copy_is_parsed_again(tmp_path, monkeypatch):
    from infra.platform_stack.components import controllers

    monkeypatch.setattr(controllers, "DOCUMENTS_CACHE", tmp_path)
    source = controller("lws").crds[0]
    controllers.documents.cache_clear()
    parsed = controllers.documents(source.module, source.path)
    kept = next(tmp_path.rglob("*.json"))
    assert "sigs.k8s.io/lws@v0.9.0/" in kept.as_posix() and json.loads(kept.read_text()) == list(parsed)
    kept.write_text('[{"kind": "Trunc')  # a copy cut short
    controllers.documents.cache_clear()
    assert controllers.documents(source.module, source.path) == parsed
    assert json.loads(kept.read_text()) == list(parsed)
    controllers.documents.cache_clear()


def test_what_a_new_cluster_needs_from_iam_and_tags(prod_runs):
    """Three things a fresh account would trip on at its first `pulumi up`:
    - Karpenter makes each node class's instance profile: the create is allowed by the tags in the
      request (a profile that does not exist yet has no aws:ResourceTag to match), with the tags
      karpenter-provider-aws v1.14.1 sets (pkg/apis/v1/ec2nodeclass.go InstanceProfileTags);
    - the security group EKS makes for the new cluster carries the discovery tag the node classes
      select security groups by (without it nodes would get the EFA group only, which reaches no
      control plane);
    - CI's Pod Identity actions are scoped by ARN to this cluster and its associations, not by a tag
      no resource carries."""
    import fnmatch

    platform, _ = prod_runs
    spec = load_platform_spec("stacks/platform-prod.yaml")
    name = spec.cloud.cluster.name

    def statements(policy_name):
        (found,) = [r for r in platform.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == policy_name]
        return json.loads(unwrap(found.inputs)["policy"])["Statement"]

    def allowing(policy_name, action):
        return [st for st in statements(policy_name)
                if any(fnmatch.fnmatchcase(action, a) for a in ([st["Action"]] if isinstance(st["Action"], str)
                                                                 else st["Action"]))]

    (create,) = allowing("karpenter-controller", "iam:CreateInstanceProfile")
    keys = [k for test in create["Condition"].values() for k in test]
    assert keys and all(k.startswith("aws:RequestTag/") for k in keys), keys
    assert create["Condition"]["StringEquals"][f"aws:RequestTag/kubernetes.io/cluster/{name}"] == "owned"
    assert "aws:RequestTag/karpenter.k8s.aws/ec2nodeclass" in create["Condition"]["StringLike"]
    for action in ("iam:AddRoleToInstanceProfile", "iam:DeleteInstanceProfile", "iam:GetInstanceProfile"):
        assert allowing("karpenter-controller", action), action

    (tag,) = platform.of_type("aws:ec2/tag:Tag")
    assert (tag.inputs["key"], tag.inputs["value"]) == ("karpenter.sh/discovery", spec.cloud.cluster.discovery())
    node_class = ec2_node_class(spec, spec.cloud.node_classes[0], "decode", "node-role", "sg-efa")
    assert {"tags": {"karpenter.sh/discovery": spec.cloud.cluster.discovery()}} in node_class["spec"][
        "securityGroupSelectorTerms"]

    (ci_create,) = allowing("ci", "eks:CreatePodIdentityAssociation")
    assert ci_create["Resource"] == f"arn:aws:eks:{spec.cloud.region}:*:cluster/{name}" and "Condition" not in ci_create
    (ci_delete,) = allowing("ci", "eks:DeletePodIdentityAssociation")
    assert ci_delete["Resource"] == f"arn:aws:eks:{spec.cloud.region}:*:podidentityassociation/{name}/*"


def test_dcgm_exporters_monitor_is_one_the_platforms_prometheus_selects():
    """The DCGM_* series (dashboards, `pdctl cost`) come from dcgm-exporter, whose ServiceMonitor
    the GPU operator makes with the chart's dcgmExporter.serviceMonitor.additionalLabels
    (deployments/gpu-operator/values.yaml at the pinned module): without the labels the
    Prometheus selects monitors by, it was never scraped."""
    from infra.platform_stack.catalog import gpu_operator_values

    for stack in ("platform-prod", "platform-dev"):
        ctx = context(stack)
        (prometheus,) = [o for o in platform_objects(ctx.spec) if o["kind"] == "Prometheus"]
        wanted = prometheus["spec"]["serviceMonitorSelector"]["matchLabels"]
        monitor = gpu_operator_values(ctx)["dcgmExporter"]["serviceMonitor"]
        assert monitor["enabled"] and wanted and wanted.items() <= monitor["additionalLabels"].items()


def test_node_groups_off_aws_is_one_message_not_a_crash():
    spec = onprem_twin_spec()
    spec = spec.model_copy(update={"nodes": spec.nodes.model_copy(update={"mode": "node-groups"})})
    problems = platform_problems(spec, [Hosted(load_spec("stacks/dev.yaml"), "dev", None)])
    assert any(p.startswith("nodes.mode: node-groups are EKS managed node groups") for p in problems), problems


def test_a_node_group_naming_an_unknown_node_class_or_environment_is_named():
    """It ended in "unexpected error: KeyError" from the program."""
    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": "prefill", "environment": "prod", "node_class": "nosuch"},
        {"role": "decode", "environment": "staging", "node_class": "gb200"}]}
    spec = PlatformSpec.model_validate(data)
    problems = platform_problems(spec, hosted_environments(spec))
    assert any("node_class 'nosuch' is no node class of the platform (gb200)" in p for p in problems), problems
    assert any("environment 'staging' is not hosted here (prod)" in p for p in problems), problems


def test_node_groups_need_subnets_and_aws():
    """A managed node group is made in listed subnets: an existing cluster's spec listed none, and
    every group would have been created with an empty subnet list (refused by EKS at `pulumi up`)."""
    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": "prefill", "environment": "prod", "node_class": "gb200"},
        {"role": "decode", "environment": "prod", "node_class": "gb200"}]}
    data["cloud"]["cluster"] = {"mode": "existing", "name": "pdstack-prod"}
    spec = PlatformSpec.model_validate(data)
    problems = platform_problems(spec, hosted_environments(spec))
    assert any(p.startswith("cloud.cluster.private_subnet_ids:") for p in problems), problems
    data["cloud"]["cluster"]["private_subnet_ids"] = ["subnet-0a1b2c3d4e5f60701"]
    assert platform_problems(PlatformSpec.model_validate(data), hosted_environments(spec)) == []


def test_a_custom_resource_is_checked_against_the_crd_its_own_stack_installs():
    """GatewayClass and Prometheus have no vendored schema, and were listed as unchecked; the
    platform stack registers their CRDs (from the pinned modules), so they are checked against
    exactly those, unknown fields refused. The bite: a misspelt field is an error."""
    from infra.render.manifests import validate_manifests

    spec = load_platform_spec("stacks/platform-prod.yaml")
    items = [unwrap(m) for m in manifests(shipped_run("platform-prod"))]
    report = validate_manifests(items, spec.kubernetes_version)
    assert report.ok and not report.unchecked_kinds, (report.errors, report.unchecked_kinds)
    assert report.custom_checked["Prometheus (CRD prometheuses.monitoring.coreos.com of this stack)"] == 1
    assert report.custom_checked["GatewayClass (CRD gatewayclasses.gateway.networking.k8s.io of this stack)"] == 1
    (prometheus,) = [m for m in items if m["kind"] == "Prometheus"]
    prometheus["spec"]["retentionPeriod"] = "15d"  # the field is `retention`
    errors = validate_manifests(items, spec.kubernetes_version).errors
    assert len(errors) == 1 and "Prometheus/" in errors[0] and "retentionPeriod" in errors[0], errors


def test_a_chart_value_its_chart_does_not_know_stops_the_preview(monkeypatch):
    """The charts' own checks run with the platform's other checks (every preview and `pulumi up`),
    not only in this file: a value cert-manager v1.21.2's chart does not have is refused."""
    import dataclasses

    import infra.platform_stack.checks as checks

    ctx = context("platform-prod")
    assert controller_problems(ctx) == []
    rows = tuple(dataclasses.replace(row, values=lambda ctx: {"replicaCounts": 2}) if row.name == "cert-manager"
                 else row for row in CATALOG)
    monkeypatch.setattr(checks, "installed", lambda ctx: [r for r in rows if r.enabled(ctx)])
    problems = controller_problems(ctx)
    # both verdicts: the key is not in its values.yaml, and its values.schema.json refuses it
    assert problems and all("cert-manager" in p and "replicaCounts" in p for p in problems), problems


def test_capacity_block_groups_need_blocks_that_hold_the_pool_evenly():
    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": "prefill", "environment": "prod", "node_class": "gb200", "capacity_block": True},
        {"role": "decode", "environment": "prod", "node_class": "gb200", "capacity_block": True}]}
    data["cloud"]["node_classes"][0]["capacity_reservations"]["by_role"] = {
        "decode": ["cr-0a1b2c3d4e5f60702", "cr-0a1b2c3d4e5f60703"]}  # 54 decode nodes (3 racks) over 2 blocks
    spec = PlatformSpec.model_validate(data)
    problems = platform_problems(spec, hosted_environments(spec))
    assert len(problems) == 2, problems
    assert "lists no capacity reservation for prefill" in problems[0]
    assert "54 nodes do not split evenly in whole NVLink domains of 18 nodes over 2" in problems[1]


@pytest.mark.parametrize("field, bad", [
    (("monitoring_namespace",), 'Monitoring"; $(id) #'),
    (("monitoring_namespace",), "m" * 64),
    (("prometheus_selector",), {"app.kubernetes.io/part-of": "pdstack; $(id)"}),
    (("prometheus_selector",), {"part of": "pdstack"}),
    (("prometheus_selector",), {"Example.com/part-of": "pdstack"}),
    (("cloud", "cluster", "discovery_tag"), "pdstack\n$(id)"),
    (("cloud", "cluster", "discovery_tag"), "pdstack; id"),
    (("cloud", "cluster", "discovery_tag"), ""),
    (("cloud", "cluster", "discovery_tag"), "aws:pdstack"),
    (("cloud", "cluster", "discovery_tag"), "t" * 257),
])
def test_free_text_platform_fields_are_held_to_what_reads_them(field, bad):
    """The monitoring namespace is a namespace name: an RFC 1123 DNS label of 63 at most
    (k8s.io/apimachinery v0.35 pkg/util/validation/validation.go, IsDNS1123Label); the Prometheus
    selector's keys and values are label keys and values (the same file: IsQualifiedName,
    IsValidLabelValue); the discovery tag is an EC2 tag value (AWS docs, "Tag naming limits and
    requirements": at most 256 Unicode characters, letters, digits, spaces and _ . : / = + - @;
    the aws: prefix reserved) that Karpenter selects subnets and security groups by, which it
    refuses empty (karpenter-provider-aws v1.14.1 EC2NodeClass CRD, subnetSelectorTerms.tags:
    "empty tag keys or values aren't supported"). Each was a plain string: `Monitoring"; $(id) #`
    passed `preview --offline` as a namespace and went into the Prometheus URL every serving stack
    reads, to fail only at `pulumi up`."""
    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    node = data
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = bad
    with pytest.raises(SpecError) as refused:
        parse_platform_spec(data)
    # the line names the field (pydantic puts the cloud's provider in the path: cloud.aws.cluster...)
    named = [p for p in refused.value.problems if p.startswith(field[0]) and p.split(":")[0].endswith(field[-1])]
    assert named and "Fix:" in named[0], refused.value.problems


def test_a_bad_platform_spec_is_refused_naming_its_file_and_field(tmp_path, capsys):
    """`pdctl preview --offline --spec` on a platform spec with a shell string for a namespace:
    exit 2, the file, the field and the fix, no traceback, nothing written."""
    from infra.cli import main

    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["monitoring_namespace"] = 'Monitoring"; $(id) #'
    data["cloud"]["cluster"]["discovery_tag"] = "pdstack; id"
    path = tmp_path / "platform-bad.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["preview", "--offline", "--spec", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err, err
    assert "- monitoring_namespace:" in err and "cluster.discovery_tag:" in err and "Fix:" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["platform-bad.yaml"]


def test_static_mode_keeps_the_taints_another_manager_put_on_a_node_and_forces_the_list():
    """Node.spec.taints is an atomic list (k8s.io/api v0.34.4 core/v1/types.go, `+listType=atomic`):
    server-side apply owns it whole, so a NodePatch carrying only the role's taints was refused on
    a node another manager had tainted (a conflict on .spec.taints), and forcing it alone would
    drop that manager's taints. The patch is forced (pulumi-kubernetes provider
    pkg/metadata/annotations.go, `pulumi.com/patchForce`) and carries the live node's other
    taints: a foreign taint is kept, a pdstack role taint of an earlier role is not, and a taint
    with the key and effect of one of ours (a taint's identity) becomes ours."""
    from infra.recording import RecordingMocks

    foreign = {"key": "example.com/maintenance", "value": "disk", "effect": "NoExecute", "timeAdded": "2026-01-01T00:00:00Z"}
    live = {"gpu-decode-0": [foreign, {"key": "pdstack.io/role", "value": "prefill", "effect": "NoSchedule"},
                             {"key": "nvidia.com/gpu", "value": "other", "effect": "NoSchedule"}]}
    answer = RecordingMocks.new_resource

    def node_read(self, args):
        resource_id, state = answer(self, args)
        if args.resource_id and args.typ == "kubernetes:core/v1:Node":
            state["spec"] = {"taints": live.get(args.resource_id, [])}
        return resource_id, state

    spec = load_platform_spec("stacks/platform-dev.yaml")
    spec = spec.model_copy(update={"nodes": spec.nodes.model_copy(update={"mode": "static"})})
    hosts = [HostEntry(name=f"gpu-{r}-{i}", address="127.0.0.1", role=r) for r in ("prefill", "decode") for i in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecordingMocks, "new_resource", node_read)
        objects = platform_objects(spec, [Hosted(load_spec("stacks/dev.yaml"), "dev",
                                                 Inventory(key_file="k", known_hosts="h", hosts=hosts))])
    nodes = [o for o in objects if o["kind"] == "Node"]
    patched = {o["metadata"]["name"]: o for o in nodes}
    assert len(nodes) == len(patched) == 4  # the reads are not objects of the stack
    assert all(o["metadata"]["annotations"] == {"pulumi.com/patchForce": "true"} for o in nodes)
    assert patched["gpu-decode-0"]["spec"]["taints"] == [foreign] + role_taints("decode")
    assert patched["gpu-prefill-0"]["spec"]["taints"] == role_taints("prefill")


def test_each_capacity_block_group_is_made_in_its_blocks_zone_without_a_placement_group_of_ours():
    """A Capacity Block is a reservation of one Availability Zone, placed by AWS (botocore 1.44.18,
    ec2 2016-11-15 service-2.json, CapacityReservation: AvailabilityZone "in which the capacity is
    reserved", PlacementGroupArn "the cluster placement group in which the Capacity Reservation
    was created"). Each block's group was given every listed subnet and the role's one placement
    group of ours; now only its block's zone's subnets, and no placement group (a group not on
    blocks keeps both)."""
    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": "prefill", "environment": "prod", "node_class": "gb200"},
        {"role": "decode", "environment": "prod", "node_class": "gb200", "capacity_block": True}]}
    spec = PlatformSpec.model_validate(data)
    reservations = spec.cloud.node_classes[0].capacity_reservations
    platform = run_spec(spec)
    groups = {r.name: r.inputs for r in platform.of_type("aws:eks/nodeGroup:NodeGroup")}
    templates = {r.name: r.inputs for r in platform.of_type("aws:ec2/launchTemplate:LaunchTemplate")}
    zone_of = spec.cloud.cluster.subnet_zones
    assert len(set(reservations.zones[b] for b in reservations.by_role["decode"])) == 2  # the blocks span zones
    for i, block in enumerate(reservations.by_role["decode"]):
        subnets = groups[f"prod-decode-{i}"]["subnetIds"]
        assert subnets and {zone_of[s] for s in subnets} == {reservations.zones[block]}, (block, subnets)
        assert "placement" not in templates[f"prod-decode-{i}"]
    assert groups["prod-prefill"]["subnetIds"] == spec.cloud.cluster.private_subnet_ids
    assert "groupName" in templates["prod-prefill"]["placement"]
    assert [r.name for r in platform.of_type("aws:ec2/placementGroup:PlacementGroup")] == ["prod-prefill"]


def test_a_capacity_block_without_a_zone_or_a_subnet_in_its_zone_is_refused():
    """Each block's group is made in its zone's subnets: a block with no zone, or in a zone no
    listed subnet is in, is named with the fix (EKS would refuse the group at `pulumi up`)."""
    from pydantic import ValidationError

    data = yaml.safe_load(open("stacks/platform-prod.yaml"))
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": "decode", "environment": "prod", "node_class": "gb200", "capacity_block": True},
        {"role": "prefill", "environment": "prod", "node_class": "gb200"}]}
    reservations = data["cloud"]["node_classes"][0]["capacity_reservations"]
    del reservations["zones"]["cr-0a1b2c3d4e5f60702"]
    reservations["zones"]["cr-0a1b2c3d4e5f60703"] = "us-east-1c"
    spec = PlatformSpec.model_validate(data)
    problems = platform_problems(spec, hosted_environments(spec))
    assert len(problems) == 2, problems
    assert "Capacity Block cr-0a1b2c3d4e5f60702 has no zone in node class gb200's capacity_reservations.zones" \
        in problems[0] and "Fix:" in problems[0]
    assert "Capacity Block cr-0a1b2c3d4e5f60703 is in us-east-1c, and no subnet of cloud.cluster.private_subnet_ids" \
        in problems[1] and "Fix:" in problems[1]
    reservations["zones"]["cr-0a1b2c3d4e5f60703"] = "us-east-1"  # a region, not a zone
    with pytest.raises(ValidationError, match="is not an Availability Zone name"):
        PlatformSpec.model_validate(data)


def _go_string_returns(parser_go: str) -> dict[str, str]:
    """A Karpenter message parser's `func (p Parser) <Name>() string { return "<value>" }` values."""
    return dict(re.findall(r'func \(p Parser\) (\w+)\(\) string \{\s*return "([^"]*)"', parser_go))


def test_karpenter_interruption_queue_gets_every_event_the_pinned_controller_handles_and_no_other():
    """The queue Karpenter reads (its chart's settings.interruptionQueue) and the EventBridge rules
    that fill it, against the pinned controller's own parsers, read from the module:
    karpenter-provider-aws v1.14.1 pkg/controllers/interruption/parser.go DefaultParsers, each
    one's Source() and DetailType() (messages/*/parser.go), statechange's acceptedStates and
    scheduledchange's acceptedService and acceptedEventTypeCategory. Before, no queue, no rule and
    an empty interruptionQueue: a Spot reclaim, a rebalance, a scheduled EC2 maintenance or a
    capacity reservation taking its instances back ended a node with no drain."""
    from infra.platform_stack.catalog import KARPENTER
    from infra.platform_stack.cloud.interruption import interruption_queue_name
    from infra.platform_stack.modules import module_dir

    folder = module_dir(KARPENTER) / "pkg/controllers/interruption"
    default = re.search(r"DefaultParsers = \[\]messages\.Parser\{(.*?)\n\s*\}", (folder / "parser.go").read_text(), re.S)
    packages = re.findall(r"(\w+)\.Parser\{\}", default.group(1))
    assert len(packages) >= 5
    handled = {}
    for package in packages:
        text = (folder / "messages" / package / "parser.go").read_text()
        returns = _go_string_returns(text)
        detail = None
        if states := re.search(r"acceptedStates = sets\.NewString\(([^)]*)\)", text):
            detail = {"state": sorted(re.findall(r'"([^"]+)"', states.group(1)))}
        if service := re.search(r'acceptedService\s*=\s*"([^"]+)"', text):
            category = re.search(r'acceptedEventTypeCategory\s*=\s*"([^"]+)"', text).group(1)
            detail = {"eventTypeCategory": [category], "service": [service.group(1)]}
        handled[(returns["Source"], returns["DetailType"])] = detail

    platform = shipped_run("platform-prod")
    spec = load_platform_spec("stacks/platform-prod.yaml")
    (queue,) = platform.of_type("aws:sqs/queue:Queue")
    assert queue.inputs["name"] == interruption_queue_name(spec.cloud.cluster.name)
    assert queue.inputs["sqsManagedSseEnabled"] is True
    rules = {r.name: json.loads(r.inputs["eventPattern"]) for r in platform.of_type("aws:cloudwatch/eventRule:EventRule")}
    routed = {}
    for name, pattern in rules.items():
        (source,), (detail_type,) = pattern["source"], pattern["detail-type"]
        detail = pattern.get("detail")
        routed[(source, detail_type)] = {k: sorted(v) for k, v in detail.items()} if detail else None
    assert routed == handled
    queue_arn = f"arn:aws:sqs:{spec.cloud.region}:000000000000:{queue.inputs['name']}"
    targets = platform.of_type("aws:cloudwatch/eventTarget:EventTarget")
    rule_urns = {r.urn for r in platform.of_type("aws:cloudwatch/eventRule:EventRule")}
    assert sorted(u for t in targets for u in t.property_dependencies["rule"]) == sorted(rule_urns)
    assert {t.inputs["arn"] for t in targets} == {queue_arn}
    (queue_policy,) = platform.of_type("aws:sqs/queuePolicy:QueuePolicy")
    allow = [st for st in json.loads(queue_policy.inputs["policy"])["Statement"] if st["Effect"] == "Allow"]
    assert allow == [{"Sid": "EventBridgeSends", "Effect": "Allow", "Action": "sqs:SendMessage", "Resource": queue_arn,
                      "Principal": {"Service": ["events.amazonaws.com", "sqs.amazonaws.com"]}}]
    values = controller("karpenter").values(context("platform-prod"))
    assert values["settings"]["interruptionQueue"] == queue.inputs["name"]
    assert values_problems("karpenter", values) == []
    # made before the controller starts (it looks the queue up by name), deleted after it stops
    from tests.test_platform_order import closure, graph

    (chart,) = [r for r in platform.of_type("kubernetes:helm.sh/v4:Chart") if r.name == "karpenter"]
    assert {queue.urn, queue_policy.urn, *(r.urn for r in targets)} <= closure(graph(platform), chart.urn)


def _karpenter_network_cards() -> dict[str, list[tuple[int, int]]]:
    """Each instance type's network cards as the pinned karpenter-provider-aws has them
    (pkg/providers/instancetype/zz_generated.vpclimits.go Limits: NetworkCards, each card's
    NetworkCardIndex and MaximumNetworkInterfaces): type -> [(card, interfaces it holds)]."""
    from infra.platform_stack.catalog import KARPENTER
    from infra.platform_stack.modules import module_file

    text = module_file(KARPENTER, "pkg/providers/instancetype/zz_generated.vpclimits.go").read_text()
    found = {}
    for itype, body in re.findall(r'\n\t"([^"]+)": \{(.*?)\n\t\},', text, re.S):
        found[itype] = [(int(card), int(most)) for most, card in re.findall(
            r"MaximumNetworkInterfaces:\s*(\d+),\s*NetworkCardIndex:\s*(\d+)", body)]
    return found


def test_efa_interfaces_sit_on_the_network_cards_each_instance_type_has():
    """Each node class's EFA interfaces, on every type EFA_CARDS knows, against the pinned
    karpenter-provider-aws's own data of the type's network cards (zz_generated.vpclimits.go):
    one primary ENA interface on card 0 (AWS EC2 User Guide, efa-acc-inst-types), each EFA-only
    interface on a card the type has, at a device index that card holds. p6e-gb200.36xlarge is not
    in that data at v1.14.1 (asserted, so a newer pin is compared too): its card 0 takes no EFA
    device and its odd cards only EFA-only ones (AWS ParallelCluster queues_stack.py
    add_network_interfaces), so prod's four sit on cards 1, 3, 5 and 7. Before, prod's GB200
    class put one at card 0, device 1, where the instance has no EFA, and on card 2."""
    cards = _karpenter_network_cards()
    assert len(cards["p5.48xlarge"]) == 32 and "p6e-gb200.36xlarge" not in cards
    for itype, known in EFA_CARDS.items():
        nics = efa_network_interfaces(itype, len(known.efa_cards))
        assert nics[0] == {"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"}
        efa = [(n["networkCardIndex"], n["deviceIndex"]) for n in nics[1:]]
        assert all(n["interfaceType"] == "efa-only" for n in nics[1:]) and len(efa) == len(known.efa_cards)
        if itype in cards:
            holds = dict(cards[itype])
            assert known.network_cards == len(holds), itype
            assert all(card in holds and device < holds[card] for card, device in efa), (itype, efa)
    prod = load_platform_spec("stacks/platform-prod.yaml")
    (gb200,) = prod.cloud.node_classes
    nc = ec2_node_class(prod, gb200, "decode", "node-role", "sg-0123456789abcdef0")["spec"]
    assert [(n["networkCardIndex"], n["deviceIndex"], n["interfaceType"]) for n in nc["networkInterfaces"]] == [
        (0, 0, "interface"), (1, 0, "efa-only"), (3, 0, "efa-only"), (5, 0, "efa-only"), (7, 0, "efa-only")]
    dev = load_platform_spec("stacks/platform-dev.yaml")
    (h100,) = dev.cloud.node_classes
    nics = ec2_node_class(dev, h100, "decode", "node-role", None)["spec"]["networkInterfaces"]
    assert nics[:3] == [{"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"},
                        {"networkCardIndex": 0, "deviceIndex": 1, "interfaceType": "efa-only"},
                        {"networkCardIndex": 1, "deviceIndex": 0, "interfaceType": "efa-only"}]
    assert len(nics) == 1 + h100.efa_interfaces == 33


def test_an_efa_layout_the_instance_type_cannot_hold_is_refused():
    """More EFA devices than the type's cards take, a type whose cards the table does not know, or
    types whose layouts differ in one node class: each refused, naming the field and the fix."""
    prod = load_platform_spec("stacks/platform-prod.yaml")
    (gb200,) = prod.cloud.node_classes

    def with_family(**update):
        return prod.model_copy(update={"cloud": prod.cloud.model_copy(update={"node_classes": [
            gb200.model_copy(update=update)]})})

    assert efa_layout_problems(prod) == []
    [too_many] = efa_layout_problems(with_family(efa_interfaces=9))
    assert too_many.startswith("cloud.node_classes[gb200].efa_interfaces: 9, but p6e-gb200.36xlarge takes 8")
    [unknown] = efa_layout_problems(with_family(instance_types=["p9.48xlarge"]))
    assert "p9.48xlarge: not in the table" in unknown and "EFA_CARDS" in unknown and "Fix:" in unknown
    [mixed] = efa_layout_problems(with_family(instance_types=["p6e-gb200.36xlarge", "p5.48xlarge"]))
    assert "different network cards" in mixed and "Fix: one node class per layout" in mixed
    assert any(p == too_many for p in platform_problems(with_family(efa_interfaces=9), []))
