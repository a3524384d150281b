"""Engine command lines: golden files a reviewer can diff, and the pinned flag-set check."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from infra.render.engine_args import all_launches
from infra.render.engine_check import variant_spec
from infra.render.flagsets import PINNED_DIR, flagset
from infra.render.router_config import RoundRobinWarning, epp_config, router_launch
from infra.spec import SpecError, stack_spec_path
from infra.spec_checks import load_spec, parse_spec
from tests.conftest import stack_data, vllm_with_epp

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PDSTACK_UPDATE_GOLDEN") == "1"


spec_for = variant_spec


def rendered_configs(stack: str, engine: str) -> str:
    spec = spec_for(stack, engine)
    parts = [f"### {role}\n{launch.script()}" for role, launch in all_launches(spec).items()]
    router = router_launch(spec)
    parts.append(f"### router ({router.implementation})\n" + " ".join([*router.entrypoint, *router.args]) + "\n")
    parts += [f"### router file {name}\n{text}" for name, text in router.files.items()]
    return "\n".join(parts)


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_golden_engine_configs(stack, engine):
    """Set PDSTACK_UPDATE_GOLDEN=1 to rewrite after an intended change, then review the diff."""
    path = GOLDEN / f"{stack}-{engine}.txt"
    text = rendered_configs(stack, engine)
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"missing {path}: run with PDSTACK_UPDATE_GOLDEN=1"
    assert text == path.read_text()


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_flag_is_in_the_pinned_flag_set(stack, engine):
    spec = spec_for(stack, engine)
    for role, launch in all_launches(spec).items():
        flags = launch.args[1:] if engine == "vllm" else launch.args
        flags = [a for a in flags if a != '"$@"']
        assert flagset(engine).check(flags) == [], role
    if engine == "sglang":
        assert flagset("sglang-router").check(router_launch(spec).args) == []


def test_flag_check_catches_misspelled_unknown_and_bad_choice():
    fs = flagset("sglang")
    assert fs.check(["--tp-sise", "8"]) == ["--tp-sise: not a flag of sglang 0.5.23", "'8': a value with no flag before it"]
    assert fs.check(["--disaggregation-mode", "prefil"]) == ["--disaggregation-mode prefil: not one of decode, null, prefill"]
    assert fs.check(["--tp-size"]) == ["--tp-size: needs a value"]
    assert flagset("vllm").check(["--enable-expert-parallel", "--kv-transfer-config", "{}"]) == []
    assert flagset("vllm").check(["--disaggregation-mode", "prefill"])[0] == "--disaggregation-mode: not a flag of vllm 0.33.0"


def test_multi_node_instances_get_rank_arguments_from_lws():
    spec = load_spec(stack_spec_path("prod"))
    decode = all_launches(spec)["decode"]
    assert decode.multi_node and decode.nodes == 16 and decode.gpus_per_pod == 4
    args = decode.args
    assert args[args.index("--nnodes") + 1] == "${NNODES}"
    assert args[args.index("--node-rank") + 1] == "${NODE_RANK}"
    assert args[args.index("--dist-init-addr") + 1] == "${LEADER}:20000"
    assert 'NODE_RANK="${LWS_WORKER_INDEX:-0}"' in decode.script()
    vllm_prefill = all_launches(spec_for("prod", "vllm"))["prefill"]
    assert "START_RANK=$((NODE_RANK * 4))" in vllm_prefill.script()
    assert "--data-parallel-start-rank" not in vllm_prefill.args  # only workers pass it (see test_engine_rules)
    assert '--headless --data-parallel-start-rank "$START_RANK"' in vllm_prefill.script()


def test_phases_get_their_disaggregation_mode_and_transfer_backend():
    spec = load_spec(stack_spec_path("prod"))
    launches = all_launches(spec)
    for role in ("prefill", "decode"):
        args = launches[role].args
        assert args[args.index("--disaggregation-mode") + 1] == role
        assert args[args.index("--disaggregation-transfer-backend") + 1] == spec.engine.kv_transfer == "nixl"
        assert args[args.index("--ep-size") + 1] == str(spec.deployment.pools()[role].expert_parallel)
    assert "--disaggregation-bootstrap-port" in launches["prefill"].args


def test_vllm_kv_connector_and_expert_parallel():
    import json

    launches = all_launches(spec_for("prod", "vllm"))
    args = launches["prefill"].args
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "MultiConnector"
    # NIXL for the P-to-D hop (what llm-d's routing sidecar drives), the Mooncake store for the prefix cache.
    assert [c["kv_connector"] for c in config["kv_connector_extra_config"]["connectors"]] == ["NixlConnector", "MooncakeStoreConnector"]
    assert "--enable-expert-parallel" in args and "--enable-eplb" in args


def test_engine_lacking_a_feature_is_a_clear_error():
    data = stack_data("dev")
    data["deployment"]["cache"]["store"] = "lmcache"
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert caught.value.problems[0].startswith("deployment.cache.store: sglang 0.5.23 has no LMCache backend")
    data = stack_data("dev")
    data["engine"].update(kind="vllm", version="0.33.0")
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert caught.value.problems == [
        "deployment.load_balancer.implementation: sglang_router speaks SGLang's PD bootstrap protocol, not vllm's. Fix: gateway_epp"
    ]


def test_round_robin_is_allowed_with_a_warning():
    data = stack_data("dev")
    data["deployment"]["load_balancer"]["strategy"] = "round_robin"
    with pytest.warns(RoundRobinWarning, match="ignores live load"):
        launch = router_launch(parse_spec(data))
    assert launch.args[launch.args.index("--prefill-policy") + 1] == "round_robin"


def test_live_load_policies_by_default():
    launch = router_launch(load_spec(stack_spec_path("prod")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.args[launch.args.index("--prefill-policy") + 1] == "cache_aware"
        assert launch.args[launch.args.index("--decode-policy") + 1] == "cache_aware"


def test_epp_has_prefix_queue_and_kv_scorers_with_spec_weights_and_pd_profiles():
    spec = spec_for("prod", "vllm")
    config = epp_config(spec)
    types = {p["type"] for p in config["plugins"]}
    assert {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer", "disagg-profile-handler",
            "always-disagg-pd-decider"} <= types
    profiles = {p["name"]: p["plugins"] for p in config["schedulingProfiles"]}
    assert set(profiles) == {"prefill", "decode"}
    weights = {p["pluginRef"]: p.get("weight") for p in profiles["decode"]}
    assert weights["prefix-cache-scorer"] == spec.deployment.load_balancer.weights.prefix_cache


def test_epp_pd_config_sends_every_request_through_prefill():
    """llm-d-inference-scheduler v0.7.1 pkg/plugins/profile/prefix_based_pd_decider.go disaggregate:
    nonCachedTokens 0 disables disaggregation, so that decider with 0 would send no request to the
    prefill pool (found running the picker on the twin); the contract check refuses it."""
    from infra.render.epp_contract import config_problems

    config = epp_config(spec_for("prod", "vllm"))
    handler = next(p for p in config["plugins"] if p["type"] == "disagg-profile-handler")
    decider = next(p for p in config["plugins"] if p["type"] == handler["parameters"]["deciders"]["prefill"])
    assert decider == {"type": "always-disagg-pd-decider"}
    assert config_problems(config) == []
    decider.update({"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 0}})
    handler["parameters"]["deciders"]["prefill"] = "prefix-based-pd-decider"
    disabled = config
    assert any("nonCachedTokens 0" in problem for problem in config_problems(disabled)), config_problems(disabled)


def test_pdctl_render_both_engines_on_one_spec(tmp_path, capsys):
    from infra.cli import main

    assert main(["render", "--stack", "dev", "--engine", "sglang", "--out", str(tmp_path / "s")]) == 0
    data = stack_data("dev")
    data["deployment"]["load_balancer"]["implementation"] = "gateway_epp"
    data["engine"]["kv_transfer"] = "nixl"  # what both engines can use behind llm-d's routing sidecar
    spec_file = tmp_path / "epp.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(data))
    assert main(["render", "--spec", str(spec_file), "--engine", "vllm", "--out", str(tmp_path / "v")]) == 0
    assert main(["render", "--spec", str(spec_file), "--engine", "sglang", "--out", str(tmp_path / "s2")]) == 0
    # the shipped dev spec routes with sglang-router, which vllm cannot use: render switches to
    # the balancer that can (and the transport llm-d's sidecar needs) and says so
    capsys.readouterr()
    assert main(["render", "--stack", "dev", "--engine", "vllm", "--out", str(tmp_path / "switched")]) == 0
    said = capsys.readouterr().err
    assert "deployment.load_balancer.implementation: sglang_router -> gateway_epp" in said
    assert "engine.kv_transfer: mooncake -> nixl" in said
    assert list((tmp_path / "switched").rglob("inferencepool-*.yaml"))


def test_kv_hop_timeout_reaches_both_engines():
    """sglang 0.5.23 sglang/srt/disaggregation/common/conn.py: the decode side's waiting timeout runs
    from bootstrap until the KV arrives, so it spans the prompt's wait and prefill on the prefill side:
    the router's attempt at prefill (timeouts.router_to_prefill), not the 30 s of the transfer alone
    (its default is 300 s; its own warning suggests 600 where long TTFTs are acceptable). vLLM's
    NIXL lease (how long prefill holds KV for decode) is the transfer's (prefill_to_decode_kv)."""
    sglang = all_launches(spec_for("prod", "sglang"))
    for role in ("prefill", "decode"):
        assert sglang[role].env == {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "280",
                                    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "280",
                                    "SGLANG_DISAGGREGATION_NIXL_BACKEND": "LIBFABRIC"}
        assert set(sglang[role].env) <= flagset("sglang").env_vars
    data = stack_data("prod")
    vllm_with_epp(data)
    vllm = all_launches(parse_spec(data))
    config = vllm["decode"].args[vllm["decode"].args.index("--kv-transfer-config") + 1]
    assert '"kv_lease_duration": 30' in config


