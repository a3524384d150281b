"""twin/fleet.py's report of an apply: the objects the API server refused, each with its
reason, and every other one counted applied.

kubectl apply goes on past a refused object but prints its `-o json` list only when none was
refused (k8s.io/kubectl v0.34.4, pkg/cmd/apply/apply.go, ApplyOptions.Run returns the errors
before PostProcessorFn prints), so a report read from that answer alone named the whole batch.
"""

from __future__ import annotations

from twin import fleet


def _config_map(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"},
            "data": {"k": "v"}}


def _leaderworkerset(name: str) -> dict:
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": {
                "containers": [{"name": "c", "image": "registry.invalid/none:1"}]}}}}}


def test_one_broken_object_in_a_batch_is_the_only_one_reported(twin):
    """Six good objects and, amid them, one with a field no schema has (strict field
    validation): the report names the broken one only, with the API server's reason, and the
    six applied (server-side dry run: nothing is left behind)."""
    good = [_config_map(f"hp-report-{n}") for n in range(5)] + [_leaderworkerset("hp-report-good")]
    broken = _leaderworkerset("hp-report-broken")
    broken["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    batch = good[:3] + [broken] + good[3:]
    result = fleet.apply_each_pass(batch, dry_run=True)
    assert list(result.rejected) == [fleet.ident(broken)], result.rejected
    assert ".spec.leaderWorkerTemplate.sizee: field not declared in schema" in result.rejected[fleet.ident(broken)]
    assert sorted(result.applied) == sorted(fleet.ident(o) for o in good)
