"""The fault matrix's SIGKILL row (tests/test_fault_matrix.py) against the cluster twin instead of
the simulated cluster file: `pdctl rollout --pulumi-stack dev`, a real process driving the real
Pulumi engine and the twin's API server, kills itself just before one of its changes
(PDSTACK_FAULT_AT: a store write, a targeted `up`, a patch of the route), then the recovery an
operator would run (`rollout --abort` or `rollback`), and a check that the live route and the
release store agree.

The canary gate reads the fleet's Prometheus, not a stand-in: dev's scenario on live traffic
(twin/live.py live_dev: every track's pods running as processes at their pod addresses, the
Prometheus prometheus-operator makes of the platform's and the tracks' rendered monitors scraping
them, a client sending requests throughout along the live route), so each stage that passes
passed on series scraped from the engine stand-ins (SGLang 0.5.23's histograms and counters), and
a rollout's first revision is judged on its own traffic. What else stands in: see twin/live.py.

Each run here takes about a minute of targeted ups, so the row runs at a few points chosen from
the traced rollout (a store write, a step's `up`, the traffic patch), not at all of them as the
simulated matrix does. The rollouts go to 100% in one stage: at 50% the gate also compares the
canary with the serving revision, and the KV transfer's p99, which no fleet model sets, differed by
more than its 1.2x between two healthy tracks on a loaded machine (161.5 ms vs 92.7 ms, load average
50): noise that would stop the rollout before the points this row kills at.
"""

from __future__ import annotations

import sys
import time

import pytest

from infra.rollout.pulumi_cluster import KubeTarget, PulumiCluster
from infra.rollout.releases import ReleaseStore
from tests.engine import require_engine
from tests.twin.conftest import FIGURES
from twin.build import program
from twin.live import live_dev


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


def test_a_rollout_killed_at_its_changes_on_the_twin_is_recovered_to_agreement(twin, tmp_path):
    require_engine()
    began = time.monotonic()
    with live_dev(tmp_path) as env:
        cluster = PulumiCluster("dev", env.store, kubectl=str(program("kubectl")), work_dir=env.target[3],
                                kube=KubeTarget("pdstack-dev", str(tmp_path / "kubeconfig")))
        first = env.rollout(env.base_spec, "100")
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert disagreements(env.store, cluster) == []

        trace = tmp_path / "trace.txt"
        traced = env.rollout(env.base_spec, "100", {"PDSTACK_FAULT_TRACE": str(trace)})
        assert traced.returncode == 0, traced.stdout[-2000:] + traced.stderr[-2000:]
        points = trace.read_text().splitlines()
        judged = [e for e in env.store.audit_entries() if e["action"] == "canary" and e["revision"] == 2]
        assert [e["stage"] for e in judged] == [100] and all(e["outcome"] == "passed" for e in judged), judged
        ttft = next(g["detail"] for g in judged[0]["gates"] if g["gate"].startswith("TTFT p99 vs SLO"))
        assert any("apply deploy decode" in p for p in points) and any("traffic" in p for p in points), points

        def first_point(word: str) -> int:
            return next(int(p.split()[0]) for p in points if word in p)
        chosen = {"a store write": 2, "a step's up": first_point("apply deploy decode"),
                  "the traffic patch": first_point("traffic")}
        figures = []
        for (what, point), recovery in zip(chosen.items(), ("abort", "rollback", "abort")):
            killed = env.rollout(env.base_spec, "100", {"PDSTACK_FAULT_AT": str(point)})
            assert killed.returncode == -9, (what, killed.returncode, killed.stderr[-1500:])
            # What an operator runs after the crash (tests/test_fault_matrix.py recover()).
            done = env.abort() if recovery == "abort" else env.rollback()
            assert done.returncode == 0, (what, recovery, done.stderr[-1500:])
            found = disagreements(env.store, cluster)
            assert found == [], (what, point, recovery, found)
            figures.append(f"{what} (point {point}): killed; {recovery}; 0 disagreements")
        answers = env.client.since(0)
        FIGURES.append(f"dev-sglang SIGKILL row (gate on the fleet's Prometheus, live traffic; r2: TTFT p99 vs SLO "
                       f"{ttft}): {'; '.join(figures)}; "
                       f"{len(answers)} requests, {sum(not a.ok for a in answers)} failed; "
                       f"{time.monotonic() - began:.0f} s")
    print(FIGURES[-1])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
