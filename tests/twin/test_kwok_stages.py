"""What the twin's kwok does with a pod being deleted: what a kubelet does (twin/crds.py
kwok_stages, twin/stages/pod-terminate-on-delete.yaml).

With kwok's stock stages a deleted pod held by a finalizer stayed Running. One such finalizer is
the garbage collector's foregroundDeletion, on the pods of an LWS group that a rolling update
deletes. Those pods own IMEX channel ResourceClaims, which the resourceclaim controller keeps
reserved until the pod is in a terminal phase (k8s.io/kubernetes v1.34.4
pkg/controller/resourceclaim/controller.go isPodDone). So prod's decode rolling update sometimes
hung: pods Terminating with foregroundDeletion for the whole 600 s deadline, seen in
tests/twin/test_fleet_on_twin.py (prod-vllm) on 2026-12-06.
"""

from __future__ import annotations

import json

from tests.twin.placement import namespace_for_pods
from twin import fleet
from twin.api import kubectl

NAMESPACE = "twin-kwok-stages"
HOLD = "twin.pdstack.io/hold"


def pod_phase(name: str) -> str | None:
    done = kubectl("get", "pod", "-n", NAMESPACE, name, "-o", "json", check=False)
    return json.loads(done.stdout)["status"].get("phase") if done.returncode == 0 else None


def test_a_deleted_pod_held_by_a_finalizer_goes_to_a_terminal_phase_and_then_goes(dev_nodes):
    """A Running pod on a kwok node, deleted while a finalizer holds it, turns Succeeded (its
    containers terminated), as a kubelet's pod does once its containers stop. When the finalizer
    is removed, the pod is gone."""
    node = f"{dev_nodes.environment.name}-system-0"
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "held", "namespace": NAMESPACE, "finalizers": [HOLD]},
           "spec": {"nodeName": node, "containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}
    try:
        namespace_for_pods(NAMESPACE)
        assert fleet.apply_each_pass([pod]).rejected == {}
        assert fleet.wait_for("the pod Running", lambda: pod_phase("held") == "Running"), pod_phase("held")
        kubectl("delete", "pod", "-n", NAMESPACE, "held", "--wait=false")
        assert fleet.wait_for("the pod terminal", lambda: pod_phase("held") == "Succeeded"), pod_phase("held")
        state = json.loads(kubectl("get", "pod", "-n", NAMESPACE, "held", "-o", "json").stdout)["status"]
        assert all("terminated" in c["state"] for c in state["containerStatuses"]), state
        kubectl("patch", "pod", "-n", NAMESPACE, "held", "--type=json",
                "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]')
        assert fleet.wait_for("the pod gone", lambda: pod_phase("held") is None), pod_phase("held")
    finally:
        kubectl("patch", "pod", "-n", NAMESPACE, "held", "--type=json",
                "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]', check=False)
        kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=300s")
