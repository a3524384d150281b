"""One release store every actor shares (an S3 bucket on moto's server): what one operator's
rollout leaves is what CI's `pulumi up` from a clean checkout deploys, and two operators on
two checkouts racing for the environment resolve to one winner."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import boto3
import pytest
import yaml
from rich.console import Console

from infra.spec import REPO_ROOT
from tests.servers import healthy_prometheus

BUCKET = "pdstack-shared-releases"


def clean_checkout(dest: Path) -> Path:
    """The project's files as a fresh clone has them (tracked and new, not ignored): no local
    release folder, no stack settings, no venv."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO_ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def spec_on_shared_store(checkout: Path, prefix: str) -> Path:
    """dev's spec, pointed at the bucket (the one place the store is configured)."""
    data = yaml.safe_load((checkout / "stacks" / "dev.yaml").read_text())
    data["environment"]["release_store"] = {"url": f"s3://{BUCKET}/{prefix}"}
    path = checkout / "stacks" / "dev-shared.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def pdctl(checkout: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=300)


PROGRAM_UNDER_MOCKS = """
import json, sys
import pulumi
from infra.offline import run_offline
from infra.program import main
pulumi.runtime.set_all_config({"pdstack:specFile": sys.argv[1]})
run = run_offline(main, stack="dev")
route = [r for r in run.custom() if r.name == "httproute-gateway"][0]
print(json.dumps({"namespaces": sorted({r.inputs.get("metadata", {}).get("namespace", "") for r in run.custom()} - {""}),
                  "backends": route.inputs["spec"]["rules"][0]["backendRefs"]}))
"""


def program_run(checkout: Path, env: dict, spec: Path) -> dict:
    """What `pulumi up` would deploy from this checkout: the real program's main(), under mocks."""
    done = subprocess.run([sys.executable, "-c", PROGRAM_UNDER_MOCKS, str(spec)], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def shared(tmp_path, s3_endpoint):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=BUCKET)
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3_endpoint, "PYTHONPATH": ""}
    return env, uuid.uuid4().hex[:8]


def test_a_clean_checkout_on_the_same_store_deploys_the_tracks_the_last_rollout_left(tmp_path, shared):
    env, prefix = shared
    operator = clean_checkout(tmp_path / "operator")
    ci = clean_checkout(tmp_path / "ci")
    spec = spec_on_shared_store(operator, prefix)
    with healthy_prometheus() as prometheus:
        for message in ("first", "second"):
            done = pdctl(operator, {**env, "PDSTACK_ACTOR": "alice"}, "rollout", "--spec", str(spec), "--sim",
                         str(tmp_path / "cluster.json"), "--prometheus", prometheus, "--stages", "100", "--bake", "0",
                         "--message", message)
            assert done.returncode == 0, done.stderr
    assert not (operator / "releases").exists() and not (ci / "releases").exists()  # nothing local
    ci_spec = spec_on_shared_store(ci, prefix)
    deployed = program_run(ci, env, ci_spec)
    assert {"pdstack-dev-r1", "pdstack-dev-r2"} <= set(deployed["namespaces"])  # r1 kept warm
    assert [(b["namespace"], b["weight"]) for b in deployed["backends"]] == [("pdstack-dev-r2", 100)]

    done = pdctl(operator, env, "rollback", "--spec", str(spec), "--sim", str(tmp_path / "cluster.json"))
    assert done.returncode == 0, done.stderr
    assert [(b["namespace"], b["weight"]) for b in program_run(ci, env, ci_spec)["backends"]] == [("pdstack-dev-r1", 100)]


def test_before_any_rollout_the_program_deploys_the_spec_itself(tmp_path, shared):
    env, prefix = shared
    ci = clean_checkout(tmp_path / "ci")
    deployed = program_run(ci, env, spec_on_shared_store(ci, prefix))
    assert deployed["namespaces"] == ["pdstack-dev"]
    assert [b.get("namespace") for b in deployed["backends"]] == [None]


