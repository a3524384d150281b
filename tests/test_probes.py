"""Engine leaders' probes: each asks the question the engine's endpoint answers, and waits as long
as the engine takes to answer it (infra/render/probes.py)."""

from __future__ import annotations

import pytest

from infra.render.engine_check import variant_spec
from infra.render.probes import LIVENESS_WINDOW_SECONDS, SGLANG_HEALTH_CHECK_SECONDS, engine_probes
from infra.offline import run_spec
from tests.test_layers import pod_templates


def engine_containers(run):
    for lws, template in pod_templates(run):
        if lws["kind"] == "LeaderWorkerSet":
            group = lws["spec"]["leaderWorkerTemplate"]
            leader = template is group.get("leaderTemplate") or "leaderTemplate" not in group
            yield leader, next(c for c in template["spec"]["containers"] if c["name"] == "engine")


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_sglang_probes_wait_for_the_engines_own_health_verdict(stack):
    """sglang 0.5.23, sglang/srt/entrypoints/http_server.py: `/health` and `/health_generate` are one
    handler that runs a one-token generation, polls every second (so it answers after >= 1 s) and
    gives its verdict within HEALTH_CHECK_TIMEOUT (SGLANG_HEALTH_CHECK_TIMEOUT, default 20 s); `/ready`
    reads the tokenizer manager's flag (`is_ready`: Up and not paused). The kubelet's default 1 s
    timeout would fail every /health probe, so the leader never became Ready."""
    run = run_spec(variant_spec(stack, "sglang"))
    leaders = 0
    for leader, c in engine_containers(run):
        if not leader:
            assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c)  # workers serve no HTTP
            continue
        leaders += 1
        port = c["ports"][0]["containerPort"]
        for kind in ("startupProbe", "livenessProbe"):
            assert c[kind]["httpGet"] == {"path": "/health_generate", "port": port}
            assert c[kind]["timeoutSeconds"] > SGLANG_HEALTH_CHECK_SECONDS
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
        assert c["readinessProbe"]["timeoutSeconds"] > 1
    assert leaders == 2


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_vllm_probes_use_health(stack):
    """vllm 0.33.0, vllm/entrypoints/serve/instrumentator/health.py: `/health` is 200 unless the engine
    core is dead (EngineDeadError from vllm/v1/engine/async_llm.py check_health), so it answers on a
    busy engine; the API server listens only once the engine is built."""
    run = run_spec(variant_spec(stack, "vllm"))
    probed = [c for leader, c in engine_containers(run) if leader]
    assert len(probed) == 2
    for c in probed:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["httpGet"]["path"] == "/health" and c[kind]["timeoutSeconds"] > 1


def test_startup_allows_twice_the_load_and_warm_up_the_spec_states():
    """Single-node groups: the pod's own fetch precedes its probes (with a group's workers' fetch
    waves, tests/test_engine_startup.py)."""
    spec = variant_spec("dev", "sglang")
    assert spec.deployment.pools()["decode"].nodes_per_instance(spec.hardware.gpus_per_node) == 1
    w = spec.model.weights
    startup = engine_probes(spec, 30000, "decode")["startupProbe"]
    allowed = startup["periodSeconds"] * startup["failureThreshold"]
    expected = w.size_gib / w.load_gib_per_second + w.start_minutes * 60
    assert 2 * expected <= allowed < 2 * expected + startup["periodSeconds"]
    slower = spec.model_copy(update={"model": spec.model.model_copy(update={
        "weights": w.model_copy(update={"load_gib_per_second": w.load_gib_per_second / 4})})})
    assert engine_probes(slower, 30000, "decode")["startupProbe"]["failureThreshold"] > startup["failureThreshold"]


def test_liveness_restarts_only_after_minutes_of_failed_answers():
    """A liveness failure restarts the container (and LWS recreates the whole group): it must take
    minutes of answers that say "broken", never one slow answer of a busy engine."""
    for engine in ("sglang", "vllm"):
        live = engine_probes(variant_spec("prod", engine), 8000, "decode")["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= LIVENESS_WINDOW_SECONDS >= 300


def test_spec_without_weight_size_is_refused():
    from tests.conftest import problems_of, stack_data

    data = stack_data("dev")
    del data["model"]["weights"]["size_gib"]
    assert any(p.startswith("model.weights.size_gib: the engines' startup probes") and "Fix:" in p
               for p in problems_of(data))


def test_dedicated_encoders_wait_for_their_dummy_encode():
    """sglang 0.5.23 sglang/srt/disaggregation/encoder/http_server.py: the encoder's /health runs a
    dummy encode and waits up to HEALTH_CHECK_TIMEOUT = 30 s; with the kubelet's 1 s default the
    encoders never became Ready."""
    from infra.render.probes import SGLANG_ENCODER_HEALTH_CHECK_SECONDS
    from tests.conftest import stack_data
    from infra.spec_checks import parse_spec

    data = stack_data("dev")
    data["model"]["multimodal"] = True
    data["deployment"]["load_balancer"]["encoder"] = {"mode": "dedicated", "workers": 2}
    (encoder,) = [d for d in run_spec(parse_spec(data)).by_kind("Deployment") if d["metadata"]["name"] == "encoder"]
    container = encoder["spec"]["template"]["spec"]["containers"][0]
    for kind in ("startupProbe", "readinessProbe"):
        assert container[kind]["httpGet"]["path"] == "/health"
        assert container[kind]["timeoutSeconds"] > SGLANG_ENCODER_HEALTH_CHECK_SECONDS
