"""Rollout, canary and rollback against the in-memory cluster, judged by a real Prometheus.

Prometheus (Debian's `prometheus`, on loopback) scrapes exporters that stand in for engine
pods of two environments: in one, the new revision is as healthy as the serving one; in
the other it is slow and drops requests. Every canary verdict here comes from PromQL
queries to that server.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from rich.console import Console

from infra.prometheus import PrometheusAPI
from infra.render.metrics import ROLE_SERIES_LABEL
from infra.rollout.canary import RELEASE_SERIES_LABEL, Observation, observe
from infra.rollout.cluster import ROUTER_STEP, InMemoryCluster
from infra.rollout.releases import LockHeld, ReleaseError, ReleaseStore, RevisionNotFound
from infra.rollout.rollback import rollback
from infra.rollout.rollout import CanaryFailed, RolloutOptions, StepFailed, rollout
from infra.spec_checks import parse_spec
from tests.conftest import stack_data
from tests.engine_exporter import DEGRADED, HEALTHY, EngineExporter
from tests.stores import snapshot
from tests.servers import free_port, prometheus

HEALTHY_NS, DEGRADED_NS = "pdstack-canary-ok", "pdstack-canary-bad"
FAST = RolloutOptions(stages=(5, 50, 100), bake_seconds=1.0, poll_seconds=0.01, timeout_scale=0.001)
WINDOW = "10s"


def spec_in(namespace: str, cache_threshold: float = 0.5):
    data = stack_data("dev")
    data["environment"]["namespace"] = namespace
    data["deployment"]["load_balancer"]["weights"] = {"cache_threshold": cache_threshold}
    return parse_spec(data)


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """Prometheus scraping four engine exporters: (namespace, revision) -> behaviour."""
    behaviours = {(HEALTHY_NS, 1): HEALTHY, (HEALTHY_NS, 2): HEALTHY,
                  (DEGRADED_NS, 1): HEALTHY, (DEGRADED_NS, 2): DEGRADED,
                  (f"{HEALTHY_NS}-r3", 3): HEALTHY}  # a release track's own namespace
    with ExitStack() as stack:
        targets = []
        for (ns, rev), behaviour in behaviours.items():
            exporter = EngineExporter(behaviour)
            exporter.start(free_port())
            stack.callback(exporter.stop)
            # an SGLang decode engine (tests/engine_exporter.py): where the PD engine times TTFT
            targets.append((exporter.port, {"namespace": ns, RELEASE_SERIES_LABEL: str(rev), ROLE_SERIES_LABEL: "decode"}))
        url = stack.enter_context(prometheus(tmp_path_factory.mktemp("prom"), targets))
        api = PrometheusAPI(url)
        deadline = time.monotonic() + 30
        while api.query(f"count(rate(sglang:num_requests_total[{WINDOW}]) > 0)") != len(targets):
            assert time.monotonic() < deadline, "Prometheus has no rates from the exporters"
            time.sleep(0.5)
        yield api


def observer(api: PrometheusAPI, namespace: str):
    return lambda rev: observe(api, spec_in(namespace), rev, WINDOW)


def test_healthy_canary_moves_all_traffic_in_stages(tmp_path, prom):
    store, cluster = ReleaseStore("dev", tmp_path), InMemoryCluster()
    watch = observer(prom, HEALTHY_NS)
    first = rollout(spec_in(HEALTHY_NS), store, cluster, watch, FAST, "first", quiet())
    assert (first.revision, cluster.traffic()) == (1, {1: 100})
    second = rollout(spec_in(HEALTHY_NS, 0.6), store, cluster, watch, FAST, "raise cache threshold", quiet())
    assert second.revision == 2
    assert cluster.traffic_log == [{1: 100}, {2: 5, 1: 95}, {2: 50, 1: 50}, {2: 100}]
    assert store.traffic() == {2: 100} and store.status(2) == "good"
    assert cluster.deployed(1), "the previous revision stays warm for a fast rollback"
    stages = [e for e in store.audit_entries() if e["action"] == "canary" and e["revision"] == 2]
    assert [(e["stage"], e["outcome"]) for e in stages] == [(5, "passed"), (50, "passed"), (100, "passed")]
    gates = {g["gate"] for g in stages[0]["gates"]}
    assert {"TTFT p99 vs SLO", "TTFT p99 vs serving", "TPOT p99 vs serving", "error rate vs SLO", "KV transfer errors"} <= gates


def test_failed_canary_leaves_the_old_revision_serving_everything(tmp_path, prom):
    store, cluster = ReleaseStore("dev", tmp_path), InMemoryCluster()
    watch = observer(prom, DEGRADED_NS)
    rollout(spec_in(DEGRADED_NS), store, cluster, watch, FAST, "first", quiet())
    with pytest.raises(CanaryFailed) as exc:
        rollout(spec_in(DEGRADED_NS, 0.6), store, cluster, watch, FAST, "bad build", quiet())
    assert "revision 1 serves 100% again" in str(exc.value)
    assert "TTFT p99 vs SLO" in str(exc.value)
    assert cluster.traffic() == {1: 100} and store.traffic() == {1: 100}
    assert max(w.get(2, 0) for w in cluster.traffic_log) == 5, "the canary never went past its first stage"
    assert store.status(2) == "failed" and not cluster.deployed(2)
    failed = [e for e in store.audit_entries() if e["action"] == "canary" and e["outcome"] == "failed"]
    assert failed and failed[0]["stage"] == 5
    reasons = {g["gate"] for g in failed[0]["gates"] if not g["passed"]}
    assert {"TTFT p99 vs SLO", "TPOT p99 vs SLO", "error rate vs SLO", "KV transfer errors"} <= reasons


def test_gates_read_live_numbers(prom):
    ok = observe(prom, spec_in(HEALTHY_NS), 1, WINDOW)
    bad = observe(prom, spec_in(DEGRADED_NS), 2, WINDOW)
    assert ok.ttft_p99_s < 0.25 and ok.error_rate == 0 and ok.kv_transfer_errors == 0
    assert bad.ttft_p99_s > 2.5 and bad.error_rate == pytest.approx(0.1, abs=0.02) and bad.kv_transfer_errors > 0
    assert math.isnan(observe(prom, spec_in(HEALTHY_NS), 99, WINDOW).ttft_p99_s)  # no such revision: no data
    track = observe(prom, spec_in(HEALTHY_NS), 3, WINDOW)  # served from pdstack-canary-ok-r3
    assert track.ttft_p99_s < 0.25 and track.error_rate == 0


# --- steps and rollback: the in-memory cluster, with a fixed observation ----------------------

GOOD = Observation(ttft_p99_s=0.3, tpot_p99_s=0.02, error_rate=0.0, kv_transfer_errors=0)
NO_BAKE = RolloutOptions(stages=(50, 100), bake_seconds=0, poll_seconds=0.001, timeout_scale=0.001)


def two_releases(tmp_path, **cluster_args):
    store, cluster = ReleaseStore("dev", tmp_path), InMemoryCluster(**cluster_args)
    for threshold in (0.5, 0.6):
        rollout(spec_in("pdstack-dev", threshold), store, cluster, lambda rev: GOOD, NO_BAKE, console=quiet())
    return store, cluster


def test_steps_run_in_the_designed_order(tmp_path):
    store, cluster = two_releases(tmp_path)
    steps = [e["step"] for e in store.audit_entries() if e["action"] == "apply" and e["outcome"] == "ready" and e["revision"] == 2]
    assert steps == ["initialise environment", "split pools", "deploy prefill", "deploy decode",
                     "deploy kv cache and balancers", "open access"]
    by_step = cluster.applied[2]
    assert "leaderworkerset-engine-prefill" in by_step["deploy prefill"]
    assert "leaderworkerset-engine-decode" in by_step["deploy decode"]
    assert "deployment-router" in by_step["deploy kv cache and balancers"]
    assert "httproute-gateway" in by_step["open access"]
    assert "networkpolicy-default-deny" in cluster.applied["shared"]["initialise environment"]


def test_a_step_that_never_gets_ready_changes_no_traffic(tmp_path):
    store, cluster = two_releases(tmp_path)
    cluster.never_ready.add((3, "deploy decode"))
    with pytest.raises(StepFailed, match="deploy decode"):
        rollout(spec_in("pdstack-dev", 0.7), store, cluster, lambda rev: GOOD, NO_BAKE, console=quiet())
    assert cluster.traffic() == {2: 100} and not cluster.deployed(3)
    assert all(3 not in w for w in cluster.traffic_log)
    assert store.status(3) == "failed"


def test_rollback_restores_the_previous_good_revision(tmp_path):
    store, cluster = two_releases(tmp_path)
    result = rollback(store, cluster, console=quiet())
    assert (result.revision, result.previous_traffic, result.redeployed) == (1, {2: 100}, False)
    assert cluster.traffic() == {1: 100} and store.traffic() == {1: 100}
    assert store.status(2) == "rolled back"
    assert result.seconds < 60
    last = store.audit_entries()[-1]
    assert (last["action"], last["outcome"], last["revision"]) == ("rollback", "succeeded", 1)
    assert last["actor"]


def test_rollback_to_a_revision_no_longer_running_applies_it_again(tmp_path):
    store, cluster = two_releases(tmp_path)
    cluster.retire(1, fence=cluster.fence)  # out of band, under the last holder's fence
    result = rollback(store, cluster, to=1, console=quiet())
    assert result.redeployed and cluster.traffic() == {1: 100}


def test_rollback_to_a_missing_revision_changes_nothing(tmp_path):
    store, cluster = two_releases(tmp_path)
    before = snapshot(store), cluster.traffic()
    with pytest.raises(RevisionNotFound, match=r"revision 9 does not exist .*revisions: 1, 2"):
        rollback(store, cluster, to=9, console=quiet())
    assert (snapshot(store), cluster.traffic()) == before


def test_rollback_while_a_rollout_holds_the_lock_changes_nothing(tmp_path):
    store, cluster = two_releases(tmp_path)
    with store.lock("rollout"):
        before = snapshot(store), cluster.traffic()
        with pytest.raises(LockHeld, match="locked by rollout"):
            rollback(store, cluster, console=quiet())
        assert (snapshot(store), cluster.traffic()) == before
    assert store.lease() is None


def test_rollback_refuses_a_failed_revision(tmp_path):
    store, cluster = two_releases(tmp_path)
    store.record(status={1: "failed"})
    with pytest.raises(ReleaseError, match="failed its rollout"):
        rollback(store, cluster, to=1, console=quiet())
    assert cluster.traffic() == {2: 100}


def test_revisions_are_numbered_immutable_records(tmp_path):
    store, _ = two_releases(tmp_path)
    assert store.revisions() == [1, 2]
    path = Path(store.location) / "revisions" / "0002.json"
    assert not os.stat(path).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    record = json.loads(path.read_text())
    assert record["router_weights"]["cache_threshold"] == 0.6
    assert set(record["engine_commands"]) == {"prefill", "decode"}
    assert record["images"]["engine"] == store.get(2).stack_spec().engine_image().image  # pinned, or a placeholder
    assert store.get(1).stack_spec().deployment.load_balancer.weights.cache_threshold == 0.5


def test_pdctl_canary_judges_once_from_prometheus(tmp_path, prom, capsys):
    import yaml

    from infra.cli import main

    for namespace, expected in ((HEALTHY_NS, 0), (DEGRADED_NS, 1)):
        path = tmp_path / f"{namespace}.yaml"
        path.write_text(yaml.safe_dump(spec_in(namespace).model_dump(mode="json")))
        code = main(["canary", "--spec", str(path), "--prometheus", prom.url, "--window", WINDOW,
                     "--revision", "2", "--baseline", "1"])
        assert code == expected, capsys.readouterr().out
    assert "FAIL" in capsys.readouterr().out


def test_a_third_rollout_retires_the_older_standby_to_make_room(tmp_path):
    """Tracks share capacity (infra/tracks.py plan_tracks): the serving revision, one warm
    standby and a new one would not fit dev's pools, so the standby before the serving one goes."""
    store, cluster = two_releases(tmp_path)
    rollout(spec_in("pdstack-dev", 0.7), store, cluster, lambda rev: GOOD, NO_BAKE, console=quiet())
    assert not cluster.deployed(1) and store.status(1) == "retired"
    assert cluster.deployed(2) and store.tracks() == {2: 0, 3: 100}


