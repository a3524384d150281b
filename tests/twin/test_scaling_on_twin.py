"""Scaling on live load, dev (SGLang), on the twin (#40 "Scaling"): load raised on decode, the real
KEDA operator and the HPA controller scale the decode LeaderWorkerSet through its scale subresource,
the scheduler binds the new group, its pod is started and takes traffic; load lowered, it scales back.

What moves the decode pool is the rendered ScaledObject's ITL trigger
(`(histogram_quantile(0.99, sum by (le) (rate(sglang:inter_token_latency_seconds_bucket{...decode}[2m])))
> 0.04) or vector(0)`, threshold 0.04), read from the fleet's Prometheus (the operator's configuration
of dev's PodMonitor, scraping the engine stand-ins; twin/monitoring.py). The stand-ins' inter-token
time is the fleet model's (twin/engine_standin.py, POST /twin/timing): told 70 ms, the decode's
p99 lands in SGLang's 0.06-0.08 bucket (sglang 0.5.23 observability/metrics_collector.py), above
the 40 ms target, so the HPA (External, AverageValue) asks for ceil(0.08 / 0.04) = 2 decode groups,
the pool's maxReplicaCount.

The path of the metric: HPA controller -> API server -> aggregator -> egress proxy (twin/egress.py) ->
KEDA's metrics API server in the pod network -> the KEDA operator's gRPC -> its Prometheus query ->
the fleet's Prometheus. Each is the real program; none is asserted on separately here.

Test-only changes to the render, named: each trigger's serverAddress (twin/scaling.py reading: the
platform's Service name resolves nowhere on the twin), the scrape and evaluation intervals at 1s
(twin/monitoring.py with_intervals, as tests/twin/test_metrics_on_twin.py), and the decode HPA's
scale-down stabilization window (rendered 600 s, dev's deployment.autoscaling) at 0, so the
scale-down shows within the test; its policy (one pod per 300 s) is kept.
"""

from __future__ import annotations

import json
import time

import pytest

from infra import naming
from infra.components.engines import ENGINE_PORT_NAME
from tests.twin.conftest import FIGURES
from tests.twin.monitored import monitored, ready_by_probes
from twin import fleet, monitoring, pods, scaling
from twin.api import kubectl

INTERVAL = "1s"
SLOW_ITL = {"itl_ms": 70}
HEALTHY_ITL = {"itl_ms": 5}  # the stand-in's default (TWIN_STANDIN_ITL_MS)


@pytest.fixture(scope="module")
def scaling_dev(twin, tmp_path_factory):
    """dev (SGLang) applied on its pools' nodes with the platform's Prometheus, every pod bound and
    running at its address, the fleet's Prometheus beside them, and the ScaledObjects reading it;
    removed afterwards. Yields the spec, the rendered objects, the processes and the ScaledObjects."""
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec
    from twin.engine import stand_in_pins

    spec = stand_in_pins(load_spec(stack_spec_path("dev")))
    objects = monitoring.with_intervals(fleet.render("dev", tmp_path_factory.mktemp("dev-scaling")), INTERVAL)
    namespace = spec.environment.namespace
    scaled = [o for o in objects if o["kind"] == "ScaledObject"]
    with monitored(spec, [o for o in objects if o["kind"] != "ScaledObject"], {namespace},
                   "dev-sglang (scaling)", INTERVAL) as (processes, url):
        scaled = scaling.reading(scaled, url)
        for obj in scaled:
            behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
            behavior["scaleDown"]["stabilizationWindowSeconds"] = 0
        assert fleet.apply_each_pass(scaled).rejected == {}
        yield spec, objects, processes, scaled


