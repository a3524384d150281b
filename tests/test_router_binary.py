"""The rendered sglang-router against the real router: sglang-router 0.3.2's own binary (the
pinned wheel, in the engines' CPU virtualenv: scripts/extract_engine_flags.py engine_venv) on
127.0.0.1, in front of a worker stub of this test's on 127.0.0.1.

- Retries: the render's `--retry-max-retries` is the spec's `timeouts.router_to_prefill.retries`
  plus the first attempt, since the router counts that value as attempts (src/core/retry.rs
  execute_response_with_retry; infra/render/router_config.py router_attempts). A worker that
  fails its first call with 503 (a status the router retries: retry.rs is_retryable_status) sees
  retries + 1 calls, and the client gets the second call's answer.
- Tokenizer: for every worker it adds, the router loads a tokenizer from the `model_path` the
  worker's /server_info reports (the engine's --model-path: src/core/steps/worker/local/
  discover_metadata.rs, register_tokenizer.rs), from that folder when it exists on the router's
  own filesystem, else by asking the Hugging Face hub for a model of that name
  (src/tokenizer/factory.rs create_tokenizer_async_with_chat_template, src/tokenizer/hub.rs; the
  hub's address is HF_ENDPOINT, hf-hub 0.4.3 ApiBuilder::from_env). The rendered router pod has
  a folder at the engines' model path (infra/render/router_config.py RouterLaunch.model_folder),
  so it never asks the hub. Here the hub's address is a loopback stub that counts what it is asked.
The router's routing itself reads no tokenizer in HTTP mode (its cache-aware tree is on request
text; only its /v1/tokenize and /v1/detokenize and its gRPC routers read the registry).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.components.balancers import router_deployment
from infra.components.k8s import LayerContext
from infra.render.engine_args import weights_path
from infra.render.router_config import router_launch
from infra.spec_checks import parse_spec
from tests.conftest import stack_data
from tests.servers import free_port, http_answer, send_json, stop
from twin.pods import _engines_venv
from twin.process import dying_with_parent

MODEL = "m"
START_DEADLINE_SECONDS = 300  # a deadline, not a measurement: the router is up in seconds on an idle machine


class WorkerStub:
    """An SGLang worker as sglang-router 0.3.2 adds one (its /health, /server_info, /model_info) and
    the Hugging Face hub (/api/...): it answers 503 to its first POST and 200 after, and records
    every POST and every hub request."""

    def __init__(self, model_path: str):
        stub = self
        self.posts: list[str] = []
        self.hub_requests: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                send_json(self, status, body)

            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith("/api/"):
                    stub.hub_requests.append(self.path)
                    return self._answer(404, {"error": "not a hub"})
                if self.path.startswith(("/server_info", "/model_info", "/get_server_info", "/get_model_info")):
                    return self._answer(200, {"model_path": model_path, "served_model_name": MODEL,
                                              "tp_size": 1, "dp_size": 1})
                return self._answer(200, {})

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.posts.append(self.path)
                if len(stub.posts) == 1:
                    return self._answer(503, {"error": "the first call fails"})
                return self._answer(200, {"text": "ok", "meta_info": {}})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _status(url: str, body: dict | None = None) -> tuple[int, str]:
    return http_answer(urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                              headers={"Content-Type": "application/json"}), timeout=60)


@contextmanager
def real_router(worker: WorkerStub, flags: list[str], log_path):
    """sglang-router 0.3.2 on 127.0.0.1 with one worker (round robin, regular mode: the retry loop and
    the worker registration are the PD router's too, src/routers/http/pd_router.rs) and `flags`; the
    hub it would ask is the stub. Yields its URL once it counts the worker healthy."""
    port, metrics = free_port(), free_port()
    argv = [str(_engines_venv() / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics), "--worker-urls", worker.url, "--policy", "round_robin", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT,
                                env={"PATH": "/usr/bin:/bin", "HF_ENDPOINT": worker.url, "HOME": str(log_path.parent)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        while _status(f"{url}/readiness")[0] != 200:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the router was not ready: {log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        yield url
    finally:
        stop(proc)


def rendered(stack: str, prefill_retries: int | None = None):
    data = stack_data(stack)
    if prefill_retries is not None:
        hops = data["timeouts"]
        hops["router_to_prefill"]["retries"] = prefill_retries
        # every attempt within the gateway's timeout (infra/spec/__init__.py), however many
        hops["gateway_to_router"]["timeout_seconds"] = hops["router_to_prefill"]["timeout_seconds"] * (prefill_retries + 2)
    spec = parse_spec(data)
    return spec, router_launch(spec)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("retries", range(6))
def test_the_rendered_attempts_are_the_specs_retries_and_the_first(retries):
    """What failed here: retries 1 rendered `--retry-max-retries 1` (one attempt, no retry), and
    retries 0 rendered 0, which the router's config validation refuses at start
    (src/config/validation.rs validate_retry: "Must be >= 1")."""
    _, launch = rendered("dev", prefill_retries=retries)
    assert flag(launch.args, "--retry-max-retries") == str(retries + 1)


def test_the_real_router_retries_a_failed_call_as_often_as_the_spec_says(tmp_path):
    """dev's router_to_prefill.retries (1): the worker sees its failed call and one retry, and the
    client gets the retry's answer. What failed here: one call, and the 503 passed on."""
    spec, launch = rendered("dev")
    retries = spec.timeouts.router_to_prefill.retries
    assert retries == 1
    with WorkerStub(model_path=str(tmp_path)) as worker, \
            real_router(worker, ["--retry-max-retries", flag(launch.args, "--retry-max-retries")],
                        tmp_path / "router.log") as url:
        status, body = _status(f"{url}/generate", {"text": "hello"})
    assert (status, worker.posts) == (200, ["/generate"] * (retries + 1)), body


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_router_pod_has_a_folder_at_the_engines_model_path(stack):
    """The path the router loads a tokenizer from is the engines' --model-path (their /server_info
    model_path); the rendered router pod has a folder there, so sglang-router 0.3.2 reads it instead
    of asking huggingface.co (factory.rs: the hub only for a path that does not exist). What failed
    here: no such folder, and the router asked https://huggingface.co/api/models//mnt/weights/...
    at every worker it added (the twin's router logs)."""
    spec, launch = rendered(stack)
    assert launch.model_folder == weights_path(spec)
    pod = router_deployment(LayerContext(spec, spec.environment.namespace), launch)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == weights_path(spec)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume == {"name": mount["name"], "emptyDir": {}} and mount["readOnly"] is True


@pytest.mark.parametrize("folder_exists", [True, False])
def test_the_real_router_asks_the_hub_only_for_a_model_path_it_lacks(tmp_path, folder_exists):
    """The upstream rule the render relies on, on the real router: a worker's model_path that is a
    folder on the router's filesystem (as the rendered pod's is) is read there, and the hub is not
    asked; one that is not (the pod before this render) is asked of the hub by that name."""
    model_path = tmp_path / "weights" / "model"
    if folder_exists:
        model_path.mkdir(parents=True)
    with WorkerStub(model_path=str(model_path)) as worker, \
            real_router(worker, [], tmp_path / "router.log") as url:
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        log = tmp_path / "router.log"
        while f"Failed to load tokenizer for model {MODEL}" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert _status(f"{url}/readiness")[0] == 200
    if folder_exists:
        assert worker.hub_requests == []
        assert "does not contain a valid tokenizer file" in log.read_text()
    else:
        assert worker.hub_requests == [f"/api/models/{model_path}/revision/main"]
