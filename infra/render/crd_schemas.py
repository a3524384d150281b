"""Custom resources checked against their projects' CRD schemas, as the API server would.

The schemas are in `infra/render/crds/`, derived by scripts/derive_crds.py from the CRD files in
each project's Go module at the version twin/*/go.mod pins (each file records module, version,
path and go.sum hash; Apache-2.0), the same files the cluster twin's API server is given. The API server validates a custom resource
against the served version's structural openAPIV3Schema and prunes unknown fields (or, with
`kubectl apply --validate=strict`, the default since kubectl 1.25, refuses them); pdstack
treats an unknown field as an error, so a field the controller would never see is caught here.

OpenAPI v3 (as Kubernetes uses it) to JSON Schema: objects with `properties` and no
`additionalProperties` / `x-kubernetes-preserve-unknown-fields` are closed; `nullable` admits
null; `x-kubernetes-int-or-string` admits an integer or a string; an
`x-kubernetes-embedded-resource` object admits apiVersion, kind and metadata. What this does
not evaluate: the CEL rules (`x-kubernetes-validations`), which are counted and reported as
unchecked rules, and `metadata` (checked by the built-in ObjectMeta schema's rules at apply).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema

CRD_DIR = Path(__file__).resolve().parent / "crds"


@dataclass(frozen=True)
class CRDSchema:
    group: str
    kind: str
    version: str
    origin: dict
    validator: jsonschema.Validator
    cel_rules: int  # x-kubernetes-validations in the schema (not evaluated here)

    @property
    def source(self) -> str:
        """Where the schema comes from: module (or, for the one no module carries, repository)
        and version; the path is in crds/index.json."""
        if "module" in self.origin:
            return f"{self.origin['module']} {self.origin['version']}"
        if "crd" in self.origin:
            return f"CRD {self.origin['crd']} of this stack"
        return f"{self.origin['repository'].removeprefix('github:')} {self.origin['tag']}"


def strict_json_schema(node: object) -> object:
    """One OpenAPI v3 schema node as a strict JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [strict_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    named = ("properties", "patternProperties")  # maps of names to schemas, not schemas: below
    out = {k: strict_json_schema(v) for k, v in node.items()
           if k not in ("x-kubernetes-validations", "default", "example", "nullable", *named)}
    for key in named:
        if key in node:  # property names are not schema keywords: keep every one (each converted once)
            out[key] = {name: strict_json_schema(v) for name, v in node[key].items()}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        if "anyOf" not in out:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for name in ("apiVersion", "kind"):
            props.setdefault(name, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    open_object = node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node
    if node.get("type") == "object" and "properties" in node and not open_object:
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if isinstance(node.get("exclusiveMaximum"), bool):  # OpenAPI 3.0's boolean form
        out.pop("exclusiveMaximum")
        if node["exclusiveMaximum"] and "maximum" in out:
            out["exclusiveMaximum"] = out.pop("maximum")
    if isinstance(node.get("exclusiveMinimum"), bool):
        out.pop("exclusiveMinimum")
        if node["exclusiveMinimum"] and "minimum" in out:
            out["exclusiveMinimum"] = out.pop("minimum")
    return out


def _count_cel(node: object) -> int:
    if isinstance(node, list):
        return sum(_count_cel(v) for v in node)
    if not isinstance(node, dict):
        return 0
    return len(node.get("x-kubernetes-validations", [])) + sum(_count_cel(v) for v in node.values())


@functools.lru_cache(maxsize=None)
def crd_schema(api_version: str, kind: str) -> CRDSchema | None:
    """The derived schema for one custom kind and version, or None if there is none."""
    group, _, version = api_version.rpartition("/")
    path = CRD_DIR / f"{group}_{kind.lower()}_{version}.json"
    if not group or not path.is_file():
        return None
    record = json.loads(path.read_text())
    return _checked_against(record["schema"], group, kind, version, record["origin"])


def _checked_against(openapi: dict, group: str, kind: str, version: str, origin: dict) -> CRDSchema:
    schema = strict_json_schema(openapi)
    # The root's metadata is ObjectMeta, which the CRD leaves open; apiVersion and kind are fixed.
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    return CRDSchema(group, kind, version, origin, jsonschema.validators.Draft202012Validator(schema),
                     _count_cel(openapi))


def schema_in(manifests: list[dict], api_version: str, kind: str) -> CRDSchema | None:
    """The schema of `kind` at `api_version` from a CRD among `manifests` themselves, or None: a
    custom resource whose CRD the same stack registers (the platform stack's GatewayClass,
    Prometheus) is checked against exactly the CRD it installs, a served version only. Only that
    CRD is converted (the stack holds megabytes of others)."""
    group, _, version = api_version.rpartition("/")
    for crd in manifests:
        if (crd.get("kind") != "CustomResourceDefinition" or crd["spec"].get("group") != group
                or crd["spec"]["names"]["kind"] != kind):
            continue
        for served in crd["spec"].get("versions") or []:
            schema = (served.get("schema") or {}).get("openAPIV3Schema")
            if served["name"] == version and served.get("served") and schema:
                return _checked_against(schema, group, kind, version, {"crd": crd["metadata"]["name"]})
    return None


def vendored_crds() -> list[dict]:
    """What is there: group, kind, version and origin of each schema."""
    return json.loads((CRD_DIR / "index.json").read_text())
