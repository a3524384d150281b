"""The weights init container runs on the twin (twin/init_containers.py): dev's engine pods, as
rendered, run their `fetch-weights` init container first, at the pod's address, from its
rendered command (infra/components/storage.py aws_cli_fetch_script under /bin/sh, the AWS CLI v1
from its pinned wheel), env (the spec's endpoint, bucket and prefix; envFrom the credentials
Secret) and volumes (the node's weights cache, hostPath); it reaches the user's MinIO Service
(`minio.storage.svc:9000`, the endpoint dev's spec names) in the pod network, carried to moto's
S3 server on the machine's loopback, where the test has uploaded weight files and their real
manifest (infra/weights.py upload: SHA256SUMS pinning each object version). Only after it exits 0
does the engine start (the kubelet's rule, k8s.io/kubernetes v1.34.4 pkg/kubelet/kuberuntime
computeInitContainerActions) and become Ready by its own probes.

Deliberate breaks, each failing as a cluster fails them: the manifest's sha256 of one file
changed (the script's own "sha256 does not match the manifest", exit 3: initContainerStatuses
terminated, reason Error, as containerd's CRI names a non-zero exit; the engine waits
PodInitializing; kubectl prints Init:Error; the engine never starts), and the credentials Secret
missing (the twin kubelet's start checks: CreateContainerConfigError on the init container,
kubectl's Init:CreateContainerConfigError, the pod never gets to run). moto enforces no IAM: the
credentials are checked for presence by the AWS CLI, not for their rights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time

import boto3
import pytest

from infra import weights
from tests.servers import moto_s3
from tests.twin.conftest import FIGURES
from tests.twin.placement import assert_runnable_pods_run
from tests.twin import test_requests_on_twin
from twin import fleet, init_containers, kubelet, pods
from twin.api import TwinError, kubectl

FILES = {"config.json": b'{"architectures": ["Qwen3MoeForCausalLM"]}',
         "model-00001-of-00002.safetensors": os.urandom(300_000),
         "model-00002-of-00002.safetensors": os.urandom(200_000)}
ENGINE_ROLES = ("prefill", "decode")
dev_applied = test_requests_on_twin.dev_applied  # the fixture: dev's render applied, every pod bound; removed after


@pytest.fixture(scope="module")
def weights_store(dev_applied, tmp_path_factory):
    """The user's MinIO as dev names it: its Service (no selector, as the user's own), and behind
    it, through the pod network's hub, moto's S3 server on the machine's loopback holding the
    weight files and the manifest infra/weights.py's upload writes."""
    spec, objects = dev_applied
    store = spec.model.weights
    name, namespace, port = init_containers.service_of(store.endpoint_url)
    assert fleet.apply_each_pass([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
         "spec": {"ports": [{"name": "s3", "port": port, "targetPort": port}]}}]).rejected == {}
    model = tmp_path_factory.mktemp("weights")
    for file, data in FILES.items():
        (model / file).write_bytes(data)
    with moto_s3(custom_endpoints=(store.endpoint_url,)) as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name=store.region,
                          aws_access_key_id="twin", aws_secret_access_key="twin")
        manifest = weights.upload(s3, store.bucket, store.prefix.strip("/"), model)
        assert set(manifest) == set(FILES)
        yield spec, s3, int(url.rsplit(":", 1)[1])
    kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


def _processes(spec, machine_port: int) -> pods.PodProcesses:
    processes = pods.PodProcesses()
    processes.init_containers = init_containers.InitContainers(processes)
    processes.init_containers.serve(spec.model.weights.endpoint_url, machine_port)
    return processes


def _engine_pods(namespace: str) -> list[dict]:
    return [p for p in fleet.get("pods", "-n", namespace)
            if pods.runs_as(p) in ENGINE_ROLES and "deletionTimestamp" not in p["metadata"]]


def _kubectl_status(namespace: str, name: str) -> str:
    """STATUS as the twin's kubectl (v1.34.4) prints it."""
    return kubectl("get", "pod", name, "-n", namespace, "--no-headers").stdout.split()[2]


