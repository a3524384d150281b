"""A rollout whose dependencies fail: Prometheus answering 503, hanging, answering junk, an
answer no HTTP client can read, a body sent a byte at a time, or not listening (real HTTP
servers on 127.0.0.1), bad options, no Pulumi CLI. Each must end with
traffic on a judged revision, the cluster and the release store agreeing, and an outcome in
the audit log; a refused command changes nothing."""

from __future__ import annotations

import os
import queue
import re

import pytest
from rich.console import Console

from infra.prometheus import PrometheusAPI
from infra.rollout.canary import Observation, observe
from infra.rollout.cluster import InMemoryCluster
from infra.rollout.releases import ReleaseStore
from infra.rollout.rollout import CanaryFailed, RolloutOptions, rollout
from infra.spec_checks import parse_spec
from tests.conftest import stack_data
from tests.servers import TRICKLE_BYTES, misbehaving_prometheus

GOOD = Observation(ttft_p99_s=0.2, tpot_p99_s=0.02, error_rate=0.0, kv_transfer_errors=0.0)
OPTIONS = RolloutOptions(stages=(5, 50, 100), bake_seconds=0, poll_seconds=0.01, timeout_scale=0.001)
# Answers http.client cannot read (tests/servers.py BROKEN_ANSWERS), and one that never ends
# within the client's deadline (DEADLINE here): each is a PrometheusError saying so.
UNREADABLE = [("short-body", "broken HTTP answer.*IncompleteRead"), ("not-http", "broken HTTP answer.*BadStatusLine"),
              ("long-header", "broken HTTP answer.*LineTooLong"), ("trickle", "did not answer within 1s")]
DEADLINE = 1.0  # under "hang"'s 2 s, far under a trickle's 20 s, with room for a busy machine


@pytest.mark.parametrize("mode, says", [("503", "HTTP 503: tsdb is closing"), ("hang", "did not answer"),
                                        ("junk", "not a query result"), ("refused", "did not answer"),
                                        *UNREADABLE])
@pytest.mark.parametrize("failing_from", [5, 50, 100])  # each of OPTIONS' canary stages
def test_prometheus_failing_mid_canary_fails_the_gate_and_reverts(tmp_path, mode, says, failing_from):
    spec = parse_spec(stack_data("dev"))
    store, cluster = ReleaseStore("dev", tmp_path / "releases"), InMemoryCluster()
    quiet = Console(file=open(tmp_path / "out.txt", "w"))
    rollout(spec, store, cluster, observe=lambda rev: GOOD, options=OPTIONS, console=quiet)  # r1 serves 100%
    with misbehaving_prometheus(mode) as url:
        api = PrometheusAPI(url, timeout_seconds=DEADLINE)

        def observe_r2(rev: int) -> Observation:  # Prometheus answers well until `failing_from`
            if rev == 1 or store.operation().stage < failing_from:
                return GOOD
            return observe(api, spec, rev, "5m")

        with pytest.raises(CanaryFailed, match=f"at {failing_from}%.*{says}"):
            rollout(spec, store, cluster, observe=observe_r2, options=OPTIONS, console=quiet)
    assert cluster.traffic() == store.traffic() == {1: 100}
    assert store.status(2) == "failed" and store.status(1) == "good"
    outcomes = [(e["action"], e["revision"], e["outcome"]) for e in store.audit_entries()]
    assert ("canary", 2, "failed") in outcomes and outcomes[-1] == ("rollout", 2, "failed")


