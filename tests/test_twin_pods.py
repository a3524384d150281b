"""Which rendered pods the twin runs as processes (twin/pods.py not_runnable, runs_as), judged on
each render's pod templates without a twin; and the Mooncake master's program as a started pod
gets it: `mooncake_master` on its PATH runs the pinned wheel's binary (mooncake-transfer-engine
0.3.8.post1 on PyPI, `mooncake/mooncake_master`), at the version of the pod's image tag."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from infra import naming
from twin import fleet, pods


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Each Deployment's and LeaderWorkerSet's pod template as a pod of its namespace, by workload name."""
    out = {}
    for o in objects:
        if o["kind"] == "Deployment":
            templates = {o["metadata"]["name"]: o["spec"]["template"]}
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            templates = {o["metadata"]["name"]: lwt["workerTemplate"],
                         **({f"{o['metadata']['name']} leader": lwt["leaderTemplate"]} if "leaderTemplate" in lwt else {})}
        else:
            continue
        for name, template in templates.items():
            out[name] = {"metadata": {**template["metadata"], "namespace": o["metadata"]["namespace"]},
                         "spec": template["spec"]}
    return out


@pytest.fixture(scope="module", params=[("dev", "sglang"), ("dev", "vllm"), ("prod", "sglang")],
                ids=["dev-sglang", "dev-vllm", "prod-sglang"])
def rendered(request, tmp_path_factory):
    stack, engine = request.param
    return stack, engine, pod_templates(fleet.render(stack, tmp_path_factory.mktemp(f"{stack}-{engine}"), engine))


def test_each_rendered_pod_is_run_or_named_with_why_not(rendered):
    """SGLang's router, vLLM's (the endpoint picker, /app/epp: the twin's build of it,
    twin/build.py PROGRAMS "epp"), both engine roles and the Mooncake master run; the trace
    collector has no command (its image's entry point), and is named with that reason."""
    stack, engine, templates = rendered
    runs = {name: pods.runs_as(pod) for name, pod in templates.items()}
    why = {name: pods.not_runnable(pod) for name, pod in templates.items() if runs[name] is None}
    assert runs[naming.MOONCAKE_MASTER] == naming.MOONCAKE_MASTER, why
    assert {runs[n] for n in templates if n.startswith("engine-")} == {"prefill", "decode"}, runs
    assert runs[naming.ROUTER] == naming.ROUTER, why
    command = templates[naming.ROUTER]["spec"]["containers"][0]["command"]
    assert (command[0] == pods.PICKER_PROGRAM) == (engine == "vllm"), command
    if "otel-collector" in templates:
        assert why["otel-collector"].startswith("no command (the entry point of "), why
    assert all(why.values()), why  # every pod the twin does not run says why


def test_a_pod_of_a_program_the_twin_has_not_is_not_run():
    pod = {"metadata": {"labels": {pods.NAME_LABEL: "something-else"}, "namespace": "x"},
           "spec": {"containers": [{"name": "c", "image": "example/x:1", "command": ["/bin/x"]}]}}
    assert pods.runs_as(pod) is None
    assert "no program of the twin's stands for it" in pods.not_runnable(pod)


def test_the_mooncake_master_pod_runs_the_pinned_wheels_binary(tmp_path):
    """The wrapper a started Mooncake master pod finds on its PATH: the pinned wheel's binary
    (sha256 checked) with its bundled libraries; `--helpfull` lists the rendered flags."""
    processes = pods.PodProcesses.__new__(pods.PodProcesses)  # only the folder: no twin, no pod network
    processes.folder = tmp_path
    folder = processes.mooncake_bin("docker.io/kvcacheai/mooncake:v0.3.8.post1")
    done = subprocess.run([str(Path(folder) / pods.MOONCAKE_MASTER), "--helpfull"], capture_output=True, text=True,
                          timeout=60)
    assert "rpc_port" in done.stdout and "metrics_port" in done.stdout, done.stderr[-2000:]
    with pytest.raises(pods.TwinError, match="no sha256 of its wheel is pinned"):
        processes.mooncake_bin("docker.io/kvcacheai/mooncake:v9.9.9")


def test_a_request_to_the_endpoint_picker_over_http_is_refused_saying_how(monkeypatch, tmp_path):
    """`python -m twin.pods request` sends chat requests to sglang-router over HTTP; vLLM's router pod is the
    endpoint picker, which a gateway asks over ext_proc (its `http` port is the gRPC ext_proc port), so it
    says so instead of retrying HTTP against gRPC until its timeout."""
    import json
    import types

    picker = {"metadata": {"name": "router-1", "namespace": "ns", "labels": {pods.NAME_LABEL: naming.ROUTER},
                           "annotations": {pods.PROCESS_ANNOTATION: "running"}},
              "spec": {"containers": [{"name": "router", "command": [pods.PICKER_PROGRAM],
                                       "ports": [{"name": "http", "containerPort": 9002}]}]},
              "status": {"podIP": "10.244.0.9"}}
    monkeypatch.setattr(pods, "kubectl", lambda *a, **k: types.SimpleNamespace(stdout=json.dumps({"items": [picker]})))
    with pytest.raises(pods.TwinError, match="is the endpoint picker .* asks over ext_proc"):
        pods.send_request("ns", kubeconfig=tmp_path / "kubeconfig", folder=tmp_path, timeout=1)


def test_an_address_given_out_again_gets_its_veth_while_the_old_namespace_lingers(tmp_path):
    """A pod address the cluster gives to a new pod while the old pod's network namespace still
    exists: the kernel frees a namespace, and the veth on the hub's bridge with it, in a work queue
    after its last process left (linux net/core/net_namespace.c cleanup_net), which on a loaded
    machine lagged behind the next pod at that address, and the twin's `ip link add` failed with
    "RTNETLINK answers: File exists" (tests/twin/test_metrics_on_twin.py, 2026-12-08). The lag is
    made certain here by a process left in the old namespace."""
    network = pods.PodNetwork(tmp_path, apiserver_port=9)  # no API server: the tunnel is never dialled
    ip = "10.244.0.3"
    old = network.attach(ip, tmp_path / "old.log")
    lingering = subprocess.Popen(["nsenter", f"--net=/proc/{old.pid}/ns/net", "--", "sleep", "infinity"])
    new = None
    try:
        while pods._netns_inode(lingering.pid) != pods._netns_inode(old.pid):  # until nsenter has entered it
            assert lingering.poll() is None, "nsenter could not enter the old pod's namespace"
            time.sleep(0.05)
        old.kill()
        old.wait()
        new = network.attach(ip, tmp_path / "new.log")
        addresses = subprocess.run(["nsenter", f"--net=/proc/{new.pid}/ns/net", "--", "ip", "-o", "addr", "show", "eth0"],
                                   capture_output=True, text=True, check=True).stdout
        assert f"inet {ip}/" in addresses
        old_links = subprocess.run(["nsenter", f"--net=/proc/{lingering.pid}/ns/net", "--", "ip", "-o", "link"],
                                   capture_output=True, text=True, check=True).stdout
        assert "eth0" not in old_links  # the old pod's end went with the hub's
    finally:
        for proc in (lingering, new):
            if proc is not None:
                proc.kill()
                proc.wait()
        network.stop()
