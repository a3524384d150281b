"""The twin's kubelet (twin/kubelet.py) on the twin: a pod starts only when what it references
exists, as a kubelet at k8s.io/kubernetes v1.34.4 would start it (pkg/kubelet/kubelet_pods.go
makeEnvironmentVariables; pkg/volume/configmap/configmap.go MakePayload; the rules are tested
one by one in tests/test_twin_kubelet.py), and a pod a process serves is Ready only when its
rendered readiness probe passes.

The fleet check every render goes through (tests/twin/placement.py assert_every_pod_bound) must
fail on the two deliberate breaks of issue #39: a release track's namespace without the weights
credentials Secret the rollout copies there (#37 item 4), and a ConfigMap without a key a pod
mounts. Each failure names the pod and the kubelet's reason; the same pods start once the
objects appear, with nothing restarted (the kubelet retries).
"""

from __future__ import annotations

import copy
import http.server
import json
import threading

import pytest

from infra.spec_checks import switch_engine
from tests.twin.placement import (assert_every_pod_bound, namespace_for_pods, remove_render, started_pods,
                                  users_objects)
from twin import dra, fleet, kubelet
from twin.api import kubectl
from twin.nodes import stack_nodes

CREDENTIALS = "weights-s3-credentials"


def test_a_track_without_its_credentials_and_a_config_map_without_its_key_fail_the_fleet_check(
        dev_nodes, tmp_path):
    """dev with vLLM as a rollout holds it (release track r1 in its own namespace), applied with
    two breaks: the track's copy of the user's credentials Secret left out, and the key
    `config.yaml` taken out of the ConfigMap the router's pod mounts it from. The fleet check fails
    naming each pod with the kubelet's reason (Init:CreateContainerConfigError `secret
    "weights-s3-credentials" not found`; FailedMount `configmap references non-existent config
    key: config.yaml`); once both are applied whole, the same pods start and the check passes."""
    from infra.offline import run_spec
    from infra.render.manifests import manifests, write_manifests
    from infra.tracks import plan_tracks

    spec, _ = switch_engine(dev_nodes, "vllm")
    tracks = plan_tracks([(1, 100, spec.model_dump(mode="json"))])
    write_manifests(manifests(run_spec(spec, tracks=tracks)), tmp_path)
    objects = fleet.read_rendered(tmp_path)
    track = f"{spec.environment.namespace}-r1"
    copied = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == CREDENTIALS
                  and o["metadata"]["namespace"] == track)
    mounted = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["namespace"] == track
                   and "config.yaml" in (o.get("data") or {}) and any(
                       item.get("key") == "config.yaml" for v in _volumes(objects, track)
                       if (v.get("configMap") or {}).get("name") == o["metadata"]["name"]
                       for item in v["configMap"].get("items") or ()))
    broken = copy.deepcopy(mounted)
    del broken["data"]["config.yaml"]
    applied = [broken if o is mounted else o for o in objects if o is not copied]
    users_objects(spec)  # the user's Secret in the environment's namespace: only the track's copy is missing
    try:
        result = fleet.apply_each_pass(applied)
        assert result.rejected == {}, result.rejected
        assert fleet.apply_each_pass(dra.stand_in(objects, stack_nodes(spec))).rejected == {}
        with pytest.raises(AssertionError) as caught:
            assert_every_pod_bound(spec, objects, result, "dev-vllm track r1, broken: no credentials, no key")
        said = str(caught.value)
        assert 'Init:CreateContainerConfigError' in said and f'secret "{CREDENTIALS}" not found' in said, said
        assert "configmap references non-existent config key: config.yaml" in said, said
        assert f"{track}/" in said, said

        assert fleet.apply_each_pass([copied, mounted]).rejected == {}
        # the kubelet retries: the same pods start, nothing restarted
        assert fleet.wait_for("the refused pods started", lambda: not started_pods({track}, refused_for=0).failing)
        assert_every_pod_bound(spec, objects, result, "dev-vllm track r1, mended")
    finally:
        remove_render(spec, objects, nodes=False)


def _volumes(objects: list[dict], namespace: str) -> list[dict]:
    def templates(o):
        spec = o.get("spec", {})
        if o["kind"] == "LeaderWorkerSet":
            t = spec["leaderWorkerTemplate"]
            return [t.get("leaderTemplate") or t["workerTemplate"], t["workerTemplate"]]
        return [spec["template"]] if "template" in spec else []
    return [v for o in objects if o["metadata"].get("namespace") == namespace
            for t in templates(o) for v in t["spec"].get("volumes") or ()]


class Health(http.server.BaseHTTPRequestHandler):
    code = 503

    def do_GET(self):
        self.send_response(type(self).code)
        self.end_headers()

    def log_message(self, *args):
        pass


NAMESPACE = "twin-kubelet-probes"


def _pod(name: str) -> dict:
    return json.loads(kubectl("get", "pod", "-n", NAMESPACE, name, "-o", "json").stdout)


def test_a_served_pod_is_ready_only_when_its_readiness_probe_passes(dev_nodes):
    """A pod annotated as served by a process (twin.pdstack.io/process) goes Running but not
    Ready; its readinessProbe (httpGet against a server this test runs on 127.0.0.1, period 1 s)
    fails on 503 and the pod stays not Ready; when the server answers 200 the pod turns Ready."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Health.code = 503
    probe = {"httpGet": {"host": "127.0.0.1", "port": server.server_address[1], "path": "/health"},
             "periodSeconds": 1, "failureThreshold": 1}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "served", "namespace": NAMESPACE, "annotations": {kubelet.PROCESS: "test"}},
           "spec": {"nodeName": f"{dev_nodes.environment.name}-system-0", "automountServiceAccountToken": False,
                    "containers": [{"name": "app", "image": "registry.invalid/app:1", "readinessProbe": probe}]}}
    try:
        namespace_for_pods(NAMESPACE)
        assert fleet.apply_each_pass([pod]).rejected == {}
        assert fleet.wait_for("the pod Running", lambda: _pod("served")["status"].get("phase") == "Running")
        # the probe has run and failed: an Unhealthy event, and the pod not Ready
        assert fleet.wait_for("the probe's failure", lambda: any(
            "Readiness probe failed" in e for e in fleet.scheduler_events(NAMESPACE, "served"))), \
            fleet.scheduler_events(NAMESPACE, "served")
        assert kubelet.condition(_pod("served"), "Ready")["status"] == "False"
        Health.code = 200
        assert fleet.wait_for("the pod Ready", lambda: kubelet.condition(_pod("served"), "Ready")["status"] == "True")
    finally:
        server.shutdown()
        server.server_close()
        kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=300s")
