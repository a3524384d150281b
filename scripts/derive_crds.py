"""Derive the CRD schemas `pdctl render` checks custom resources against, from the Go modules
the cluster twin pins (twin/*/go.mod and go.sum).

Why: the API server checks a custom resource against its CRD's openAPIV3Schema and drops or
refuses unknown fields; pdstack does the same offline, with the CRDs each project publishes in
its module at the pinned version. This keeps only what the check needs, the schema of each
served version (with its x-kubernetes-validations, without the prose descriptions), as JSON
next to the code, and records each file's origin (module, version, path in the module, go.sum
hash) beside it. All of them are Apache-2.0.

    python scripts/derive_crds.py            # rewrite infra/render/crds/
    python scripts/derive_crds.py --check    # exit 1 if infra/render/crds/ differs from the modules

Which files: twin/crds.py CRD_FILES (the `rendered` ones). NVIDIA's ComputeDomain is the one
schema no Go module carries (twin/crds.py says why): it is derived from the recorded copy in
infra/render/crds/sources/, whose README gives repository, tag, commit and path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twin.crds import CRD_FILES, UNSERVED_CRD_FILES, crd_documents  # noqa: E402

OUT = ROOT / "infra" / "render" / "crds"


def without_descriptions(node):
    """The schema minus its prose (most of its size); every validating keyword stays."""
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def unserved_origins(readme: Path) -> dict[str, dict[str, str]]:
    """file name -> origin, from the sources README's table (file, repository, tag, commit, path)."""
    rows = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].endswith(".yaml"):
            rows[cells[0]] = dict(zip(("file", "repository", "tag", "commit", "path"), cells[:5]))
            rows[cells[0]].pop("file")
    return rows


def sources() -> list[tuple[list[dict], dict]]:
    found = [crd_documents(entry) for entry in CRD_FILES if entry.rendered]
    for path in UNSERVED_CRD_FILES:
        origin = unserved_origins(path.parent / "README.md")[path.name]
        origin["why_not_a_module"] = "the Go module proxy serves no version of github.com/NVIDIA/k8s-dra-driver-gpu"
        found.append(([d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") ==
                       "CustomResourceDefinition"], origin))
    return found


def derive() -> dict[str, str]:
    """file name -> content of every file infra/render/crds/ should hold."""
    files, index = {}, []
    for docs, origin in sources():
        for doc in docs:
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", True) or "schema" not in version:
                    continue
                name = f"{spec['group']}_{spec['names']['kind'].lower()}_{version['name']}.json"
                record = {"group": spec["group"], "kind": spec["names"]["kind"], "version": version["name"],
                          "scope": spec["scope"], "origin": origin,
                          "schema": without_descriptions(version["schema"]["openAPIV3Schema"])}
                files[name] = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
                index.append({"file": name, **{k: record[k] for k in ("group", "kind", "version")}, "origin": origin})
    index.sort(key=lambda r: r["file"])
    files["index.json"] = json.dumps(index, indent=1) + "\n"
    files["README.md"] = notice(index)
    return files


NOTICE = """# CRD schemas, derived from the pinned Go modules

The `openAPIV3Schema` of each served version of the CustomResourceDefinitions pdstack renders, as JSON without
the prose descriptions, for `infra/render/crd_schemas.py`. Made by `scripts/derive_crds.py` from the CRD files in
each project's Go module at the version twin/*/go.mod pins and go.sum verifies (the cluster twin applies the same
files). Each JSON file's `origin` names module, version, path and go.sum hash. Do not edit: run the script.

All of them are published under the Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0) by
their projects' authors (The Kubernetes Authors; Amazon.com, Inc.; The KEDA Authors; The prometheus-operator
Authors; Envoy Proxy Authors; NVIDIA CORPORATION). These files are derived from them (descriptions removed).

| module or repository | version | path | kinds |
|---|---|---|---|
"""


def notice(index: list[dict]) -> str:
    rows: dict[tuple, list[str]] = {}
    for row in index:
        o = row["origin"]
        key = (o.get("module") or o["repository"], o.get("version") or o["tag"], o["path"])
        rows.setdefault(key, []).append(f"{row['kind']} {row['group']}/{row['version']}")
    lines = [f"| {m} | {v} | {p} | {', '.join(k)} |" for (m, v, p), k in sorted(rows.items())]
    unserved = [r for r in index if "why_not_a_module" in r["origin"]]
    tail = "".join(f"\n{r['kind']}: {r['origin']['why_not_a_module']}, so it comes from the copy in sources/ "
                   f"({r['origin']['repository']} {r['origin']['tag']}, commit {r['origin']['commit']}, "
                   f"{r['origin']['path']}).\n" for r in unserved[:1])
    return NOTICE + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = p.parse_args(argv)
    try:
        files = derive()
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"derive_crds: {exc}. Fix: run it where `go` and the Go module proxy are reachable", file=sys.stderr)
        return 1
    current = {f.name: f.read_text() for f in OUT.iterdir() if f.is_file()}
    if args.check:
        differ = sorted(set(files) ^ set(current) | {n for n in files if current.get(n) != files[n]})
        for name in differ:
            print(f"infra/render/crds/{name}: differs from the pinned modules. Fix: python scripts/derive_crds.py")
        return 1 if differ else 0
    for name in current:
        if name not in files:
            (OUT / name).unlink()
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"derived {len(files) - 2} schemas into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
