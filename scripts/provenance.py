"""Every upstream-derived file in the repository and what it was derived from, in one place:
upstream/PROVENANCE.json.

Why: a file copied or extracted from an upstream package drifts silently when the pin moves or a
hand edit slips in. Each such file is listed there with the package (PyPI) or Go module it comes
from, the version, the hash the index or go.sum gives, and the paths inside it that were read;
the generator that writes the file; and the test that runs the generator again at the pinned
version and compares (every one of them runs in `make test`). Where a file cannot be regenerated
here, the entry says so and why. Tables of facts no pinned package carries, kept by hand in code,
are listed apart (`hand_kept`), each with its values, where they were read and why no package
gives them.

The list is generated from the files' own origin records (each generator writes one into the
file it writes), so it cannot disagree with them:

    python scripts/provenance.py           # rewrite upstream/PROVENANCE.json
    python scripts/provenance.py --check   # exit 1 if upstream/PROVENANCE.json differs

The model configs the engine check feeds the engines (infra/render/engine_check/models/) are
copies of models' config.json, which only the Hugging Face Hub serves (not reachable here). The
pinned transformers (the version the pinned SGLang wheel requires) carries each model's config
class: every value that class's field defaults give is attributed to it and compared here, the
rest are listed as not regenerable here, by key.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import io
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from generated import write_or_check
from pinned_wheels import pinned_wheel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "upstream" / "PROVENANCE.json"
sys.path.insert(0, str(ROOT))

from infra.platform_stack.efa import EFA_PLUGIN_LISTED_FROM, EFA_PLUGIN_LISTED_FROM_ORIGIN  # noqa: E402
from infra.platform_stack.weight_cache import INSTANCE_STORE_GB, INSTANCE_STORE_ORIGIN  # noqa: E402
from infra.render.engine_check import MODEL_CONFIGS, MODELS  # noqa: E402
from infra.spec import PINNED_ENGINE_VERSIONS  # noqa: E402
from twin.platform_prod import DRA_CONTROLLER_DEFAULTS, DRA_DEFAULTS_ORIGIN, DRA_KUBELET_PLUGIN_DEFAULTS  # noqa: E402

HUB_ONLY = ("the model's config.json on the Hugging Face Hub, which this project does not reach; no package "
            "pinned here carries these values (the pinned transformers' config class has other defaults or none)")


@dataclass(frozen=True)
class Derived:
    """Files one generator writes: how to regenerate them and the test that compares them in `make test`."""
    files: tuple[str, ...]  # glob patterns, relative to the repository
    generator: str
    checked_by: str | None  # tests/<file>.py::<test>, which runs the generator again and compares
    origins: str  # how the files record their origin (a key of ORIGIN_READERS)
    not_regenerable: str | None = None  # why not, when checked_by is None


DERIVED = (
    Derived(("infra/render/crds/*.json", "infra/render/crds/README.md"), "python scripts/derive_crds.py",
            "tests/test_crd_schemas.py::test_the_schemas_are_what_the_pinned_modules_hold", "crd"),
    Derived(("infra/render/crds/sources/*",), "none: a copy of the upstream file, unchanged", None, "crd_source",
            "no Go module or package carries NVIDIA's ComputeDomain CRD (infra/render/crds/sources/README.md): "
            "the Go module proxy answers 403 for github.com/NVIDIA/k8s-dra-driver-gpu"),
    Derived(("infra/render/pinned/llm-d-inference-scheduler-*.json",), "python scripts/extract_epp_contract.py",
            "tests/test_endpoint_picker.py::test_the_contract_is_what_the_extractor_reads_from_the_pinned_modules",
            "epp_contract"),
    Derived(("infra/render/pinned/rbac-needs.json",), "python scripts/derive_rbac.py",
            "tests/test_rbac.py::test_the_committed_needs_are_what_the_source_says", "rbac"),
    Derived(("infra/render/pinned/*-metrics.json",), "python scripts/extract_engine_metrics.py",
            "tests/test_provenance.py::test_the_metric_catalogues_are_what_the_pinned_wheels_declare", "metrics"),
    Derived(("infra/render/pinned/sglang-[0-9]*[0-9].json", "infra/render/pinned/vllm-[0-9]*[0-9].json",
             "infra/render/pinned/sglang-router-[0-9]*[0-9].json"),
            "python scripts/extract_engine_flags.py --venv upstream/.cache/engines",
            "tests/test_provenance.py::test_the_flag_tables_are_what_the_pinned_engines_parse", "flags"),
    Derived(("infra/platform_stack/pinned/*.json",), "python scripts/platform_sources.py",
            "tests/test_provenance.py::test_the_chart_values_are_what_the_pinned_modules_hold", "chart_values"),
    Derived(("infra/render/engine_check/models/*.json",), "python scripts/provenance.py",
            "tests/test_provenance.py::test_the_list_is_what_the_files_and_packages_say", "model_config"),
)


@dataclass(frozen=True)
class HandKept:
    """A table of facts kept by hand in code, because no package pinned here carries them: listed
    with its values, so an edit shows in the list as a derived file's does."""
    file: str
    name: str  # the table's name in `file`
    values: dict
    origin: str  # where the facts were read
    not_regenerable: str  # why no package gives them


