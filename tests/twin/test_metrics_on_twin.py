"""Metrics and alerts on the twin (#40): the Prometheus prometheus-operator v0.93.0 makes of the
platform's Prometheus and dev's rendered PodMonitor, ServiceMonitors and PrometheusRule, run at its
pod address (twin/monitoring.py: Prometheus v3.13.1, the operator's default, built from its Go
module; the config it generated, gunzipped as its config-reloader does), scraping the routers,
engine stand-ins and Mooncake masters twin/pods.py runs at theirs. dev (SGLang) is applied as a
rollout holds it: the serving track r1 and the canary r2, each in a namespace of its own with its
own monitors and rules.

- One up target per process that serves /metrics, and none for one that does not: which serve is
  read from the running pods themselves (GET /metrics on each container port through the pod
  network, once Ready by their own probes), not written here. The deliberate break: a PodMonitor
  whose port name is wrong leaves the engines unscraped, and the check names them.
- Every rendered alert rule is loaded and evaluates (Prometheus's /api/v1/rules: health ok), and
  none is active on the healthy fleet after each track answered a request.
- The canary's decode slowed (its stand-in told a 2.5 s TTFT and 60 ms ITL through /twin/timing:
  twin/engine_standin.py) makes the TTFT and TPOT warnings active for the canary's namespace and
  role decode only; the serving track's decode with broken hand-offs (SGLANG_HOST_IP=127.0.0.1 in
  its launch script) makes PdstackKVTransferErrors active for the serving namespace and decode only.
  Active: the rule's condition holds and Prometheus lists the alert (state `pending`, `firing`
  once the rule's own `for`, 5m and 1m as rendered, has passed: not waited out here).

Intervals: the rendered objects' own fields, set for this test only: the PodMonitor's and
ServiceMonitors' endpoint `interval` (dev's spec field observability.scrape_interval_seconds) and
the platform Prometheus's `scrapeInterval` at 1s; the Prometheus's `evaluationInterval` (the
platform stack leaves it to the operator's default, 30s) at 1s, a twin-side override of the
Prometheus CR's own field (twin/monitoring.py with_intervals).
"""

from __future__ import annotations

import copy
import json
import time
import urllib.parse
import urllib.request

import pytest

from infra import naming
from infra.components.engines import ENGINE_PORT_NAME
from infra.render.metrics import ROLE_SERIES_LABEL
from tests.twin.conftest import FIGURES
from tests.twin.monitored import monitored, ready_by_probes
from twin import fleet, monitoring, pods
from twin.api import kubectl

INTERVAL = "1s"
SLOW = {"ttft_ms": 2500, "itl_ms": 60}  # dev's SLO: TTFT p99 2000 ms, TPOT p99 50 ms (stacks/dev.yaml)


def api(url: str, path: str, **params) -> dict:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=30) as answer:
        return json.load(answer)["data"]


SERVING, CANARY = 1, 2  # the release tracks a rollout holds: revision 1 at 90%, revision 2 at 10%


@pytest.fixture(scope="module")
def monitored_dev(twin, tmp_path_factory):
    """dev (SGLang) as a rollout holds it (tracks r1 at 90% and r2 at 10%, each a namespace of its
    own with its own monitors and rules: infra/tracks.py) applied on its pools' nodes with the
    platform's Prometheus, every pod bound, each track's router and engine pods running at their
    addresses and the operator's Prometheus beside them; removed afterwards. Yields the spec,
    the objects, the processes, Prometheus's URL and each track's namespace by revision."""
    from infra.offline import run_spec
    from infra.render.manifests import manifests, write_manifests
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec
    from infra.tracks import plan_tracks
    from twin.engine import stand_in_pins

    spec = stand_in_pins(load_spec(stack_spec_path("dev")))
    data = spec.model_dump(mode="json")
    out = tmp_path_factory.mktemp("dev-metrics")
    write_manifests(manifests(run_spec(spec, tracks=plan_tracks([(SERVING, 90, data), (CANARY, 10, data)]))), out)
    objects = monitoring.with_intervals(fleet.read_rendered(out), INTERVAL)
    tracks = {revision: f"{spec.environment.namespace}-r{revision}" for revision in (SERVING, CANARY)}
    with monitored(spec, objects, set(tracks.values()), "dev-sglang, tracks r1 90% + r2 10% (metrics)",
                   INTERVAL) as (processes, url):
        yield spec, objects, processes, url, tracks


