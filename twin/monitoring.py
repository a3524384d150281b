"""The Prometheus prometheus-operator asks for, run on the twin as a kubelet would run its pod.

prometheus-operator v0.93.0 (twin/dataplane.py) reconciles the platform's Prometheus into a
StatefulSet `prometheus-<name>` whose pods hold three containers (pkg/prometheus/server/
statefulset.go): `prometheus` (image quay.io/prometheus/prometheus at the operator's
DefaultPrometheusVersion, v3.13.1, pkg/operator/defaults.go; args only: the image's entrypoint is
/bin/prometheus), `config-reloader` and the init container `init-config-reloader`. What the twin
does for pod 0 of that StatefulSet:

- its claims (the StatefulSet's volumeClaimTemplate: no StorageClass on the twin) get a hostPath
  PersistentVolume each, as a storage provisioner would make one, so the PV controller binds them,
  the scheduler places the pod and the twin's kubelet lets kwok start it (its start checks);
- the reloaders' work (prometheus-operator v0.93.0 cmd/prometheus-config-reloader, on
  github.com/thanos-io/thanos pkg/reloader): the generated Secret's `prometheus.yaml.gz`
  (pkg/prometheus/common.go ConfigFilename) gunzipped, each `$(VAR)` replaced from the reloader
  container's environment (POD_NAME, SHARD; an unset one is an error, as there), written to
  `prometheus.env.yaml` (ConfigEnvsubstFilename) in the `config-out` volume, and the rule files of
  the operator's `prometheus-<name>-rulefiles-<n>` ConfigMaps into their volumes; once before the
  server starts (init-config-reloader), then again whenever the Secret or a ConfigMap changes,
  followed by POST /-/reload (its --reload-url), as the sidecar does;
- the `prometheus` container, with its rendered args, at the pod's address in the pod network of
  twin/pods.py (PodProcesses.start_pod: its volumes, its projected ServiceAccount token for the
  in-cluster Kubernetes discovery the generated config uses, env); the binary is Prometheus
  v3.13.1 built from its Go module (github.com/prometheus/prometheus v0.313.1, twin/prometheus/
  go.mod). The twin's kubelet runs its rendered probes, so the operator reads it Available.

Its HTTP API is forwarded to a loopback port of the machine (`fleet_prometheus` yields the URL),
so `pdctl rollout --prometheus URL` and the tests read the Prometheus that scrapes the fleet.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json
import re
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from infra.platform_stack.spec import PlatformSpec
from twin import build, fleet, pods
from twin.api import TwinError, kubectl
from twin.paths import KUBECONFIG

PROMETHEUS_CONTAINER = "prometheus"
RELOADER_CONTAINER = "config-reloader"
WEB_PORT = 9090  # the container's `web` port (pkg/prometheus/server/statefulset.go)
CONFIG_KEY = "prometheus.yaml.gz"  # prometheus-operator v0.93.0 pkg/prometheus/common.go ConfigFilename
CONFIG_OUT = "prometheus.env.yaml"  # ... ConfigEnvsubstFilename
CONFIG_OUT_VOLUME = "config-out"
MONITORING_NAMESPACE = "monitoring"  # the platform's (infra/platform_stack/spec.py monitoring_namespace)
CLAIM_VOLUME_LABEL = "twin.pdstack.io/stands-in-for=storage-provisioner"  # on the PersistentVolumes it makes
RELOAD_SECONDS = 1.0  # how often the twin's reloader reads the Secret and ConfigMaps
_ENV_REFERENCE = re.compile(r"\$\(([a-zA-Z_0-9]+)\)")  # thanos pkg/reloader: $(VAR)


def expand_env(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` replaced by VAR's value, as the config reloader writes prometheus.env.yaml; an
    unset variable is an error there (the file is not written), and here."""
    def value(match: re.Match) -> str:
        if match.group(1) not in env:
            raise TwinError(f"the generated Prometheus configuration names $({match.group(1)}), which the "
                            f"config-reloader container's environment does not set")
        return env[match.group(1)]
    return _ENV_REFERENCE.sub(value, text)


def reloaded_files(secret: dict, rule_configmaps: dict[str, dict], env: dict[str, str]) -> dict[str, dict[str, bytes]]:
    """What the config reloader writes, per volume name: config-out's prometheus.env.yaml from the
    Secret's gzipped configuration, and each rule ConfigMap's files into its own volume. Pure."""
    config = gzip.decompress(base64.b64decode(secret["data"][CONFIG_KEY])).decode()
    files = {CONFIG_OUT_VOLUME: {CONFIG_OUT: expand_env(config, env).encode()}}
    for volume, configmap in rule_configmaps.items():
        files[volume] = {key: text.encode() for key, text in (configmap.get("data") or {}).items()}
    return files