def test_a_revision_that_cannot_fit_beside_the_serving_one_is_refused_before_any_change(tmp_path):
    from infra.rollout.rollout import RolloutRefused

    store, cluster = two_releases(tmp_path)
    data = spec_in("pdstack-dev", 0.7).model_dump(mode="json")
    data["deployment"]["prefill"]["scaling"] = {"min_instances": 2, "max_instances": 2}
    data["deployment"]["prefill"]["instances"] = 2
    data["deployment"]["pd_ratio"] = "2:1"
    before = snapshot(store), cluster.traffic(), dict(cluster.applied)
    with pytest.raises(RolloutRefused, match="cannot run beside revision 2.*Nothing was changed"):
        rollout(parse_spec(data), store, cluster, lambda rev: GOOD, NO_BAKE, console=quiet())
    assert (snapshot(store), cluster.traffic(), dict(cluster.applied)) == before


# Ranges for Prometheus's own parser: accepted, refused for grammar, and both sides of the
# int64-nanosecond limit (292 years fit, 293 do not).
PROMQL_RANGES = ("5m", "10s", "1h30m", "24h", "300ms", "1y2w3d4h5m6s7ms", "05m", "292y", "5", "0", "0s", "1.5h",
                 "5M", "-5m", "", "m", "1m1h", "5m5m", "1d1d", "293y", "99999999999y", "1hs", "5min")


