"""Release tracks: two revisions side by side under Pulumi mocks, with the gateway splitting
traffic between their routers, and capacity shared rather than doubled."""

from __future__ import annotations

from collections import Counter

import pytest

from infra.offline import run_offline
from infra.policy.rules import Resource, evaluate
from infra.program import build_stack
from infra.render.manifests import manifests, unwrap, validate_manifests
from infra.spec import SpecError
from infra.spec_checks import parse_spec
from infra.tracks import plan_tracks
from tests.conftest import stack_data


def prod_tracks(weights=(95, 5)):
    stable, canary = stack_data("prod"), stack_data("prod")
    canary["deployment"]["load_balancer"]["weights"]["cache_threshold"] = 0.6
    return plan_tracks([(7, weights[0], stable), (8, weights[1], canary)])


def test_tracks_share_capacity_and_the_newest_starts_small():
    stable, canary = prod_tracks()
    assert (stable.namespace, canary.namespace) == ("pdstack-prod-r7", "pdstack-prod-r8")
    assert canary.spec.deployment.prefill.instances == 4 and canary.spec.deployment.decode.instances == 1
    # Prefill may reach 8 and decode 2 in all: each track gets the rest after the other's minimum.
    assert stable.spec.deployment.prefill.bounds() == (4, 4)
    assert stable.spec.deployment.decode.bounds() == (1, 1)
    assert canary.spec.deployment.decode.bounds() == (1, 1)
    assert canary.spec.deployment.pd_ratio == "1:2"


def test_a_track_that_cannot_fit_is_refused_by_field():
    one_each = stack_data("dev")
    for role in ("prefill", "decode"):
        one_each["deployment"][role]["scaling"] = {"min_instances": 1, "max_instances": 1}
    with pytest.raises(SpecError, match="revision 2 cannot fit beside the other tracks: prefill may grow to 1"):
        plan_tracks([(2, 100, one_each), (3, 0, one_each)])
    with pytest.raises(SpecError, match="must be 0..100 and add up to 100"):
        plan_tracks([(2, 60, stack_data("prod")), (3, 60, stack_data("prod"))])


@pytest.fixture(scope="module")
def tracked_run():
    spec = parse_spec(stack_data("prod"))
    return run_offline(lambda: build_stack(spec, release="8", tracks=prod_tracks()), stack="prod")


def test_the_route_splits_traffic_between_the_tracks_routers(tracked_run):
    (route,) = tracked_run.by_kind("HTTPRoute")
    refs = route["spec"]["rules"][0]["backendRefs"]
    assert [(r["name"], r["namespace"], r["weight"]) for r in refs] == [
        ("router", "pdstack-prod-r7", 95), ("router", "pdstack-prod-r8", 5)]
    grants = {g["metadata"]["namespace"] for g in tracked_run.by_kind("ReferenceGrant")}
    assert grants == {"pdstack-prod-r7", "pdstack-prod-r8"}
    assert {n["metadata"]["name"] for n in tracked_run.by_kind("Namespace")} == {
        "pdstack-prod", "pdstack-prod-r7", "pdstack-prod-r8"}


def test_each_track_runs_its_own_engines_router_and_scalers(tracked_run):
    names = Counter((r.type, r.name) for r in tracked_run.custom())
    assert all(n == 1 for n in names.values()), [k for k, n in names.items() if n > 1]
    groups = {(g["metadata"]["namespace"], g["metadata"]["name"]): g for g in tracked_run.by_kind("LeaderWorkerSet")}
    assert set(groups) == {(ns, f"engine-{role}") for ns in ("pdstack-prod-r7", "pdstack-prod-r8") for role in ("prefill", "decode")}
    pods = groups[("pdstack-prod-r8", "engine-decode")]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]
    assert pods["labels"]["pdstack.io/release"] == "8"
    scalers = {(s["metadata"]["namespace"], s["metadata"]["name"]): s["spec"] for s in tracked_run.by_kind("ScaledObject")}
    assert scalers[("pdstack-prod-r7", "engine-prefill")]["maxReplicaCount"] == 4
    launch = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in tracked_run.by_kind("ConfigMap")}
    router = launch[("pdstack-prod-r8", "router-launch")]["data"]["launch.sh"]
    assert "--service-discovery-namespace pdstack-prod-r8" in router and "--cache-threshold 0.6" in router
    nodes = {p["metadata"]["name"]: p["spec"]["replicas"] for p in tracked_run.by_kind("NodePool")}
    assert nodes == {"pdstack-prod-prefill": 18, "pdstack-prod-decode": 54}  # shared, not doubled


def test_tracked_stack_passes_the_schemas_and_the_policy_pack(tracked_run):
    from twin.engine import stand_in_pins

    report = validate_manifests(manifests(tracked_run), "1.33")
    assert report.ok, report.errors
    # prod's images pinned (stand-in digests): the pack refuses placeholders on purpose (tests/test_images.py)
    pinned = stand_in_pins(parse_spec(stack_data("prod")))
    data = pinned.model_dump(mode="json")
    run = run_offline(lambda: build_stack(pinned, release="8", tracks=plan_tracks([(7, 95, data), (8, 5, data)])),
                      stack="prod")
    violations = evaluate([Resource(r.type, r.name, unwrap(r.inputs)) for r in run.custom()])
    assert [v for v in violations if v.level == "mandatory"] == []


def test_an_environments_first_revision_is_planned_before_it_takes_traffic():
    """`pdctl rollout --pulumi-stack` records the first revision at weight 0 and deploys it
    step by step; the program must plan it (on the cluster twin the first rollout was refused,
    "weights [0] must ... add up to 100"). 0 and 100 are the only totals."""
    (track,) = plan_tracks([(1, 0, stack_data("dev"))])
    assert track.revision == 1 and track.weight == 0
    with pytest.raises(SpecError, match="add up to 100"):
        plan_tracks([(1, 0, stack_data("dev")), (2, 50, stack_data("dev"))])


def test_the_longest_namespace_a_spec_admits_runs_tracks_up_to_r9999(tmp_path, capsys):
    """The spec holds an environment's namespace to NAMESPACE_MAX, leaving room for '-r9999' in a
    Kubernetes namespace, a DNS label of 63 at most (Kubernetes, "Namespaces": RFC 1123 label
    names). plan_tracks held each track's own namespace to NAMESPACE_MAX as well, so an environment
    whose namespace was longer than 51 characters could not run its tracks. Now the longest valid one
    runs r9999, rendered, schema-checked and passing the policy pack; one character more is refused
    by validate, naming the field."""
    import yaml

    from infra.cli import main
    from infra.spec import NAMESPACE_MAX
    from twin.engine import stand_in_pins

    data = stand_in_pins(parse_spec(stack_data("prod"))).model_dump(mode="json")
    data["environment"]["namespace"] = "p" * NAMESPACE_MAX
    tracks = plan_tracks([(9998, 95, data), (9999, 5, data)])
    assert [len(t.namespace) for t in tracks] == [63, 63]
    run = run_offline(lambda: build_stack(parse_spec(data), release="9999", tracks=tracks), stack="prod")
    report = validate_manifests(manifests(run), "1.33")
    assert report.ok, report.errors
    violations = evaluate([Resource(r.type, r.name, unwrap(r.inputs)) for r in run.custom()])
    assert [v for v in violations if v.level == "mandatory"] == []

    data["environment"]["namespace"] += "p"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "environment.namespace" in err and f"at most {NAMESPACE_MAX} fit" in err and "Traceback" not in err
