"""Vendor the upstream CRDs' schemas that `pdctl render` checks custom resources against.

Why: the API server checks a custom resource against its CRD's openAPIV3Schema and drops or
refuses unknown fields; without a cluster, pdstack does the same with the CRDs each project
publishes at a release tag. This keeps only what the check needs, the schema of each served
version (with its x-kubernetes-validations, without the prose descriptions), as JSON next to the code, and records each
file's origin (repository, tag, commit, path) beside it. All of them are Apache-2.0.

    python scripts/vendor_crds.py ../shared/crds infra/render/crds/sources

A source folder holds the CRD YAML files and a README.md whose table gives each file's
origin (`| file | repository | tag | commit | path |`); a single file needs an origin
README next to it the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "infra" / "render" / "crds"


def origins(readme: Path) -> dict[str, dict[str, str]]:
    """file name -> origin, from a markdown table with file, repository, tag, commit, path."""
    rows = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].endswith(".yaml"):
            rows[cells[0]] = dict(zip(("file", "repository", "tag", "commit", "path"), cells))
    return rows


def without_descriptions(node):
    """The schema minus its prose (most of its size); every validating keyword stays."""
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def vendor(files: list[tuple[Path, dict[str, str]]]) -> list[dict]:
    OUT.mkdir(parents=True, exist_ok=True)
    index = []
    for path, origin in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", True) or "schema" not in version:
                    continue
                name = f"{spec['group']}_{spec['names']['kind'].lower()}_{version['name']}.json"
                record = {"group": spec["group"], "kind": spec["names"]["kind"], "version": version["name"],
                          "scope": spec["scope"], "origin": origin,
                          "schema": without_descriptions(version["schema"]["openAPIV3Schema"])}
                (OUT / name).write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
                index.append({"file": name, **{k: record[k] for k in ("group", "kind", "version")},
                              "repository": origin["repository"], "tag": origin["tag"], "path": origin["path"]})
    return index


NOTICE = """# Vendored CRD schemas

The `openAPIV3Schema` of each served version of the CustomResourceDefinitions pdstack renders, as JSON without
the prose descriptions, for `infra/render/crd_schemas.py`. Made by `scripts/vendor_crds.py` from the CRD files
each project publishes at the release tag below (`../shared/crds/` holds those files for this project).

All of them are published under the Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0) by
their projects' authors (The Kubernetes Authors; Amazon.com, Inc.; The KEDA Authors; The prometheus-operator
Authors; Envoy Proxy Authors; NVIDIA CORPORATION). These files are derived from them (descriptions removed).

| repository | tag | commit | path | kinds |
|---|---|---|---|---|
"""


def write_notice(files: list[tuple[Path, dict[str, str]]], index: list[dict]) -> None:
    kinds: dict[str, list[str]] = {}
    for row in index:
        kinds.setdefault(row["repository"] + row["tag"] + row["path"], []).append(
            f"{row['kind']} {row['group']}/{row['version']}")
    lines = sorted({f"| {o['repository']} | {o['tag']} | {o['commit']} | {o['path']} | "
                    f"{', '.join(kinds[o['repository'] + o['tag'] + o['path']])} |" for _, o in files
                    if o['repository'] + o['tag'] + o['path'] in kinds})
    (OUT / "README.md").write_text(NOTICE + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", type=Path, help="CRD folders (with an origin README.md) or files")
    args = p.parse_args(argv)
    files = []
    for source in args.sources:
        folder = source if source.is_dir() else source.parent
        readme = folder / "README.md"
        if not readme.is_file():
            p.error(f"{folder}: no README.md with the origin table. Fix: add one (see this script's docstring)")
        table = origins(readme)
        for path in sorted(folder.glob("*.yaml")) if source.is_dir() else [source]:
            if path.name not in table:
                p.error(f"{path}: no origin row in {readme}. Fix: add | {path.name} | repository | tag | commit | path |")
            files.append((path, table[path.name]))
    for old in OUT.glob("*.json"):
        old.unlink()
    index = vendor(files)
    (OUT / "index.json").write_text(json.dumps(sorted(index, key=lambda r: r["file"]), indent=1) + "\n")
    write_notice(files, index)
    print(f"vendored {len(index)} schemas into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
