"""The in-cluster load test: a Kubernetes Job running the pinned aiperf image against a service
inside the cluster (the gateway's, or one release track's router), its result files on a
PersistentVolumeClaim for `pdctl validate-deployment --results` to read. Pure: spec in,
manifest out; `--render-job` writes it after the schema check."""

from __future__ import annotations

from pathlib import Path

from infra import naming
from infra.spec import StackSpec
import yaml

from infra.validation.loadtest import AIPERF_API_KEY_ENV, Scenario, aiperf_command, aiperf_config

RESULTS_MOUNT = "/results"
CONFIG_MOUNT = "/etc/aiperf"


def loadtest_job(spec: StackSpec, url: str, scenario: Scenario, concurrency: int, requests: int,
                 results_claim: str, api_key_secret: str, api_key_name: str) -> list[dict]:
    """One aiperf run as a ConfigMap (aiperf's config file) and the Job that runs it. The API key
    comes from a Secret (the gateway's own keys) into the container's environment, where aiperf
    reads it as `${PDSTACK_AIPERF_API_KEY}` from its config: it is never in the manifest, nor on
    the command line (`ps` in the pod, /proc on the node)."""
    if spec.images.loadtest is None:
        raise ValueError("images.loadtest: no aiperf image is named. Fix: the aiperf image of the pinned release, "
                         "by digest")
    name = f"loadtest-{scenario.name}-c{concurrency}"
    config = aiperf_config(url, spec.model.name, scenario, concurrency, requests, Path(RESULTS_MOUNT) / name,
                           spec.model.name, with_api_key=True)
    cmd = aiperf_command("aiperf", Path(CONFIG_MOUNT) / "aiperf.yaml")
    labels = {"app.kubernetes.io/name": "loadtest", "app.kubernetes.io/part-of": "pdstack",
              "pdstack.io/environment": spec.environment.name}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": name, "namespace": spec.environment.namespace, "labels": labels},
                  "data": {"aiperf.yaml": yaml.safe_dump(config, sort_keys=False)}}
    return [config_map, {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": spec.environment.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,  # a failed measurement is a result; a retry would blend two runs
            "ttlSecondsAfterFinished": 86400,
            "activeDeadlineSeconds": 3600,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
                    # The load generator must not sit on, or compete with, the GPUs it measures.
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": naming.ROLE_LABEL, "operator": "DoesNotExist"}]}]}}},
                    "containers": [{
                        "name": "aiperf",
                        "image": spec.images.loadtest,
                        "command": cmd[:1],
                        "args": cmd[1:],
                        "env": [{"name": AIPERF_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
                                    "name": api_key_secret, "key": api_key_name}}},
                                {"name": "HF_HOME", "value": "/tmp/hf"}],
                        "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                      "limits": {"cpu": "8", "memory": "16Gi"}},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [{"name": "results", "mountPath": RESULTS_MOUNT},
                                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                                         {"name": "scratch", "mountPath": "/tmp"}],
                    }],
                    "volumes": [{"name": "results", "persistentVolumeClaim": {"claimName": results_claim}},
                                {"name": "config", "configMap": {"name": name}},
                                {"name": "scratch", "emptyDir": {}}],
                },
            },
        },
    }]
