"""A request answered on the twin: dev (SGLang) rendered and applied, the router and engine pods
started as processes at their pod addresses (twin/pods.py), and one chat request sent to the
router's pod address, answered through the real sglang-router 0.3.2 (the engines' CPU virtualenv,
with the rendered flags, finding its workers by service discovery through the twin's API server)
by the engine stand-ins (twin/engine_standin.py), prefill and decode both taking part as PD mode
has them (sglang-router 0.3.2 routers/http/pd_router.rs: both get the request, with the prefill's
bootstrap address and room; the decode asks that prefill's bootstrap server, SGLang 0.5.23
disaggregation/common/conn.py CommonKVBootstrapServer, before it answers).

A flag the router refuses, or one the engine's own parser refuses (sglang 0.5.23
ServerArgs.add_cli_args), ends that process, and the runner reports it with the program's reason.

dev with vLLM 0.33.0: its engine pods' rendered `vllm serve` commands run the stand-in (vLLM's own
parser first) at their pod addresses, and the router's pod runs the endpoint picker
(gateway-api-inference-extension v1.4.0's EPP with llm-d-inference-scheduler v0.7.1's plugins,
twin/endpoint-picker) with the rendered flags and EndpointPickerConfig, finding the pods through
the twin's API server as its ServiceAccount. The test asks it as the gateway does (Envoy's
ext_proc, twin/endpoint_picker.py) and sends the request where it says, as llm-d's routing sidecar
sends it (the prefill first with kv_transfer_params do_remote_decode and max_tokens 1, then the
decode with the kv_transfer_params the prefill answered: vllm nixl/pull_scheduler.py
request_finished), so the decode's NIXL handshake reaches the prefill's side channel at the
address the render gives it (VLLM_NIXL_SIDE_CHANNEL_HOST from status.podIP). With a second decode
instance, the picker's choice follows prefix affinity (its prefix-cache scorer), not round robin.
"""

from __future__ import annotations

import copy
import json
import time

import pytest

from infra import naming
from infra.render.router_config import EPP_GRPC_PORT
from tests.twin.conftest import FIGURES
from tests.twin.placement import assert_every_pod_bound, remove_render, unready_by_probes, users_objects
from twin import dra, endpoint_picker, fleet, kubelet, pods
from twin.api import TwinError, kubectl
from twin.nodes import stack_nodes

@pytest.fixture(scope="module")
def dev_applied(twin, tmp_path_factory, request):
    """dev's render (SGLang, or the engine a test asks for: indirect parametrization) applied on
    nodes of its pools, every pod bound; removed afterwards (before another engine's is applied)."""
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec, switch_engine

    engine = getattr(request, "param", "sglang")
    spec, _ = switch_engine(load_spec(stack_spec_path("dev")), engine)
    objects = fleet.render("dev", tmp_path_factory.mktemp(f"dev-{engine}-requests"), engine=engine)
    nodes = stack_nodes(spec)
    assert fleet.apply_each_pass(nodes).rejected == {}
    users_objects(spec)
    result = fleet.apply_each_pass(objects)
    assert result.rejected == {}, result.rejected
    assert fleet.apply_each_pass(dra.stand_in(objects, nodes)).rejected == {}
    assert_every_pod_bound(spec, objects, result, f"dev-{engine} (requests)")
    yield spec, objects
    remove_render(spec, objects)


def _launch_script(objects: list[dict], name: str) -> dict:
    return copy.deepcopy(next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name))


