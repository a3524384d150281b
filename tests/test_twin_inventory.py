"""The controllers part of the fleet tests' one line per stack (twin/inventory.py), without a twin."""

from __future__ import annotations

from twin import inventory


def test_controllers_are_read_from_what_runs_and_what_a_stand_in_published():
    """Each live component is a controller for real or a stand-in; the API's own processes are
    neither, a component whose process is gone is not counted, and a stand-in made of objects
    (twin/dra.py's label) is named by its label."""
    components = {"etcd": True, "kube-apiserver": True, "kube-scheduler": True, "keda-operator": False,
                  "envoy-gateway": True, "kwok": True, "kubelet": True}
    labelled = [{"metadata": {"labels": {inventory.STAND_IN_LABEL: "nvidia-dra-driver-gpu"}}},
                {"metadata": {"labels": {inventory.STAND_IN_LABEL: "nvidia-dra-driver-gpu"}}}]
    real, stand_ins = inventory.controllers(components, labelled)
    assert real == ["envoy-gateway", "kube-scheduler"]
    assert stand_ins == ["kubelet", "kwok", "nvidia-dra-driver-gpu (its objects)"]
    assert inventory.summary(real, stand_ins) == (
        "controllers running for real 2 (envoy-gateway, kube-scheduler), "
        "stand-in 3 (kubelet, kwok, nvidia-dra-driver-gpu (its objects))")
