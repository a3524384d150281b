"""pdctl as an operator runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import stack_data


def pdctl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_validate_bad_file_exits_nonzero_names_field_and_writes_nothing(tmp_path):
    data = stack_data("prod")
    data["deployment"]["decode"]["expert_parallel"] = 128
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = pdctl("validate", "--spec", str(bad), cwd=tmp_path)
    assert result.returncode == 2
    assert "deployment.decode.expert_parallel: 128 is larger than the supernode's 72 GPUs" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_render_bad_spec_writes_nothing(tmp_path):
    data = stack_data("dev")
    data["deployment"]["pd_ratio"] = "3:1"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    result = pdctl("render", "--spec", str(bad), "--out", str(out))
    assert result.returncode == 2 and "deployment.pd_ratio" in result.stderr
    assert not out.exists()


def test_preview_offline_prints_layers_with_counts():
    result = pdctl("preview", "--offline", "--stack", "dev")
    assert result.returncode == 0, result.stderr
    assert "offline preview under Pulumi mocks" in result.stdout
    assert "foundation (" in result.stdout
    assert "total" in result.stdout


def test_render_writes_one_file_per_manifest(tmp_path):
    result = pdctl("render", "--stack", "dev", "--out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    files = list((tmp_path / "m").rglob("*.yaml"))
    assert len(files) >= 2
    assert all(yaml.safe_load(f.read_text())["kind"] for f in files)


def test_generated_keys_never_appear_in_plain_text_in_render_or_preview(tmp_path):
    """Keys come from pulumi-random as secret outputs; what operators see or commit never holds them."""
    from infra.offline import is_secret
    from infra.render.manifests import unwrap
    from tests.conftest import shipped_run

    (secret,) = shipped_run("prod").by_kind("Secret")
    assert is_secret(secret["stringData"])
    keys = list(unwrap(secret["stringData"]).values())
    assert keys and all(len(k) >= 20 for k in keys)
    preview = pdctl("preview", "--offline", "--stack", "prod")
    render = pdctl("render", "--stack", "prod", "--out", str(tmp_path / "m"))
    assert preview.returncode == 0 and render.returncode == 0, preview.stderr + render.stderr
    written = "".join(f.read_text() for f in (tmp_path / "m").rglob("*") if f.is_file())
    assert "<secret>" in written  # the Secret is rendered, its values redacted
    for key in keys:
        for text in (preview.stdout, preview.stderr, render.stdout, render.stderr, written):
            assert key not in text


def test_version_names_the_installed_package(capsys):
    from importlib.metadata import version

    from infra.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"pdctl (pdstack) {version('pdstack')}"
