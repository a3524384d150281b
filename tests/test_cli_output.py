"""What pdctl prints and writes, as users of kubectl, helm and pulumi expect: previews that can be
diffed, manifests as `kubectl get -o yaml` would show them, machine-readable output with a
documented shape, a render folder that holds exactly one render, and `plan --write` that keeps
the operator's file as it was apart from the counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from infra.cli import main
from infra.spec import REPO_ROOT
from infra.spec_checks import load_spec

PDCTL = [sys.executable, "-m", "infra.cli"]


def test_preview_is_byte_identical_across_runs_and_hash_seeds():
    """Registrations resolve in a different order from run to run (and Python's string hashing
    changes with every process): the preview must not show it."""
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([*PDCTL, "preview", "--offline", "--stack", "dev"], cwd=REPO_ROOT, env=env,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        outputs.add(done.stdout)
    assert len(outputs) == 1


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("render") / "prod"
    assert main(["render", "--stack", "prod", "--out", str(out)]) == 0
    return out


def test_rendered_numbers_are_integers_and_keys_in_kubectl_order(rendered):
    """Pulumi's wire format carries numbers as doubles (pulumi/pulumi sdk/proto/resource.proto:
    google.protobuf.Struct); the providers send integers to the API server, and so must render."""
    texts = {p: p.read_text() for p in rendered.rglob("*.yaml")}
    assert texts
    assert not [p for p, t in texts.items() if "port: 8000.0" in t or "replicas: 1.0" in t]
    lws = next(yaml.safe_load(t) for p, t in texts.items() if p.name.startswith("leaderworkerset-"))
    assert isinstance(lws["spec"]["leaderWorkerTemplate"]["size"], int)
    for path, text in texts.items():
        keys = list(yaml.safe_load(text))
        assert keys[:3] == ["apiVersion", "kind", "metadata"], (path, keys)


def test_render_owns_its_folder_stale_files_go_foreign_files_refuse(tmp_path):
    out = tmp_path / "out"
    assert main(["render", "--stack", "prod", "--out", str(out)]) == 0
    prod_files = {p.relative_to(out) for p in out.rglob("*.yaml")}
    assert main(["render", "--stack", "dev", "--out", str(out)]) == 0
    dev_files = {p.relative_to(out) for p in out.rglob("*.yaml")}
    assert dev_files and not any("pdstack-prod" in str(p) for p in dev_files)  # prod's are gone, not mixed in
    assert prod_files - dev_files and not (out / "pdstack-prod").exists()
    (out / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["render", "--stack", "prod", "--out", str(out)]) == 2
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def _doc(capsys, argv, fmt="json"):
    capsys.readouterr()
    code = main([*argv, "--output", fmt])
    out = capsys.readouterr().out
    return code, (json.loads(out) if fmt == "json" else yaml.safe_load(out))


def test_output_json_and_yaml_carry_kind_version_and_the_documented_fields(capsys, tmp_path):
    code, doc = _doc(capsys, ["validate", "--stack", "prod"])
    assert code == 0 and doc["kind"] == "pdstack/validate" and doc["version"] == 1
    assert doc["pools"]["decode"] == {"instances": 1, "gpus_per_instance": 64}
    code, doc = _doc(capsys, ["validate", "--stack", "prod"], "yaml")
    assert doc["pools"]["prefill"]["instances"] == 8
    code, doc = _doc(capsys, ["preview", "--offline", "--stack", "dev"])
    assert code == 0 and doc["total"] == sum(layer["create"] for layer in doc["layers"])
    assert doc["validation"]["ok"] and doc["layers"][0]["resources"][0].keys() == {"type", "name"}
    code, doc = _doc(capsys, ["render", "--stack", "dev", "--out", str(tmp_path / "r")])
    assert code == 0 and len(doc["files"]) == len(list((tmp_path / "r").rglob("*.yaml")))
    code, doc = _doc(capsys, ["plan", "--stack", "prod", "--workload",
                              str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")])
    assert code == 0 and doc["phases"]["decode"]["recommended"] >= 1 and ":" in doc["pd_ratio"]["recommended"]
    code, doc = _doc(capsys, ["releases", "--stack", "dev", "--releases", str(tmp_path / "none")])
    assert code == 0 and doc == {"kind": "pdstack/releases", "version": 1, "environment": "dev", "revisions": []}
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"logical_count": [[i % 5 + 1 for i in range(256)]] * 58}))
    code, doc = _doc(capsys, ["eplb", "--stack", "prod", "--loads", str(loads), "--out", str(tmp_path / "p.json")])
    assert code == 0 and doc["imbalance_after"]["mean"] <= doc["imbalance_before"]["mean"]


def test_canary_and_cost_documents_against_a_prometheus(capsys):
    from tests.servers import healthy_prometheus

    with healthy_prometheus() as url:
        code, doc = _doc(capsys, ["canary", "--stack", "dev", "--prometheus", url, "--revision", "2"])
        assert doc["kind"] == "pdstack/canary" and doc["passed"] is (code == 0)
        assert {"name", "passed", "detail"} <= doc["gates"][0].keys()
        code, doc = _doc(capsys, ["cost", "--stack", "dev", "--prometheus", url])
        assert code == 0 and doc["kind"] == "pdstack/cost" and "total_gpu_hours" in doc


def test_a_spec_path_is_accepted_where_spec_is(capsys):
    path = str(REPO_ROOT / "stacks/prod.yaml")
    assert _doc(capsys, ["validate", path])[1]["environment"] == "prod"
    assert _doc(capsys, ["validate", "--spec", path])[1]["environment"] == "prod"


def test_plan_write_keeps_comments_and_layout_and_changes_only_the_counts_and_scaler_targets(tmp_path, capsys):
    source = REPO_ROOT / "stacks/prod.yaml"
    target = tmp_path / "prod.yaml"
    assert main(["plan", "--stack", "prod", "--workload", str(REPO_ROOT / "stacks/workloads/prod-chat.yaml"),
                 "--write", str(target), "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    targets = tuple(f"{key}:" for key in doc["scaler_targets"])
    before, after = source.read_text().splitlines(), target.read_text().splitlines()
    added = [line for line in after if line.strip().startswith(targets) and line not in before
             and not any(line.strip().split(":")[0] == b.strip().split(":")[0] for b in before)]
    after = [line for line in after if line not in added]  # a target the spec had not set: appended
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    assert changed and all(any(k in b for k in ("instances:", "pd_ratio:", "min:", "max:") + targets)
                           for b, _ in changed), changed
    assert [line for line in after if line.lstrip().startswith("#")] == \
        [line for line in before if line.lstrip().startswith("#")]
    written = load_spec(target)  # read back by the spec's own (YAML 1.1) reader: the ratio stayed a ratio
    assert written.deployment.prefill.instances == doc["phases"]["prefill"]["recommended"]
    assert written.deployment.pd_ratio == doc["pd_ratio"]["recommended"]


def test_a_key_given_twice_is_refused_by_every_reader_with_file_line_and_key(tmp_path, capsys):
    """PyYAML and Python's json keep the last of two equal keys silently: `validate` took the
    second `instances:` unseen, and `plan --write` (ruamel.yaml's round trip) ended in
    "unexpected error". YAML requires unique keys (YAML 1.2, 3.2.1.1); every reader refuses them."""
    from infra.inputs import InputError
    from infra.spec_edit import write_counts

    lines = (REPO_ROOT / "stacks/prod.yaml").read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("    instances: "))
    spec = tmp_path / "prod.yaml"
    spec.write_text("".join(lines[:at] + ["    instances: 7\n"] + lines[at:]))
    said = f"{spec}: the key 'instances' appears twice in one mapping at line {at + 2} (first at line {at + 1})"
    workload = str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")
    for argv in (["validate", str(spec)], ["plan", str(spec), "--workload", workload, "--write", str(tmp_path / "p.yaml")],
                 ["diff", "--stack", "prod", "--against", str(spec)]):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert said in err and "Fix: keep one" in err and "unexpected error" not in err, err
    with pytest.raises(InputError, match=f"at line {at + 2}"):  # the ruamel path, called on its own
        write_counts(spec, tmp_path / "p.yaml", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prod.yaml"]  # nothing written
    loads = tmp_path / "loads.json"
    loads.write_text('{"logical_count":\n  [[1, 2]],\n "logical_count":\n  [[3, 4]]}')
    assert main(["eplb", "--stack", "prod", "--loads", str(loads), "--out", str(tmp_path / "p.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{loads}: the key 'logical_count' appears twice in one mapping at line 3 (first at line 1)" in err, err


def test_tables_keep_whole_timestamps_when_piped(tmp_path):
    """rich assumes 80 columns when stdout is not a terminal and would cut a table's cells."""
    from infra.rollout.releases import ReleaseStore
    from infra.spec_checks import parse_spec
    from tests.conftest import stack_data

    store = ReleaseStore("dev", tmp_path / "releases")
    release = store.create(parse_spec(stack_data("dev")), message="a message long enough to need room " * 3)
    done = subprocess.run([*PDCTL, "releases", "--stack", "dev", "--releases", str(tmp_path / "releases")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": ""})
    assert done.returncode == 0, done.stderr
    assert release.created_at in done.stdout


def test_an_output_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Every output pdctl writes (placements, manifests, planned specs, profiles) goes through one
    writer: a write that fails half way (here the disk fills on the first byte written) leaves the
    file it replaces as it was, and no temporary file behind."""
    import errno
    from pathlib import Path

    from infra.inputs import write_output

    target = tmp_path / "placement.json"
    target.write_text("the old placement")
    real_write = Path.write_text

    def disk_full(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError) as caught:
        write_output(target, "the new placement")
    assert caught.value.filename == str(target) and caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert target.read_text() == "the old placement" and sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]
    write_output(target, "the new placement")
    assert target.read_text() == "the new placement" and sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]


def _snapshot(*roots):
    return {str(p): (p.is_symlink(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for root in roots for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("entry", ["../keep/precious.txt", "{keep}/precious.txt", "pdstack-dev/../../keep/precious.txt",
                                   "./x.yaml", "a\nb.yaml", 7])
def test_render_never_touches_a_file_its_index_names_outside_the_folder(tmp_path, entry, capsys):
    """The index is read back from the folder: a name in it that leaves the folder is refused,
    exit 2, and nothing anywhere is touched (issue #24: the next render deleted ../keep/precious.txt)."""
    out, keep = tmp_path / "out", tmp_path / "keep"
    assert main(["render", "--stack", "dev", "--out", str(out)]) == 0
    keep.mkdir()
    (keep / "precious.txt").write_text("precious")
    index = out / ".pdstack-render.json"
    names = json.loads(index.read_text())["files"]
    index.write_text(json.dumps({"files": [*names, entry.format(keep=keep) if isinstance(entry, str) else entry]}))
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main(["render", "--stack", "prod", "--out", str(out)]) == 2  # prod: dev's files would all go
    assert _snapshot(tmp_path) == before
    err = capsys.readouterr().err
    assert ".pdstack-render.json" in err and "Nothing was touched" in err and "Traceback" not in err


def test_render_writes_through_no_symbolic_link_inside_its_folder(tmp_path, capsys):
    """A folder inside --out that is a link elsewhere: render refuses before writing anything
    (issue #24: 41 files landed in the folder the link pointed to)."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    assert main(["render", "--stack", "dev", "--out", str(out)]) == 0
    elsewhere.mkdir()
    (out / "pdstack-dev").rename(tmp_path / "moved")
    (out / "pdstack-dev").symlink_to(elsewhere, target_is_directory=True)
    before = _snapshot(tmp_path)
    assert main(["render", "--stack", "dev", "--out", str(out)]) == 2
    assert _snapshot(tmp_path) == before and not list(elsewhere.iterdir())
    assert "pdstack-dev is a symbolic link" in capsys.readouterr().err
    (out / "pdstack-dev").unlink()  # a link to a file render wrote before: also refused, nothing followed
    (tmp_path / "moved").rename(out / "pdstack-dev")
    victim = next((out / "pdstack-dev").glob("*.yaml"))
    (tmp_path / "target.txt").write_text("not render's")
    victim.unlink()
    victim.symlink_to(tmp_path / "target.txt")
    before = _snapshot(tmp_path)
    assert main(["render", "--stack", "prod", "--out", str(out)]) == 2
    assert _snapshot(tmp_path) == before


def test_two_renders_into_one_folder_take_turns_on_its_lock(tmp_path, monkeypatch):
    """A render holds an flock on the folder's lock file while it checks, writes and cleans, so
    a second render waits instead of seeing half a render (which it would refuse as foreign
    files: issue #24). Here the test holds the lock: the render reaches it, writes nothing until
    it is released, then finishes."""
    import fcntl
    import threading

    from infra.render.manifests import manifests, write_manifests
    from tests.conftest import shipped_run

    prod = manifests(shipped_run("prod"))  # rendered here: Pulumi's mocks run on the main thread
    out = tmp_path / "out"
    assert main(["render", "--stack", "dev", "--out", str(out)]) == 0
    index_before = (out / ".pdstack-render.json").read_text()
    reached = threading.Event()
    real_flock = fcntl.flock

    def flock(fd, op):
        reached.set()
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    holder = os.open(out / ".pdstack-render.lock", os.O_RDWR)
    real_flock(holder, fcntl.LOCK_EX)
    result = {}
    render = threading.Thread(target=lambda: result.setdefault("written", write_manifests(prod, out)))
    render.start()
    try:
        assert reached.wait(300), "render never took the folder's lock"
        assert (out / ".pdstack-render.json").read_text() == index_before
        assert not (out / "pdstack-prod").exists()
    finally:
        os.close(holder)  # releases the lock
    render.join(300)
    assert len(result["written"]) == len(prod)
    assert not (out / "pdstack-dev").exists() and (out / "pdstack-prod").is_dir()


def test_concurrent_renders_leave_a_folder_the_next_render_accepts(tmp_path):
    out = str(tmp_path / "out")
    procs = [subprocess.Popen([*PDCTL, "render", "--stack", stack, "--out", out], cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for stack in ("dev", "prod", "dev")]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()
    assert main(["render", "--stack", "prod", "--out", out]) == 0
    assert not (tmp_path / "out" / "pdstack-dev").exists()