def test_dev_engine_pods_fetch_the_weights_then_start_and_become_ready(weights_store):
    spec, _, machine_port = weights_store
    namespace = spec.environment.namespace
    began = time.monotonic()
    processes = _processes(spec, machine_port)
    try:
        assert_runnable_pods_run(processes, {namespace}, "dev-sglang (weights fetched by its init containers)")
        engines = _engine_pods(namespace)
        assert sorted(pods.runs_as(p) for p in engines) == sorted(ENGINE_ROLES)
        dest = spec.model.weights.node_cache_path.lstrip("/") + "/" + spec.model.weights.prefix.strip("/")
        for pod in engines:
            name = pod["metadata"]["name"]
            fetch = pod["status"]["initContainerStatuses"][0]
            assert fetch["name"] == "fetch-weights" and fetch["state"]["terminated"]["exitCode"] == 0, fetch
            assert kubelet.condition(pod, "Initialized")["status"] == "True"
            assert _kubectl_status(namespace, name) == "Running"
            cache = processes.folder / "nodes" / pod["spec"]["nodeName"] / dest  # the node's hostPath
            assert {f: hashlib.sha256((cache / f).read_bytes()).hexdigest() for f in FILES} == {
                f: hashlib.sha256(data).hexdigest() for f, data in FILES.items()}, name
            assert (cache / ".pdstack-verified").is_file(), name  # the script's marker: verified against the manifest
        FIGURES.append(f"dev-sglang init containers: {len(engines)} engine pods fetched {len(FILES)} weight files "
                       f"from S3 at {spec.model.weights.endpoint_url} (aws-cli script, sha256 checked against the "
                       f"manifest), then started and Ready in {time.monotonic() - began:.0f} s")
    finally:
        processes.stop()


def _manifest_with_one_sha_changed(s3, spec) -> tuple[bytes, bytes]:
    store = spec.model.weights
    key = f"{store.prefix.strip('/')}/{weights.SUMS_NAME}"
    original = s3.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    lines = original.decode().splitlines()
    victim = next(i for i, line in enumerate(lines) if line.endswith("model-00002-of-00002.safetensors"))
    sha, rest = lines[victim].split(" ", 1)
    lines[victim] = f"{'0' * 64 if sha != '0' * 64 else '1' * 64} {rest}"
    changed = ("\n".join(lines) + "\n").encode()
    s3.put_object(Bucket=store.bucket, Key=key, Body=changed)
    return key.encode(), original


