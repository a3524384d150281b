"""The Automation API adapter's own logic: what a step targets, the tracks config it writes,
the readiness commands. The Pulumi CLI it drives is not installed here, so `up` is a
recording stand-in; everything it is given is computed by the real code."""

from __future__ import annotations

import json

import pytest

from infra.rollout.pulumi_cluster import PulumiCluster, wait_command, with_track, with_weights, without_track
from infra.rollout.releases import ReleaseStore
from infra.rollout.steps import plan_steps
from infra.offline import run_spec
from infra.spec import parse_spec
from tests.conftest import stack_data


class RecordingStack:
    """Stands in for pulumi.automation.Stack (get_all_config, set_config, up)."""

    def __init__(self):
        self.config: dict[str, str] = {}
        self.ups: list[dict] = []

    def get_all_config(self):
        from pulumi import automation as auto

        return {key: auto.ConfigValue(value) for key, value in self.config.items()}

    def set_config(self, key, value):
        self.config[key] = value.value

    def up(self, **kwargs):
        self.ups.append({**kwargs, "config": dict(self.config)})


@pytest.fixture
def cluster(tmp_path):
    store = ReleaseStore("prod", tmp_path)
    for threshold in (0.5, 0.6):
        data = stack_data("prod")
        data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = threshold
        store.create(parse_spec(data))
    waits = []
    c = PulumiCluster("prod", store, on_output=lambda line: None, run_command=lambda cmd: waits.append(cmd) or 0)
    c._stack = RecordingStack()
    c.waits = waits
    return c


def steps():
    spec = parse_spec(stack_data("prod"))
    return {s.name: s for s in plan_steps(spec, run_spec(spec).resources)}


def test_config_edits():
    entries = [{"revision": 1, "weight": 100}]
    assert with_track(entries, 2) == [{"revision": 1, "weight": 100}, {"revision": 2, "weight": 0}]
    assert with_weights(with_track(entries, 2), {1: 95, 2: 5}) == [{"revision": 1, "weight": 95}, {"revision": 2, "weight": 5}]
    assert without_track(with_track(entries, 2), 1) == [{"revision": 2, "weight": 0}]
    with pytest.raises(ValueError, match="not deployed"):
        with_weights(entries, {3: 100})


def test_wait_commands():
    assert wait_command("LeaderWorkerSet/engine-decode condition=Available", "pdstack-prod-r2") == [
        "kubectl", "wait", "leaderworkerset/engine-decode", "--for=condition=Available", "--timeout=1s", "-n", "pdstack-prod-r2"]
    assert "-n" not in wait_command("NodePool/pdstack-prod-decode condition=Ready", "x")


def test_a_step_targets_its_revisions_resources_and_keeps_secrets_out_of_logs(cluster):
    cluster._stack.config["pdstack:tracks"] = json.dumps([{"revision": 1, "weight": 100}])
    cluster.apply(2, steps()["deploy decode"])
    (up,) = cluster._stack.ups
    assert json.loads(up["config"]["pdstack:tracks"]) == [{"revision": 1, "weight": 100}, {"revision": 2, "weight": 0}]
    names = {urn.rsplit("::", 1)[1] for urn in up["target"]}
    assert names == {"r2-leaderworkerset-engine-decode", "r2-service-engine-decode-http", "r2-configmap-engine-decode-launch",
                     "r2-poddisruptionbudget-engine-decode", "r2-computedomain-engine-decode-nvlink"}
    assert all(urn.startswith("urn:pulumi:prod::pdstack::") for urn in up["target"])
    assert up["show_secrets"] is False and up["policy_packs"][0].endswith("/policy")
    assert cluster.ready(2, steps()["deploy decode"])
    assert cluster.waits[-1][-2:] == ["-n", "pdstack-prod-r2"]


def test_traffic_moves_by_updating_only_the_route(cluster):
    cluster._stack.config["pdstack:tracks"] = json.dumps([{"revision": 1, "weight": 100}, {"revision": 2, "weight": 0}])
    cluster.set_traffic({1: 95, 2: 5})
    (up,) = cluster._stack.ups
    assert [u.rsplit("::", 1)[1] for u in up["target"]] == ["httproute-gateway"]
    assert cluster.traffic() == {1: 95, 2: 5}
    with pytest.raises(ValueError, match="still takes traffic"):
        cluster.retire(2)
