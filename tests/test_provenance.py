"""Every upstream-derived file is listed with its origin in one place (upstream/PROVENANCE.json,
written by scripts/provenance.py), and `make test` regenerates each from its pinned package or
Go module and compares it with the committed file.

The CRDs (tests/test_crd_schemas.py), the endpoint picker's contract (tests/test_endpoint_picker.py)
and the RBAC needs (tests/test_rbac.py) are compared where they are used; the engines' flag tables
and metric catalogues, the charts' values and the list itself are compared here. The engines'
wheels and the virtualenv the flag tables need are downloaded once into the machine's upstream
cache, outside the checkout (scripts/pinned_wheels.py CACHE), so only a machine's first run pays.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LISTING = ROOT / "upstream" / "PROVENANCE.json"
# Where the generators write: every tracked file here is upstream-derived.
DERIVED_FOLDERS = ("infra/render/pinned", "infra/render/crds", "infra/platform_stack/pinned",
                   "infra/render/engine_check/models")
BUILD_ONCE_SECONDS = 1800  # the first run downloads ~6 GB; later runs take about a minute


def run_script(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def provenance_module():
    """scripts/provenance.py as a module (scripts/ is not a package; its scripts import their neighbours)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("provenance_under_test", ROOT / "scripts" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def listed() -> list[dict]:
    return json.loads(LISTING.read_text())["files"]


def tracked(folder: str = "") -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", folder or "."], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_the_metric_catalogues_are_what_the_pinned_wheels_declare():
    """scripts/extract_engine_metrics.py reads every prometheus_client metric the sglang 0.5.23
    and vllm 0.33.0 wheels from PyPI declare (their Python source, by AST) and writes exactly the
    committed infra/render/pinned/*-metrics.json, wheel name and sha256 included."""
    done = run_script("scripts/extract_engine_metrics.py", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": matches the ") == 2, done.stdout


def test_the_flag_tables_are_what_the_pinned_engines_parse():
    """scripts/extract_engine_flags.py builds the engines' own argparse parsers (sglang 0.5.23
    sglang/srt/server_args.py ServerArgs.add_cli_args, vllm 0.33.0
    vllm/entrypoints/common/cli_args.py make_arg_parser, sglang-router 0.3.2
    sglang_router/router_args.py RouterArgs.add_cli_args) in the virtualenv
    upstream/engine-venv-requirements.txt describes, with the wheels from PyPI, and writes exactly
    the committed tables, every wheel's sha256 and file hashes included."""
    done = run_script("scripts/extract_engine_flags.py", "--check", timeout=BUILD_ONCE_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.count(": matches what the pinned engine parses") == 3, done.stdout


def test_the_chart_values_are_what_the_pinned_modules_hold():
    """scripts/platform_sources.py reads each chart's Chart.yaml, values.yaml (values.tmpl.yaml)
    and values.schema.json from the Go module twin/*/go.mod pins (`go mod download`, verified
    against go.sum) and writes exactly the committed infra/platform_stack/pinned/*.json."""
    done = run_script("scripts/platform_sources.py", "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_list_is_what_the_files_and_packages_say():
    """upstream/PROVENANCE.json is what scripts/provenance.py makes of the derived files' own origin
    records and of the pinned transformers (5.19.0, the version sglang 0.5.23's METADATA requires):
    a derived file added, re-pinned or edited by hand shows here."""
    done = run_script("scripts/provenance.py", "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_upstream_derived_file_is_listed_with_package_version_and_paths():
    """Every tracked file in the folders generators write, and every tracked JSON file anywhere that
    records an `origin`, is in the list; each entry names a package (PyPI), Go module or repository,
    its version or tag, the paths read in it, and either the test that regenerates it or why not."""
    entries = {e["file"]: e for e in listed()}
    derived = {f for folder in DERIVED_FOLDERS for f in tracked(folder)}
    for path in tracked():
        if path.endswith(".json") and not path.startswith("tests/"):
            data = json.loads((ROOT / path).read_text())
            if isinstance(data, dict) and "origin" in data:
                derived.add(path)
    assert derived - set(entries) == set(), "derived files missing from upstream/PROVENANCE.json"
    assert set(entries) - set(tracked()) == set(), "listed files that are not in the repository"
    for entry in entries.values():
        assert entry["checked_by"] or entry["not_regenerable"], entry["file"]
        assert entry["sources"], entry["file"]
        for source in entry["sources"]:
            assert source.get("pypi") or source.get("go_module") or source.get("repository"), entry["file"]
            assert source.get("version") or source.get("tag"), entry["file"]
            assert source["paths"] and all(not p.startswith("/") for p in source["paths"]), entry["file"]
            assert source.get("sha256") or source.get("go_sum") or source.get("commit") or source.get("pinned_in"), \
                entry["file"]



def test_every_hand_kept_table_is_listed_with_its_values_origin_and_reason():
    """A fact no pinned package carries is kept by hand in code and listed as such: the EFA device
    plugin's instance types by chart version (aws/eks-charts is in no package pinned here), the
    instance-store sizes (from the EC2 User Guide) and the DRA driver chart's placement defaults, each with its values, so an edit shows in the
    list, and with where it was read and why no package gives it."""
    hand_kept = {(e["file"], e["name"]): e for e in json.loads(LISTING.read_text())["hand_kept"]}
    assert {("infra/platform_stack/efa.py", "EFA_PLUGIN_LISTED_FROM"),
            ("infra/platform_stack/weight_cache.py", "INSTANCE_STORE_GB"),
            ("twin/platform_prod.py", "DRA_CONTROLLER_DEFAULTS"),
            ("twin/platform_prod.py", "DRA_KUBELET_PLUGIN_DEFAULTS")} <= set(hand_kept)
    for (file, name), entry in hand_kept.items():
        tree = ast.parse((ROOT / file).read_text())
        assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert name in assigned, f"{file} has no {name}"
        assert entry["values"] and entry["origin"] and entry["not_regenerable"], name
    assert hand_kept[("infra/platform_stack/efa.py", "EFA_PLUGIN_LISTED_FROM")]["values"]["p6e-gb200.36xlarge"] \
        == "v0.5.14"

def test_every_listed_check_is_a_test_that_runs_its_generator():
    """A `checked_by` that names no test, or a test that does not run the generator, would make
    the list a promise nobody keeps: each names a test function that runs the listed script."""
    for entry in listed():
        if not entry["checked_by"]:
            continue
        file, name = entry["checked_by"].split("::")
        tree = ast.parse((ROOT / file).read_text())
        func = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        assert func is not None, f"{entry['file']}: {entry['checked_by']} does not exist"
        script = entry["generator"].split()[1]
        assert Path(script).name in ast.get_source_segment((ROOT / file).read_text(), func), \
            f"{entry['checked_by']} does not run {script}"


def test_a_model_config_value_the_package_does_not_give_is_listed_as_not_regenerable():
    """transformers 5.19.0's DeepseekV3Config (transformers/models/deepseek_v3/configuration_deepseek_v3.py)
    defaults hidden_size to 7168; a config.json saying otherwise no longer has that value from the
    package, and the list says so by key (so a hand edit of a model config changes the list)."""
    provenance = provenance_module()
    version, _ = provenance.transformers_pin()
    import zipfile

    with zipfile.ZipFile(provenance.pinned_wheel("transformers", version)) as z:
        files = {n: z.read(n) for n in z.namelist() if n.startswith("transformers/") and n.endswith(".py")
                 and ("/deepseek_v3/" in n or n.endswith("modeling_rope_utils.py"))}
    config = json.loads((ROOT / "infra/render/engine_check/models/deepseek-v3.json").read_text())
    given, rest, _ = provenance.model_attribution(config, files)
    assert given["hidden_size"].endswith("DeepseekV3Config.hidden_size") and "hidden_size" not in rest
    assert "max_position_embeddings" in rest  # 163840 in the model's config.json, 4096 in the class
    given, rest, _ = provenance.model_attribution({**config, "hidden_size": 4096}, files)
    assert "hidden_size" in rest and "hidden_size" not in given


@pytest.mark.parametrize("file", tracked("infra/render/engine_check/models"))
def test_each_model_config_key_is_attributed_once(file):
    """Each key of a model config is either given by the pinned transformers (with the file and
    attribute) or listed as not regenerable here (the Hugging Face Hub only), never both."""
    entry = next(e for e in listed() if e["file"] == file)
    config = json.loads((ROOT / file).read_text())
    (source,) = entry["sources"]
    assert source["pypi"] == "transformers" and source["pinned_by"].startswith("sglang ")
    given, rest = set(source["values"]), set(entry["not_regenerable"]["keys"])
    assert given | rest == set(config) and not given & rest
    assert "Hugging Face Hub" in entry["not_regenerable"]["from"]


def test_the_engine_virtualenv_pins_the_transformers_the_list_reads():
    """The flag tables' virtualenv and the model configs' attribution read one transformers: the
    version sglang 0.5.23's METADATA requires (Requires-Dist: transformers==5.19.0)."""
    requirements = (ROOT / "upstream" / "engine-venv-requirements.txt").read_text().splitlines()
    pinned = {line.split("==")[0]: line.split("==")[1] for line in requirements if "==" in line and not line.startswith("#")}
    assert all(fnmatch.fnmatchcase(line, "*==*") for line in requirements if line and not line.startswith("#"))
    version, _ = provenance_module().transformers_pin()
    assert pinned["transformers"] == version