def serving_metrics(processes: pods.PodProcesses, namespaces: set[str]) -> set[tuple[str, str, int]]:
    """(namespace, pod, port) of every process in `namespaces` that answers GET /metrics in the
    text format, asked on each of its pod's container ports once the kubelet has it Ready by its
    own probes."""
    serving = set()
    for started in [p for p in processes.started if p.namespace in namespaces]:
        pod = json.loads(kubectl("get", "pod", started.name, "-n", started.namespace, "-o", "json").stdout)
        for port in pod["spec"]["containers"][0].get("ports", []):
            if serves_metrics(processes, started, port["containerPort"], timeout=10):
                serving.add((started.namespace, started.name, port["containerPort"]))
    return serving


def serves_metrics(processes: pods.PodProcesses, started: pods.Started, port: int, timeout: float) -> bool:
    """Whether the process answers GET /metrics on `port` in the text format within `timeout`
    (a port that is not HTTP, such as a transfer engine's, may hold the request unanswered)."""
    try:
        status, text = processes.request(started.ip, port, "/metrics", timeout=timeout)
    except OSError:
        return False
    return status == 200 and "# TYPE " in text


def targets(url: str, namespaces: set[str]) -> dict[tuple[str, str, int], str]:
    """(namespace, pod, port) -> health of every active target in `namespaces`, once each was scraped."""
    def scraped():
        active = [t for t in api(url, "targets", state="active")["activeTargets"]
                  if t["labels"].get("namespace") in namespaces]
        return active if active and all(t["health"] != "unknown" for t in active) else None
    active = fleet.wait_for("every target scraped", scraped, timeout=120, interval=1) or []
    return {(t["labels"]["namespace"], t["labels"].get("pod", ""), urllib.parse.urlsplit(t["scrapeUrl"]).port or 0):
            t["health"] for t in active}


def assert_targets_are_the_serving_processes(url: str, processes: pods.PodProcesses, namespaces: set[str]) -> dict:
    expected = serving_metrics(processes, namespaces)
    roles = {(p.namespace, p.name): p.role for p in processes.started}
    assert {roles[(ns, name)] for ns, name, _ in expected} >= {naming.ROUTER, "prefill", "decode"}, expected
    found = fleet.wait_for("the targets", lambda: (lambda t: t if set(t) == expected else None)(
        targets(url, namespaces)), timeout=60, interval=1) or targets(url, namespaces)
    # A target Prometheus scraped that the first ask missed is asked again, patiently: on a loaded
    # machine the 10 s above ran out on a router and a prefill that serve /metrics (a fresh clone's
    # run at load 44). It counts only if the process itself answers in the text format.
    started = {(p.namespace, p.name): p for p in processes.started}
    expected |= {(ns, name, port) for ns, name, port in set(found) - expected
                 if (ns, name) in started and serves_metrics(processes, started[(ns, name)], port, timeout=60)}
    assert set(found) == expected, (f"targets of no serving process: {sorted(set(found) - expected)}; serving "
                                    f"processes with no target: {sorted(expected - set(found))}")
    assert set(found.values()) == {"up"}, found
    return found


def test_one_up_target_per_process_that_serves_metrics(monitored_dev):
    _, _, processes, url, tracks = monitored_dev
    found = assert_targets_are_the_serving_processes(url, processes, set(tracks.values()))
    FIGURES.append(f"dev-sglang metrics (tracks r1 + r2): Prometheus v3.13.1 as prometheus-operator v0.93.0 "
                   f"configured it, at its pod address; targets up {len(found)} = processes serving /metrics "
                   f"{len(found)}, down 0 ({', '.join(sorted(f'{n}:{p}' for _, n, p in found))})")


