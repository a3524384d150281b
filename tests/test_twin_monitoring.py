"""twin/monitoring.py's pure parts, without a twin: what the config reloader writes for the
operator's Prometheus pod, and the volume the twin gives its claim.

The reloader's rules are prometheus-operator v0.93.0's (cmd/prometheus-config-reloader, its
--config-file .../prometheus.yaml.gz and --config-envsubst-file .../prometheus.env.yaml, on
github.com/thanos-io/thanos pkg/reloader, which gunzips a `.gz` configuration and replaces each
`$(VAR)` from its environment, refusing an unset one).
"""

from __future__ import annotations

import base64
import gzip

import pytest

from twin import fleet, monitoring
from twin.api import TwinError


def _secret(config: str) -> dict:
    return {"data": {"prometheus.yaml.gz": base64.b64encode(gzip.compress(config.encode())).decode()}}


def test_the_generated_configuration_is_gunzipped_and_its_env_references_expanded():
    config = "global:\n  external_labels:\n    prometheus_replica: $(POD_NAME)\n# shard $(SHARD) of ${NOT_OURS}\n"
    files = monitoring.reloaded_files(_secret(config), {"rules-0": {"data": {"a.yaml": "groups: []\n"}}},
                                      {"POD_NAME": "prometheus-pdstack-0", "SHARD": "0"})
    assert files["config-out"]["prometheus.env.yaml"].decode() == (
        "global:\n  external_labels:\n    prometheus_replica: prometheus-pdstack-0\n# shard 0 of ${NOT_OURS}\n")
    assert files["rules-0"] == {"a.yaml": b"groups: []\n"}


def test_an_unset_variable_in_the_configuration_is_refused_naming_it():
    with pytest.raises(TwinError, match=r"\$\(SHARD\)"):
        monitoring.reloaded_files(_secret("x: $(SHARD)\n"), {}, {"POD_NAME": "p"})


def test_a_claim_gets_a_volume_bound_to_it_with_its_size_and_modes(tmp_path):
    claim = {"metadata": {"name": "prometheus-pdstack-db-prometheus-pdstack-0", "namespace": "monitoring"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "200Gi"}}}}
    volume = monitoring.claim_volume(claim, tmp_path)
    assert volume["spec"]["claimRef"] == {"namespace": "monitoring", "name": claim["metadata"]["name"]}
    assert volume["spec"]["capacity"] == {"storage": "200Gi"}
    assert volume["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "storageClassName" not in volume["spec"]  # the claim names none either


def test_a_required_wait_names_what_it_waited_for_and_a_failing_check_ends_it():
    """twin/fleet.py wait_for, the one wait of the twin's helpers (twin/monitoring.py, twin/live.py):
    `required` turns a wait that never held into a TwinError naming it; a check that raises (a
    process it needs exited) ends the wait with that error instead of waiting out the timeout."""
    with pytest.raises(TwinError, match="the operator's pod: not within 0 s"):
        fleet.wait_for("the operator's pod", lambda: None, timeout=0, interval=0, required=True)
    assert fleet.wait_for("a value", lambda: None, timeout=0, interval=0) is None  # not required: the last value
    assert fleet.wait_for("a value", lambda: 7, timeout=0, required=True) == 7

    def exited():
        raise TwinError("pod p: its process exited")
    with pytest.raises(TwinError, match="its process exited"):
        fleet.wait_for("Prometheus ready", exited, timeout=3600, required=True)


def test_the_monitors_and_the_prometheus_get_the_interval_and_nothing_else_changes():
    objects = [{"kind": "PodMonitor", "spec": {"podMetricsEndpoints": [{"port": "http", "interval": "15s"}]}},
               {"kind": "ServiceMonitor", "spec": {"endpoints": [{"port": "metrics"}]}},
               {"kind": "Prometheus", "spec": {"scrapeInterval": "30s"}},
               {"kind": "Service", "spec": {"ports": []}}]
    quick = monitoring.with_intervals(objects, "1s")
    assert [o["spec"] for o in quick] == [
        {"podMetricsEndpoints": [{"port": "http", "interval": "1s"}]}, {"endpoints": [{"port": "metrics", "interval": "1s"}]},
        {"scrapeInterval": "1s", "evaluationInterval": "1s"}, {"ports": []}]
    assert objects[0]["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"  # a copy: the render untouched