@pytest.mark.parametrize("mode, says", UNREADABLE)
def test_pdctl_rollout_whose_prometheus_cannot_be_read_mid_canary_reverts_and_exits_1(tmp_path, monkeypatch, capsys,
                                                                                   mode, says):
    """Issue #36: Prometheus answers well until revision 2 has traffic, then sends an answer
    http.client cannot read (its exceptions are neither OSError nor ValueError: CPython 3.11
    Lib/http/client.py, `class HTTPException(Exception)`) or one that never ends. `pdctl
    rollout` ran into "unexpected error: IncompleteRead", exit 1, with 50/50 left serving and
    the operation open (or, for the trickle, waited with no bound). The stage's tries run, the
    gate fails, traffic goes back (README, "Prometheus failing to answer ... fails the gate and
    reverts"). The CLI's own poll and deadline are shortened here; nothing else is."""
    import functools
    import json

    from infra.cli import main
    from infra.rollout import rollout as rollout_module

    monkeypatch.setattr(rollout_module, "RolloutOptions", functools.partial(RolloutOptions, poll_seconds=0.01))
    monkeypatch.setattr("infra.prometheus.PrometheusAPI", functools.partial(PrometheusAPI, timeout_seconds=DEADLINE))
    sim, releases = tmp_path / "cluster.json", tmp_path / "releases"
    args = ["rollout", "--stack", "dev", "--sim", str(sim), "--releases", str(releases), "--bake", "0"]
    with misbehaving_prometheus(mode, breaks=lambda query: 'pdstack_io_release="2"' in query) as url:
        assert main([*args, "--prometheus", url, "--stages", "100"]) == 0  # r1 serves 100%
        capsys.readouterr()
        code = main([*args, "--prometheus", url, "--stages", "50,100"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "unexpected error" not in err and "Traceback" not in err
    assert re.search(f"revision 2 failed its canary at 50%.*no answer after 3 tries.*{says}", err, re.S), err
    assert "revision 1 serves 100% again" in err
    store = ReleaseStore("dev", releases)
    assert json.loads(sim.read_text())["weights"] == {"1": 100} and store.traffic() == {1: 100}
    assert store.operation() is None and store.lease() is None
    assert store.status(2) == "failed" and store.status(1) == "good"
    last = store.audit_entries()[-1]
    assert (last["action"], last["revision"], last["outcome"]) == ("rollout", 2, "failed")


@pytest.mark.parametrize("mode, says", UNREADABLE)
def test_an_answer_that_cannot_be_read_is_a_prometheus_error(mode, says):
    """Any failure to read an answer is the client's one error type, which every caller (the
    gates, `canary`, `cost`, `plan --watch`, `validate-deployment`) handles. The trickle's
    server is still sending when the client hangs up: the deadline ended the read, not the
    server (a per-read timeout never fires while bytes keep coming)."""
    from infra.prometheus import PrometheusError

    hung_up: queue.Queue[int] = queue.Queue()
    with misbehaving_prometheus(mode, hung_up=hung_up) as url:
        with pytest.raises(PrometheusError, match=says):
            PrometheusAPI(url, timeout_seconds=DEADLINE).query("up")
        if mode == "trickle":
            assert hung_up.get(timeout=60) < TRICKLE_BYTES  # the server records it at its next write


@pytest.mark.parametrize("mode, says", UNREADABLE)
@pytest.mark.parametrize("command", [
    ["canary", "--stack", "dev", "--revision", "1"],
    ["cost", "--stack", "dev"],
    ["plan", "--stack", "prod", "--workload", "stacks/workloads/prod-chat.yaml", "--watch", "--dry-run",
     "--iterations", "1"]], ids=["canary", "cost", "plan-watch"])
def test_every_command_that_reads_prometheus_says_an_unreadable_answer_and_exits_1(monkeypatch, capsys, command,
                                                                                  mode, says):
    """Issue #36: `canary`, `cost` and `plan --watch` ended with "unexpected error:
    IncompleteRead" too. Prometheus is a dependency: its failure is said, exit 1 (README, "Exit
    codes"). The CLI's deadline is shortened here (functools.partial), nothing else."""
    import functools

    from infra.cli import main
    from infra.spec import REPO_ROOT

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr("infra.prometheus.PrometheusAPI", functools.partial(PrometheusAPI, timeout_seconds=DEADLINE))
    with misbehaving_prometheus(mode) as url:
        code = main([*command, "--prometheus", url])
    err = capsys.readouterr().err
    assert "unexpected error" not in err and "Traceback" not in err
    assert code == 1 and re.search(f"Prometheus at {url} .*{says}", err, re.S), err


def test_a_lease_half_run_out_while_a_stage_waits_on_prometheus_is_renewed_before_the_next_try(tmp_path):
    """Each try of a stage is bounded (every query by the client's whole-answer deadline), and
    the lease is renewed between tries: a stage's reads cannot outlast it. Half run out is when
    keep_alive renews (ReleaseStore.keep_alive); LEASE_SECONDS is raised mid-stage so that the
    lease held counts as half run out without waiting for it."""
    spec = parse_spec(stack_data("dev"))
    store, cluster = ReleaseStore("dev", tmp_path / "releases"), InMemoryCluster()
    quiet = Console(file=open(tmp_path / "out.txt", "w"))
    rollout(spec, store, cluster, observe=lambda rev: GOOD, options=OPTIONS, console=quiet)  # r1 serves 100%
    expiries = []
    with misbehaving_prometheus("trickle") as url:
        api = PrometheusAPI(url, timeout_seconds=DEADLINE)

        def observe_r2(rev: int) -> Observation:
            if rev == 1 or store.operation().stage < 50:
                return GOOD
            expiries.append(store.lease().expires)
            if len(expiries) == 1:
                store.LEASE_SECONDS = 10 * ReleaseStore.LEASE_SECONDS
            return observe(api, spec, rev, "5m")

        with pytest.raises(CanaryFailed, match="at 50%.*did not answer within 1s"):
            rollout(spec, store, cluster, observe=observe_r2, options=OPTIONS, console=quiet)
    assert len(expiries) == 3 and expiries[0] < expiries[1] == expiries[2]
    assert cluster.traffic() == store.traffic() == {1: 100}


def test_a_stage_judged_with_every_read_timing_out_cannot_outlast_the_lease():
    """The longest stretch without a renewal while a stage is judged: one try (every gate query
    of the canary and of the serving revision, each ended by the client's deadline) and the wait
    before the next. keep_alive renews once half the lease has run out, so that stretch must be
    under half of it."""
    from infra.rollout.canary import gate_queries
    from infra.rollout.rollout import OBSERVE_ATTEMPTS

    queries_per_try = 2 * len(gate_queries(parse_spec(stack_data("dev")), 2, "5m"))
    longest_wait = RolloutOptions().poll_seconds * OBSERVE_ATTEMPTS
    assert queries_per_try * PrometheusAPI.timeout_seconds + longest_wait < ReleaseStore.LEASE_SECONDS / 2


def test_options_are_checked_before_anything_changes(tmp_path, capsys):
    from infra.cli import main

    sim = tmp_path / "cluster.json"
    for bad in (["--bake", "-1"], ["--bake", "nan"], ["--stages", "5,x,100"], ["--stages", "50,5,100"]):
        code = main(["rollout", "--stack", "dev", "--sim", str(sim), "--releases", str(tmp_path / "releases"),
                     "--prometheus", "http://127.0.0.1:9", *bad])
        assert code == 2, bad
        assert "Traceback" not in capsys.readouterr().err
    assert not sim.exists() and not (tmp_path / "releases").exists()


def test_a_missing_pulumi_cli_is_said_plainly_and_creates_no_revision(tmp_path, capsys):
    """This machine has no Pulumi CLI: the Automation API cannot select the stack."""
    from infra.cli import main
    from tests.engine import deployable_spec_file  # placeholder images are refused first (tests/test_images.py)

    code = main(["rollout", "--spec", str(deployable_spec_file("dev", tmp_path)), "--pulumi-stack", "dev",
                 "--releases", str(tmp_path / "releases"),
                 "--prometheus", "http://127.0.0.1:9", "--stages", "100", "--bake", "0"])
    err = capsys.readouterr().err
    assert code == 3 and "the Pulumi CLI is not installed here" in err and "weights" not in err
    store = ReleaseStore("dev", tmp_path / "releases")
    assert store.traffic() == {} and store.status(1) is None


def test_the_prometheus_client_says_what_went_wrong():
    from infra.prometheus import PrometheusError

    with pytest.raises(PrometheusError, match="no http:// or https:// scheme"):
        PrometheusAPI("prometheus:9090").query("up")


def test_a_lease_that_expired_or_whose_process_is_gone_is_taken_over_and_audited(tmp_path):
    import json
    import socket
    from datetime import datetime, timezone

    from infra.rollout.releases import LockHeld

    store = ReleaseStore("dev", tmp_path / "releases")
    lease_file = tmp_path / "releases" / "dev" / "lease.json"
    lease_file.parent.mkdir(parents=True)
    lease_file.write_text("")  # what a full disk left behind under an older version
    with pytest.raises(LockHeld, match="lease.json cannot be read .empty.*--force"):
        with store.lock("rollback"):  # whether its holder runs is unknown: only taken with --force
            pass
    with store.lock("rollback", force=True):
        pass
    dead = {"operation": "rollout", "actor": "ci@runner", "pid": 2 ** 22 + 7, "host": socket.gethostname(),
            "since": "2026-12-03T00:00:00+00:00", "expires": "2999-01-01T00:00:00+00:00", "token": "ab", "fence": 2}
    lease_file.unlink()
    lease_file.write_text(json.dumps(dead))
    with store.lock("rollback"):
        pass
    expired = {**dead, "pid": os.getpid(), "host": "elsewhere", "expires": "2026-01-01T00:00:00+00:00", "fence": 3}
    lease_file.unlink()
    lease_file.write_text(json.dumps(expired))
    written = int(os.path.getmtime(lease_file)) - 16 * 60  # last written 16 min ago by the store's clock
    os.utime(lease_file, (written, written))
    with store.lock("rollback") as lease:
        assert lease.fence == 4  # fencing numbers only grow
    taken = [e for e in store.audit_entries() if e["action"] == "lease"]
    assert [t["previous"]["why"] for t in taken] == [
        "its lease record is unreadable (empty (a write that never finished, or a file someone truncated))",
        f"its process {dead['pid']} on {dead['host']} is gone",
        f"it expired at {datetime.fromtimestamp(written + 900, timezone.utc).isoformat()} by the store's clock "
        "(15 min after the store last wrote it)"]
    assert store.lease() is None and "token" not in taken[0]["previous"]


def test_force_takes_a_live_lease_and_the_old_holder_stops_at_its_next_write(tmp_path):
    from infra.rollout.releases import LeaseLost, LockHeld

    store, other = ReleaseStore("dev", tmp_path / "r"), ReleaseStore("dev", tmp_path / "r")
    with store.lock("rollout"):
        with pytest.raises(LockHeld, match="locked by rollout"):
            with other.lock("rollback"):
                pass
        with other.lock("rollback", force=True):
            with pytest.raises(LeaseLost, match="taken over"):
                store.record(traffic={1: 100})
    assert any(e["action"] == "lease" and e["previous"]["why"] == "forced" for e in store.audit_entries())


# --- SIGKILL at every point where a rollout changes something ----------------------------------


def test_careless_inputs_are_refused_with_the_fix_and_change_nothing(tmp_path, capsys):
    from infra.cli import main

    releases = tmp_path / "releases"
    (tmp_path / "dir").mkdir()
    (tmp_path / "junk.json").write_text("junk")
    for sim in ("dir", "junk.json"):
        assert main(["rollback", "--stack", "dev", "--sim", str(tmp_path / sim), "--releases", str(releases)]) == 2
        said = capsys.readouterr().err
        assert "simulated cluster file" in said and "Nothing was changed" in said
    assert main(["rollout", "--stack", "dev", "--sim", str(tmp_path / "c.json"), "--releases", str(releases),
                 "--force", "--prometheus", "http://127.0.0.1:9"]) == 2
    assert "--force only goes with --abort" in capsys.readouterr().err
    assert main(["rollout", "--stack", "dev", "--sim", str(tmp_path / "c.json"), "--releases", str(releases),
                 "--abort"]) == 3
    assert "no unfinished rollout to abort" in capsys.readouterr().err
    assert main(["rollout", "--stack", "dev", "--sim", str(tmp_path / "c.json"), "--releases", str(releases),
                 "--resume", "--prometheus", "http://127.0.0.1:9"]) == 3
    assert "no unfinished rollout to resume" in capsys.readouterr().err
    assert not releases.exists() and not (tmp_path / "c.json").exists()
    assert (tmp_path / "junk.json").read_text() == "junk"


@pytest.mark.parametrize("terminal", [True, False])
def test_a_bake_counts_down_with_the_gates_readings_on_a_terminal_and_is_quiet_in_a_log(tmp_path, monkeypatch,
                                                                                         terminal):
    import io

    import infra.rollout.rollout as rollout_module

    monkeypatch.setattr(rollout_module, "BAKE_TICK_SECONDS", 0.2)
    spec = parse_spec(stack_data("dev"))
    store, cluster = ReleaseStore("dev", tmp_path / "releases"), InMemoryCluster()
    seen = []
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200)

    def observe(rev):
        seen.append(rev)
        return GOOD

    rollout(spec, store, cluster, observe=observe, options=RolloutOptions(stages=(100,), bake_seconds=0.6,
                                                                          poll_seconds=0.01, timeout_scale=0.001),
            console=console)
    text = out.getvalue()
    if terminal:
        assert "baking r1 at 100%" in text and "TTFT p99 200 ms, TPOT p99 20 ms, errors 0.00%" in text
        assert len(seen) >= 3  # a reading each tick, then the verdict's own
    else:
        # the gates asked once before any change, then the verdict's read only
        assert "baking r1" not in text and "TTFT p99" not in text and len(seen) == 2
    assert cluster.traffic() == {1: 100}


def test_audit_entries_are_read_through_their_model_and_a_foreign_one_is_named(tmp_path):
    """Every store object is parsed by its model (infra/rollout/records.py); an audit entry's
    own detail is free, its common fields are not."""
    from infra.rollout.releases import StoreObjectUnreadable

    store = ReleaseStore("dev", tmp_path)
    store.audit("rollout", 1, "started", serving={1: 100}, message="why")
    assert store.audit_entries()[0]["serving"] == {"1": 100}
    (tmp_path / "dev" / "audit" / "99999999T000000-foreign.json").write_text('{"time": "yesterday", "who": "me"}')
    with pytest.raises(StoreObjectUnreadable, match=r"audit/99999999T000000-foreign.json cannot be read: "
                                                    r"time: not an ISO 8601 time.*Fix: restore"):
        store.audit_entries()
