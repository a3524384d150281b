"""twin/live.py's pure parts, without a twin: reading the client's answers, and the scrape targets a
rendered PodMonitor selects with the labels prometheus-operator gives them."""

from __future__ import annotations

from types import SimpleNamespace

from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from infra.offline import run_spec
from twin.live import Answer, monitor_targets, share_back, shares, track_of


def answer(at: float, by: int, ok: bool = True) -> Answer:
    return Answer(at, at + 1, by, by if ok else None, ok)


def test_the_share_is_back_from_the_first_request_after_the_last_one_another_track_answered():
    answers = [answer(0, 2), answer(1, 2), answer(2, 1), answer(3, 2), answer(4, 1), answer(5, 1, ok=False),
               answer(6, 1)]
    assert share_back(answers, 1, since=0.5) == 4 - 0.5  # r2 answered the request sent at 3
    assert share_back(answers, 2, since=0) is None  # the last answer is r1's: not back on r2
    assert share_back([answer(1, 1), answer(2, 1)], 1, since=0) == 1  # already there
    assert shares(answers) == {1: 0.5, 2: 0.5}  # the failed request counts for no track


def test_a_namespace_is_a_track_of_its_environment_or_nothing():
    assert [track_of(n, "pdstack-dev") for n in ("pdstack-dev", "pdstack-dev-r12", "pdstack-dev-research", "other")] \
        == [0, 12, None, None]


def test_the_rendered_pod_monitor_selects_the_engine_pods_with_the_operators_target_labels():
    """prometheus-operator v0.93.0 (pkg/prometheus/promcfg.go generatePodMonitorConfig): a PodMonitor's
    target carries namespace, pod, container, endpoint (the port's name), job podMonitor/<ns>/<name>/<i>,
    and each podTargetLabels label under its sanitised name; the gates select by those."""
    (monitor,) = run_spec(load_spec(stack_spec_path("dev"))).by_kind("PodMonitor")
    namespace = monitor["metadata"]["namespace"]
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]

    def pod(name: str, role: str | None) -> tuple:
        labels = {"pdstack.io/release": "3", **({"pdstack.io/role": role} if role else {})}
        return (SimpleNamespace(ip=f"10.244.0.{len(name)}"),
                {"metadata": {"name": name, "namespace": namespace, "labels": labels},
                 "spec": {"containers": [{"name": "engine", "ports": [{"name": port, "containerPort": 30000}]}]}})

    groups = monitor_targets(monitor, [pod("engine-decode-0", "decode"), pod("router-x", None)])
    assert groups == [{"targets": ["10.244.0.15:30000"], "labels": {
        "namespace": namespace, "pod": "engine-decode-0", "container": "engine", "endpoint": port,
        "job": f"podMonitor/{namespace}/{monitor['metadata']['name']}/0", "__metrics_path__": "/metrics",
        "pdstack_io_role": "decode", "pdstack_io_release": "3"}}]
