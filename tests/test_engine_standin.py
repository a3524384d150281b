"""The engine stand-in's PD hand-off (twin/engine_standin.py) on 127.0.0.1, without the twin: a
decode answers only after the prefill the router named (bootstrap_host, bootstrap_port,
bootstrap_room, as sglang-router 0.3.2 routers/http/pd_router.rs adds them) has taken the room;
a bootstrap port where no prefill listens, or a prefill with another page size (SGLang 0.5.23
disaggregation/common/conn.py try_ensure_parallel_info: "Page size mismatch"), fails the request.
Each stand-in's argv goes through SGLang 0.5.23's own parser first (one checker process)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.servers import free_port
from twin.pods import STANDIN, _engines_venv
from twin.process import die_with_parent


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A checker, a prefill (page size 64) and two decodes (64 and 32) on 127.0.0.1."""
    folder = tmp_path_factory.mktemp("standins")
    python, checker = str(_engines_venv() / "bin" / "python"), folder / "checker.sock"
    ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "decode32")}
    common = ["--model-path", str(folder), "--host", "127.0.0.1", "--enable-metrics"]
    argvs = {"checker": ["--serve-checks", str(checker)],
             "prefill": ["--checker", str(checker), *common, "--port", str(ports["prefill"]), "--page-size", "64",
                         "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports["bootstrap"])],
             "decode": ["--checker", str(checker), *common, "--port", str(ports["decode"]), "--page-size", "64",
                        "--disaggregation-mode", "decode"],
             "decode32": ["--checker", str(checker), *common, "--port", str(ports["decode32"]), "--page-size", "32",
                          "--disaggregation-mode", "decode"]}
    # how long a decode waits for its prefill to take the room (SGLang's own knob): short, for the case
    # where no prefill ever gets the request; the router sends both at once
    env = {**os.environ, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "15"}
    procs = {name: subprocess.Popen([python, str(STANDIN), *argv], stdout=open(folder / f"{name}.log", "wb"), env=env,
                                    stderr=subprocess.STDOUT, preexec_fn=functools.partial(die_with_parent, os.getpid()))
             for name, argv in argvs.items()}
    try:
        deadline = time.monotonic() + 300
        for name in ("prefill", "decode", "decode32"):
            while _get(ports[name], "/health")[0] != 200:
                assert procs[name].poll() is None, (folder / f"{name}.log").read_text()
                assert time.monotonic() < deadline, f"{name} did not serve within 300 s"
                time.sleep(0.2)
        yield ports
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def _get(port: int, path: str) -> tuple[int, str]:
    return _call(urllib.request.Request(f"http://127.0.0.1:{port}{path}"))


def _call(request) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


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
    assert f"prefill 127.0.0.1:{engines['bootstrap']} room 7" in json.loads(text)["choices"][0]["message"]["content"]
    loads = json.loads(_get(engines["decode"], "/v1/loads")[1])["loads"][0]
    assert loads["disaggregation"]["mode"] == "decode" and loads["num_running_reqs"] == 0


@pytest.mark.parametrize("decode, bootstrap, said", [
    ("decode", None, "Connection refused"),  # a bootstrap port where nothing listens
    ("decode", "bootstrap", "never took bootstrap room 8"),  # the prefill never got this request
    ("decode32", "bootstrap", "Page size mismatch: prefill server has page_size=64"),
])
def test_a_wrong_bootstrap_port_a_room_never_taken_or_another_page_size_fails_the_request(engines, decode, bootstrap, said):
    status, text = _chat(engines[decode], engines[bootstrap] if bootstrap else free_port(), 8)
    assert status != 200 and said in text, (status, text)