def _wait_exit(processes: pods.PodProcesses, timeout: float = 300) -> str:
    """The reason the runner gives once a started process has exited (fails if none exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            processes.check()
        except TwinError as exc:
            return str(exc)
        time.sleep(0.5)
    pytest.fail(f"no process exited within {timeout:.0f} s: " + ", ".join(p.name for p in processes.started))


def test_a_request_is_answered_through_the_router_by_prefill_and_decode(dev_applied):
    spec, objects = dev_applied
    namespace = spec.environment.namespace
    started_at = time.monotonic()
    processes = pods.start_processes(namespace)  # in the twin's folder, where its kubelet probes them
    try:
        by_role = {p.role: p for p in processes.started}
        assert set(by_role) == {"router", "prefill", "decode", "mooncake-master"}, by_role
        for pod in fleet.get("pods", "-n", namespace):
            if pod["metadata"]["name"] in {p.name for p in processes.started}:
                assert pod["metadata"]["annotations"][pods.PROCESS_ANNOTATION] == "running"

        answer = pods.send_request(namespace, check=processes.check)
        assert answer["object"] == "chat.completion" and answer["model"] == spec.model.name
        content = answer["choices"][0]["message"]["content"]
        prefill, decode = by_role["prefill"], by_role["decode"]
        # the decode answered after the prefill named in the router's bootstrap fields took the room,
        # and its KV crossed from that prefill's pod with Mooncake (twin/kv_handoff.py, sha256 checked)
        assert f"prefill {prefill.ip}:" in content, content
        assert "bytes of KV over mooncake, sha256 " in content, content

        def requests_served(pod: pods.Started) -> float:
            status, text = processes.request(pod.ip, 30000, "/metrics")
            assert status == 200, text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("sglang:num_requests_total{"))

        served = {role: requests_served(by_role[role]) for role in ("prefill", "decode")}
        assert served["prefill"] >= 1 and served["decode"] >= 1, served
        processes.check()
        FIGURES.append(f"dev-sglang requests: router, Mooncake master + "
                       f"{sum(p.role in ('prefill', 'decode') for p in processes.started)} engine stand-ins started at their "
                       f"pod addresses; 1 chat request answered through sglang-router 0.3.2 (prefill {prefill.ip} "
                       f"served {served['prefill']:.0f}, decode {decode.ip} served {served['decode']:.0f}) in "
                       f"{time.monotonic() - started_at:.0f} s")
    finally:
        processes.stop()


@pytest.mark.parametrize("config_map, role, old, new, said", [
    # sglang-router 0.3.2 router_args.py: --prefill-policy takes one of its policy names
    ("router-launch", "router", "--prefill-policy cache_aware", "--prefill-policy cache_awar",
     "argument --prefill-policy: invalid choice: 'cache_awar'"),
    # sglang 0.5.23 ServerArgs.add_cli_args: --disaggregation-mode choices null, prefill, decode
    ("engine-decode-launch", "decode", "--disaggregation-mode decode", "--disaggregation-mode decod",
     "invalid choice: 'decod'"),
])
def test_a_flag_its_program_refuses_ends_the_process(dev_applied, config_map, role, old, new, said):
    """The launch script as the ConfigMap carries it, one flag corrupted: the program exits and the
    runner reports its reason."""
    spec, objects = dev_applied
    namespace = spec.environment.namespace
    original = _launch_script(objects, config_map)
    broken = copy.deepcopy(original)
    assert old in broken["data"]["launch.sh"]
    broken["data"]["launch.sh"] = broken["data"]["launch.sh"].replace(old, new)
    assert fleet.apply_each_pass([broken]).rejected == {}
    processes = pods.PodProcesses()
    try:
        processes.start(namespace, select=lambda pod: pods.runs_as(pod) == role)
        reason = _wait_exit(processes)
        assert said in reason, reason
    finally:
        processes.stop()
        assert fleet.apply_each_pass([original]).rejected == {}  # restored as rendered


def test_a_flag_the_mooncake_master_refuses_ends_its_pod(dev_applied):
    """The Mooncake master's Deployment with one rendered flag misspelt: the pinned wheel's
    mooncake_master (gflags, mooncake-transfer-engine on PyPI) exits on an unknown flag before it
    serves, and the runner reports its pod with the program's own message."""
    spec, objects = dev_applied
    namespace = spec.environment.namespace
    original = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"
                                  and o["metadata"]["name"] == naming.MOONCAKE_MASTER))
    broken = copy.deepcopy(original)
    command = broken["spec"]["template"]["spec"]["containers"][0]["command"]
    command[command.index("--rpc_port=50051")] = "--rpc_portt=50051"
    assert fleet.apply_each_pass([broken]).rejected == {}
    processes = pods.PodProcesses()
    try:
        processes.start(namespace, select=lambda pod: pods.runs_as(pod) == naming.MOONCAKE_MASTER and
                        "--rpc_portt=50051" in pod["spec"]["containers"][0]["command"])
        reason = _wait_exit(processes)
        assert f"pod {namespace}/{naming.MOONCAKE_MASTER}-" in reason and "rpc_portt" in reason, reason
    finally:
        processes.stop()
        assert fleet.apply_each_pass([original]).rejected == {}  # restored as rendered


