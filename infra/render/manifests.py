"""Kubernetes manifests from an offline run: extract, hide Secret values, validate, write.

A rendered object is what the provider sends, apart from what the program itself holds as
secret: a Secret's data and stringData, and every value Pulumi marks secret (the keys
pulumi-random generates). Nothing else is rewritten (issue #37: a free-text redaction turned the
picker's `--metrics-endpoint-auth=false` into `<password redacted>`, a flag it cannot parse); a
credential anywhere else is refused instead of written (`plaintext_credentials`).

Validation uses `kubernetes-validate`, which carries the real OpenAPI schemas of each
Kubernetes release, in strict mode (unknown fields are errors), and for custom resources the
upstream CRD schemas vendored in infra/render/crds/ (infra/render/crd_schemas.py). A kind with
neither is listed as unchecked, by kind, rather than silently passed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

from infra.inputs import InputError, write_output
from infra.recording import SECRET_PLACEHOLDER, OfflineRun, is_secret, manifest_of
from infra.render.crd_schemas import crd_schema, schema_in


def redact(value: Any) -> Any:
    """Replace every secret-marked value with a placeholder, recursively."""
    if is_secret(value):
        return SECRET_PLACEHOLDER
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


SECRET_FIELDS = ("data", "stringData")  # a Secret's values


def as_rendered(manifest: dict) -> dict:
    """The manifest as render writes it: secret-marked values and a Secret's values replaced by
    SECRET_PLACEHOLDER (each field whole, as twin/fleet.py reads it back), all else as sent."""
    shown = redact(manifest)
    if manifest["kind"] == "Secret":
        shown |= {k: SECRET_PLACEHOLDER for k in SECRET_FIELDS if k in shown}
    return shown


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, v in value.items():
            yield from _strings(v, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")


def plaintext_credentials(items: list[dict], files: dict[str, str]) -> list[str]:
    """Where a rendered object outside a Secret holds something shaped like a credential (a key
    pasted into a spec field), naming the object, the field and the shape, never the value.
    `files`: each manifest's rendered text by `manifest_path`, searched first (one search each)."""
    from infra.redaction import secret_shapes

    found = []
    for manifest in items:
        if manifest["kind"] == "Secret" or not secret_shapes(files[manifest_path(manifest)]):
            continue
        shown = as_rendered(manifest)
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        fields = [f"{name} {path}: {', '.join(shapes)}" for path, text in _strings(shown) if (shapes := secret_shapes(text))]
        found += fields or [f"{name}: a credential across its fields"]
    return found


class PlaintextCredentialError(InputError):
    """A rendered object outside a Secret holds a credential; nothing was written."""


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
    plains = [unwrap(m) for m in items]
    plains += [t for m in plains for t in embedded_pod_templates(m)]
    in_stack: dict = {}  # (apiVersion, kind) -> the schema from a CRD the stack itself registers
    for plain in plains:
        validator = _validator(plain["kind"], plain["apiVersion"], kubernetes_version)
        name = f"{plain['kind']}/{plain['metadata']['name']}"
        custom = crd_schema(plain["apiVersion"], plain["kind"]) if validator is None else None
        if validator is None and custom is None:
            key = (plain["apiVersion"], plain["kind"])
            if key not in in_stack:
                in_stack[key] = schema_in(plains, *key)
            custom = in_stack[key]
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
RENDER_LOCK = ".pdstack-render.lock"  # held (flock) while a render reads, writes and cleans the folder
_RENDER_OWN = {RENDER_INDEX, RENDER_LOCK}


class RenderFolderError(InputError):
    """The output folder is not one render may write into; nothing was written."""


def manifest_path(manifest: dict) -> str:
    meta = manifest["metadata"]
    return f"{meta.get('namespace', '_cluster')}/{manifest['kind'].lower()}-{meta['name']}.yaml"


def _inside(out_dir: Path, rel: object, what: str) -> str:
    """`rel` if it names a file strictly inside the output folder; else the refusal.

    The index is read back from the folder, so it is input like any other: a name with `..`,
    an absolute name, or a control character would make render remove or write a file it
    never wrote (issue #24: `../keep/precious.txt` in the index was deleted)."""
    import posixpath

    fix = "Fix: remove the folder (or that entry) and render again"
    if not isinstance(rel, str) or not rel or any(ord(c) < 32 or c == "\\" for c in rel):
        raise RenderFolderError(f"--out {out_dir}: {what} names {rel!r}, not a file name. Nothing was touched. {fix}")
    parts = rel.split("/")
    if rel.startswith("/") or posixpath.normpath(rel) != rel or ".." in parts or "." in parts:
        raise RenderFolderError(f"--out {out_dir}: {what} names {rel!r}, which is outside the folder. Nothing was "
                                f"touched. {fix}")
    return rel


