"""A pod's init containers on the twin, run as a kubelet runs them: before its main container,
one at a time in order, each as a process at the pod's address (the pod's network namespace,
a mount namespace of its own) from its rendered command, args, env (envFrom's Secret too) and
mounted volumes (twin/pods.py PodProcesses.spawn_container, the main container's way); the main
container starts only when every one has exited 0.

The kubelet's rules, at k8s.io/kubernetes v1.34.4:
- pkg/kubelet/kuberuntime/kuberuntime_manager.go computePodActions and
  kuberuntime_container.go computeInitContainerActions: the next init container starts only
  after the one before it exited 0; one that exits non-zero is not followed by the next, nor by
  the main containers (with restartPolicy Always it is restarted after a back-off: the twin runs
  it once and reports it).
- pkg/kubelet/kubelet_pods.go convertToAPIContainerStatuses: a container not started yet waits
  with the reason PodInitializing when the pod has init containers; pkg/kubelet/status/generate.go
  GeneratePodInitializedCondition: Initialized False, ContainersNotInitialized, "containers with
  incomplete status: [...]"; GenerateContainersReadyCondition: ContainersNotReady.
- the reason of a terminated container is the runtime's: containerd's CRI
  (internal/cri/server/container_status.go toCRIContainerStatus) says Completed for exit code 0,
  Error otherwise.
- kubectl's STATUS column (pkg/printers/internalversion/printers.go printPod): the first init
  container not completed gives "Init:<its terminated reason>" (Init:Error), "Init:<waiting
  reason>" unless that is PodInitializing, else "Init:<index>/<count>".
Differences: the pod's phase stays the Running kwok wrote (kwok gives a pod its IP with Running,
and a Pending pod would be taken to Running and Ready again by kwok's pod-ready stage,
twin/kubelet.py ready_stages); Ready, ContainersReady and Initialized are False while they run
and after one fails. An init container with restartPolicy Always (a sidecar: vLLM decode's
routing sidecar) is not run by the twin (no program of the twin's stands for it).

The weights fetch (infra/components/storage.py weights_init_container) runs the programs its image
holds from a virtualenv of the twin's (`fetcher_venv`, twin/weights-fetcher-requirements.txt):
`aws` (AWS CLI v1, `python -m awscli`) for `aws-cli`, `python3` with boto3 for `python-boto3`,
first on its PATH.
The object store it reaches is the user's Service (dev: MinIO, `minio.storage.svc:9000`, which
the user makes: README, "Objects that stay the user's"); `InitContainers.serve` carries that
Service's ClusterIP and port in the pod network's hub to a server on the machine's loopback (the
tests': moto), and each init container's /etc/hosts (the kubelet's managed hosts file,
pkg/kubelet/kubelet_pods.go managedHostsFileContent) also names each such Service, standing in
for cluster DNS, which the twin does not run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from twin import netns
from twin.api import TwinError, kubectl
from twin.paths import ROOT, private_folder, script_module
from twin.pods import PATH_TAIL, _spawn, _stop, _tail, get_object

REQUIREMENTS = ROOT / "twin" / "weights-fetcher-requirements.txt"
SIDECAR = "Always"  # an init container's restartPolicy that makes it a sidecar (KEP-753)
WAITING = "PodInitializing"
TIMEOUT = 600  # seconds an init container may run before the twin ends it and reports it


def fetcher_venv() -> Path:
    """The virtualenv holding `aws` (AWS CLI v1) and python3 with boto3 at their pins, built once
    per content of twin/weights-fetcher-requirements.txt into the machine's upstream cache."""
    key = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    return script_module("pinned_wheels").cached_venv(f"weights-fetcher-{key}", REQUIREMENTS, size="~230 MB")


# --- the status a kubelet writes (pure) --------------------------------------------------------

def to_run(pod: dict) -> list[dict]:
    """The init containers the twin runs, in order: all but sidecars."""
    return [c for c in pod["spec"].get("initContainers") or () if c.get("restartPolicy") != SIDECAR]


def _status(container: dict, state: dict) -> dict:
    return {"name": container["name"], "image": container["image"], "imageID": "", "ready": False,
            "restartCount": 0, "started": "running" in state, "state": state}


