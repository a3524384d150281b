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

from infra.inputs import InputError, write_output
from infra.offline import SECRET_PLACEHOLDER, OfflineRun, is_secret, manifest_of
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

    from referencing import Resource

    version = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) <= k8s_version][-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    try:
        schema = kv_utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        return None
    registry = Resource.from_contents(schema) @ _definitions(schema_dir, version)
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@functools.lru_cache(maxsize=None)
def _definitions(schema_dir: str, version: str):
    """The release's shared definitions (every kind's $refs point there), read once: the file
    is large, and reading it for every kind was most of a preview's validation time."""
    from referencing import Registry, Resource

    return Resource.from_contents(kv_utils.schema_contents(f"{schema_dir}/_definitions.json", version)) @ Registry()


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


RENDER_INDEX = ".pdstack-render.json"  # what the last render wrote, so the next one can remove it


class RenderFolderError(InputError):
    """The output folder is not one render may write into; nothing was written."""


def manifest_path(manifest: dict) -> str:
    meta = manifest["metadata"]
    return f"{meta.get('namespace', '_cluster')}/{manifest['kind'].lower()}-{meta['name']}.yaml"


def write_manifests(items: list[dict], out_dir: Path) -> list[Path]:
    """One YAML file per manifest, secrets redacted; files an earlier render wrote and this one
    does not are removed, so the folder holds exactly this render. Returns the written paths.

    The folder is render's own: it keeps an index of what it wrote, and refuses a folder that
    holds anything else (it never deletes or mixes in a file it did not write)."""
    import json

    index = out_dir / RENDER_INDEX
    if out_dir.exists() and not out_dir.is_dir():
        raise RenderFolderError(f"--out {out_dir}: is a file. Fix: name a folder")
    previous: set[str] = set()
    if index.exists():
        try:
            previous = set(json.loads(index.read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError):
            raise RenderFolderError(f"--out {out_dir}: its {RENDER_INDEX} is unreadable. Fix: remove the folder "
                                    "and render again") from None
    if out_dir.is_dir():
        present = {str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()} - {RENDER_INDEX}
        foreign = sorted(present - previous)
        if foreign:
            raise RenderFolderError(f"--out {out_dir}: holds {len(foreign)} file(s) an earlier render did not write "
                                    f"(e.g. {foreign[0]}). Nothing was written. Fix: name a new or empty folder")
    files = {manifest_path(m): yaml.safe_dump(redact(m), sort_keys=False) for m in items}
    out_dir.mkdir(parents=True, exist_ok=True)
    # The index first, naming old and new files: a render killed half way leaves a folder the
    # next render still owns and cleans.
    index.write_text(json.dumps({"files": sorted(previous | set(files))}, indent=1))
    for rel, text in files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        write_output(path, text)
    for rel in sorted(previous - set(files)):
        (out_dir / rel).unlink(missing_ok=True)
        try:
            (out_dir / rel).parent.rmdir()  # only when empty
        except OSError:
            pass
    index.write_text(json.dumps({"files": sorted(files)}, indent=1))
    return [out_dir / rel for rel in files]