def test_the_range_grammar_is_the_one_prometheus_parses(prom):
    """`range_seconds` against the real server: Debian's Prometheus 2.42.0 refuses (HTTP 400)
    exactly the ranges it refuses (promql/parser/lex.go lexDuration, parse.go parseDuration,
    prometheus/common v0.39.0 model/time.go ParseDuration)."""
    from infra.prometheus import PrometheusError, range_seconds

    for text in PROMQL_RANGES:
        try:
            range_seconds(text)
            ours = True
        except ValueError:
            ours = False
        try:
            prom.vector(f"count_over_time(up[{text}])")
            theirs = True
        except PrometheusError as exc:
            assert "HTTP 400" in str(exc), exc
            theirs = False
        assert ours == theirs, f"{text!r}: pdctl {'accepts' if ours else 'refuses'}, Prometheus does not"


def test_an_option_prometheus_would_refuse_stops_the_rollout_before_any_change(tmp_path, prom, capsys):
    """`rollout --window 5` passed the option checks: revision 2 was deployed and took 50% of the
    traffic before its first gate failed on Prometheus's 400. Now every option that ends up in a
    query is checked first, and the gates' queries are asked once before the first change: a
    Prometheus that is down is said with nothing changed."""
    import yaml

    from infra.cli import main
    from tests.servers import misbehaving_prometheus

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_in(HEALTHY_NS).model_dump(mode="json")))
    sim, releases = tmp_path / "cluster.json", tmp_path / "releases"
    args = ["rollout", "--spec", str(spec), "--sim", str(sim), "--releases", str(releases), "--stages", "50,100",
            "--bake", "0"]
    assert main([*args, "--prometheus", prom.url, "--window", WINDOW]) == 0  # r1 serves 100%
    capsys.readouterr()
    store = ReleaseStore("dev", releases)
    before, cluster_before = snapshot(store), sim.read_text()
    for window in ("5", "0s", "1.5h", "5M"):
        with pytest.raises(SystemExit) as refused:  # argparse: a usage error
            main([*args, "--prometheus", prom.url, "--window", window])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert f"--window: {window!r}" in err and "Fix: e.g. --window 5m" in err and "Traceback" not in err
    for mode in ("503", "refused"):
        with misbehaving_prometheus(mode) as url:
            assert main([*args, "--prometheus", url, "--window", WINDOW]) == 1
        err = capsys.readouterr().err
        assert "The canary gates cannot be read, so nothing was changed" in err, err
    assert snapshot(store) == before and sim.read_text() == cluster_before
    assert store.revisions() == [1] and store.traffic() == {1: 100}