def init_status(pod: dict, completed: int, now: str, exit_code: int | None = None) -> dict:
    """The status (a strategic merge patch) of a pod whose first `completed` init containers (of
    `to_run`) exited 0: the next one running, or, given its `exit_code`, terminated with it; all
    of them completed when `completed` is their count (the main containers then start)."""
    runs = to_run(pod)
    done = completed == len(runs)
    failed = exit_code is not None and exit_code != 0
    if done and exit_code is not None:
        raise ValueError("every init container completed: no exit code to report")
    current = {s["name"]: s for s in (pod.get("status") or {}).get("initContainerStatuses") or ()}

    def init(index: int, container: dict) -> dict:
        if index < completed:
            return _status(container, {"terminated": {"exitCode": 0, "reason": "Completed",
                                                      "startedAt": now, "finishedAt": now}})
        if index == completed and exit_code is not None:
            return _status(container, {"terminated": {"exitCode": exit_code, "reason": "Error" if failed else
                                                      "Completed", "startedAt": now, "finishedAt": now}})
        if index == completed:
            return _status(container, {"running": {"startedAt": now}})
        return _status(container, {"waiting": {"reason": WAITING}})

    order = {c["name"]: i for i, c in enumerate(runs)}
    statuses = [init(order[c["name"]], c) if c["name"] in order else current.get(c["name"]) or
                _status(c, {"waiting": {"reason": WAITING}}) for c in pod["spec"].get("initContainers") or ()]
    names = [c["name"] for c in pod["spec"]["containers"]]
    incomplete = [c["name"] for i, c in enumerate(runs) if i >= completed]
    unready = {"status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now,
               "message": f"containers with unready status: [{' '.join(names)}]"}
    main_state = {"running": {"startedAt": now}} if done else {"waiting": {"reason": WAITING}}
    return {"status": {
        "conditions": [
            {"type": "Initialized", "lastTransitionTime": now,
             **({"status": "True"} if done else {"status": "False", "reason": "ContainersNotInitialized",
                                                 "message": f"containers with incomplete status: [{' '.join(incomplete)}]"})},
            {"type": "Ready", **unready}, {"type": "ContainersReady", **unready}],
        "initContainerStatuses": statuses,
        "containerStatuses": [_status(c, main_state) for c in pod["spec"]["containers"]]}}


def kubectl_status(pod: dict) -> str:
    """The STATUS kubectl prints for a pod whose init containers have not all completed, else its
    phase (k8s.io/kubernetes v1.34.4 pkg/printers/internalversion/printers.go printPod)."""
    specs = {c["name"]: c for c in pod["spec"].get("initContainers") or ()}
    for index, status in enumerate((pod.get("status") or {}).get("initContainerStatuses") or ()):
        state = status.get("state") or {}
        terminated, waiting = state.get("terminated"), state.get("waiting")
        if terminated and terminated.get("exitCode") == 0:
            continue
        if specs.get(status["name"], {}).get("restartPolicy") == SIDECAR and status.get("started"):
            continue
        if terminated:
            return "Init:" + (terminated.get("reason") or (f"Signal:{terminated['signal']}" if terminated.get("signal")
                                                           else f"ExitCode:{terminated.get('exitCode')}"))
        if waiting and waiting.get("reason") and waiting["reason"] != WAITING:
            return "Init:" + waiting["reason"]
        return f"Init:{index}/{len(specs)}"
    return (pod.get("status") or {}).get("phase", "Pending")


def hosts_file(pod: dict, services: dict[str, str]) -> str:
    """The pod's /etc/hosts as the kubelet writes it (managedHostsFileContent), plus a line per
    Service the twin serves (`services`: ClusterIP -> its DNS names), cluster DNS's part."""
    lines = ["# Kubernetes-managed hosts file (the twin's).", "127.0.0.1\tlocalhost",
             "::1\tlocalhost ip6-localhost ip6-loopback", "fe00::0\tip6-localnet", "fe00::0\tip6-mcastprefix",
             "fe00::1\tip6-allnodes", "fe00::2\tip6-allrouters",
             f"{pod['status']['podIP']}\t{pod['spec'].get('hostname') or pod['metadata']['name']}",
             "", "# the Services the twin serves, standing in for cluster DNS (twin/init_containers.py)"]
    return "\n".join(lines + [f"{ip}\t{names}" for ip, names in services.items()]) + "\n"


def service_of(url: str) -> tuple[str, str, int]:
    """The Service an in-cluster URL names (http://<name>.<namespace>.svc[.cluster.local]:<port>):
    its name, namespace and port."""
    parts = urlsplit(url)
    labels = (parts.hostname or "").split(".")
    if len(labels) < 3 or labels[2] != "svc" or labels[3:] not in ([], ["cluster", "local"]):
        raise TwinError(f"{url}: not a Service's in-cluster name (<name>.<namespace>.svc[.cluster.local])")
    return labels[0], labels[1], parts.port or (443 if parts.scheme == "https" else 80)


# --- running them -------------------------------------------------------------------------------

