"""The gateway_epp path as the pinned endpoint picker, its routing sidecar and the gateway behave.

The picker's rules come from infra/render/pinned/llm-d-inference-scheduler-0.7.1.json, read
by scripts/extract_epp_contract.py from the Go modules contracts/go.mod pins:
llm-d-inference-scheduler v0.7.1 and gateway-api-inference-extension v1.4.0 (the version it is
built with). Paths below are those modules'.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys

import pytest

from infra import naming
from infra.offline import run_offline, run_spec
from infra.program import build_stack
from infra.render.engine_args import ENGINE_PORT, SIDECAR_ENGINE_PORT
from infra.render.epp_contract import CONTRACT_FILE, config_problems, contract, flag_problems
from infra.render.flagsets import PINNED_DIR
from infra.render.router_config import epp_config
from infra.spec import REPO_ROOT, SpecError
from infra.spec_checks import parse_spec
from infra.tracks import plan_tracks
from tests.conftest import problems_of, stack_data, vllm_with_epp


def epp_spec(stack: str = "prod", **change):
    data = vllm_with_epp(stack_data(stack))
    for path, value in change.items():
        section, key = path.split("__")
        data["deployment"][section][key] = value
    return parse_spec(data)


def test_the_contract_names_the_go_modules_it_was_read_from():
    """Each module the contract was read from is the one contracts/go.mod pins, at that
    version and with go.sum's hash, and the contract lists the files it read."""
    go_mod = (REPO_ROOT / "contracts" / "go.mod").read_text()
    go_sum = (REPO_ROOT / "contracts" / "go.sum").read_text().splitlines()
    for key in ("epp", "inference_extension"):
        origin = contract()[key]
        assert f"\t{origin['module']} {origin['version']}" in go_mod
        assert f"{origin['module']} {origin['version']} {origin['go.sum']}" in go_sum
        assert origin["files_read"] and all(not f.startswith("/") for f in origin["files_read"])
    assert CONTRACT_FILE == f"llm-d-inference-scheduler-{contract()['epp']['version'].lstrip('v')}.json"


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Go and the module proxy (or a filled module cache)")
def test_the_contract_is_what_the_extractor_reads_from_the_pinned_modules(tmp_path):
    """scripts/extract_epp_contract.py, run again on the modules contracts/go.mod pins (from the
    module cache, checked against go.sum), writes exactly the committed contract."""
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "extract_epp_contract.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / CONTRACT_FILE).read_text() == (PINNED_DIR / CONTRACT_FILE).read_text()


def test_the_rendered_config_is_what_the_pinned_picker_reads():
    """apiVersion/kind as the GIE v1.4.0 config loader decodes them (apix/config/v1alpha1), only
    registered plugin types (llm-d pkg/plugins/register.go, GIE
    cmd/epp/runner/runner.go), parameters their structs define, every pluginRef defined."""
    for spec in (epp_spec(), colocated_epp_spec()):
        assert config_problems(epp_config(spec)) == []
    config = epp_config(epp_spec())
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    prefix = next(p for p in config["plugins"] if p["type"] == "prefix-cache-scorer")
    assert prefix["parameters"]["blockSizeTokens"] == epp_spec().engine.kv_page_size


def colocated_epp_spec():
    data = vllm_with_epp(stack_data("dev"))
    dep = data["deployment"]
    dep["mode"] = "colocated"
    dep["colocated"] = {"instances": 1, "expert_parallel": 8, "redundant_experts": 0}
    del dep["prefill"], dep["decode"]
    return parse_spec(data)


@pytest.mark.parametrize("break_it, expected", [
    # The prefix-cache scorer's config: blockSize counted characters and is deprecated ("Depricated"
    # in GIE v1.4.0 pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go).
    (lambda c: c["plugins"][0]["parameters"].update(blockSize=64), "parameters.blockSize: deprecated"),
    # pd-profile-handler is registered for backward compatibility only, and needs a decider
    # plugin (llm-d pkg/plugins/profile/pd_profile_handler.go).
    (lambda c: c["plugins"].append({"type": "pd-profile-handler"}), "pd-profile-handler is kept for backward"),
    (lambda c: c["plugins"][-1]["parameters"].update(threshold=0), "parameters.threshold: not a field"),
    (lambda c: c["plugins"][-1]["parameters"]["deciders"].update(prefill="missing"), "decider for prefill 'missing'"),
    (lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "nope"}), "'nope' is not defined"),
    (lambda c: c.update(apiVersion="inference.networking.k8s.io/v1"), "apiVersion/kind"),
    (lambda c: c.update(scheduling={}), "config.scheduling: not a field"),
    (lambda c: c["plugins"].append({"type": "least-kv-cache"}), "'least-kv-cache' is not a registered plugin type"),
])
def test_the_contract_check_bites(break_it, expected):
    config = copy.deepcopy(epp_config(epp_spec()))
    break_it(config)
    assert any(expected in p for p in config_problems(config)), config_problems(config)


def test_picker_and_sidecar_flags_are_the_pinned_binaries_own():
    """Flags from gateway-api-inference-extension v1.4.0 pkg/epp/server/options.go and llm-d
    pkg/sidecar/proxy/options.go; deprecated ones (MarkDeprecated) refused."""
    assert flag_problems(["--pool-name=x", "--grpc-port=9002"], "epp") == []
    assert flag_problems(["--model-server-metrics-port=8000"], "epp") == [
        "--model-server-metrics-port: deprecated in the pinned epp"]
    assert flag_problems(["--connector=nixlv2"], "sidecar") == ["--connector: deprecated in the pinned sidecar"]
    assert "nixlv2" in contract()["sidecar"]["kv_connectors"]