HAND_KEPT = (
    HandKept("infra/platform_stack/weight_cache.py", "INSTANCE_STORE_GB", INSTANCE_STORE_GB, INSTANCE_STORE_ORIGIN,
             "no package this project reaches carries these instance types' instance-store sizes (the pinned "
             "karpenter-provider-aws's fake DescribeInstanceTypes lists other types; botocore has no instance data)"),
    HandKept("infra/platform_stack/efa.py", "EFA_PLUGIN_LISTED_FROM", EFA_PLUGIN_LISTED_FROM,
             EFA_PLUGIN_LISTED_FROM_ORIGIN,
             "the chart lives in aws/eks-charts, which the Go module proxy does not serve (403) and no package "
             "pinned here carries, so its values cannot be read at a pinned version"),
    *(HandKept("twin/platform_prod.py", name, values, DRA_DEFAULTS_ORIGIN,
               "the DRA driver's chart is in no package pinned here (NVIDIA publishes it from its own Helm "
               "repository, not as a Go module the proxy serves), so its defaults cannot be read at a pinned version")
      for name, values in (("DRA_CONTROLLER_DEFAULTS", DRA_CONTROLLER_DEFAULTS),
                           ("DRA_KUBELET_PLUGIN_DEFAULTS", DRA_KUBELET_PLUGIN_DEFAULTS))),
)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def tracked(pattern: str) -> list[Path]:
    """Files git tracks that match the pattern (a scratch file beside them is not part of the repository)."""
    folder = pattern.rsplit("/", 1)[0]
    out = subprocess.run(["git", "ls-files", "--", folder], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.splitlines() if fnmatch.fnmatchcase(f, pattern)]


def go_module(module: str, version: str, hash_: str, paths) -> dict:
    return {"go_module": module, "version": version, "go_sum": hash_, "paths": sorted(set(paths))}


def pypi(package: str, version: str, sha256: str | None, wheel: str | None, paths) -> dict:
    return {"pypi": package, "version": version, "wheel": wheel, "sha256": sha256, "paths": sorted(set(paths))}


def crd_origin(o: dict) -> dict:
    if "module" in o:
        return go_module(o["module"], o["version"], o["go_sum"], [o["path"]])
    return {"repository": o["repository"], "tag": o["tag"], "commit": o["commit"], "paths": [o["path"]]}


def merged(sources: list[dict]) -> list[dict]:
    """One entry per package or module and version, with the paths of all of them."""
    by_key: dict[tuple, dict] = {}
    for s in sources:
        key = tuple((k, v) for k, v in s.items() if k != "paths")
        entry = by_key.setdefault(key, {**s, "paths": []})
        entry["paths"] = sorted(set(entry["paths"]) | set(s["paths"]))
    return [by_key[k] for k in sorted(by_key)]


