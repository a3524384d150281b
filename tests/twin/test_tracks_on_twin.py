"""Two release tracks of prod on the cluster twin, as a rollout holds them (infra/tracks.py).

This test applies its own fleet, so it lives apart from tests/twin/test_fleet_on_twin.py:
pytest keeps that module's fleet (a module-scoped fixture) applied until the module ends, and a
second fleet on the same stack's nodes would find their GPUs taken (it did, in CI).
"""

from __future__ import annotations

from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from tests.twin.placement import assert_every_pod_bound, remove_render
from twin import dra, fleet
from twin.nodes import stack_nodes


def pods_on(nodes: list[dict]) -> list[str]:
    """Pods of another render still bound to these nodes (they would hold the nodes' GPUs)."""
    names = {n["metadata"]["name"] for n in nodes}
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in fleet.get("pods", "--all-namespaces") if p["spec"].get("nodeName") in names]


def test_a_second_release_track_fits_beside_the_first(twin, tmp_path):
    """prod with a canary track beside the serving one (infra/tracks.py: each track in its own
    namespace; the joining track at its minimum, the serving one at most the pool's maximum less
    the other's minimum), as the program builds it from the release store during a rollout:
    every object accepted, and every pod of both tracks bound by the real scheduler to its pool,
    its groups inside their NVLink domains, within the nodes' GPUs and EFA devices."""
    from infra.offline import run_spec
    from infra.render.manifests import manifests, write_manifests
    from infra.tracks import plan_tracks
    from tests.conftest import stack_data

    spec = load_spec(stack_spec_path("prod"))
    left = fleet.wait_for("no other render on prod's nodes", lambda: not pods_on(stack_nodes(spec)),
                          timeout=300) or pods_on(stack_nodes(spec))
    assert left is True, f"pods of another render still hold prod's nodes: {left[:5]}"
    tracks = plan_tracks([(1, 90, stack_data("prod")), (2, 10, stack_data("prod"))])
    write_manifests(manifests(run_spec(spec, tracks=tracks)), tmp_path)  # as `pdctl render` writes them
    objects = fleet.read_rendered(tmp_path)
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] == "LeaderWorkerSet"} == {
        f"{spec.environment.namespace}-r1", f"{spec.environment.namespace}-r2"}
    nodes = stack_nodes(spec)
    assert fleet.apply_each_pass(nodes).rejected == {}
    try:
        result = fleet.apply_each_pass(objects)
        assert result.rejected == {}, "\n".join(f"{k}: {v}" for k, v in result.rejected.items())
        assert fleet.apply_each_pass(dra.stand_in(objects, nodes)).rejected == {}
        assert_every_pod_bound(spec, objects, result, "prod-sglang, tracks r1 90% + r2 10%")
    finally:
        remove_render(spec, objects)
