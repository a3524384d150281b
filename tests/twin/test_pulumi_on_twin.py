"""The rollout as `pdctl rollout --pulumi-stack dev` runs it, on the cluster twin: the real Pulumi
engine and Kubernetes provider (`make engine`) apply each step with a targeted `up`, pdctl's
kubectl (the twin's, v1.34) waits on the real LeaderWorkerSet controller's conditions and moves
traffic by one fenced merge patch of the real HTTPRoute, and a full `up` retires a track.

What is real: kube-apiserver with the upstream CRDs (Gateway API's HTTPRoute schema and CEL
rules judge every patch), the scheduler binding pods to kwok nodes of the pools, the LWS
controller that forms the groups and sets `Available`, the namespace controller that deletes a
retired track. What stands in: kwok runs the pods (no images, no GPUs); nothing programs the
Gateway (Envoy Gateway does not run on the twin), so the "open access" step's waits
(`Gateway condition=Programmed`, the route `Accepted`) are not awaited here, nor the NodePools'
Ready (the kwok nodes of twin/nodes.py stand in for what Karpenter would launch); the platform
stack is tests/engine.py's stand-in that exports the twin's kubeconfig.
"""

from __future__ import annotations

import time

import pytest

from infra.offline import run_spec
from infra.rollout.cluster import FenceRefused
from infra.rollout.pulumi_cluster import FENCE_ANNOTATION, POLICY_PACK, KubeTarget, PulumiCluster
from infra.rollout.releases import ReleaseStore
from infra.rollout.steps import plan_steps
from infra.tracks import track_namespace
from tests.engine import engine_project, program_stack, serving_program
from tests.twin.placement import delete_namespaces, users_objects
from twin import fleet
from twin.build import program
from twin.api import kubectl
from twin.paths import KUBECONFIG

# Waits the twin cannot answer: "open access" needs a gateway controller; "split pools" waits for
# the NodePools' Ready, which Karpenter's kwok provider never sets on a pool naming an
# EC2NodeClass (tests/twin/test_karpenter_on_twin.py); the twin's nodes stand in (stack_nodes).
NOT_AWAITED_HERE = {"open access", "split pools"}
READY_WITHIN_SECONDS = 600  # a deadline for a wait, not a measurement: a busy machine only waits longer


def wait_until(what: str, ready) -> None:
    deadline = time.monotonic() + READY_WITHIN_SECONDS
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {READY_WITHIN_SECONDS} s")
        time.sleep(2)


def live_route(namespace: str) -> dict:
    return fleet.get("httproute", "-n", namespace)[0]


def test_a_rollout_and_its_rollback_act_on_the_twins_real_objects(dev_nodes, tmp_path, monkeypatch):
    """Revision 1 step by step (each engine step waits for its LeaderWorkerSet's Available, set
    by the real controller), its traffic created by Pulumi and then carried by the fenced patch;
    revision 2 beside it at 50%; a holder with an older fence refused by the route itself and
    nothing changed; the rollback to {1: 100}; revision 2 retired by a full `up`, its namespace
    deleted by the namespace controller; and a last preview with no changes."""
    spec = dev_nodes
    env_ns = spec.environment.namespace
    project = engine_project(tmp_path, monkeypatch, twin=KUBECONFIG)
    store = ReleaseStore("dev", tmp_path / "releases")
    stack = program_stack(project, serving_program(tmp_path))  # `pulumi stack init dev`
    log: list[str] = []
    cluster = PulumiCluster("dev", store, kubectl=str(program("kubectl")), work_dir=project.work_dir,
                            policy_pack=POLICY_PACK, on_output=log.append,
                            kube=KubeTarget("pdstack-dev", str(project.kubeconfig)))
    steps = [s for s in plan_steps(spec, run_spec(spec).resources) if s.name != "verify"]
    try:
        def deploy(revision: int, fence: int) -> None:
            for step in steps:
                cluster.apply(revision, step, fence=fence)
                if step.name not in NOT_AWAITED_HERE:
                    wait_until(f"r{revision} {step.name}", lambda: cluster.ready(revision, step))

        users_objects(spec)
        store.create(spec)
        store.intend({1: 0})  # as the rollout records a first revision: deployed before it serves
        deploy(1, fence=1)
        store.intend({1: 100})
        cluster.set_traffic({1: 100}, fence=1)  # no route yet: Pulumi creates it, then it carries the fence
        assert cluster.traffic() == {1: 100}
        assert live_route(env_ns)["metadata"]["annotations"][FENCE_ANNOTATION] == "1"
        assert cluster.healthy(1)

        store.create(spec)
        store.intend({1: 100, 2: 0})
        deploy(2, fence=2)
        store.intend({1: 50, 2: 50})
        cluster.set_traffic({1: 50, 2: 50}, fence=2)
        assert cluster.traffic() == {1: 50, 2: 50}

        before = live_route(env_ns)["metadata"]["resourceVersion"]
        store.intend({1: 100, 2: 0})
        with pytest.raises(FenceRefused):  # the paused holder of fence 1, continued
            cluster.set_traffic({1: 100}, fence=1)
        assert live_route(env_ns)["metadata"]["resourceVersion"] == before
        assert cluster.traffic() == {1: 50, 2: 50}

        cluster.set_traffic({1: 100}, fence=3)  # the rollback
        assert cluster.traffic() == {1: 100}
        store.intend({1: 100})
        cluster.retire(2, fence=3)
        wait_until("r2's namespace deleted", lambda: not cluster.deployed(2))
        assert cluster.healthy(1) and cluster.traffic() == {1: 100}
        again = stack.preview(on_output=lambda line: None, expect_no_changes=True)
        # "read": each track's copy of the user's credentials Secret reads it (Secret.get), no change
        assert set(again.change_summary) <= {"same", "read"}, again.change_summary
    finally:
        delete_namespaces([env_ns, track_namespace(env_ns, 1), track_namespace(env_ns, 2)])
        kubectl("delete", "nodepools.karpenter.sh", "-l", f"pdstack.io/environment={spec.environment.name}",
                "--ignore-not-found", "--wait=false")