def crd_sources(path: Path) -> list[dict]:
    if path.name in ("index.json", "README.md"):  # both are made from every schema's row
        rows = json.loads((path.parent / "index.json").read_text())
        return merged([crd_origin(r["origin"]) for r in rows])
    return [crd_origin(json.loads(path.read_text())["origin"])]


def crd_source_sources(path: Path) -> list[dict]:
    rows = json.loads((path.parents[1] / "index.json").read_text())
    return [crd_origin(r["origin"]) for r in rows if "why_not_a_module" in r["origin"]]


def epp_contract_sources(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return [go_module(o["module"], o["version"], o["go.sum"], o["files_read"])
            for o in (data["epp"], data["inference_extension"])]


CITATION = re.compile(r"(\S+)@(v\S+) (\S+\.go)")


def rbac_sources(path: Path) -> list[dict]:
    """Go modules with the files each need cites; the router's wheel with the file it read."""
    data = json.loads(path.read_text())
    cited: dict[tuple[str, str], set[str]] = {}
    texts = [n["source"] for c in data["components"].values() for n in c["needs"]] + [data["llm_d"]["main_runs_gie_runner"]]
    for text in texts:
        for module, version, file in CITATION.findall(text):
            cited.setdefault((module, version), set()).add(file)
    sources = [go_module(m["module"], m["version"], m["sum"], cited.get((m["module"], m["version"]), ()))
               for m in data["modules"] + [data["llm_d"]["origin"]]]
    router = data["components"]["sglang_router"]["origin"]
    files = {f for n in data["components"]["sglang_router"]["needs"]
             for f in re.findall(r"wheel (\S+\.py):", n["source"])}
    return sources + [pypi(router["package"], router["version"], router["sha256"], router["wheel"], files)]


def metrics_sources(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    files = {m["source"].rsplit(":", 1)[0] for m in data["metrics"].values()}
    return [pypi(data["package"], data["version"], data["sha256"], data["wheel"], files)]


def flags_sources(path: Path) -> list[dict]:
    o = json.loads(path.read_text())["origin"]
    return [pypi(o["package"], o["version"], (o.get("wheel_hashes") or {}).get("sha256"), None, o["files_read"])]


def chart_values_sources(path: Path) -> list[dict]:
    o = json.loads(path.read_text())["origin"]
    paths = sorted(p for p in (o["path"], o["schema"]) if p)
    return [{"go_module": o["module"], "version": o["version"], "pinned_in": o["pinned_in"], "paths": paths}]


# --- the model configs: which values the pinned transformers' config class gives ---

def transformers_pin() -> tuple[str, str]:
    """(version, why): the transformers the pinned SGLang wheel requires exactly (its METADATA)."""
    sglang = PINNED_ENGINE_VERSIONS["sglang"]
    with zipfile.ZipFile(pinned_wheel("sglang", sglang)) as z:
        metadata = z.read(f"sglang-{sglang}.dist-info/METADATA").decode()
    found = re.search(r"^Requires-Dist: transformers==(\S+)$", metadata, flags=re.MULTILINE)
    if not found:
        raise SystemExit(f"sglang {sglang}'s METADATA no longer requires one transformers version: choose the pin here")
    return found.group(1), f"sglang {sglang} METADATA Requires-Dist: transformers=={found.group(1)}"


def literal(node: ast.expr | None):
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def class_defaults(tree: ast.Module) -> dict[str, dict]:
    """Per class: its attributes with a literal value (`x: int = 3`, `model_type = "..."`)."""
    classes = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        values = {}
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                values[st.target.id] = st.value
            elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                values[st.targets[0].id] = st.value
        classes[cls.name] = values
    return classes


def same(a, b) -> bool:
    """JSON's value equals Python's (1e-06 == 1e-6, 10000 == 10_000.0, true == True), type-strict for bools."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def model_attribution(config: dict, files: dict[str, bytes]) -> tuple[dict[str, str], list[str], list[str]]:
    """(key -> where the pinned transformers gives that value, keys it does not give, files read)."""
    model_type = config["model_type"]
    config_path = f"transformers/models/{model_type}/configuration_{model_type}.py"
    modeling_path = f"transformers/models/{model_type}/modeling_{model_type}.py"
    rope_path = "transformers/modeling_rope_utils.py"
    classes = class_defaults(ast.parse(files[config_path]))
    name, fields = next((n, f) for n, f in classes.items() if literal(f.get("model_type")) == model_type)
    modeling = {n.name for n in ast.parse(files[modeling_path]).body if isinstance(n, ast.ClassDef)}
    # transformers 5 keeps rope_theta in rope_parameters; a config without one takes the mixin's default_theta
    rope = class_defaults(ast.parse(files[rope_path]))["RotaryEmbeddingConfigMixin"]
    given: dict[str, str] = {}
    for key, value in config.items():
        if key == "architectures" and value and all(a in modeling for a in value):
            given[key] = f"{modeling_path}: class {', '.join(value)}"
        elif key in fields and same(value, literal(fields[key])):
            given[key] = f"{config_path}: {name}.{key}"
        elif key == "rope_theta" and key not in fields and same(value, literal(rope["default_theta"])):
            given[key] = f"{rope_path}: RotaryEmbeddingConfigMixin.default_theta"
    read = sorted({w.split(":")[0] for w in given.values()})
    return given, sorted(set(config) - set(given)), read


def model_config_entries() -> list[dict]:
    version, why = transformers_pin()
    wheel = pinned_wheel("transformers", version)
    data = wheel.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        files = {n: z.read(n) for n in z.namelist() if n.endswith(".py")}
    import hashlib

    entries = []
    for model, file in sorted(MODEL_CONFIGS.items()):
        path = MODELS / file
        given, rest, read = model_attribution(json.loads(path.read_text()), files)
        source = {**pypi("transformers", version, hashlib.sha256(data).hexdigest(), wheel.name, read),
                  "pinned_by": why, "values": given}
        entries.append({"file": relative(path), "model": model, "sources": [source],
                        "not_regenerable": {"keys": rest, "from": f"{model} config.json: {HUB_ONLY}"}})
    return entries


ORIGIN_READERS = {"crd": crd_sources, "crd_source": crd_source_sources, "epp_contract": epp_contract_sources,
                  "rbac": rbac_sources, "metrics": metrics_sources, "flags": flags_sources,
                  "chart_values": chart_values_sources}


def listing() -> dict:
    files = []
    models = {e["file"]: e for e in model_config_entries()}
    for d in DERIVED:
        how = {"generator": d.generator, "checked_by": d.checked_by}
        if d.not_regenerable:
            how["not_regenerable"] = d.not_regenerable
        for pattern in d.files:
            for path in tracked(pattern):
                if d.origins == "model_config":
                    if relative(path) not in models:
                        raise SystemExit(f"{relative(path)}: not in MODEL_CONFIGS (infra/render/engine_check). "
                                         "Fix: name the model it configures there")
                    files.append({**models[relative(path)], **how})
                else:
                    files.append({"file": relative(path), "sources": ORIGIN_READERS[d.origins](path), **how})
    twice = sorted({f["file"] for f in files if sum(g["file"] == f["file"] for g in files) > 1})
    if twice:
        raise SystemExit(f"{', '.join(twice)}: matched by two DERIVED entries. Fix: narrow their patterns")
    return {"about": __doc__.splitlines()[0].rstrip(":") + " (scripts/provenance.py writes it)",
            "files": sorted(files, key=lambda f: f["file"]),
            "hand_kept": [{"file": h.file, "name": h.name, "values": h.values, "origin": h.origin,
                           "not_regenerable": h.not_regenerable} for h in HAND_KEPT]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = p.parse_args(argv)
    text = json.dumps(listing(), indent=1, sort_keys=True) + "\n"
    return write_or_check({OUT: text}, args.check, "the derived files and the pinned packages",
                          "python scripts/provenance.py, and read the diff")

if __name__ == "__main__":
    sys.exit(main())
