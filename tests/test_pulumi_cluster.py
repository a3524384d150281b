"""The Automation API adapter's own logic: what a step targets (from the tracks the release
store records), the readiness commands, the live route it reads. The Pulumi CLI and kubectl
it drives are not installed here, so `up` and kubectl are recording stand-ins; everything
they are given is computed by the real code."""

from __future__ import annotations

import json

import pytest

from infra.rollout.pulumi_cluster import PulumiCluster, traffic_from_route, wait_command
from infra.rollout.releases import ReleaseStore
from infra.rollout.steps import plan_steps
from infra.offline import run_spec
from infra.spec_checks import parse_spec
from tests.conftest import stack_data


class RecordingStack:
    """Stands in for pulumi.automation.Stack (up)."""

    def __init__(self):
        self.ups: list[dict] = []

    def up(self, **kwargs):
        self.ups.append(kwargs)


@pytest.fixture
def cluster(tmp_path):
    store = ReleaseStore("prod", tmp_path)
    for threshold in (0.5, 0.6):
        data = stack_data("prod")
        data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = threshold
        store.create(parse_spec(data))
    waits = []
    route = {"spec": {"rules": [{"backendRefs": [{"name": "router", "namespace": "pdstack-prod-r1", "weight": 100}]}]}}
    c = PulumiCluster("prod", store, on_output=lambda line: None, run_command=lambda cmd: waits.append(cmd) or 0,
                      read_command=lambda cmd: json.dumps(route))
    c._stack = RecordingStack()
    c.waits = waits
    return c


def steps():
    spec = parse_spec(stack_data("prod"))
    return {s.name: s for s in plan_steps(spec, run_spec(spec).resources)}


def test_the_live_route_is_read_as_traffic_per_revision():
    """Backends as infra/components/access.py renders them: the track's router Service (or its
    InferencePool) in `<namespace>-r<revision>`, weight per Gateway API HTTPBackendRef
    (gateway-api apis/v1/httproute_types.go: weight defaults to 1)."""
    route = {"spec": {"rules": [{"backendRefs": [
        {"name": "router", "namespace": "pdstack-prod-r7", "port": 8000, "weight": 95},
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool",
         "namespace": "pdstack-prod-r8", "weight": 5}]}]}}
    assert traffic_from_route(route, "pdstack-prod") == {7: 95, 8: 5}
    assert traffic_from_route({"spec": {"rules": [{"backendRefs": [{"name": "router"}]}]}}, "pdstack-prod") == {0: 1}


def test_wait_commands():
    assert wait_command("LeaderWorkerSet/engine-decode condition=Available", "pdstack-prod-r2") == [
        "kubectl", "wait", "leaderworkerset/engine-decode", "--for=condition=Available", "--timeout=1s", "-n", "pdstack-prod-r2"]
    assert "-n" not in wait_command("NodePool/pdstack-prod-decode condition=Ready", "x")


def test_a_step_targets_its_revisions_resources_and_keeps_secrets_out_of_logs(cluster):
    with pytest.raises(ValueError, match="record it first"):  # the program would not deploy it
        cluster.apply(2, steps()["deploy decode"])
    cluster.store.intend({1: 100, 2: 0})
    cluster.apply(2, steps()["deploy decode"])
    (up,) = cluster._stack.ups
    names = {urn.rsplit("::", 1)[1] for urn in up["target"]}
    assert names == {"r2-leaderworkerset-engine-decode", "r2-service-engine-decode-http", "r2-configmap-engine-decode-launch",
                     "r2-poddisruptionbudget-engine-decode", "r2-computedomain-engine-decode-nvlink"}
    assert all(urn.startswith("urn:pulumi:prod::pdstack::") for urn in up["target"])
    assert up["show_secrets"] is False and up["policy_packs"][0].endswith("/policy")
    assert cluster.ready(2, steps()["deploy decode"])
    assert cluster.waits[-1][-2:] == ["-n", "pdstack-prod-r2"]


def test_traffic_moves_by_updating_only_the_route(cluster):
    cluster.store.intend({1: 100, 2: 0})
    with pytest.raises(ValueError, match="not what the release store records"):
        cluster.set_traffic({1: 95, 2: 5})
    cluster.store.intend({1: 95, 2: 5})
    cluster.set_traffic({1: 95, 2: 5})
    (up,) = cluster._stack.ups
    assert [u.rsplit("::", 1)[1] for u in up["target"]] == ["httproute-gateway"]
    assert cluster.traffic() == {1: 100}  # the live route (the stand-in's), not the intent
    with pytest.raises(ValueError, match="still takes traffic"):
        cluster.retire(1)
