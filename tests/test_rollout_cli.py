"""The operator commands end to end: rollout, releases, rollback, against a simulated cluster file."""

from __future__ import annotations

import io
import json
import subprocess

from rich.console import Console

from infra.cli import main
from infra.rollout.canary import Observation
from infra.rollout.cluster import load_simulated, save_simulated
from infra.rollout.releases import ReleaseStore
from infra.rollout.rollout import RolloutOptions, rollout
from infra.spec import REPO_ROOT, stack_spec_path
from infra.spec_checks import load_spec


def test_rollback_script_after_two_rollouts(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSTACK_ACTOR", "alice@example")
    sim, releases = tmp_path / "cluster.json", tmp_path / "releases"
    store = ReleaseStore("dev", releases)
    # Two good revisions (their canaries are covered with a real Prometheus in test_rollout.py),
    # left in the simulated cluster file that the script then reads.
    cluster = load_simulated(sim)
    good = Observation(0.3, 0.02, 0.0, 0)
    spec = load_spec(stack_spec_path("dev"))
    for _ in range(2):
        rollout(spec, store, cluster, lambda rev: good, RolloutOptions(stages=(100,), bake_seconds=0, poll_seconds=0.001),
                console=Console(file=io.StringIO()))
    save_simulated(cluster, sim)

    result = subprocess.run([str(REPO_ROOT / "scripts" / "rollback"), "--stack", "dev", "--sim", str(sim),
                             "--releases", str(releases)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "revision 1 serves 100%" in result.stdout
    assert json.loads(sim.read_text())["weights"] == {"1": 100}
    assert store.audit_entries()[-1]["actor"] == "alice@example"

    assert main(["rollback", "--stack", "dev", "--sim", str(sim), "--releases", str(releases), "--to", "7"]) == 3
    assert json.loads(sim.read_text())["weights"] == {"1": 100}
    assert main(["releases", "--stack", "dev", "--releases", str(releases)]) == 0


def test_rollout_command_stops_on_a_failed_preflight_before_any_change(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    (tmp_path / "kh").write_text("")
    inv.write_text(json.dumps({"key_file": "nokey", "known_hosts": "kh", "timeout_seconds": 1,
                               "hosts": [{"name": "gpu-0", "address": "127.0.0.1", "port": 1}]}))
    code = main(["rollout", "--stack", "dev", "--sim", str(tmp_path / "c.json"), "--releases", str(tmp_path / "r"),
                 "--prometheus", "http://127.0.0.1:1", "--inventory", str(inv)])
    assert code == 1
    assert "gpu-0" in capsys.readouterr().out
    assert not (tmp_path / "r").exists() and not (tmp_path / "c.json").exists()