def _samples(processes: pods.PodProcesses, ip: str, port: int, name: str) -> dict[str, float]:
    """One metric's samples on a pod's /metrics: {labels: value}."""
    status, text = processes.request(ip, port, "/metrics")
    assert status == 200, text
    return {line.split("{", 1)[1].rsplit("}", 1)[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(name + "{")}


def test_a_decode_whose_kv_handoffs_fail_is_taken_out_with_its_prefill_and_refused_by_the_gate(dev_applied):
    """dev's one decode group rendered with a wrong hostname for its transfer engine (its launch
    script exports SGLANG_HOST_IP=127.0.0.1, so it registers its Mooncake session at its own
    loopback): each request's KV write from the prefill fails in Mooncake, and the decode aborts it
    with a 500 as SGLang 0.5.23 does (disaggregation/decode.py pop_transferred: "Decode transfer
    failed ...", prepare_abort INTERNAL_SERVER_ERROR) and counts it in its own
    sglang:num_transfer_failed_reqs_total (the counter the canary gate and PdstackKVTransferErrors
    read: infra/render/metrics.py ENGINE_METRICS). Taken out of rotation by what the rendered fleet
    does: sglang-router 0.3.2's circuit breaker, which the router's render leaves on at its defaults
    (router_args.py: cb_failure_threshold 10, cb_timeout_duration_secs 60) and which records each
    PD request's outcome on both the prefill and the decode (routers/http/pd_router.rs
    execute_dual_dispatch: record_outcome): after enough failures both circuits open and the router
    answers 503 with no worker to pick. The rollout's verdict (infra/rollout/canary.py judge) on
    the decode's counter refuses it on "KV transfer errors" alone."""
    from infra.render.metrics import ENGINE_METRICS
    from infra.render.router_config import ROUTER_METRICS_PORT, ROUTER_PORT
    from infra.rollout.canary import Observation, gate_queries, judge

    spec, objects = dev_applied
    namespace = spec.environment.namespace
    original = _launch_script(objects, "engine-decode-launch")
    broken = copy.deepcopy(original)
    script = broken["data"]["launch.sh"]
    assert "\nexec python3 -m sglang.launch_server" in script
    broken["data"]["launch.sh"] = script.replace("\nexec python3", "\nexport SGLANG_HOST_IP=127.0.0.1\nexec python3", 1)
    assert fleet.apply_each_pass([broken]).rejected == {}
    started_at = time.monotonic()
    processes = pods.start_processes(namespace)
    try:
        by_role = {p.role: p for p in processes.started}
        router, prefill, decode = by_role["router"], by_role["prefill"], by_role["decode"]
        _served(processes, decode, 30000)
        answers: list[tuple[int, str]] = []
        model = None
        deadline = time.monotonic() + 600  # the router finds its workers first (a busy machine: minutes)
        while time.monotonic() < deadline and not (answers and answers[-1][0] in (200, 503)):
            processes.check()
            try:
                if model is None:  # as pods.send_request: until the router lists the model
                    status, said = processes.request(router.ip, ROUTER_PORT, "/v1/models")
                    model = json.loads(said)["data"][0]["id"] if status == 200 and json.loads(said).get("data") else None
                if model is not None:
                    answer = processes.request(router.ip, ROUTER_PORT, "/v1/chat/completions",
                                               {**pods.CHAT, "model": model})
                    if answer[0] != 503 or answers:  # before any answer, a 503 is the router still finding the pair
                        answers.append(answer)
                        continue
            except (OSError, ValueError):
                pass  # the router does not listen yet (the pod network resets the connection)
            time.sleep(1)
        failed = [text for status, text in answers if status == 500]
        assert failed and answers[-1][0] == 503, [(s, t[:200]) for s, t in answers]
        assert all(status in (500, 503) for status, _ in answers), [(s, t[:200]) for s, t in answers]
        # the library's own error reaches the client through the decode's abort and the router
        assert "Decode transfer failed" in failed[0] and "Mooncake transfer_sync_write to 127.0.0.1:" in failed[0], failed[0]
        assert "No available" in answers[-1][1], answers[-1][1]

        counter = ENGINE_METRICS["sglang"].kv_transfer_failures
        transfers_failed = sum(_samples(processes, decode.ip, 30000, counter).values())
        assert transfers_failed >= len(failed), (transfers_failed, len(failed))
        circuits = _samples(processes, router.ip, ROUTER_METRICS_PORT, "smg_worker_cb_state")
        print(f"router circuit breakers: {circuits}", flush=True)
        opened = {labels for labels, value in circuits.items() if value != 0}
        assert any(decode.ip in labels for labels in opened) and any(prefill.ip in labels for labels in opened), circuits

        # the canary gate reads this very counter, and refuses the revision on it alone
        assert counter in gate_queries(spec, 2, "5m")["kv_transfer_errors"]
        serving = Observation(ttft_p99_s=0.2, tpot_p99_s=0.02, error_rate=0.0, kv_transfer_errors=0.0)
        verdict = judge(Observation(**{**serving.__dict__, "kv_transfer_errors": transfers_failed}), serving, spec.slo)
        assert not verdict.passed and [g.name for g in verdict.gates if not g.passed] == ["KV transfer errors"], verdict
        FIGURES.append(f"dev-sglang KV hand-off broken on its decode (SGLANG_HOST_IP=127.0.0.1): {len(failed)} requests "
                       f"failed with Mooncake's error, {transfers_failed:.0f} counted by the decode, then the router's "
                       f"circuits open (503) after {len(answers)} requests; gate: {verdict.reasons()}; "
                       f"{time.monotonic() - started_at:.0f} s")
    finally:
        processes.stop()
        assert fleet.apply_each_pass([original]).rejected == {}  # restored as rendered


UNSERVED_PORT = 1  # tcpmux: nothing in a router pod's network namespace listens there


def test_a_readiness_probe_on_a_port_nothing_serves_keeps_the_pod_unready_and_the_fleet_check_names_it(dev_applied):
    """The router's rendered readinessProbe (tcpSocket on the port it serves, infra/components/
    balancers.py) pointed at a port nothing in its pod serves, nothing else changed: its process
    starts and serves its own port, but the twin's kubelet's probe (k8s.io/kubernetes v1.34.4
    pkg/probe/tcp/tcp.go: the connection must open) is refused every period, so the pod is never
    Ready. The fleet check (placement.unready_by_probes, what assert_runnable_pods_run fails with)
    names the pod and the probe's reason, and so does the kubelet's Unhealthy event."""
    spec, objects = dev_applied
    namespace = spec.environment.namespace
    original = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"
                                  and o["metadata"]["name"] == naming.ROUTER))
    broken = copy.deepcopy(original)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    served = container["readinessProbe"]["tcpSocket"]["port"]
    container["readinessProbe"]["tcpSocket"]["port"] = UNSERVED_PORT
    assert fleet.apply_each_pass([broken]).rejected == {}

    def is_broken(pod: dict) -> bool:
        return (pods.runs_as(pod) == naming.ROUTER and
                pod["spec"]["containers"][0]["readinessProbe"].get("tcpSocket", {}).get("port") == UNSERVED_PORT)
    processes = pods.PodProcesses()
    try:
        [router] = processes.start(namespace, select=is_broken)
        live = _pod(namespace, router.name)
        serving = fleet.wait_for("the router serving its own port", lambda: processes.check() or kubelet.run_probe(
            {"tcpSocket": {"port": served}}, router.ip, live["spec"]["containers"][0])[0], interval=1)
        assert serving, f"{router.name} never served {router.ip}:{served}"
        refused = f"dial tcp {router.ip}:{UNSERVED_PORT}: connect: connection refused"
        events = fleet.wait_for("the kubelet's Unhealthy event", lambda: [
            e for e in fleet.scheduler_events(namespace, router.name) if e.startswith("Unhealthy:")], interval=1)
        assert f"Unhealthy: Readiness probe failed: probe failed: {refused}" in events, events
        assert kubelet.condition(_pod(namespace, router.name), "Ready")["status"] == "False"
        assert unready_by_probes(processes, {namespace}) == [f"{router.name}: probe failed: {refused}; Ready False"]
    finally:
        processes.stop()
        assert fleet.apply_each_pass([original]).rejected == {}  # restored as rendered