def _role(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get(naming.ROLE_LABEL)


def _replicas(namespace: str, name: str) -> int:
    return json.loads(kubectl("get", "leaderworkerset", name, "-n", namespace, "-o", "json").stdout)["spec"]["replicas"]


def _hpa(scaled: dict) -> dict:
    name = scaled["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get(
        "name", f"keda-hpa-{scaled['metadata']['name']}")
    return json.loads(kubectl("get", "hpa", name, "-n", scaled["metadata"]["namespace"], "-o", "json").stdout)


def _condition(obj: dict, kind: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def _port(pod: dict, name: str) -> int:
    return next(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == name)


def _pod(started: pods.Started) -> dict:
    return json.loads(kubectl("get", "pod", started.name, "-n", started.namespace, "-o", "json").stdout)


def _served(processes: pods.PodProcesses, started: pods.Started) -> float:
    status, text = processes.request(started.ip, _port(_pod(started), ENGINE_PORT_NAME), "/metrics")
    assert status == 200, text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_requests_total{"))


def _set_timing(processes: pods.PodProcesses, decodes: list[pods.Started], timing: dict) -> None:
    for decode in decodes:
        status, said = processes.request(decode.ip, _port(_pod(decode), ENGINE_PORT_NAME), "/twin/timing", timing)
        assert status == 200, said


def test_decode_scales_out_on_load_takes_traffic_and_scales_back(scaling_dev):
    spec, objects, processes, scaled = scaling_dev
    namespace = spec.environment.namespace
    decode_scaled = next(o for o in scaled if _role(o) == "decode")
    lws = decode_scaled["spec"]["scaleTargetRef"]["name"]
    low, high = decode_scaled["spec"]["minReplicaCount"], decode_scaled["spec"]["maxReplicaCount"]
    assert _replicas(namespace, lws) == low == 1 and high == 2, (low, high)

    # the HPA reads its metrics (KEDA's metrics API server) before any load: ScalingActive
    reads = fleet.wait_for("the decode HPA reading its metrics", lambda: _condition(
        _hpa(decode_scaled), "ScalingActive").get("status") == "True", timeout=180)
    assert reads, _hpa(decode_scaled).get("status")

    (router,) = [s for s in processes.started if s.role == naming.ROUTER]
    router_port = _port(_pod(router), "http")
    status, models = processes.request(router.ip, router_port, "/v1/models")
    assert status == 200, models
    model = json.loads(models)["data"][0]["id"]
    first_decodes = [s for s in processes.started if s.role == "decode"]
    started_at = time.monotonic()
    _set_timing(processes, first_decodes, SLOW_ITL)
    with scaling.Load(processes.network.client_socket, router.ip, router_port, model) as load:
        scaled_out = fleet.wait_for("the decode pool scaled out", lambda: _replicas(namespace, lws) == high,
                                    timeout=420, interval=3)
        hpa = _hpa(decode_scaled)
        assert scaled_out, (f"decode stayed at {_replicas(namespace, lws)} under load: HPA {hpa.get('status')}; "
                            f"load {dict(load.counts)} {load.errors[:3]}")
        out_seconds = time.monotonic() - started_at
        # the new group: bound by the scheduler (on a node Karpenter launches if the pool's are full),
        # started as a process at its address, Ready by its own probes, then taking the router's traffic.
        # Every new pod is started: the prefill pool may scale out too (its TTFT trigger, with the
        # hand-off's wait on a loaded machine), and a pod no process serves would take requests and fail them
        known = {s.name for s in processes.started}
        new = processes.start(namespace, select=lambda p: p["metadata"]["name"] not in known)
        ready_by_probes(processes, {namespace})
        new_decodes = [s for s in new if s.role == "decode"]
        assert new_decodes, f"no new decode pod: {[s.name for s in new]}"
        def taking_traffic() -> bool:
            processes.check()  # a process that exited ends the wait, naming it
            try:
                return all(_served(processes, s) > 0 for s in new_decodes)
            except OSError:  # its port not open yet: a pod just started reads Ready for up to a
                return False  # second before the kubelet's first probe round (README, known gap)

        took = fleet.wait_for("the new decode taking traffic", taking_traffic, timeout=180, interval=2)
        processes.check()
        assert took, f"the new decode pods took no request: {[(s.name, _served(processes, s)) for s in new_decodes]}"
        new_served = {s.name: _served(processes, s) for s in new_decodes}
    # load lowered: no more requests, and the decodes healthy again; the ITL p99 over the trigger's
    # 2-minute window falls to nothing and the HPA scales the pool back to its floor
    _set_timing(processes, first_decodes + new_decodes, HEALTHY_ITL)
    lowered_at = time.monotonic()
    back = fleet.wait_for("the decode pool back to its floor", lambda: _replicas(namespace, lws) == low,
                          timeout=420, interval=3)
    assert back, f"decode stayed at {_replicas(namespace, lws)}: HPA {_hpa(decode_scaled).get('status')}"
    back_seconds = time.monotonic() - lowered_at
    prefill = next(o for o in scaled if _role(o) == "prefill")
    prefill_replicas = _replicas(namespace, prefill["spec"]["scaleTargetRef"]["name"])
    assert prefill["spec"]["minReplicaCount"] <= prefill_replicas <= prefill["spec"]["maxReplicaCount"]
    for started in new:  # their pods are gone with the group: end their processes
        processes.stop_pod(started)
    assert load.counts["failed"] == 0, (dict(load.counts), load.errors[:5])
    FIGURES.append(
        f"dev-sglang scaling on live load: decode ITL 70 ms -> its HPA (KEDA v2.20.2 + kube-controller-manager) "
        f"scaled {lws} {low} -> {high} in {out_seconds:.0f} s; new group started and Ready, took "
        f"{sum(new_served.values()):.0f} requests; load lowered: back to {low} in {back_seconds:.0f} s; requests "
        f"sent {load.counts['sent']} / answered {load.counts['answered']} / failed {load.counts['failed']}")