def test_open_access_does_not_wait_for_the_route_that_traffic_owns():
    """The route is changed only by the traffic step's fenced patch, and on an environment's
    first rollout it is created when traffic first moves, after every step: a wait for its
    Accepted condition in "open access" could never be met (found on the cluster twin,
    tests/twin/test_rollout_kill_on_twin.py). The gateway itself is still waited for, in the
    environment's namespace, where it stays while each revision serves from its own (a wait in
    the revision's namespace could never be met: found on the twin too)."""
    from infra.offline import run_spec
    from infra.rollout.steps import plan_steps
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path("dev"))
    (open_access,) = [s for s in plan_steps(spec, run_spec(spec).resources) if s.name == "open access"]
    assert "Gateway/gateway condition=Programmed in pdstack-dev" in open_access.waits_for
    deploy = next(s for s in plan_steps(spec, run_spec(spec).resources) if s.name == "deploy prefill")
    assert deploy.waits_for and not any(" in " in w for w in deploy.waits_for), deploy.waits_for
    assert not any(w.startswith("HTTPRoute/") for w in open_access.waits_for), open_access.waits_for


def test_the_first_rollout_cuts_over_from_an_environment_deployed_before_tracks(tmp_path):
    """An environment first deployed by a plain `pulumi up` (no release store yet) serves from
    its own namespace: its route's backend is revision 0, not a revision (traffic_from_route).
    The first rollout records revision 1 alone and cuts over to it; a track 0 would be refused
    by the store's own model (the cluster twin's rollout met exactly that, "tracks.0: Input
    should be greater than or equal to 1")."""
    store = ReleaseStore("dev", tmp_path / "releases")
    cluster = InMemoryCluster()
    cluster.applied[0] = {ROUTER_STEP: ("deployment-router",)}
    cluster.weights = {0: 100}
    rollout(spec_in("pdstack-dev", 0.5), store, cluster, lambda rev: GOOD, NO_BAKE, console=quiet())
    assert cluster.traffic() == {1: 100} and store.traffic() == {1: 100}
    assert 0 not in (store.tracks() or {})
