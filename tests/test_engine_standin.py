"""The engine stand-in's PD hand-off (twin/engine_standin.py) on 127.0.0.1, without the twin: a
decode answers only after the prefill the router named (bootstrap_host, bootstrap_port,
bootstrap_room, as sglang-router 0.3.2 routers/http/pd_router.rs adds them) has taken the room;
a bootstrap port where no prefill listens, or a prefill with another page size (SGLang 0.5.23
disaggregation/common/conn.py try_ensure_parallel_info: "Page size mismatch"), fails the request.
The room's KV moves with the pinned Mooncake (twin/kv_handoff.py), its sha256 checked on the
decode; NIXL's READ likewise for vLLM; each engine's failed-transfer counter stays 0 and its
transfer-time histogram counts the transfer where the engine times it.
Each stand-in's argv goes through SGLang 0.5.23's own parser first (one checker process).

vLLM 0.33.0 mode (the same checker runs `vllm serve`'s parser and validation,
vllm/entrypoints/cli/serve.py): a prefill answers a request whose kv_transfer_params say
do_remote_decode with the params a decode needs (nixl/pull_scheduler.py request_finished), and the
decode given them does vLLM's NIXL handshake on the prefill's side channel (nixl/base_worker.py
_nixl_handshake, ZMQ REQ, 5 s) before it answers; a side channel where nothing listens fails it. A
`--headless` worker serves nothing; a flag vLLM's parser refuses ends the stand-in with exit 2.
Token timing: an instance told a slow TTFT (POST /twin/timing) shows it in its own
time_to_first_token histogram, both engines; a streamed answer is one event per token.
Load: an instance runs as many requests as its own flag allows and publishes the rest as waiting."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from tests.servers import free_port
from tests.servers import http_answer as _call
from twin import kv_libraries
from twin.pods import STANDIN, _engines_venv
from twin.process import dying_with_parent


VLLM_PRODUCER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
VLLM_CONSUMER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A checker, an SGLang prefill (page size 64) and two decodes (64 and 32), a vLLM prefill and
    decode (NixlConnector) and a headless vLLM worker, on 127.0.0.1."""
    folder = tmp_path_factory.mktemp("standins")
    python, checker = str(_engines_venv() / "bin" / "python"), folder / "checker.sock"
    ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "decode32", "vllm_prefill",
                                            "side_channel", "vllm_decode", "headless", "sglang_capped",
                                            "vllm_capped")}
    common = ["--model-path", str(folder), "--host", "127.0.0.1", "--enable-metrics"]
    vllm = [str(folder), "--host", "127.0.0.1", "--served-model-name", "m", "--block-size", "64"]
    standin = ["--checker", str(checker)]
    argvs = {"checker": ["--serve-checks", str(checker)],
             "prefill": [*standin, "sglang", *common, "--port", str(ports["prefill"]), "--page-size", "64",
                         "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports["bootstrap"])],
             "decode": [*standin, "sglang", *common, "--port", str(ports["decode"]), "--page-size", "64",
                        "--disaggregation-mode", "decode"],
             "decode32": [*standin, "sglang", *common, "--port", str(ports["decode32"]), "--page-size", "32",
                          "--disaggregation-mode", "decode"],
             "vllm_prefill": [*standin, "vllm", *vllm, "--port", str(ports["vllm_prefill"]),
                              "--kv-transfer-config", VLLM_PRODUCER],
             "vllm_decode": [*standin, "vllm", *vllm, "--port", str(ports["vllm_decode"]),
                             "--kv-transfer-config", VLLM_CONSUMER],
             "headless": [*standin, "vllm", *vllm, "--port", str(ports["headless"]), "--headless"],
             # two running at once, by each engine's own flag (the load test below)
             "sglang_capped": [*standin, "sglang", *common, "--port", str(ports["sglang_capped"]),
                               "--max-running-requests", "2", "--context-length", "1000"],
             "vllm_capped": [*standin, "vllm", *vllm, "--port", str(ports["vllm_capped"]), "--max-num-seqs", "2",
                             "--max-model-len", "1000"]}
    # how long a decode waits for its prefill to take the room (SGLang's own knob): short, for the case
    # where no prefill ever gets the request; the router sends both at once. vLLM's side channel
    # (vllm/envs.py VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) on a free port of 127.0.0.1.
    # The KV moves between them with the pinned transfer libraries (twin/kv_libraries.py), each side
    # registered at 127.0.0.1 (SGLang's SGLANG_HOST_IP, vLLM's side-channel host).
    env = {**os.environ, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "15", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports["side_channel"]), "SGLANG_HOST_IP": "127.0.0.1",
           **kv_libraries.environment()}
    procs = {name: subprocess.Popen(dying_with_parent([python, str(STANDIN), *argv]), env=env,
                                    stdout=open(folder / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
             for name, argv in argvs.items()}
    try:
        deadline = time.monotonic() + 300
        for name in ("prefill", "decode", "decode32", "vllm_prefill", "vllm_decode", "sglang_capped", "vllm_capped"):
            while _get(ports[name], "/health")[0] != 200:
                assert procs[name].poll() is None, (folder / f"{name}.log").read_text()
                assert time.monotonic() < deadline, f"{name} did not serve within 300 s"
                time.sleep(0.2)
        while "no API server" not in (folder / "headless.log").read_text():
            assert procs["headless"].poll() is None, (folder / "headless.log").read_text()
            assert time.monotonic() < deadline, "the headless worker's argv was not checked within 300 s"
            time.sleep(0.2)
        yield {**ports, "folder": folder, "python": python, "checker": checker, "procs": procs}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def _sample(port: int, name: str) -> float:
    """The sum of one metric's samples on an engine's /metrics."""
    status, text = _get(port, "/metrics")
    assert status == 200, text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _get(port: int, path: str) -> tuple[int, str]:
    return _call(urllib.request.Request(f"http://127.0.0.1:{port}{path}"))


def _chat(port: int, bootstrap_port: int, room: int) -> tuple[int, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    return _call(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                        headers={"Content-Type": "application/json"}))


def test_the_decode_answers_after_the_named_prefill_took_the_room(engines):
    """Both requests at once, as the router sends them: the decode's answer names the prefill."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decode = pool.submit(_chat, engines["decode"], engines["bootstrap"], 7)
        prefill = pool.submit(_chat, engines["prefill"], engines["bootstrap"], 7)
        (status, text), (prefill_status, _) = decode.result(), prefill.result()
    assert (status, prefill_status) == (200, 200), text
    content = json.loads(text)["choices"][0]["message"]["content"]
    assert f"prefill 127.0.0.1:{engines['bootstrap']} room 7" in content
    # the room's KV crossed with Mooncake (the decode checked its sha256 against the prefill's)
    assert "bytes of KV over mooncake, sha256 " in content, content
    assert _sample(engines["decode"], "sglang:num_transfer_failed_reqs_total") == 0
    assert _sample(engines["prefill"], "sglang:kv_transfer_latency_ms_count") >= 1  # timed where it pushes
    loads = json.loads(_get(engines["decode"], "/v1/loads")[1])["loads"][0]
    assert loads["disaggregation"]["mode"] == "decode" and loads["num_running_reqs"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_kv_transfer_aborts_the_request_and_counts_in_the_engines_own_metric(engines, stream):
    """The prefill holds the room's KV for its prompt, the decode expects another prompt's (a pair
    that disagrees on the request): the transfer fails, and the decode aborts the request as SGLang
    0.5.23 does (disaggregation/decode.py pop_transferred: "Decode transfer failed ... with
    exception", prepare_abort INTERNAL_SERVER_ERROR; a stream gets it as an error event in a 200
    answer, entrypoints/openai/serving_chat.py) and counts it in sglang:num_transfer_failed_reqs_total."""
    import concurrent.futures

    room = 20 + stream
    before = _sample(engines["decode"], "sglang:num_transfer_failed_reqs_total")
    decode_body = {"model": "m", "messages": [{"role": "user", "content": "a longer question than the prefill's"}],
                   "bootstrap_host": "127.0.0.1", "bootstrap_port": engines["bootstrap"], "bootstrap_room": room,
                   "stream": stream}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decode = pool.submit(_post, engines["decode"], "/v1/chat/completions", decode_body)
        prefill = pool.submit(_chat, engines["prefill"], engines["bootstrap"], room)
        (status, text), _ = decode.result(), prefill.result()
    assert "Decode transfer failed for request rank=0 bootstrap_room=" in text and "bytes, decode has" in text, text
    if stream:
        assert status == 200 and '"code": 500' in text and text.rstrip().endswith("data: [DONE]"), (status, text)
    else:
        assert status == 500, (status, text)
    assert _sample(engines["decode"], "sglang:num_transfer_failed_reqs_total") == before + 1


@pytest.mark.parametrize("decode, bootstrap, said", [
    ("decode", None, "Connection refused"),  # a bootstrap port where nothing listens
    ("decode", "bootstrap", "never took bootstrap room 8"),  # the prefill never got this request
    ("decode32", "bootstrap", "Page size mismatch: prefill server has page_size=64"),
])
def test_a_wrong_bootstrap_port_a_room_never_taken_or_another_page_size_fails_the_request(engines, decode, bootstrap, said):
    status, text = _chat(engines[decode], engines[bootstrap] if bootstrap else free_port(), 8)
    assert status != 200 and said in text, (status, text)


def _post(port: int, path: str, body: dict) -> tuple[int, str]:
    return _call(urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                        headers={"Content-Type": "application/json"}))


def test_vllm_serves_its_endpoints_and_a_headless_worker_serves_none(engines):
    """vLLM 0.33.0's API server routes (entrypoints/launchers/api_server/routers.py), its metric
    names (infra/render/pinned/vllm-0.33.0-metrics.json); SGLang's /v1/loads is not among them; a
    --headless worker (serve.py run_headless) runs, and nothing listens on its port."""
    port = engines["vllm_decode"]
    assert _get(port, "/ping")[0] == 200 and _post(port, "/ping", {})[0] == 200
    assert json.loads(_get(port, "/v1/models")[1])["data"][0]["id"] == "m"
    assert json.loads(_get(port, "/load")[1]) == {"server_load": 0}
    assert _get(port, "/v1/loads")[0] == 404
    metrics = _get(port, "/metrics")[1]
    assert '# TYPE vllm:time_to_first_token_seconds histogram' in metrics
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"}' in metrics
    headless = engines["procs"]["headless"]
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    assert headless.poll() is None and f"pid={headless.pid}," not in listening, listening


def test_vllm_decode_answers_after_the_nixl_handshake_with_the_prefill(engines):
    """As llm-d's sidecar drives vLLM P/D: the prefill (do_remote_decode, max_tokens 1) returns the
    kv_transfer_params; the decode given them handshakes with that prefill's side channel."""
    status, text = _post(engines["vllm_prefill"], "/v1/completions", {
        "model": "m", "prompt": "hi", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert status == 200, text
    params = json.loads(text)["kv_transfer_params"]
    assert params["do_remote_prefill"] and (params["remote_host"], params["remote_port"]) == (
        "127.0.0.1", engines["side_channel"])
    status, text = _post(engines["vllm_decode"], "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": params})
    assert status == 200, text
    content = json.loads(text)["choices"][0]["message"]["content"]
    assert f"prefill {params['remote_engine_id']} at 127.0.0.1:{engines['side_channel']}" in content
    assert "bytes of KV over nixl, sha256 " in content, content  # READ from the prefill's agent, digest checked
    assert _sample(engines["vllm_decode"], "vllm:nixl_num_failed_transfers_total") == 0
    assert _sample(engines["vllm_decode"], "vllm:nixl_xfer_time_seconds_count") == 1  # timed where it pulls
    status, text = _post(engines["vllm_decode"], "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {**params, "remote_port": free_port()}})  # a side channel where nothing listens
    assert status != 200 and "NIXL handshake" in text, (status, text)


def test_a_flag_vllms_parser_refuses_ends_the_standin(engines):
    """`vllm serve --dtype fp9`: argparse's invalid choice and exit status 2, as the engine ends."""
    done = subprocess.run([engines["python"], str(STANDIN), "--checker", str(engines["checker"]), "vllm",
                           str(engines["folder"]), "--port", str(free_port()), "--dtype", "fp9"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "invalid choice: 'fp9'" in done.stderr, done.stderr


def _ttft(metrics: str, name: str) -> tuple[float, float]:
    """(observations at or under 0.6 s, all observations) of the TTFT histogram."""
    def value(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)
                   and ('le="0.6"' in line or "_count" in prefix))
    return value(f"{name}_bucket"), value(f"{name}_count")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_slow_instance_shows_in_its_ttft_histogram(engines, engine):
    """An instance told a 700 ms TTFT: its request lands above the 0.6 s bucket of the engine's own
    histogram (vllm:/sglang:time_to_first_token_seconds); the streamed answer is one event per token."""
    port, name = ((engines["vllm_prefill"], "vllm:time_to_first_token_seconds") if engine == "vllm"
                  else (engines["decode"], "sglang:time_to_first_token_seconds"))
    fast, count = _ttft(_get(port, "/metrics")[1], name)
    assert json.loads(_post(port, "/twin/timing", {"ttft_ms": 700})[1])["ttft_ms"] == 700
    try:
        body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
        if engine == "vllm":
            status, text = _post(port, "/v1/completions", body)
        else:
            import concurrent.futures

            pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": engines["bootstrap"], "bootstrap_room": 11}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answer = pool.submit(_post, port, "/v1/completions", {**body, **pd})
                pool.submit(_post, engines["prefill"], "/v1/completions", {**body, **pd, "stream": False}).result()
                status, text = answer.result()
    finally:
        _post(port, "/twin/timing", {"ttft_ms": 40})
    assert status == 200, text
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]", text
    assert _ttft(_get(port, "/metrics")[1], name) == (fast, count + 1)


LOAD_GAUGES = {"sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                          "sglang:queue_time_seconds_count"),
               "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                        "vllm:request_queue_time_seconds_count")}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_instance_runs_as_many_as_its_flag_allows_and_publishes_the_rest_as_waiting(engines, engine):
    """Five requests at once on an instance whose own flag allows two running (SGLang
    --max-running-requests, vLLM --max-num-seqs): two run and three wait, and its /metrics says so
    with the pinned engines' gauges (sglang/srt/observability/metrics_collector.py:364-404
    num_running_reqs, num_queue_reqs, token_usage; vllm/v1/metrics/loggers.py:527-619
    num_requests_running, num_requests_waiting, kv_cache_usage_perc: what the endpoint picker's
    queue and KV-cache scorers read, gateway-api-inference-extension v1.4.0
    pkg/epp/server/options.go), the KV held by the running two over the capacity the flags imply
    (2 x 1000 tokens); SGLang's /v1/loads and vLLM's /load count the same. Each waited request is
    in the engine's queue-time histogram. Afterwards nothing runs or waits."""
    import concurrent.futures

    port = engines[f"{engine}_capped"]
    running, waiting, usage, queued = LOAD_GAUGES[engine]
    before = _sample(port, queued)
    _post(port, "/twin/timing", {"itl_ms": 300})  # each answer takes seconds: the five overlap
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            answers = [pool.submit(_post, port, "/v1/completions",
                                   {"model": "m", "prompt": f"request {i} " + "word " * 50, "max_tokens": 8})
                       for i in range(5)]
            deadline = time.monotonic() + 120
            while _sample(port, waiting) < 3:  # until all five have arrived
                assert time.monotonic() < deadline, _get(port, "/metrics")[1]
                time.sleep(0.1)
            assert (_sample(port, running), _sample(port, waiting)) == (2, 3)
            assert 0 < _sample(port, usage) < 1
            load = json.loads(_get(port, "/twin/load")[1])
            assert (load["max_running"], load["kv_capacity_tokens"]) == (2, 2000), load
            assert 0 < load["kv_tokens"] <= 2 * 70, load  # the two running prompts and their tokens so far
            if engine == "sglang":
                [loads] = json.loads(_get(port, "/v1/loads")[1])["loads"]
                assert (loads["num_running_reqs"], loads["num_waiting_reqs"], loads["queues"]["waiting"],
                        loads["max_running_requests"]) == (2, 3, 3, 2), loads
            else:
                assert json.loads(_get(port, "/load")[1]) == {"server_load": 5}
            assert all(answer.result()[0] == 200 for answer in answers)
    finally:
        _post(port, "/twin/timing", {"itl_ms": 5})
    assert (_sample(port, running), _sample(port, waiting), _sample(port, usage)) == (0, 0, 0)
    assert _sample(port, queued) == before + 5