def test_a_pod_monitor_whose_port_name_is_wrong_leaves_the_engines_unscraped(monitored_dev):
    """The deliberate break: the serving track's PodMonitor naming a port its pods do not have.
    The operator's configuration keeps no engine target of that track, so the check above fails
    naming the engines as serving processes with no target; applied as rendered, they come back."""
    _, objects, processes, url, tracks = monitored_dev
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["namespace"] == tracks[SERVING]]
    broken = copy.deepcopy(monitor)
    broken["spec"]["podMetricsEndpoints"][0]["port"] = ENGINE_PORT_NAME + "s"
    assert fleet.apply_each_pass([broken]).rejected == {}
    try:
        def engines_gone():
            return not any(ns == tracks[SERVING] and roles.get(name) in ("prefill", "decode")
                           for ns, name, _ in targets(url, set(tracks.values())))
        roles = {p.name: p.role for p in processes.started}
        assert fleet.wait_for("the engine targets gone", engines_gone, timeout=120, interval=1)
        with pytest.raises(AssertionError, match="serving processes with no target") as caught:
            assert_targets_are_the_serving_processes(url, processes, set(tracks.values()))
        missing = [p.name for p in processes.started if p.namespace == tracks[SERVING] and p.role in ("prefill", "decode")]
        assert all(name in str(caught.value) for name in missing), str(caught.value)
    finally:
        assert fleet.apply_each_pass([monitor]).rejected == {}
    assert_targets_are_the_serving_processes(url, processes, set(tracks.values()))


def _rules(url: str) -> list[dict]:
    return [r for g in api(url, "rules")["groups"] for r in g["rules"]]


def _active(url: str) -> list[dict]:
    return api(url, "alerts")["alerts"]


def _alerts(rendered_rule: dict) -> set[str]:
    return {r["alert"] for g in rendered_rule["spec"]["groups"] for r in g["rules"]}


def test_every_alert_rule_evaluates_and_none_is_active_on_a_healthy_fleet(monitored_dev):
    """Every rule of each track's PrometheusRule is loaded (its file from the operator's rule
    ConfigMap) and evaluated after requests were answered by both tracks, each healthy (health
    ok: no rule errors on the scraped series), and no alert is active (pending or firing)."""
    _, objects, processes, url, tracks = monitored_dev
    rules_by_track = {o["metadata"]["namespace"]: _alerts(o) for o in objects if o["kind"] == "PrometheusRule"}
    assert set(rules_by_track) == set(tracks.values())
    for namespace in tracks.values():
        pods.send_request(namespace, check=processes.check)
    since = time.time()
    expected = sum(len(names) for names in rules_by_track.values())

    def evaluated():
        rules = [r for r in _rules(url) if r["name"] in set().union(*rules_by_track.values())]
        fresh = [r for r in rules if _seconds(r.get("lastEvaluation", "")) > since + 1]
        return rules if len(rules) == expected and len(fresh) == expected else None
    rules = fleet.wait_for("every rendered rule evaluated after the requests", evaluated, timeout=120, interval=1)
    assert rules, f"rules loaded {sorted(r['name'] for r in _rules(url))}, rendered {rules_by_track}"
    assert [r for r in rules if r["health"] != "ok"] == []
    assert _active(url) == []
    FIGURES.append(f"dev-sglang alerts (tracks r1 + r2): {expected} rendered rules loaded and evaluated, health ok; "
                   f"active on the healthy fleet after each track answered: 0")


def _seconds(stamp: str) -> float:
    """An RFC 3339 time from Prometheus's API (nanoseconds, a zone) as Unix time; 0 for none."""
    import datetime
    import re

    said = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:\d\d)", stamp or "")
    if not said or stamp.startswith("0001"):
        return 0.0
    return datetime.datetime.fromisoformat(said[1] + ("+00:00" if said[2] == "Z" else said[2])).timestamp()


def _engine_port(started: pods.Started) -> int:
    pod = json.loads(kubectl("get", "pod", started.name, "-n", started.namespace, "-o", "json").stdout)
    return next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == ENGINE_PORT_NAME)


