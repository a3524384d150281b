"""The fault matrix's SIGKILL row (tests/test_fault_matrix.py) against the cluster twin instead of
the simulated cluster file: `pdctl rollout --pulumi-stack dev`, a real process driving the real
Pulumi engine and the twin's API server, kills itself just before one of its changes
(PDSTACK_FAULT_AT: a store write, a targeted `up`, a patch of the route), then the recovery an
operator would run (`rollout --abort` or `rollback`), and a check that the live route and the
release store agree.

What stands in: kwok runs the pods; tests/twin/standins.py writes the status Envoy Gateway and
Karpenter's AWS provider would (the gateway Programmed, the route Accepted, the NodePools Ready);
Prometheus is tests/servers.py's healthy stand-in; the platform stack is tests/engine.py's.

Each run here takes about a minute of targeted ups, so the row runs at a few points chosen from
the traced rollout (a store write, a step's `up`, the traffic patch at 50%), not at all of them
as the simulated matrix does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infra.rollout.pulumi_cluster import KubeTarget, PulumiCluster
from infra.rollout.releases import ReleaseStore
from infra.spec import REPO_ROOT
from infra.tracks import track_namespace
from tests.engine import engine_project, program_stack, serving_program
from tests.servers import healthy_prometheus
from tests.twin.placement import delete_namespaces, users_objects
from twin.standins import controllers_status
from twin.build import program
from twin.api import kubectl
from twin.paths import KUBECONFIG


def pdctl(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=env, timeout=3600)


def disagreements(store: ReleaseStore, cluster: PulumiCluster) -> list[str]:
    """What the live route and the store disagree on, and what a recovery must not leave."""
    found = []
    live, recorded = cluster.traffic(), store.traffic()
    if live != recorded:
        found.append(f"the route serves {live}, the store says {recorded}")
    tracks = {r: w for r, w in (store.tracks() or {}).items() if w}
    if tracks != live:
        found.append(f"the store's tracks {tracks} do not route as the route does ({live})")
    if list(live.values()) != [100] or store.status(next(iter(live), 0)) != "good":
        found.append(f"not one good revision at 100%: {live}, {store.state()['status']}")
    if store.lease() is not None or store.operation() is not None:
        found.append(f"left: lease {store.lease()}, operation {store.operation()}")
    return found


def test_a_rollout_killed_at_its_changes_on_the_twin_is_recovered_to_agreement(dev_nodes, tmp_path, monkeypatch):
    spec = dev_nodes
    env_ns = spec.environment.namespace
    namespaces = [env_ns, *[track_namespace(env_ns, r) for r in range(1, 8)]]
    delete_namespaces(namespaces)  # what an earlier test of dev left, so that this one starts from nothing
    users_objects(spec)
    project = engine_project(tmp_path, monkeypatch, twin=KUBECONFIG)
    program_stack(project, serving_program(tmp_path))  # `pulumi stack init dev`: the rollout selects it
    kubectl_dir = str(program("kubectl").parent)
    monkeypatch.setenv("PATH", kubectl_dir + os.pathsep + os.environ["PATH"])  # pdctl's kubectl: the twin's
    releases = tmp_path / "releases"
    store = ReleaseStore("dev", releases)
    cluster = PulumiCluster("dev", store, kubectl=str(program("kubectl")), work_dir=project.work_dir,
                            kube=KubeTarget("pdstack-dev", str(project.kubeconfig)))
    target = ["--spec", str(project.spec_file), "--pulumi-stack", "dev", "--pulumi-project", str(project.work_dir),
              "--releases", str(releases)]
    env = dict(os.environ)
    try:
        with healthy_prometheus() as prometheus, controllers_status(env_ns, spec.environment.name):
            rollout = ["rollout", *target, "--prometheus", prometheus, "--bake", "0"]
            first = pdctl([*rollout, "--stages", "100"], env)
            assert first.returncode == 0, first.stderr[-2000:]
            assert disagreements(store, cluster) == []

            trace = tmp_path / "trace.txt"
            traced = pdctl([*rollout, "--stages", "50,100"], {**env, "PDSTACK_FAULT_TRACE": str(trace)})
            assert traced.returncode == 0, traced.stderr[-2000:]
            points = trace.read_text().splitlines()
            assert any("apply deploy decode" in p for p in points) and any("traffic" in p for p in points), points

            def first_point(word: str) -> int:
                return next(int(p.split()[0]) for p in points if word in p)
            chosen = {"a store write": 2, "a step's up": first_point("apply deploy decode"),
                      "the traffic patch": first_point("traffic")}
            figures = []
            for (what, point), recovery in zip(chosen.items(), ("abort", "rollback", "abort")):
                killed = pdctl([*rollout, "--stages", "50,100"], {**env, "PDSTACK_FAULT_AT": str(point)})
                assert killed.returncode == -9, (what, killed.returncode, killed.stderr[-1500:])
                # What an operator runs after the crash (tests/test_fault_matrix.py recover()).
                done = pdctl(["rollout", *target, "--abort"] if recovery == "abort" else ["rollback", *target], env)
                assert done.returncode == 0, (what, recovery, done.stderr[-1500:])
                found = disagreements(store, cluster)
                assert found == [], (what, point, recovery, found)
                figures.append(f"{what} (point {point}): killed; {recovery}; 0 disagreements")
            print("\n".join(["SIGKILL row on the twin:", *figures]))
    finally:
        delete_namespaces(namespaces)
        kubectl("delete", "nodepools.karpenter.sh", "-l", f"pdstack.io/environment={spec.environment.name}",
                "--ignore-not-found", "--wait=false")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
