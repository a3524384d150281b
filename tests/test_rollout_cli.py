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


def test_every_command_that_changes_traffic_first_makes_the_store_follow_the_cluster(tmp_path, capsys):
    """The cluster is the truth for traffic (infra/rollout/cluster.py RecordedCluster.reconcile):
    a holder paused and then continued, or a hand edit of the route, can leave the cluster
    serving other weights than the store records. Whichever command takes the lease next says
    so, audits it, and has the store follow the cluster before its own first change, so it acts
    from what really serves."""
    sim, releases = tmp_path / "cluster.json", tmp_path / "releases"
    store = ReleaseStore("dev", releases)
    cluster = load_simulated(sim)
    good = Observation(0.3, 0.02, 0.0, 0)
    spec = load_spec(stack_spec_path("dev"))
    for _ in range(2):
        rollout(spec, store, cluster, lambda rev: good, RolloutOptions(stages=(100,), bake_seconds=0, poll_seconds=0.001),
                console=Console(file=io.StringIO()))
    assert store.traffic() == {2: 100} and cluster.deployed(1)
    cluster.weights = {1: 25, 2: 75}  # what the store never recorded
    save_simulated(cluster, sim)

    assert main(["rollback", "--stack", "dev", "--sim", str(sim), "--releases", str(releases)]) == 0
    out = capsys.readouterr()
    assert "the store now follows the cluster" in out.out + out.err
    entries = store.audit_entries()
    (reconciled,) = [i for i, e in enumerate(entries) if e["action"] == "reconcile"]
    assert entries[reconciled]["cluster"] == {"1": 25, "2": 75}  # JSON keys
    assert entries[reconciled]["store"]["traffic"] == {"2": 100}
    # The rollback acted after the reconcile, from what really served, and left them agreeing.
    after = entries[reconciled + 1:]
    assert after and {e["action"] for e in after} == {"rollback"}
    assert after[-1]["previous"] == {"1": 25, "2": 75}
    assert json.loads(sim.read_text())["weights"] == {"1": 100}
    assert store.traffic() == {1: 100}


def test_a_release_message_is_stored_and_shown_as_one_plain_line_without_credentials(tmp_path, capsys):
    """`rollout --message` is free text other operators read in `pdctl releases`. A credential in it
    was stored in clear in revisions/NNNN.json (only the audit entry was redacted), and terminal
    control sequences in it reached the next operator's terminal: an OSC 0 window title, an ED
    (erase display), an OSC 8 hyperlink (ECMA-48 5th edition sections 5.4 and 5.6; OSC 8 as
    xterm and VTE implement it), and rich's own [link] markup, which print_table would turn into
    one. Each is removed before the record is written, and again when an older record is shown."""
    from tests.servers import healthy_prometheus

    token = "ghp_" + "A1b2C3d4" * 4 + "E5f6"  # a GitHub classic token's shape (redaction.py)
    message = (f"fix with {token}\x1b]0;owned\x07\x1b[2J \x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"
               " [link=https://evil.example/]here[/link]\tdone\nsecond line\x00\x9b31m")
    sim, releases = tmp_path / "cluster.json", tmp_path / "releases"
    with healthy_prometheus() as prometheus:
        assert main(["rollout", "--stack", "dev", "--sim", str(sim), "--releases", str(releases), "--prometheus",
                     prometheus, "--stages", "100", "--bake", "0", "--message", message]) == 0
    capsys.readouterr()
    plain = ("fix with <GitHub token redacted> click [link=https://evil.example/]here[/link] done second line")
    record = (releases / "dev" / "revisions" / "0001.json").read_text()
    assert json.loads(record)["message"] == plain
    assert token not in record and "\\u001b" not in record and "\\u009b" not in record
    (started,) = [e for e in ReleaseStore("dev", releases).audit_entries()
                  if (e["action"], e["outcome"]) == ("rollout", "started")]
    assert started["message"] == plain

    # A record an older pdctl wrote, message as given: shown plain all the same.
    older = {**json.loads(record), "revision": 2, "message": message}
    (releases / "dev" / "revisions" / "0002.json").write_text(json.dumps(older))
    for output in ("text", "json"):
        assert main(["releases", "--stack", "dev", "--releases", str(releases), "--output", output]) == 0
        shown = capsys.readouterr().out
        assert token not in shown and not any(c in shown for c in "\x1b\x9b\x07\x00"), repr(shown)
        assert shown.count("<GitHub token redacted>") == 2
        assert output == "json" or shown.count("[link=https://evil.example/]here[/link]") == 2  # as text, not markup
    assert main(["releases", "--stack", "dev", "--releases", str(releases), "--output", "json"]) == 0
    assert [r["message"] for r in json.loads(capsys.readouterr().out)["revisions"]] == [plain, plain]