def test_a_weight_file_whose_sha256_is_not_the_manifests_fails_its_init_container_and_the_engine_never_starts(
        weights_store):
    spec, s3, machine_port = weights_store
    namespace = spec.environment.namespace
    key, original = _manifest_with_one_sha_changed(s3, spec)
    processes = _processes(spec, machine_port)
    try:
        with pytest.raises(TwinError) as failed:
            processes.start(namespace, select=lambda pod: pods.runs_as(pod) == "prefill")
        said = str(failed.value)
        prefill = next(p for p in _engine_pods(namespace) if pods.runs_as(p) == "prefill")
        name = prefill["metadata"]["name"]
        # the pod, the init container, its exit code and the script's own last lines
        assert f"pod {namespace}/{name} (Init:Error): init container fetch-weights exited with 3" in said, said
        assert "model-00002-of-00002.safetensors: sha256 does not match the manifest" in said, said
        assert processes.started == []  # the engine was never started
        fetch = prefill["status"]["initContainerStatuses"][0]["state"]
        assert fetch["terminated"]["reason"] == "Error" and fetch["terminated"]["exitCode"] == 3, fetch
        assert prefill["status"]["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
        assert kubelet.condition(prefill, "Initialized")["reason"] == "ContainersNotInitialized"
        assert kubelet.condition(prefill, "Ready")["status"] == "False"
        assert pods.PROCESS_ANNOTATION not in (prefill["metadata"].get("annotations") or {})
        assert _kubectl_status(namespace, name) == "Init:Error"
    finally:
        processes.stop()
        s3.put_object(Bucket=spec.model.weights.bucket, Key=key.decode(), Body=original)


def test_a_missing_credentials_secret_stops_the_init_container_at_the_kubelets_start_checks(weights_store):
    spec, _, _ = weights_store
    namespace = spec.environment.namespace
    secret = spec.model.weights.credentials_secret
    kept = json.loads(kubectl("get", "secret", secret, "-n", namespace, "-o", "json").stdout)
    kubectl("delete", "secret", secret, "-n", namespace)
    try:
        old = next(p for p in _engine_pods(namespace) if pods.runs_as(p) == "prefill")
        # Not --wait: the StatefulSet makes the pod again under the same name, and on a fresh clone's
        # run kubectl's wait for the old one never returned (27 min); the wait below is by UID.
        kubectl("delete", "pod", old["metadata"]["name"], "-n", namespace, "--wait=false")

        def refused():  # the pod made again in its place, refused by the kubelet's start checks
            return [p for p in _engine_pods(namespace) if pods.runs_as(p) == "prefill"
                    and p["metadata"]["uid"] != old["metadata"]["uid"]
                    and ((p["status"].get("initContainerStatuses") or [{}])[0].get("state") or {}).get("waiting", {})
                    .get("reason") == kubelet.CONFIG_ERROR]
        made_again = fleet.wait_for("the prefill pod refused by its start checks", refused, timeout=120)
        assert made_again, [(p["metadata"]["name"], p["status"]) for p in _engine_pods(namespace)]
        again = made_again[0]
        waiting = again["status"]["initContainerStatuses"][0]["state"]["waiting"]
        assert waiting["message"] == f'secret "{secret}" not found', waiting
        assert again["status"]["phase"] == "Pending" and not again["status"].get("podIP")
        assert kubelet.condition(again, "Ready")["status"] == "False"
        assert _kubectl_status(namespace, again["metadata"]["name"]) == "Init:CreateContainerConfigError"
    finally:
        kubectl("apply", "-f", "-", input=json.dumps({k: kept[k] for k in ("apiVersion", "kind", "data", "type")}
                                                   | {"metadata": {"name": secret, "namespace": namespace}}))


def test_the_python_boto3_fetcher_fetches_and_verifies_as_well(weights_store, dev_applied):
    """`images.weights_fetcher_tool: python-boto3`: the prefill's init container as that renders it
    (infra/components/storage.py weights_init_container: python3 runs infra/weights.py from the
    weights-fetcher ConfigMap), python3 with boto3 1.44.5 on its PATH; it verifies every file
    against the manifest's JSON form and the engine starts after it."""
    from infra.components.storage import weights_init_container

    spec, _, machine_port = weights_store
    _, objects = dev_applied
    namespace = spec.environment.namespace
    boto = spec.model_copy(update={"images": spec.images.model_copy(update={"weights_fetcher_tool": "python-boto3"})})
    rendered = next(o for o in objects if o["kind"] == "LeaderWorkerSet" and o["metadata"]["name"] == "engine-prefill")
    changed = copy.deepcopy(rendered)
    template = changed["spec"]["leaderWorkerTemplate"]
    pod_spec = (template.get("leaderTemplate") or template["workerTemplate"])["spec"]
    fetch = weights_init_container(boto, "prefill")
    assert fetch["command"][0] == "python3" and pod_spec["initContainers"][0]["name"] == fetch["name"]
    for part in (template.get("leaderTemplate"), template["workerTemplate"]):
        if part:
            part["spec"]["initContainers"][0] = fetch
    assert fleet.apply_each_pass([changed]).rejected == {}
    processes = _processes(spec, machine_port)
    try:
        def boto_prefill(pod: dict) -> bool:
            return pods.runs_as(pod) == "prefill" and pod["spec"]["initContainers"][0]["command"][0] == "python3"
        processes.start(namespace, select=boto_prefill)
        assert [p.role for p in processes.started] == ["prefill"]
        log = (processes.folder / f"{namespace}_{processes.started[0].name}" / "init-fetch-weights.log").read_text()
        dest = next(e["value"] for e in fetch["env"] if e["name"] == "PDSTACK_WEIGHTS_DEST")
        assert f"verified {len(FILES)} files in {dest}" in log, log  # infra/weights.py's own last line
        processes.check()
    finally:
        processes.stop()
        assert fleet.apply_each_pass([rendered]).rejected == {}  # restored as rendered