def test_a_slow_decode_in_the_canary_makes_its_latency_alerts_active_for_that_track_and_role(monitored_dev):
    """The canary track's decode instance slowed (its stand-in told a 2.5 s TTFT and 60 ms ITL): after
    requests through that track's router, the TTFT and TPOT warnings are active with the canary's
    namespace and role decode, and no alert names the serving track or another role."""
    _, _, processes, url, tracks = monitored_dev
    canary = tracks[CANARY]
    (decode,) = [p for p in processes.started if p.namespace == canary and p.role == "decode"]
    status, said = processes.request(decode.ip, _engine_port(decode), "/twin/timing", SLOW)
    assert status == 200, said
    for _ in range(3):
        pods.send_request(canary, check=processes.check)
    latency = {"PdstackTTFTp99Warning", "PdstackTPOTp99Warning"}

    def active():
        alerts = _active(url)
        return alerts if latency <= {a["labels"]["alertname"] for a in alerts} else None
    alerts = fleet.wait_for("the latency alerts", active, timeout=120, interval=1) or _active(url)
    assert latency <= {a["labels"]["alertname"] for a in alerts}, alerts
    assert {(a["labels"]["namespace"], a["labels"][ROLE_SERIES_LABEL]) for a in alerts} == {(canary, "decode")}, alerts
    FIGURES.append(f"dev-sglang canary r{CANARY}'s decode slow (TTFT {SLOW['ttft_ms']} ms, ITL {SLOW['itl_ms']} ms): "
                   + ", ".join(sorted(f"{a['labels']['alertname']} {a['state']} ({a['labels']['namespace']}, "
                                      f"{a['labels'][ROLE_SERIES_LABEL]})" for a in alerts)))


def test_failed_hand_offs_on_the_serving_decode_make_the_transfer_alert_active_for_it(monitored_dev):
    """The serving track's decode restarted with a wrong hostname for its transfer engine (its
    launch script exports SGLANG_HOST_IP=127.0.0.1, as tests/twin/test_requests_on_twin.py breaks
    it): the prefill's KV writes fail in Mooncake, the decode aborts those requests (500) and
    counts them in its own sglang:num_transfer_failed_reqs_total (twin/engine_standin.py, SGLang
    0.5.23's counter), and PdstackKVTransferErrors is active for that track's namespace and role
    decode, and no other; the canary's rule, reading its own namespace, stays quiet."""
    from infra.render.router_config import ROUTER_PORT

    _, objects, processes, url, tracks = monitored_dev
    serving = tracks[SERVING]
    (original,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "engine-decode-launch"
                   and o["metadata"]["namespace"] == serving]
    broken = copy.deepcopy(original)
    script = broken["data"]["launch.sh"]
    assert "\nexec python3 -m sglang.launch_server" in script
    broken["data"]["launch.sh"] = script.replace("\nexec python3", "\nexport SGLANG_HOST_IP=127.0.0.1\nexec python3", 1)
    (decode,) = [p for p in processes.started if p.namespace == serving and p.role == "decode"]
    (router,) = [p for p in processes.started if p.namespace == serving and p.role == naming.ROUTER]
    assert fleet.apply_each_pass([broken]).rejected == {}
    try:
        processes.stop_pod(decode)
        processes.start_pod(json.loads(kubectl("get", "pod", decode.name, "-n", serving, "-o", "json").stdout))
        ready_by_probes(processes, {serving})
        model = json.loads(processes.request(router.ip, ROUTER_PORT, "/v1/models")[1])["data"][0]["id"]
        statuses = []
        deadline = time.monotonic() + 300
        while 500 not in statuses and time.monotonic() < deadline:  # the router finds the restarted decode
            processes.check()
            try:
                statuses.append(processes.request(router.ip, ROUTER_PORT, "/v1/chat/completions",
                                                  {**pods.CHAT, "model": model})[0])
            except OSError:
                time.sleep(1)
        assert 500 in statuses, statuses

        def active():
            alerts = [a for a in _active(url) if a["labels"]["alertname"] == "PdstackKVTransferErrors"]
            return alerts or None
        alerts = fleet.wait_for("the transfer alert", active, timeout=120, interval=1) or []
        assert {(a["labels"]["namespace"], a["labels"][ROLE_SERIES_LABEL]) for a in alerts} == {(serving, "decode")}, \
            _active(url)
        FIGURES.append(f"dev-sglang serving r{SERVING}'s decode hand-offs broken (SGLANG_HOST_IP=127.0.0.1): "
                       f"{statuses.count(500)} of {len(statuses)} requests aborted; "
                       + ", ".join(f"{a['labels']['alertname']} {a['state']} ({a['labels']['namespace']}, "
                                   f"{a['labels'][ROLE_SERIES_LABEL]})" for a in alerts))
    finally:
        assert fleet.apply_each_pass([original]).rejected == {}  # restored as rendered