def _pod(namespace: str, name: str) -> dict:
    return fleet.get("pods", "-n", namespace, f"--field-selector=metadata.name={name}")[0]


def _served(processes: pods.PodProcesses, pod: pods.Started, port: int, timeout: float = 300) -> None:
    """Until the pod's engine answers /health at its address (its argv is checked first; until it
    listens, the pod network resets the connection)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if processes.request(pod.ip, port, "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        processes.check()
        assert time.monotonic() < deadline, f"{pod.name} did not serve on {pod.ip}:{port} within {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def dev_vllm_pods(dev_applied):
    """dev-vllm's pods started as processes once for the tests below (the picker, both engines)."""
    spec, _ = dev_applied
    processes = pods.start_processes(spec.environment.namespace)
    yield processes
    processes.stop()


def _picked(processes: pods.PodProcesses, picker: pods.Started, model: str, prompt: str, ready=lambda pick: True):
    """The endpoint picker's choice for one chat request, asked as the gateway asks it; retried until
    it has found the pods and `ready(pick)` holds."""
    return endpoint_picker.ask_until_picked(
        processes.network.client_socket, f"{picker.ip}:{EPP_GRPC_PORT}", "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}, ready,
        check=processes.check)


@pytest.mark.parametrize("dev_applied", ["vllm"], indirect=True)
def test_dev_vllm_a_request_is_answered_by_prefill_and_decode_through_the_nixl_side_channel(dev_applied,
                                                                                             dev_vllm_pods):
    """The rendered vLLM pods at their addresses; the prefill's kv_transfer_params name its pod IP
    (the render's VLLM_NIXL_SIDE_CHANNEL_HOST) and the decode answers after its handshake there."""
    import json

    spec, objects = dev_applied
    started_at = time.monotonic()
    processes = dev_vllm_pods
    by_role = {p.role: p for p in processes.started}
    assert {"prefill", "decode", "router"} <= set(by_role), by_role  # the router's pod is the picker
    prefill, decode = by_role["prefill"], by_role["decode"]
    _served(processes, prefill, 8000)
    _served(processes, decode, 8200)
    # the picker chooses the pair, as the gateway asks it (ext_proc); the sidecar's port on decode
    pick = _picked(processes, by_role["router"], spec.model.name, "Say hello from the twin.", lambda pick: pick.prefill)
    assert (pick.destination, pick.prefill) == (f"{decode.ip}:8000", f"{prefill.ip}:8000"), pick
    status, text = processes.request(prefill.ip, 8000, "/v1/completions", {
        "model": spec.model.name, "prompt": "Say hello from the twin.", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert status == 200, text
    params = json.loads(text)["kv_transfer_params"]
    assert params["remote_host"] == prefill.ip, params
    status, text = processes.request(decode.ip, 8200, "/v1/chat/completions", {
        "model": spec.model.name, "messages": [{"role": "user", "content": "Say hello from the twin."}],
        "max_tokens": 8, "kv_transfer_params": params})
    assert status == 200, text
    answer = json.loads(text)
    assert answer["model"] == spec.model.name
    content = answer["choices"][0]["message"]["content"]
    assert f"prefill {params['remote_engine_id']} at {prefill.ip}:" in content
    assert "bytes of KV over nixl, sha256 " in content, content  # READ from the prefill's agent

    def succeeded(pod: pods.Started, port: int) -> float:
        status, text = processes.request(pod.ip, port, "/metrics")
        assert status == 200, text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))

    served = {"prefill": succeeded(prefill, 8000), "decode": succeeded(decode, 8200)}
    assert served == {"prefill": 1.0, "decode": 1.0}, served
    processes.check()
    FIGURES.append(f"dev-vllm requests: {sum(p.role in ('prefill', 'decode') for p in processes.started)} engine "
                   f"stand-ins and the endpoint picker started at their pod addresses; 1 request picked by it and "
                   f"answered by "
                   f"prefill {prefill.ip} and decode {decode.ip} after the NIXL side-channel handshake, in "
                   f"{time.monotonic() - started_at:.0f} s")