def _folder_contents(out_dir: Path) -> set[str]:
    """Every file under out_dir, relative; a symbolic link anywhere is refused (render writes and
    removes only through real folders, so nothing it does can land where a link points)."""
    import os

    present = set()
    for top, dirs, files in os.walk(out_dir, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(top) / name
            rel = path.relative_to(out_dir).as_posix()
            if path.is_symlink():
                raise RenderFolderError(f"--out {out_dir}: {rel} is a symbolic link; render follows none (it "
                                        "would write or delete where the link points). Nothing was touched. "
                                        "Fix: name a new or empty folder, or remove the link")
            if name in files:
                present.add(rel)
    return present


def _previous_files(out_dir: Path) -> set[str]:
    """What the last render wrote (its index), each name checked to lie inside the folder."""
    import json

    index = out_dir / RENDER_INDEX
    if not index.exists():
        return set()
    try:
        names = json.loads(index.read_text())["files"]
        if not isinstance(names, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise RenderFolderError(f"--out {out_dir}: its {RENDER_INDEX} is unreadable. Nothing was touched. Fix: "
                                "remove the folder and render again") from None
    return {_inside(out_dir, rel, RENDER_INDEX) for rel in names}


def _check_folder(out_dir: Path, files: dict[str, str]) -> set[str]:
    """Everything render checks before it touches the folder; returns the previous render's files."""
    if out_dir.is_symlink() and not out_dir.is_dir() or out_dir.exists() and not out_dir.is_dir():
        raise RenderFolderError(f"--out {out_dir}: is a file. Fix: name a folder")
    for rel in files:
        _inside(out_dir, rel, "a manifest")
    if not out_dir.exists():
        return set()
    previous = _previous_files(out_dir)
    foreign = sorted(_folder_contents(out_dir) - previous - _RENDER_OWN)
    if foreign:
        raise RenderFolderError(f"--out {out_dir}: holds {len(foreign)} file(s) an earlier render did not write "
                                f"(e.g. {foreign[0]}). Nothing was written. Fix: name a new or empty folder")
    return previous


def _locked(out_dir: Path):
    """An exclusive flock on the folder's lock file: two renders into one folder take turns, so
    neither sees the other's files half written (and refuses them as foreign)."""
    import contextlib
    import fcntl
    import os

    @contextlib.contextmanager
    def hold():
        fd = os.open(out_dir / RENDER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock
    return hold()


def _write_inside(root: Path, rel: str, text: str) -> Path:
    """Write root/rel, making its folders, refusing any step that is not a real folder inside root."""
    path = root / rel
    folder = root
    for part in rel.split("/")[:-1]:
        folder = folder / part
        if folder.is_symlink() or folder.exists() and not folder.is_dir():
            raise RenderFolderError(f"--out {root}: {folder.relative_to(root)} is not a folder render made. "
                                    "Fix: name a new or empty folder")
        folder.mkdir(exist_ok=True)
    if path.is_symlink():
        raise RenderFolderError(f"--out {root}: {rel} is a symbolic link. Fix: name a new or empty folder")
    write_output(path, text)
    return path


def write_manifests(items: list[dict], out_dir: Path) -> list[Path]:
    """One YAML file per manifest, as sent less Secret values (`as_rendered`); files an earlier
    render wrote and this one does not are removed, so the folder holds exactly this render.
    Returns the written paths. A credential outside a Secret is refused: written, it would sit in
    plain text, and rewritten, the file would no longer be what is applied.

    The folder is render's own: it keeps an index of what it wrote, and refuses a folder that
    holds anything else (it never deletes or mixes in a file it did not write). Every name it
    writes or removes lies inside the folder, through no symbolic link; all of that is checked
    before the first write, and again under the folder's lock."""
    import json

    files = {manifest_path(m): yaml.safe_dump(as_rendered(m), sort_keys=False) for m in items}
    leaks = plaintext_credentials(items, files)
    if leaks:
        raise PlaintextCredentialError(
            f"{len(leaks)} field(s) of the rendered objects hold a credential in plain text, outside a Secret ("
            + "; ".join(leaks[:5]) + (", ..." if len(leaks) > 5 else "") + "). Nothing was written. Fix: take it "
            "out of the spec field it came from; credentials belong in a Secret (e.g. model.weights.credentials_secret)")
    _check_folder(out_dir, files)  # refuse before anything is created
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir):
        previous = _check_folder(out_dir, files)  # again: another render may have run meanwhile
        # The index first, naming old and new files: a render killed half way leaves a folder the
        # next render still owns and cleans.
        write_output(out_dir / RENDER_INDEX, json.dumps({"files": sorted(previous | set(files))}, indent=1))
        written = [_write_inside(out_dir, rel, text) for rel, text in files.items()]
        for rel in sorted(previous - set(files)):
            path = out_dir / rel
            if not path.is_symlink():
                path.unlink(missing_ok=True)
            for folder in path.relative_to(out_dir).parents:  # only when empty, never out_dir itself
                if str(folder) != ".":
                    try:
                        (out_dir / folder).rmdir()
                    except OSError:
                        break
        write_output(out_dir / RENDER_INDEX, json.dumps({"files": sorted(files)}, indent=1))
    return written