def claim_volume(claim: dict, folder: Path) -> dict:
    """A hostPath PersistentVolume bound in advance to `claim` (its size and access modes), as a
    provisioner makes one for a claim with no StorageClass to serve it."""
    meta = claim["metadata"]
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"twin-{meta['namespace']}-{meta['name']}"[:253],
                         "labels": dict([CLAIM_VOLUME_LABEL.split("=")])},
            "spec": {"capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
                     "accessModes": claim["spec"]["accessModes"], "persistentVolumeReclaimPolicy": "Delete",
                     "claimRef": {"namespace": meta["namespace"], "name": meta["name"]},
                     "hostPath": {"path": str(folder / meta["namespace"] / meta["name"]), "type": "DirectoryOrCreate"}}}


def _claimed_pod(name: str, namespace: str, kubeconfig: Path, folder: Path, timeout: float) -> dict:
    """Pod 0 of the operator's StatefulSet, its claims given volumes, once it has its address."""
    statefulset = f"prometheus-{name}"
    pod_name = f"{statefulset}-0"
    pod = fleet.wait_for(f"pod {namespace}/{pod_name} of the operator's StatefulSet",
                         lambda: pods.get_object("pod", pod_name, namespace, kubeconfig), timeout, 0.5, required=True)
    volumes = []
    for volume in pod["spec"].get("volumes", []):
        if "persistentVolumeClaim" in volume:
            claim = fleet.wait_for(f"claim {volume['persistentVolumeClaim']['claimName']}", lambda: pods.get_object(
                "pvc", volume["persistentVolumeClaim"]["claimName"], namespace, kubeconfig), timeout, 0.5, required=True)
            if not claim["spec"].get("volumeName"):
                volumes.append(claim_volume(claim, folder))
    if volumes:
        kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": volumes}),
                kubeconfig_path=kubeconfig)

    def addressed():
        got = pods.get_object("pod", pod_name, namespace, kubeconfig)
        return got if got and got.get("status", {}).get("podIP") else None
    return fleet.wait_for(f"pod {namespace}/{pod_name} running with an address (bound, its start checks passed)",
                          addressed, timeout, 0.5, required=True)


