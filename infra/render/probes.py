"""Spec to the engine leaders' startup, readiness and liveness probes. Pure.

Each engine documents what its endpoints mean; a probe asks the question it answers:

SGLang 0.5.23 (sglang/srt/entrypoints/http_server.py):
- `/health` and `/health_generate` are one handler: it sends a one-token generation through the
  scheduler and polls once a second, for up to HEALTH_CHECK_TIMEOUT (env SGLANG_HEALTH_CHECK_TIMEOUT,
  default 20 s), for any output from the detokenizer. It answers after at least one second (its
  first `asyncio.sleep(1)`), 503 while the server starts, and on a timeout marks the server
  UnHealthy; a success marks it Up (which also recovers a failed PD warm-up). While the engine is
  busy, any other request's output answers it, so it costs nothing and passes on a busy engine.
- `/ready` is a flag check (`is_ready`: Up and not paused): whether to send new requests.
So: startup and liveness on `/health_generate` with a timeout above SGLang's own 20 s (the
engine's verdict, not the kubelet's 1 s default, decides), readiness on `/ready`.

vLLM 0.33.0 (vllm/entrypoints/serve/instrumentator/health.py, vllm/v1/engine/async_llm.py
`check_health`): `/health` is 200 unless the engine core died (EngineDeadError), and the API
server listens only once the engine is built. It is the one endpoint for all three probes.

Startup: the kubelet allows the weight load (`model.weights.size_gib` / `load_gib_per_second`)
plus `start_minutes` (CUDA graphs, warm-up), twice over because both are estimates; the weight
fetch runs in an init container before any probe counts. Liveness restarts an engine only after
LIVENESS_WINDOW_SECONDS of answers that say it is broken, never for slowness alone.
"""

from __future__ import annotations

import math

from infra.spec import StackSpec

PROBE_PERIOD_SECONDS = 10
SGLANG_HEALTH_CHECK_SECONDS = 20  # HEALTH_CHECK_TIMEOUT's default in sglang 0.5.23
# The kubelet waits longer than the engine's own verdict, so the answer is the engine's.
SGLANG_HEALTH_PROBE_TIMEOUT_SECONDS = SGLANG_HEALTH_CHECK_SECONDS + 5
FLAG_PROBE_TIMEOUT_SECONDS = 5  # endpoints that read a flag (SGLang /ready, vLLM /health)
STARTUP_MARGIN = 2  # load rate and start time are estimates
LIVENESS_PERIOD_SECONDS = 60
LIVENESS_WINDOW_SECONDS = 300  # failures in a row, this long, before a restart
READINESS_FAILURES = 3

# (startup/liveness path, readiness path) per engine.
HEALTH_PATHS = {"sglang": ("/health_generate", "/ready"), "vllm": ("/health", "/health")}


def _probe(path: str, port: int, period: int, timeout: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": timeout,
            "failureThreshold": failures}


def _startup_failures(spec: StackSpec) -> int:
    return math.ceil(STARTUP_MARGIN * spec.model.weights.restart_seconds() / PROBE_PERIOD_SECONDS)


def engine_probes(spec: StackSpec, port: int) -> dict[str, dict]:
    """The leader container's startupProbe, readinessProbe and livenessProbe."""
    health, ready = HEALTH_PATHS[spec.engine.kind]
    health_timeout = SGLANG_HEALTH_PROBE_TIMEOUT_SECONDS if spec.engine.kind == "sglang" else FLAG_PROBE_TIMEOUT_SECONDS
    return {
        "startupProbe": _probe(health, port, PROBE_PERIOD_SECONDS, health_timeout, _startup_failures(spec)),
        "readinessProbe": _probe(ready, port, PROBE_PERIOD_SECONDS, FLAG_PROBE_TIMEOUT_SECONDS, READINESS_FAILURES),
        "livenessProbe": _probe(health, port, LIVENESS_PERIOD_SECONDS, health_timeout,
                                LIVENESS_WINDOW_SECONDS // LIVENESS_PERIOD_SECONDS),
    }


# sglang 0.5.23 sglang/srt/disaggregation/encoder/http_server.py: the encoder's /health runs a dummy
# encode and waits up to HEALTH_CHECK_TIMEOUT (30 s) for it; it has no flag-only endpoint.
SGLANG_ENCODER_HEALTH_CHECK_SECONDS = 30


def encoder_probes(spec: StackSpec, port: int) -> dict[str, dict]:
    """A dedicated SGLang encoder's probes: its /health is its only health endpoint."""
    timeout = SGLANG_ENCODER_HEALTH_CHECK_SECONDS + 5
    return {
        "startupProbe": _probe("/health", port, PROBE_PERIOD_SECONDS, timeout, _startup_failures(spec)),
        "readinessProbe": _probe("/health", port, PROBE_PERIOD_SECONDS, timeout, READINESS_FAILURES),
    }