@pytest.mark.parametrize("dev_applied", ["vllm"], indirect=True)
def test_dev_vllm_the_picker_keeps_a_prompts_prefix_on_one_decode_pod_not_round_robin(dev_applied, dev_vllm_pods):
    """dev's decode scaled to its maximum, 2 instances (its ScaledObject set aside): the picker's
    prefix-cache scorer (gateway-api-inference-extension v1.4.0
    pkg/epp/framework/plugins/scheduling/scorer/prefix: it remembers which pod it sent each prompt's
    blocks to) sends every request that shares a long prompt's prefix to the pod that had it, so
    two prompts first placed on different pods each stay on theirs, twice in a row and then
    interleaved; round robin would move every second request. The scorers' load inputs (waiting
    queue, KV use) are equal on both stand-ins."""
    from tests.twin.test_fleet_on_twin import autoscaler_set_aside

    spec, objects = dev_applied
    namespace = spec.environment.namespace
    decode_lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet"
                      and o["metadata"]["labels"].get(naming.ROLE_LABEL) == "decode")
    started_at = time.monotonic()
    processes = dev_vllm_pods
    picker = next(p for p in processes.started if p.role == naming.ROUTER)
    with autoscaler_set_aside(objects, decode_lws):
        kubectl("scale", "leaderworkerset", decode_lws["metadata"]["name"], "-n", namespace, "--replicas=2")
        running = {p.name for p in processes.started}
        processes.start(namespace, select=lambda pod: pods.runs_as(pod) == "decode"
                        and pod["metadata"]["name"] not in running)
        decodes = [p for p in processes.started if p.role == "decode"]
        assert len(decodes) == 2, [p.name for p in processes.started]
        for decode in decodes:
            _served(processes, decode, 8200)
        long_prefix = " ".join(f"word{i}" for i in range(600))  # ~4 KB: many of the scorer's blocks
        first = _picked(processes, picker, spec.model.name, f"A: {long_prefix}")
        # a new prompt scores 0 on both pods, so the picker draws between them once it has the second
        # (Ready by its probes, found by its pod reconciler): new prompts until one lands there
        deadline, attempt = time.monotonic() + 120, 0
        while True:
            attempt += 1
            prompt_b = f"B{attempt}: {long_prefix}"
            other = _picked(processes, picker, spec.model.name, prompt_b)
            if other.destination != first.destination:
                break
            assert time.monotonic() < deadline, f"the picker picked no second decode pod in 120 s ({attempt} prompts)"
            time.sleep(0.2)
        # each prompt twice in a row, then interleaved: round robin would move every second request
        order = [(f"A: {long_prefix}", first.destination)] * 2 + [(prompt_b, other.destination)] * 2
        order += [(f"A: {long_prefix}", first.destination), (prompt_b, other.destination)]
        seen = [(_picked(processes, picker, spec.model.name, f"{prompt} and then {i}").destination, want)
                for i, (prompt, want) in enumerate(order)]
        assert all(got == want for got, want in seen), seen
        assert {want for _, want in seen} == {f"{d.ip}:8000" for d in decodes}
        processes.stop_pod(next(p for p in decodes if p.name not in running))
        kubectl("scale", "leaderworkerset", decode_lws["metadata"]["name"], "-n", namespace, "--replicas=1")
    processes.check()
    FIGURES.append(f"dev-vllm picker: 2 decode pods, 6 requests of 2 long prompts (each twice in a row, then "
                   f"interleaved) each kept on the pod "
                   f"the picker first gave it (prefix affinity), in {time.monotonic() - started_at:.0f} s")
