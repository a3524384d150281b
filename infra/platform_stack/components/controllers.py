"""One catalog row installed: its namespace, its CRDs as ordinary resources, then its chart
(skipCrds: the CRDs are ours, so an upgrade of the row upgrades them) or its manifests.

`helm.v4.Chart` renders the chart in the Kubernetes provider and registers every object it
renders as a child resource (pulumi-kubernetes: "equivalent to helm template, then Pulumi deploys
the resulting manifests"), so the policy pack sees them at `pulumi preview`. Under the offline
mocks a chart is one registration: its values are checked against the chart's own
(infra/platform_stack/values.py); the objects it renders are not (that needs Helm: the cluster twin's
part).
"""

from __future__ import annotations

import copy
import functools
import json

import pulumi
import pulumi_kubernetes as k8s
import yaml

from infra.inputs import write_output
from infra.platform_stack.catalog import Controller, PlatformContext, Source
from infra.platform_stack.charts import prepared_chart
from infra.platform_stack.components.base import PlatformLayer
from infra.platform_stack.modules import REPO_ROOT, escape_module_path, module_file, pin

DOCUMENTS_CACHE = REPO_ROOT / ".pdstack" / "cache" / "module-documents"

class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader (libyaml's where built), reading a bare `=` (YAML 1.1's value key,
    which some published CRDs list as an enum value) as the string it is in YAML 1.2."""


_Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))
# Kinds the bundle ships whose objects are cluster-wide (no namespace to move).
_CLUSTER_SCOPED = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Namespace"}


@functools.cache
def documents(module: str, path: str) -> tuple[dict, ...]:
    """The YAML documents of a file in a pinned module, parsed once per process, and once per
    module version on this machine: building Python objects from megabytes of CRD schema took
    5 of platform-prod's 12 s of offline preview, and JSON reads the same objects in a fraction
    of that. A module's files never change at a version (go.sum checks the zip), so the parsed
    copy under .pdstack/cache/ is keyed by module, version and path."""
    cached = DOCUMENTS_CACHE / f"{escape_module_path(module)}@{pin(module).version}" / f"{path}.json"  # Go's layout
    try:
        return tuple(json.loads(cached.read_text()))
    except (OSError, ValueError):
        pass
    text = module_file(module, path).read_text()
    docs = tuple(d for d in yaml.load_all(text, Loader=_Loader) if d)
    try:
        text = json.dumps(docs)
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_output(cached, text)  # whole or not at all
    except (OSError, TypeError):  # a read-only checkout, or a value JSON cannot hold: parse each time
        pass
    return docs


def _published(doc: dict) -> dict:
    """An object as applied: a published file may carry a `status` (the API server's to write)."""
    return {k: v for k, v in doc.items() if k != "status"}


def crd_documents(source: Source) -> list[dict]:
    return [_published(d) for d in documents(source.module, source.path) if d.get("kind") == "CustomResourceDefinition"]


def manifest_documents(source: Source, namespace: str) -> list[dict]:
    """Manifests as published, moved into the row's namespace (prometheus-operator's bundle.yaml
    puts everything in `default`), their bindings' subjects with them."""
    out = []
    for doc in documents(source.module, source.path):
        doc = copy.deepcopy(_published(doc))
        if doc["kind"] not in _CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace
        for subject in doc.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace
        out.append(doc)
    return out


def chart_location(row: Controller, chart_source: str) -> dict:
    """helm.v4.Chart's chart arguments: the published chart, or its source prepared from the
    pinned module (infra/platform_stack/charts.py; infra/platform_stack/checks.py refuses a row
    without one)."""
    if chart_source == "pinned-modules":
        return {"chart": str(prepared_chart(row))}
    c = row.chart
    if c.repo.startswith("oci://"):
        return {"chart": f"{c.repo}/{c.name}", "version": c.version}
    return {"chart": c.name, "version": c.version, "repository_opts": k8s.helm.v4.RepositoryOptsArgs(repo=c.repo)}


CRD_TYPE = "kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition"


def retain_crds(args: pulumi.ResourceTransformArgs) -> pulumi.ResourceTransformResult | None:
    """A CRD a chart renders (a row's `chart_crds`) is kept when the stack deletes it, as the CRDs
    the stack registers itself are (PlatformLayer.add says why)."""
    if args.type_ != CRD_TYPE:
        return None
    return pulumi.ResourceTransformResult(args.props, pulumi.ResourceOptions.merge(
        args.opts, pulumi.ResourceOptions(retain_on_delete=True)))


class ControllerInstall(PlatformLayer):
    layer = "controllers"

    def __init__(self, row: Controller, ctx: PlatformContext, namespaces: dict[str, pulumi.Resource],
                 opts: pulumi.ResourceOptions | None = None, cloud_values: dict | None = None):
        """`namespaces`: those made so far, by name (two rows may share one; it is made once).
        `cloud_values`: top-level chart values the cloud gives the row (CloudOutputs.controller_values)."""
        super().__init__(row.name, opts)
        self.row = row
        first: list[pulumi.Resource] = []
        if row.namespace != "kube-system":
            if row.namespace not in namespaces:
                namespaces[row.namespace] = self.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                    "name": row.namespace, "labels": {"app.kubernetes.io/part-of": "pdstack-platform"}}})
            first.append(namespaces[row.namespace])
        self.crds = [self.add(doc) for source in row.crds for doc in crd_documents(source)]
        self.values = {**row.values(ctx), **(cloud_values or {})}
        self.resources: list[pulumi.Resource] = []
        if row.manifests:
            docs = manifest_documents(row.manifests, row.namespace)
            crds = [self.add(d, first) for d in docs if d["kind"] == "CustomResourceDefinition"]
            self.crds += crds
            self.resources = [self.add(d, first + crds) for d in docs if d["kind"] != "CustomResourceDefinition"]
        if row.chart:
            # What the chart's hooks would make (catalog.Hook: the provider runs none), each object
            # after the ones before it (the Job after its RBAC), all before the chart, as a
            # pre-install hook runs; Pulumi awaits a Job's completion.
            made: list[pulumi.Resource] = []
            for hook in row.hooks:
                for doc in hook.objects(row, ctx) if hook.objects else ():
                    made.append(self.add(doc, first + made))
            self.chart = k8s.helm.v4.Chart(
                row.name, **chart_location(row, ctx.spec.controllers.chart_source),
                namespace=row.namespace,
                values=self.values,
                skip_crds=not row.chart_crds,
                opts=pulumi.ResourceOptions(parent=self, depends_on=first + self.crds + made,
                                            transforms=[retain_crds] if row.chart_crds else None))
            self.resources.append(self.chart)
        self.register_outputs({"version": row.version})

    def ready(self) -> list[pulumi.Resource]:
        """What a custom resource of this row's kinds waits for."""
        return self.crds + self.resources