def lws(run, role: str) -> dict:
    return next(g for g in run.by_kind("LeaderWorkerSet") if g["metadata"]["name"] == naming.engine(role))


def test_decode_pods_run_the_routing_sidecar_in_front_of_the_engine():
    """llm-d's PD path: the gateway sends the request to the decode pod the picker chose; the
    sidecar there (a native sidecar, restartPolicy Always, Kubernetes 1.29+) calls the prefill
    pod named in the picker's header, then its own engine (llm-d-inference-scheduler v0.7.1,
    deploy/components/vllm-sim-pd/deployments.yaml: --port 8000, --vllm-port 8200). Every vLLM decode
    node serves its own ranks (hybrid DP load balancing), so each has one."""
    run = run_spec(epp_spec())
    decode = lws(run, "decode")["spec"]["leaderWorkerTemplate"]
    leader, worker = decode["leaderTemplate"]["spec"], decode["workerTemplate"]["spec"]
    (sidecar,) = [c for c in leader["initContainers"] if c["name"] == "routing-sidecar"]
    assert [c for c in worker["initContainers"] if c["name"] == "routing-sidecar"] == [sidecar]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["args"] == [f"--port={ENGINE_PORT['vllm']}", f"--vllm-port={SIDECAR_ENGINE_PORT}",
                               "--kv-connector=nixlv2", "--secure-proxy=false"]
    engine = leader["containers"][0]
    assert engine["ports"] == [{"name": "engine", "containerPort": SIDECAR_ENGINE_PORT}]
    assert engine["readinessProbe"]["httpGet"]["port"] == SIDECAR_ENGINE_PORT
    prefill_worker = lws(run, "prefill")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert not [c for c in prefill_worker["initContainers"] if c["name"] == "routing-sidecar"]
    prefill = lws(run, "prefill")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    assert not [c for c in prefill["initContainers"] if c["name"] == "routing-sidecar"]
    assert prefill["containers"][0]["ports"] == [{"name": "engine", "containerPort": ENGINE_PORT["vllm"]}]
    (pool,) = run.by_kind("InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT["vllm"]}]  # the sidecar, on decode


def test_the_picker_runs_its_own_image():
    spec = epp_spec()
    run = run_spec(spec)
    (router,) = [d for d in run.by_kind("Deployment") if d["metadata"]["name"] == naming.ROUTER]
    image = router["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == spec.images.endpoint_picker != spec.images.router


def test_vllm_pd_needs_nixl_and_the_images():
    """llm-d's routing sidecar knows the KV connectors nixlv2, shared-storage and sglang
    (llm-d-inference-scheduler v0.7.1, pkg/sidecar/proxy/options.go, supportedKVConnectors),
    so vLLM's Mooncake connector has no PD path behind it."""
    data = vllm_with_epp(stack_data("prod"))
    data["engine"]["kv_transfer"] = "mooncake"
    del data["images"]["routing_sidecar"]
    problems = problems_of(data)
    assert any(p.startswith("engine.kv_transfer: llm-d's routing sidecar runs vLLM's prefill hop only over NIXL")
               for p in problems)
    assert any(p.startswith("images.routing_sidecar: gateway_epp in PD mode needs") for p in problems)


def test_tracks_behind_an_inference_pool_switch_whole():
    """Envoy AI Gateway v1.1.0's extension server accepts one InferencePool per route rule
    (envoyproxy/ai-gateway, internal/extensionserver/post_route_modify.go: "at most one
    inferencepool can be referenced per route rule"): no weighted canary between two pools.
    A blue/green switch works: the serving track alone in the rule, the standby at weight 0."""
    data = vllm_with_epp(stack_data("prod"))
    with pytest.raises(SpecError, match="would split traffic by weight between InferencePools"):
        plan_tracks([(7, 95, data), (8, 5, data)])
    tracks = plan_tracks([(7, 0, data), (8, 100, data)])
    run = run_offline(lambda: build_stack(parse_spec(data), release="8", tracks=tracks), stack="prod")
    (route,) = run.by_kind("HTTPRoute")
    (ref,) = route["spec"]["rules"][0]["backendRefs"]
    assert (ref["kind"], ref["namespace"], ref["weight"]) == ("InferencePool", "pdstack-prod-r8", 100)


def test_a_weighted_canary_behind_inference_pools_is_refused_before_anything_changes(tmp_path):
    from infra.rollout.cluster import InMemoryCluster
    from infra.rollout.releases import ReleaseStore
    from infra.rollout.rollout import RolloutOptions, RolloutRefused, rollout

    store, cluster = ReleaseStore("prod", tmp_path / "releases"), InMemoryCluster()
    with pytest.raises(RolloutRefused, match="Fix: --stages 100"):
        rollout(epp_spec(), store, cluster, observe=lambda rev: None, options=RolloutOptions(stages=(5, 100)))
    folder = tmp_path / "releases"
    assert (list(folder.rglob("*")) if folder.exists() else []) == []  # no revision, no lock, no audit