class Reloader:
    """The config reloaders' work for one Prometheus pod (see the module's docstring)."""

    def __init__(self, pod: dict, kubeconfig: Path, reload):
        self.pod, self.kubeconfig, self.reload = pod, kubeconfig, reload
        self.namespace = pod["metadata"]["namespace"]
        (secret_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
        self.secret = secret_volume["secret"]["secretName"]
        self.rule_volumes = {v["name"]: v["configMap"]["name"] for v in pod["spec"]["volumes"]
                             if "configMap" in v and "-rulefiles-" in v["configMap"]["name"]}
        (reloader,) = [c for c in pod["spec"]["containers"] if c["name"] == RELOADER_CONTAINER]
        self.env = pods._env(pod, reloader, kubeconfig, "")
        self.seen: dict | None = None
        self.stopping = threading.Event()
        self.error = ""

    def files(self) -> dict[str, dict[str, bytes]]:
        secret = pods.get_object("secret", self.secret, self.namespace, self.kubeconfig)
        if secret is None:
            raise TwinError(f"secret {self.namespace}/{self.secret}: the operator's generated configuration is not there")
        configmaps = {volume: pods.get_object("configmap", name, self.namespace, self.kubeconfig)
                      for volume, name in self.rule_volumes.items()}
        # the operator mounts rulefiles-1.. optionally: a ConfigMap it has not made is no volume
        return reloaded_files(secret, {v: c for v, c in configmaps.items() if c is not None}, self.env)

    def write(self, volumes: dict[str, Path]) -> bool:
        """Write what changed into the volumes' folders; whether anything did."""
        files = self.files()
        if files == self.seen:
            return False
        for volume, content in files.items():
            if volume not in volumes:
                continue  # an optional ConfigMap made after the pod started: the kubelet would mount it on a restart
            folder = volumes[volume]
            for old in folder.iterdir():
                if old.name not in content and old.is_file():
                    old.unlink()
            for key, data in content.items():
                (folder / key).write_bytes(data)
        self.seen = files
        return True

    def watch(self, volumes: dict[str, Path]) -> None:
        while not self.stopping.wait(RELOAD_SECONDS):
            try:
                if self.write(volumes):
                    self.reload()
            except (OSError, TwinError, ValueError) as exc:
                self.error = str(exc)


def with_intervals(objects: list[dict], interval: str) -> list[dict]:
    """The monitors and the Prometheus among `objects` with their own interval fields at `interval`
    (the monitors' endpoint `interval`, the Prometheus's `scrapeInterval` and `evaluationInterval`,
    which the platform leaves at the operator's 30s): a test's few minutes hold enough samples. Pure."""
    out = copy.deepcopy(objects)
    for obj in out:
        if obj["kind"] == "PodMonitor":
            for endpoint in obj["spec"]["podMetricsEndpoints"]:
                endpoint["interval"] = interval
        elif obj["kind"] == "ServiceMonitor":
            for endpoint in obj["spec"]["endpoints"]:
                endpoint["interval"] = interval
        elif obj["kind"] == "Prometheus":
            obj["spec"].update(scrapeInterval=interval, evaluationInterval=interval)
    return out


@contextmanager
def platform_prometheus(platform: PlatformSpec, interval: str, kubeconfig: Path = KUBECONFIG) -> Iterator[list[dict]]:
    """The platform stack's Prometheus (its monitoring namespace and infra/platform_stack's
    prometheus_manifests, intervals at `interval`) applied, for prometheus-operator to make its
    StatefulSet; yields the objects. Removed afterwards with the volumes the twin gave its claims."""
    from infra.platform_stack.components.observability import prometheus_manifests

    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": platform.monitoring_namespace}}
    provided = with_intervals(prometheus_manifests(platform), interval)
    applied = fleet.apply_each_pass([namespace, *provided], kubeconfig)
    try:
        if applied.rejected:
            raise TwinError(f"the platform's Prometheus refused: {applied.rejected}")
        yield provided
    finally:
        fleet.delete_namespaces([platform.monitoring_namespace], kubeconfig)
        kubectl("delete", "--ignore-not-found", "--wait=false", *(
            f"{o['kind'].lower()}.{o['apiVersion'].split('/')[0]}/{o['metadata']['name']}"
            for o in provided if "namespace" not in o["metadata"]), kubeconfig_path=kubeconfig)
        kubectl("delete", "pv", "-l", CLAIM_VOLUME_LABEL, "--ignore-not-found", "--wait=false", kubeconfig_path=kubeconfig)


def prometheus_program() -> Path:
    """Prometheus v3.13.1 (the operator's default image's version), built from its Go module."""
    build.build_module(build.TEST_MODULES["prometheus"])
    return build.program("prometheus")


@contextmanager
def fleet_prometheus(processes: pods.PodProcesses, namespace: str = MONITORING_NAMESPACE, name: str = "pdstack",
                     timeout: float = 300) -> Iterator[str]:
    """The operator's Prometheus `namespace`/`name` (the platform stack's, applied beforehand)
    running at its pod address in `processes`' pod network, beside the fleet it scrapes; yields its
    URL on 127.0.0.1. Its process stops on leaving."""
    kubeconfig = processes.kubeconfig
    pod = _claimed_pod(name, namespace, kubeconfig, processes.folder / "volumes", timeout)
    ip = pod["status"]["podIP"]
    listener, port = pods.forward(processes.network.client_socket, ip, WEB_PORT)
    url = f"http://127.0.0.1:{port}"

    def reload() -> None:
        urllib.request.urlopen(urllib.request.Request(f"{url}/-/reload", method="POST"), timeout=30).close()

    reloader = Reloader(pod, kubeconfig, reload)
    volumes: dict[str, Path] = {}

    def init(made: dict[str, Path]) -> None:  # init-config-reloader
        volumes.update(made)
        reloader.write(volumes)

    started = processes.start_pod(pod, PROMETHEUS_CONTAINER, entrypoint=[str(prometheus_program())], init=init)
    watcher = threading.Thread(target=reloader.watch, args=(volumes,), daemon=True)
    try:
        fleet.wait_for(f"Prometheus {namespace}/{name} ready at {ip}:{WEB_PORT}",
                       lambda: processes.check() or _ready(url), timeout, 0.5, required=True)
        watcher.start()
        yield url
    finally:
        reloader.stopping.set()
        listener.close()
        processes.stop_pod(started)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False