def test_an_unreachable_store_stops_the_program_instead_of_deploying_without_the_tracks(tmp_path, shared):
    """Deploying the spec alone would delete the serving revisions' tracks."""
    env, prefix = shared
    ci = clean_checkout(tmp_path / "ci")
    spec = spec_on_shared_store(ci, prefix)
    done = subprocess.run([sys.executable, "-c", PROGRAM_UNDER_MOCKS, str(spec)], cwd=ci,
                          env={**env, "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "release store s3://" in done.stderr and "cannot" in done.stderr


def test_two_operators_on_two_checkouts_racing_resolve_to_one_winner(tmp_path, shared):
    """Both start at once on one environment (one bucket, one cluster): the store's conditional
    create of the lease lets one through; the other is refused naming the holder and changes
    nothing. Then the same for two emergency rollbacks."""
    env, prefix = shared
    checkouts = {who: clean_checkout(tmp_path / who) for who in ("alice", "bob")}
    specs = {who: spec_on_shared_store(c, prefix) for who, c in checkouts.items()}
    cluster = str(tmp_path / "cluster.json")
    with healthy_prometheus() as prometheus:
        def start(who: str, *args: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "infra.cli", *args, "--spec", str(specs[who]), "--sim",
                                     cluster], cwd=checkouts[who], env={**env, "PDSTACK_ACTOR": who},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def race(*args: str) -> dict[str, tuple[int, str]]:
            procs = {who: start(who, *args) for who in checkouts}
            return {who: (p.wait(timeout=300), p.stderr.read()) for who, p in procs.items()}

        rollout = ("rollout", "--prometheus", prometheus, "--stages", "100", "--bake", "4")
        first = start("alice", *rollout)
        assert first.wait(timeout=300) == 0, first.stderr.read()  # r1
        results = race(*rollout)
        from infra.rollout.cluster import load_simulated, save_simulated

        slow = load_simulated(cluster)  # a route change takes 3 s, as on a real gateway: the racers overlap
        slow.apply_latency = 3.0
        save_simulated(slow, cluster)
        rollbacks = race("rollback")

    def one_winner(results: dict[str, tuple[int, str]]) -> str:
        codes = sorted(code for code, _ in results.values())
        assert codes == [0, 3], results
        winner = next(who for who, (code, _) in results.items() if code == 0)
        loser_err = next(err for code, err in results.values() if code == 3)
        assert f"of {winner}" in loser_err and "Nothing was changed" in loser_err, loser_err
        return winner

    one_winner(results)
    one_winner(rollbacks)
    from infra.rollout.objectstore import BucketStore
    from infra.rollout.releases import ReleaseStore

    store = ReleaseStore("dev", objects=BucketStore(BUCKET, f"{prefix}/dev", env["AWS_ENDPOINT_URL_S3"]))
    assert store.revisions() == [1, 2]  # the losers created no revision
    assert store.traffic() == load_simulated(cluster).traffic() == {1: 100}
    assert store.lease() is None and store.operation() is None


@pytest.mark.parametrize("url", ["s3:/pdstack-releases/x", "S3://pdstack-releases/x", "s3:pdstack-releases",
                                 "s3//pdstack-releases/x", "https://pdstack-releases.s3.amazonaws.com/x"])
def test_a_mistyped_store_url_is_refused_never_taken_for_a_folder(url, tmp_path, monkeypatch, capsys):
    """`s3:/bucket/x` used to become a folder `s3:/bucket/x` of the project: a second, private
    history and lease nobody else sees. Refused in the spec (environment.release_store.url)
    and in `--releases`, naming the field and the fix; nothing is created."""
    from infra.cli import main
    from infra.spec import SpecError
    from infra.spec_checks import parse_spec
    from tests.conftest import stack_data

    data = stack_data("dev")
    data["environment"]["release_store"] = {"url": url}
    with pytest.raises(SpecError, match=r"environment\.release_store\.url: .*Fix: s3://<bucket>/<prefix>"):
        parse_spec(data)
    monkeypatch.chdir(tmp_path)
    for argv in (["releases"], ["rollback", "--sim", "c.json"]):
        assert main([*argv, "--stack", "dev", "--releases", url]) == 2
        err = capsys.readouterr().err
        assert f"--releases '{url}'" in err and "Fix: s3://<bucket>/<prefix>" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


class ClockAhead(datetime):
    """This machine's clock, 20 minutes ahead (faketime-like, for the release store's module only:
    the store, moto's server or the file system, keeps the right time)."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) + timedelta(minutes=20)


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_a_machine_whose_clock_runs_ahead_cannot_take_a_live_lease_over(kind, tmp_path, monkeypatch, capsys, request):
    """Issue #36: an operator whose clock ran 20 minutes ahead ran `rollout --abort` and aborted
    another operator's running rollout, whose lease it judged "expired" against its own clock.
    A lease's age is judged on the store's clock only: S3's LastModified of lease.json against
    the Date of the store's answer (AWS S3 API reference, "Common Response Headers"; moto's
    server here), a folder's file time against the clock that stamps it. A skew beyond
    MAX_CLOCK_SKEW between this machine and the store is refused, naming it; under it, a lease
    its holder renews stays its holder's. Nothing is changed either way."""
    import socket

    from infra.cli import main
    from infra.rollout import releases as releases_module
    from infra.rollout.canary import Observation
    from infra.rollout.cluster import load_simulated, save_simulated
    from infra.rollout.releases import store_for
    from infra.rollout.rollout import RolloutOptions, rollout
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec
    from tests.stores import snapshot

    if kind == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    else:
        url = str(tmp_path / "releases")
    spec, sim = load_spec(stack_spec_path("dev")), tmp_path / "cluster.json"
    store, cluster = store_for(spec, url), load_simulated(sim)
    for _ in range(2):  # r2 serves, r1 is warm
        rollout(spec, store, cluster, lambda rev: Observation(0.3, 0.02, 0.0, 0),
                RolloutOptions(stages=(100,), bake_seconds=0, poll_seconds=0.001), console=Console(file=io.StringIO()))
    save_simulated(cluster, sim)

    # Alice's rollout of r3 runs on her laptop: it holds the lease, just taken, and recorded its operation.
    with monkeypatch.context() as alice:
        alice.setattr(socket, "gethostname", lambda: "alice-laptop")
        alice.setenv("PDSTACK_ACTOR", "alice")
        held = store.lock("rollout")
        held.__enter__()
        store.begin_operation("rollout", 3, {2: 100}, stages=[5, 100], baseline=2)
    try:
        before = snapshot(store), sim.read_bytes()
        monkeypatch.setenv("PDSTACK_ACTOR", "bob")
        abort = ["rollout", "--abort", "--stack", "dev", "--sim", str(sim), "--releases", url]

        with monkeypatch.context() as bob_ahead:
            bob_ahead.setattr(releases_module, "datetime", ClockAhead)
            assert main(abort) == 3
            err = capsys.readouterr().err
            assert re.search(r"this machine's clock is about (19 min 5\d s|20 min) ahead of the release store's", err), err
            assert "Nothing was changed" in err and "Fix: synchronise this machine's clock" in err
            assert (snapshot(store), sim.read_bytes()) == before

            # Within a bound that let the skew through, the lease is still judged alive, on the store's clock.
            bob_ahead.setattr(releases_module, "MAX_CLOCK_SKEW", timedelta(hours=1))
            assert main(abort) == 3
            err = capsys.readouterr().err
            assert "dev is locked by rollout of alice (pid" in err and "on alice-laptop" in err, err
            assert (snapshot(store), sim.read_bytes()) == before

        assert main(abort) == 3  # and as with the right time
        assert "dev is locked by rollout of alice" in capsys.readouterr().err
        assert (snapshot(store), sim.read_bytes()) == before
        assert not [e for e in store.audit_entries() if e["action"] == "lease"]  # nothing "taken over"
    finally:
        held.__exit__(None, None, None)


def test_force_takes_a_lease_over_whatever_this_machine_s_clock_says_and_audits_the_skew(tmp_path, monkeypatch):
    """The emergency path is not held up by NTP: with --force no clock judges the lease (it is
    taken whatever its age), so a skewed clock is not refused there; the takeover's audit entry
    records how far off this machine's clock was."""
    import socket

    from infra.rollout import releases as releases_module
    from infra.rollout.releases import ClockSkewed, ReleaseStore

    store = ReleaseStore("dev", tmp_path / "releases")
    with monkeypatch.context() as alice:
        alice.setattr(socket, "gethostname", lambda: "alice-laptop")
        held = store.lock("rollout")
        held.__enter__()
    monkeypatch.setattr(releases_module, "datetime", ClockAhead)
    with pytest.raises(ClockSkewed):
        with store.lock("rollback"):
            pass
    with store.lock("rollback", force=True):
        pass
    (taken,) = [e for e in store.audit_entries() if e["action"] == "lease"]
    assert 19 * 60 < taken["previous"]["clock_skew_seconds"] <= 20 * 60 + 5, taken


def test_a_lease_its_holder_just_wrote_is_alive_whatever_expiry_the_holder_s_clock_put_in_it(tmp_path):
    """A holder whose clock runs 20 minutes behind (an older pdctl, which did not compare its
    clock with the store's) records an expiry already past by everyone else's clock. The store
    wrote the lease a moment ago: it is alive, and refused naming its holder, not "expired"."""
    from infra.rollout.releases import LockHeld, ReleaseStore

    store = ReleaseStore("dev", tmp_path / "releases")
    behind = datetime.now(timezone.utc) - timedelta(minutes=20)
    store.objects.create("lease.json", json.dumps({
        "operation": "rollout", "actor": "alice", "pid": 4242, "host": "alice-laptop", "since": behind.isoformat(),
        "expires": (behind + timedelta(minutes=15)).isoformat(), "token": "ab12", "fence": 1}).encode())
    with pytest.raises(LockHeld, match="dev is locked by rollout of alice"):
        with store.lock("abort"):
            pass
    assert store.audit_entries() == []
