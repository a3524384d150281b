"""The gateway's side of the endpoint picker on the twin: one request's headers and body handed to
the picker's pod over Envoy's ext_proc protocol, as the gateway's proxy does before it routes
(twin/endpoint-picker's ext-proc-client, built with the picker), and what the picker answered.

The picker (gateway-api-inference-extension v1.4.0's EPP with llm-d-inference-scheduler v0.7.1's
plugins, twin/endpoint-picker/main.go) names the pod to send the request to in
`x-gateway-destination-endpoint` (GIE v1.4.0 pkg/epp/metadata/consts.go) and, in PD mode, the
prefill pod for the decode pod's routing sidecar in `x-prefiller-host-port` (llm-d v0.7.1
pkg/common/common.go, set by its disagg-headers-handler). No Envoy proxy runs on the twin, so the
caller sends the request on itself, as the gateway and the sidecar would.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from twin import build
from twin.api import TwinError

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILL_HEADER = "x-prefiller-host-port"


@dataclass(frozen=True)
class Pick:
    """What the picker answered for one request: the pod (ip:port) it chose and, in PD mode, the
    prefill pod (None when its decider sends the request to the decode pod alone)."""

    destination: str
    prefill: str | None
    headers: dict[str, str]


def ask(client_socket: Path, picker: str, path: str, body: dict) -> Pick:
    """One request through the picker at `picker` (ip:port, its gRPC ext_proc port), reached
    through the pod network's client socket (twin/pods.py). Raises TwinError with the picker's
    immediate response (no pod to pick, say) or the client's error."""
    done = subprocess.run([str(build.program("ext-proc-client")), str(client_socket), picker, path],
                          input=json.dumps(body), capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise TwinError(f"ext_proc call to the picker at {picker}: {done.stderr.strip()[-500:]}")
    answer = json.loads(done.stdout)
    if "immediate" in answer:
        raise TwinError(f"the picker at {picker} answered {answer['immediate']['status']}: "
                        f"{answer['immediate']['body'][:300]}")
    headers = answer["headers"]
    return Pick(headers[DESTINATION_HEADER], headers.get(PREFILL_HEADER), headers)


def ask_until_picked(client_socket: Path, picker: str, path: str, body: dict, ready: Callable[[Pick], bool],
                     timeout: float = 180, check: Callable[[], None] = lambda: None) -> Pick:
    """ask() until the picker picks and `ready(pick)` holds (it has found the pods it should and read
    their metrics), within `timeout`; `check()` between tries (PodProcesses.check). The picker's
    last answer is in the error."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        check()
        try:
            pick = ask(client_socket, picker, path, body)
            if ready(pick):
                return pick
            last = f"picked {pick}"
        except (TwinError, subprocess.TimeoutExpired) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise TwinError(f"the picker at {picker} did not pick as expected within {timeout:.0f} s; last: {last}")
        time.sleep(1)
