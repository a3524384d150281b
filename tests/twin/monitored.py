"""A render of dev monitored on the twin, as the tests that read the fleet's metrics set it up
(tests/twin/test_metrics_on_twin.py: a rollout's two tracks; tests/twin/test_scaling_on_twin.py:
the pool KEDA scales): the platform's Prometheus, the render applied on its pools' nodes, its pods
running as processes at their addresses, and the Prometheus prometheus-operator makes of it
(twin/monitoring.py)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from infra.platform_stack.spec import load_platform_spec
from tests.twin.placement import assert_every_pod_bound, pods_in, remove_render, users_objects
from twin import dra, fleet, kubelet, monitoring, pods
from twin.nodes import stack_nodes
from twin.paths import ROOT

PLATFORM_SPEC = ROOT / "stacks" / "platform-dev.yaml"


@contextmanager
def monitored(spec, objects: list[dict], namespaces: set[str], label: str,
              interval: str) -> Iterator[tuple[pods.PodProcesses, str]]:
    """`objects` (a render of `spec`) applied on its pools' nodes with the platform's Prometheus
    (scraping and evaluating every `interval`), every pod bound, each pod of `namespaces` running at
    its address and Ready by its own probes, and the fleet's Prometheus beside them. Yields the
    processes and that Prometheus's URL; afterwards the processes are stopped and the render, its
    DRA stand-in and its nodes removed (`label` names the render in the run's figures)."""
    platform = load_platform_spec(PLATFORM_SPEC)
    nodes = stack_nodes(spec)
    assert fleet.apply_each_pass(nodes).rejected == {}
    users_objects(spec)
    processes = pods.PodProcesses()
    with monitoring.platform_prometheus(platform, interval):
        try:
            result = fleet.apply_each_pass(objects)
            assert result.rejected == {}, result.rejected
            assert fleet.apply_each_pass(dra.stand_in(objects, nodes)).rejected == {}
            assert_every_pod_bound(spec, objects, result, label)
            for namespace in sorted(namespaces):
                processes.start(namespace)
            ready_by_probes(processes, namespaces)
            with monitoring.fleet_prometheus(processes, platform.monitoring_namespace) as url:
                yield processes, url
        finally:
            processes.stop()
            remove_render(spec, objects)


def ready_by_probes(processes: pods.PodProcesses, namespaces: set[str], timeout: float = 300) -> None:
    """Until the kubelet has every started pod of `namespaces` Ready by its own rendered probes (a
    process that exits fails, naming it)."""
    def unready() -> list[str]:
        live = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods_in(namespaces)}
        return [f"{s.namespace}/{s.name}" for s in processes.started if s.namespace in namespaces
                and (kubelet.condition(live.get((s.namespace, s.name), {"status": {}}), "Ready") or {}).get(
                    "status") != "True"]
    deadline = time.monotonic() + timeout
    while (waiting := unready()) and time.monotonic() < deadline:
        processes.check()
        time.sleep(1)
    assert not waiting, f"not Ready by their probes within {timeout:.0f} s: {waiting}"
