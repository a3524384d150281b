"""Kubernetes manifests from an offline run: extract, redact secrets, validate, write.

Validation uses `kubernetes-validate`, which carries the real OpenAPI schemas of each
Kubernetes release, in strict mode (unknown fields are errors), and for custom resources the
upstream CRD schemas vendored in infra/render/crds/ (infra/render/crd_schemas.py). A kind with
neither is listed as unchecked, by kind, rather than silently passed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

from infra.offline import SECRET_PLACEHOLDER, OfflineRun, RegisteredResource, is_secret
from infra.render.crd_schemas import crd_schema


def redact(value: Any) -> Any:
    """Replace every secret-marked value with a placeholder, recursively."""
    if is_secret(value):
        return SECRET_PLACEHOLDER
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def unwrap(value: Any) -> Any:
    """The plain value, secrets included (for checks in memory, never for writing)."""
    if is_secret(value):
        return unwrap(value["value"])
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


def manifest_of(resource: RegisteredResource) -> dict | None:
    """The manifest a kubernetes:* resource sends to the API server, secrets still wrapped."""
    if not resource.type.startswith("kubernetes:") or "apiVersion" not in resource.inputs:
        return None  # providers and other non-object resources
    return {k: v for k, v in resource.inputs.items() if not k.startswith("__")}


def manifests(run: OfflineRun) -> list[dict]:
    return [m for m in (manifest_of(r) for r in run.custom()) if m is not None]


@dataclass
class ValidationReport:
    checked: int = 0
    errors: list[str] = field(default_factory=list)
    unchecked_kinds: dict[str, int] = field(default_factory=dict)
    custom_checked: dict[str, int] = field(default_factory=dict)  # "Kind (schema source)" -> count
    cel_rules: dict[str, int] = field(default_factory=dict)  # CEL rules in each schema used (not evaluated)

    @property
    def ok(self) -> bool:
        return not self.errors


@functools.lru_cache(maxsize=None)
def _validator(kind: str, api_version: str, k8s_version: str) -> jsonschema.Validator | None:
    """A cached strict validator for one kind (kubernetes_validate reloads schemas per call)."""
    import re

    from referencing import Registry, Resource

    version = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) <= k8s_version][-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    try:
        schema = kv_utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        return None
    definitions = kv_utils.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def embedded_pod_templates(manifest: dict) -> list[dict]:
    """Pod templates inside custom resources, as v1 PodTemplates the schemas can check."""
    if manifest["kind"] != "LeaderWorkerSet":
        return []
    group = manifest["spec"]["leaderWorkerTemplate"]
    return [
        {"apiVersion": "v1", "kind": "PodTemplate",
         "metadata": {"name": f"{manifest['metadata']['name']}-{key}", "namespace": manifest["metadata"].get("namespace")},
         "template": group[key]}
        for key in ("leaderTemplate", "workerTemplate") if key in group
    ]


def validate_manifests(items: list[dict], kubernetes_version: str) -> ValidationReport:
    """Check every built-in kind (and pod templates inside CRDs) against that release's schemas."""
    report = ValidationReport()
    assert kubernetes_validate  # the schemas ship with this package
    items = [*items, *(t for m in items for t in embedded_pod_templates(unwrap(m)))]
    for manifest in items:
        plain = unwrap(manifest)
        validator = _validator(plain["kind"], plain["apiVersion"], kubernetes_version)
        name = f"{plain['kind']}/{plain['metadata']['name']}"
        custom = crd_schema(plain["apiVersion"], plain["kind"]) if validator is None else None
        if custom is not None:
            validator = custom.validator
            key = f"{plain['kind']} ({custom.source})"
            report.custom_checked[key] = report.custom_checked.get(key, 0) + 1
            report.cel_rules[key] = custom.cel_rules
        if validator is None:
            key = f"{plain['kind']} ({plain['apiVersion']})"
            report.unchecked_kinds[key] = report.unchecked_kinds.get(key, 0) + 1
            continue
        report.checked += 1
        for error in validator.iter_errors(plain):
            where = ".".join(str(p) for p in error.absolute_path) or "(root)"
            report.errors.append(f"{name}: {where}: {error.message}")
    return report


def write_manifests(items: list[dict], out_dir: Path) -> list[Path]:
    """One YAML file per manifest, secrets redacted. Returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for manifest in items:
        meta = manifest["metadata"]
        ns = meta.get("namespace", "_cluster")
        path = out_dir / ns / f"{manifest['kind'].lower()}-{meta['name']}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(redact(manifest), sort_keys=False))
        written.append(path)
    return written