class InitContainers:
    """What runs each started pod's init containers (PodProcesses.init_containers = this), and the
    Services their programs reach, carried to the machine's loopback."""

    def __init__(self, processes):
        self.processes = processes
        # the programs the fetcher's image holds, as wrappers of the virtualenv's python: its bin/
        # scripts' shebangs name the folder it was built in (cached_venv renames it into place)
        venv = fetcher_venv()
        self.bin = private_folder(processes.folder / "fetcher-bin")
        self.bin.chmod(0o755)
        for name, text in (("aws", f'exec {venv}/bin/python -m awscli "$@"'), ("python3", f'exec {venv}/bin/python "$@"'),
                           ("python", f'exec {venv}/bin/python "$@"')):
            (self.bin / name).write_text(f"#!/bin/sh\n{text}\n")
            (self.bin / name).chmod(0o755)
        self.services: dict[str, str] = {}  # ClusterIP -> its names (the pods' /etc/hosts)
        self.forwards: list[tuple[subprocess.Popen, socket.socket]] = []

    def serve(self, url: str, machine_port: int) -> None:
        """Connections to the Service `url` names (it must exist: the user's) reach
        127.0.0.1:machine_port on the machine: its ClusterIP is put on the hub's bridge, where a
        listener on its port hands each connection to a Unix socket, and from there a thread of
        this process connects it to the loopback port (twin/netns.py forward_unix_to_tcp)."""
        name, namespace, port = service_of(url)
        service = get_object("service", name, namespace, self.processes.kubeconfig)
        ip = (service or {}).get("spec", {}).get("clusterIP")
        if not ip or ip == "None":
            raise TwinError(f"{url}: Service {namespace}/{name} {'has no ClusterIP' if service else 'does not exist'}; "
                            "the fetch reaches its store through it (make it, as the user does: README)")
        unix = self.processes.folder / f"service-{namespace}.{name}.{port}.sock"
        bridge = netns.forward_unix_to_tcp(unix, machine_port)
        log = self.processes.folder / f"service-{namespace}.{name}.log"
        forwarder = _spawn(["nsenter", f"--net=/proc/{_hub_pid(self.processes.network)}/ns/net", "--", sys.executable,
                            "-m", "twin.init_containers", "forward", "--ip", ip, "--port", str(port),
                            "--unix-socket", str(unix)], log, env={"PYTHONPATH": str(ROOT)})
        self.forwards.append((forwarder, bridge))
        deadline = time.monotonic() + 60
        while "listening" not in log.read_text(errors="replace"):
            if forwarder.poll() is not None or time.monotonic() > deadline:
                raise TwinError(f"the forward of {url} in the pod network did not start: "
                                f"{log.read_text(errors='replace')[-500:]}")
            time.sleep(0.05)
        self.services[ip] = f"{name}.{namespace}.svc {name}.{namespace}.svc.cluster.local"

    def stop(self) -> None:
        for forwarder, bridge in self.forwards:
            _stop(forwarder)
            bridge.close()
        self.forwards.clear()
        self.services.clear()

    def run(self, processes, pod: dict, folder: Path, volumes: dict[str, Path], holder: subprocess.Popen) -> None:
        """Run the pod's init containers in order at its address; the pod's status says where they
        are. One that exits non-zero (or outlives TIMEOUT) ends it: its status written as the
        kubelet's, and a TwinError naming the pod, the container and its log's last lines."""
        meta = pod["metadata"]
        runs = to_run(pod)
        if not runs:
            return
        hosts = folder / "etc-hosts"
        hosts.write_text(hosts_file(pod, self.services))
        path = f"{self.bin}:{PATH_TAIL}"
        for index, container in enumerate(runs):
            self._patch(pod, init_status(pod, index, _now()))
            if not container.get("command"):
                raise TwinError(f"pod {meta['namespace']}/{meta['name']}: init container {container['name']} has no "
                                "command (the image's entry point is not known to the twin)")
            log = folder / f"init-{container['name']}.log"
            process = processes.spawn_container(pod, container, container["command"], volumes, folder, holder, path,
                                                log, ({"source": str(hosts), "target": "/etc/hosts", "read_only": True},))
            try:
                code = process.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                _stop(process)
                code = process.returncode
            if code != 0:
                status = init_status(pod, index, _now(), exit_code=code)
                self._patch(pod, status)
                shown = kubectl_status({**pod, "status": {**pod.get("status", {}), **status["status"]}})
                raise TwinError(f"pod {meta['namespace']}/{meta['name']} ({shown}): init container {container['name']} "
                                f"exited with {code}; the end of its log ({log}):\n{_tail(log)}")
        self._patch(pod, init_status(pod, len(runs), _now()))

    def _patch(self, pod: dict, status: dict) -> None:
        kubectl("patch", "pod", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"], "--subresource=status",
                "--type=strategic", "-p", json.dumps(status), kubeconfig_path=self.processes.kubeconfig)


def _hub_pid(network) -> int:
    """The pod network's hub process (a PodNetwork that joined a running hub knows only its pid)."""
    return getattr(network, "hub_pid", None) or network.hub.pid


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def forward_main(ip: str, port: int, unix_socket: Path) -> int:
    """In the hub's network namespace: `ip` on its bridge, and ip:port's connections to the socket."""
    subprocess.run(["ip", "addr", "replace", f"{ip}/32", "dev", "br0"], check=True)
    listener = socket.create_server((ip, port))
    threading.Thread(target=netns._serve, args=(listener, lambda: netns._unix(unix_socket)), daemon=True).start()
    print(f"listening on {ip}:{port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m twin.init_containers")
    sub = parser.add_subparsers(dest="command", required=True)
    forward = sub.add_parser("forward", help="(inside the pod network's hub) a Service's address to a Unix socket")
    forward.add_argument("--ip", required=True)
    forward.add_argument("--port", type=int, required=True)
    forward.add_argument("--unix-socket", type=Path, required=True)
    args = parser.parse_args()
    return forward_main(args.ip, args.port, args.unix_socket)


if __name__ == "__main__":
    sys.exit(main())