def test_an_env_var_the_engine_does_not_read_is_refused():
    with pytest.raises(AssertionError, match="SGLANG_DISAGG_TIMEOUT"):
        flagset("sglang").require_env({"SGLANG_DISAGG_TIMEOUT": "30"}, "test")


@pytest.mark.parametrize("table", ["sglang-0.5.23.json", "sglang-router-0.3.2.json", "vllm-0.33.0.json"])
def test_each_flag_table_names_the_wheel_and_files_it_was_read_from(table):
    """scripts/extract_engine_flags.py records the PyPI package and version it imported, the
    wheel's sha256 (pip's direct_url.json, installed from the downloaded wheel) and every file
    it read with its hash from the wheel's RECORD."""
    data = json.loads((PINNED_DIR / table).read_text())
    origin = data["origin"]
    assert table == f"{data['engine']}-{origin['version']}.json" and origin["version"] == data["version"]
    assert origin["package"] == data["engine"] and origin["index"] == "PyPI"
    assert len(origin["wheel_hashes"]["sha256"]) == 64
    assert origin["files_read"] and all(h.startswith("sha256=") for h in origin["files_read"].values())


def test_the_routers_whole_request_timeout_covers_the_longest_stream():
    """sglang-router 0.3.2's --request-timeout-secs is one timeout for the request (the wheel's
    sglang_router/router_args.py: "Request timeout in seconds", default 1800, far above any single
    hop), which the audit of issue #25 found cutting streams: rendered as the gateway's whole-request
    timeout, not the prefill hop's 280 s. (That it spans the stream is read from the audit and the
    default, not from the router's Rust source, which the wheel does not ship.)"""
    for stack in ("dev", "prod"):
        spec = spec_for(stack, "sglang")
        args = router_launch(spec).args
        assert args[args.index("--request-timeout-secs") + 1] == str(int(spec.timeouts.gateway_to_router.timeout_seconds))


