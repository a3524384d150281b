"""The status the twin writes for a pod's init containers, as the kubelet at k8s.io/kubernetes
v1.34.4 writes it, and the STATUS kubectl prints from it (twin/init_containers.py):
- pkg/kubelet/kuberuntime/kuberuntime_container.go computeInitContainerActions: the next init
  container starts only after the one before exited 0; pkg/kubelet/kubelet_pods.go
  convertToAPIContainerStatuses: what has not started waits with the reason PodInitializing;
  pkg/kubelet/status/generate.go GeneratePodInitializedCondition: Initialized False,
  ContainersNotInitialized, "containers with incomplete status: [...]";
- containerd's CRI (internal/cri/server/container_status.go toCRIContainerStatus): a terminated
  container's reason is Completed for exit code 0, Error otherwise;
- kubectl's STATUS (pkg/printers/internalversion/printers.go printPod): Init:Error,
  Init:<index>/<count>, and a started sidecar (restartPolicy Always) skipped.
"""

from __future__ import annotations

import pytest

from twin import init_containers
from twin.api import TwinError

NOW = "2026-12-07T17:00:00Z"


def _pod(*init: dict) -> dict:
    return {"metadata": {"name": "engine-prefill-0", "namespace": "pdstack-dev"},
            "spec": {"initContainers": list(init),
                     "containers": [{"name": "engine", "image": "sglang"}, {"name": "trace", "image": "otel"}]},
            "status": {"phase": "Running", "podIP": "10.244.0.7"}}


FETCH = {"name": "fetch-weights", "image": "docker.io/amazon/aws-cli:2.27.0", "command": ["/bin/sh", "-c", "..."]}
SIDECAR = {"name": "routing-sidecar", "image": "llm-d-routing-sidecar", "restartPolicy": "Always"}


def _applied(pod: dict, patch: dict) -> dict:
    """The pod with the status patch's fields over its status (the fields the patch names replaced)."""
    return {**pod, "status": {**pod["status"], **patch["status"]}}


def _condition(status: dict, kind: str) -> dict:
    return next(c for c in status["status"]["conditions"] if c["type"] == kind)


def test_a_failed_init_container_is_terminated_with_error_and_the_pod_is_neither_initialized_nor_ready():
    pod = _pod(FETCH)
    status = init_containers.init_status(pod, 0, NOW, exit_code=3)
    fetch = status["status"]["initContainerStatuses"][0]
    assert fetch["state"] == {"terminated": {"exitCode": 3, "reason": "Error", "startedAt": NOW, "finishedAt": NOW}}
    assert fetch["ready"] is False and fetch["restartCount"] == 0
    assert [c["state"] for c in status["status"]["containerStatuses"]] == [{"waiting": {"reason": "PodInitializing"}}] * 2
    assert _condition(status, "Initialized") == {
        "type": "Initialized", "status": "False", "reason": "ContainersNotInitialized", "lastTransitionTime": NOW,
        "message": "containers with incomplete status: [fetch-weights]"}
    for kind in ("Ready", "ContainersReady"):
        assert _condition(status, kind)["status"] == "False"
        assert _condition(status, kind)["message"] == "containers with unready status: [engine trace]"
    assert init_containers.kubectl_status(_applied(pod, status)) == "Init:Error"


def test_while_one_runs_the_next_waits_and_kubectl_counts_the_completed():
    second = {**FETCH, "name": "warm-cache"}
    pod = _pod(FETCH, second)
    running = init_containers.init_status(pod, 1, NOW)
    states = [s["state"] for s in running["status"]["initContainerStatuses"]]
    assert states == [{"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": NOW, "finishedAt": NOW}},
                      {"running": {"startedAt": NOW}}]
    assert init_containers.kubectl_status(_applied(pod, running)) == "Init:1/2"
    first = init_containers.init_status(pod, 0, NOW)
    assert first["status"]["initContainerStatuses"][1]["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert _condition(first, "Initialized")["message"] == "containers with incomplete status: [fetch-weights warm-cache]"
    assert init_containers.kubectl_status(_applied(pod, first)) == "Init:0/2"


def test_all_completed_the_pod_is_initialized_and_its_containers_start_not_yet_ready():
    pod = _pod(FETCH)
    status = init_containers.init_status(pod, 1, NOW)
    assert _condition(status, "Initialized") == {"type": "Initialized", "status": "True", "lastTransitionTime": NOW}
    assert _condition(status, "Ready")["status"] == "False"  # the probes say when (twin/kubelet.py)
    assert [c["state"] for c in status["status"]["containerStatuses"]] == [{"running": {"startedAt": NOW}}] * 2
    assert init_containers.kubectl_status(_applied(pod, status)) == "Running"
    with pytest.raises(ValueError):
        init_containers.init_status(pod, 1, NOW, exit_code=1)


def test_a_sidecar_is_not_run_and_keeps_the_status_it_has():
    pod = _pod(SIDECAR, FETCH)
    kept = {"name": "routing-sidecar", "image": "llm-d-routing-sidecar", "ready": True, "restartCount": 0,
            "started": True, "state": {"running": {"startedAt": NOW}}}
    pod["status"]["initContainerStatuses"] = [kept]
    assert init_containers.to_run(pod) == [FETCH]
    status = init_containers.init_status(pod, 0, NOW, exit_code=2)
    assert status["status"]["initContainerStatuses"][0] == kept
    assert _condition(status, "Initialized")["message"] == "containers with incomplete status: [fetch-weights]"
    assert init_containers.kubectl_status(_applied(pod, status)) == "Init:Error"


def test_kubectl_names_an_exit_without_a_reason_by_its_code_or_signal():
    pod = _pod(FETCH)
    for terminated, shown in (({"exitCode": 137, "signal": 9}, "Init:Signal:9"), ({"exitCode": 3}, "Init:ExitCode:3")):
        pod["status"]["initContainerStatuses"] = [{"name": "fetch-weights", "state": {"terminated": terminated}}]
        assert init_containers.kubectl_status(pod) == shown
    pod["status"]["initContainerStatuses"] = [{"name": "fetch-weights", "state": {"waiting": {
        "reason": "CreateContainerConfigError"}}}]
    assert init_containers.kubectl_status(pod) == "Init:CreateContainerConfigError"


def test_a_service_url_names_its_service_and_anything_else_is_refused():
    assert init_containers.service_of("http://minio.storage.svc:9000") == ("minio", "storage", 9000)
    assert init_containers.service_of("https://s3.weights.svc.cluster.local") == ("s3", "weights", 443)
    for url in ("https://s3.us-east-1.amazonaws.com", "http://minio.storage:9000", "http://minio.storage.svc.example:1"):
        with pytest.raises(TwinError, match="not a Service's in-cluster name"):
            init_containers.service_of(url)


def test_the_pods_hosts_file_is_the_kubelets_with_the_served_services():
    text = init_containers.hosts_file(_pod(FETCH), {"10.96.0.20": "minio.storage.svc minio.storage.svc.cluster.local"})
    lines = text.splitlines()
    assert lines[0] == "# Kubernetes-managed hosts file (the twin's)."
    assert "127.0.0.1\tlocalhost" in lines and "10.244.0.7\tengine-prefill-0" in lines
    assert lines[-1] == "10.96.0.20\tminio.storage.svc minio.storage.svc.cluster.local"
