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
plus `start_minutes` (CUDA graphs, warm-up), twice over because all are estimates. A pod's own
weight fetch runs in its init container, before its probes count; but a leader waits for its
group's workers, and on a first deploy the fleet's nodes fetch in waves of
`fetch_nodes_at_once` (`fetch_waves`, infra/weights.py fetch_wave), each wave one node's fetch
(`size_gib` / `fetch_gib_per_second`) after the one before. A leader whose cache is warm starts at
once, so a group of several nodes is allowed, besides, up to the end of its latest worker's wave.
Liveness restarts an engine only after LIVENESS_WINDOW_SECONDS of answers that say it is broken,
never for slowness alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.spec import StackSpec
from infra.weights import fetch_wave

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


@dataclass(frozen=True)
class FetchWaves:
    """How the fleet's nodes fetch the weights: `nodes_at_once` at a time, in `waves` waves of
    `wave_seconds` (one node's whole fetch), by node ordinal (a pool's first node, then its groups'
    nodes in order, each pool at its largest)."""

    nodes_at_once: int
    waves: int
    wave_seconds: int
    first_node: dict[str, int]
    group_nodes: dict[str, int]
    groups: dict[str, int]

    def latest_worker_wave(self, role: str) -> int | None:
        """The latest wave any non-leader node of the pool fetches in (None: single-node groups)."""
        first, size = self.first_node[role], self.group_nodes[role]
        return max((fetch_wave(first + g * size + w, self.nodes_at_once, self.waves)
                    for g in range(self.groups[role]) for w in range(1, size)), default=None)


def fetch_waves(spec: StackSpec) -> FetchWaves:
    w, gpus_per_node = spec.model.weights, spec.hardware.gpus_per_node
    first, sizes, groups, total = {}, {}, {}, 0
    for role, phase in spec.deployment.pools().items():
        first[role], sizes[role] = total, phase.nodes_per_instance(gpus_per_node)
        groups[role] = max(phase.instances, phase.bounds()[1])
        total += sizes[role] * groups[role]
    return FetchWaves(nodes_at_once=w.fetch_nodes_at_once, waves=max(1, math.ceil(total / w.fetch_nodes_at_once)),
                      wave_seconds=math.ceil((w.size_gib or 0) / w.fetch_gib_per_second),
                      first_node=first, group_nodes=sizes, groups=groups)


def startup_seconds(spec: StackSpec, role: str | None) -> float:
    """Estimated time from a leader's container start to serving, at most (no margin): its load and
    warm-up, and in a group of several nodes the end of its latest worker's fetch wave. `role` None:
    a pod outside the pools (a dedicated encoder), whose own fetch precedes its probes."""
    waves = fetch_waves(spec) if role else None
    latest = waves.latest_worker_wave(role) if waves else None
    fetching = 0 if latest is None else (latest + 1) * waves.wave_seconds
    return fetching + spec.model.weights.restart_seconds()


def _startup_failures(spec: StackSpec, role: str | None) -> int:
    return math.ceil(STARTUP_MARGIN * startup_seconds(spec, role) / PROBE_PERIOD_SECONDS)


def engine_probes(spec: StackSpec, port: int, role: str) -> dict[str, dict]:
    """The leader container's startupProbe, readinessProbe and livenessProbe, for a pool's leader."""
    health, ready = HEALTH_PATHS[spec.engine.kind]
    health_timeout = SGLANG_HEALTH_PROBE_TIMEOUT_SECONDS if spec.engine.kind == "sglang" else FLAG_PROBE_TIMEOUT_SECONDS
    return {
        "startupProbe": _probe(health, port, PROBE_PERIOD_SECONDS, health_timeout, _startup_failures(spec, role)),
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
        "startupProbe": _probe("/health", port, PROBE_PERIOD_SECONDS, timeout, _startup_failures(spec, None)),
        "readinessProbe": _probe("/health", port, PROBE_PERIOD_SECONDS, timeout, READINESS_FAILURES),
    }