def test_a_prefill_hop_shorter_than_a_full_context_prefill_is_refused():
    from tests.conftest import problems_of

    data = stack_data("prod")  # 131072 tokens in chunks of 16384: 8 passes x 1.5 s TTFT = 12 s
    data["timeouts"]["router_to_prefill"]["timeout_seconds"] = 10
    data["timeouts"]["prefill_to_decode_kv"]["timeout_seconds"] = 2
    assert any(p.startswith("timeouts.router_to_prefill.timeout_seconds: 10s is shorter than a full-context "
                            "prompt's prefill at the TTFT SLO (12s") and "Fix: at least 12" in p for p in problems_of(data))


def test_vllm_decode_serves_each_nodes_ranks_on_that_node():
    """vllm 0.33.0, vllm/entrypoints/cli/serve.py: --data-parallel-hybrid-lb with
    --data-parallel-start-rank makes each node's API servers (as many as its local DP ranks, the
    default there) front that node's ranks, and run_headless refuses hybrid LB, so no decode node is
    headless and none fronts the whole instance. Every decode pod then serves: it has the probes,
    the routing sidecar and the label the InferencePool and the Service select; a prefill worker
    (headless) has none of them. The argv is checked by vLLM's own validation (verdicts.json)."""
    from infra import naming
    from infra.offline import run_spec
    from infra.render.engine_check import launch_argv

    spec = spec_for("prod", "vllm")
    decode = all_launches(spec)["decode"]
    for index in (0, 5):
        argv = launch_argv(decode, index)
        assert "--data-parallel-hybrid-lb" in argv and "--headless" not in argv and "--api-server-count" not in argv
        assert argv[argv.index("--data-parallel-start-rank") + 1] == str(index * 4)
        assert argv[argv.index("--data-parallel-size-local") + 1] == "4"
    run = run_spec(spec)
    groups = {g["metadata"]["name"]: g["spec"]["leaderWorkerTemplate"] for g in run.by_kind("LeaderWorkerSet")}
    (pool,) = run.by_kind("InferencePool")
    service = next(s for s in run.by_kind("Service") if s["metadata"]["name"] == naming.engine_http("decode"))
    for template in (groups[naming.engine("decode")]["leaderTemplate"], groups[naming.engine("decode")]["workerTemplate"]):
        labels = template["metadata"]["labels"]
        engine = next(c for c in template["spec"]["containers"] if c["name"] == "engine")
        assert "readinessProbe" in engine and "startupProbe" in engine
        assert len(template["spec"]["initContainers"]) == 2  # the weights fetch and the routing sidecar
        assert all(labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    prefill_worker = groups[naming.engine("prefill")]["workerTemplate"]
    assert naming.SERVES_API_LABEL not in prefill_worker["metadata"]["labels"]
    assert "readinessProbe" not in prefill_worker["spec"]["containers"][0]


def test_sglang_router_in_pd_mode_says_in_its_notes_that_it_picks_at_random(colocated_spec):
    """sglang-router 0.3.2 in PD mode builds no prefix tree for its prefill and decode policies
    (policies/registry.rs init_pd_cache_aware_policies is called nowhere; routers/factory.rs
    create_pd_router), so it picks at random: measured in tests/twin/test_load_spread_on_twin.py.
    The render must not present it as load-aware; colocated, cache_aware works and no such note."""
    from infra.render.router_config import PD_RANDOM_NOTE
    pd = spec_for("dev", "sglang")
    assert pd.deployment.mode == "disaggregated" and pd.deployment.load_balancer.implementation == "sglang_router"
    assert PD_RANDOM_NOTE in router_launch(pd).notes
    assert PD_RANDOM_NOTE not in router_launch(colocated_spec).notes
