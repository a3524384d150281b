"""Each ServiceAccount pdstack renders may do what its program's source asks of the API server, no more.

The needs are read from the source at the pinned versions by scripts/derive_rbac.py into
infra/render/pinned/rbac-needs.json (Go modules from upstream/go.mod + go.sum, the sglang-router
wheel from PyPI); the tests below compare what the stacks render with them, and encode the rules
that made the picker's hand-written Role fail.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra import naming
from infra.offline import run_spec
from infra.render import rbac
from infra.render.router_config import router_launch
from infra.spec_checks import parse_spec
from tests.conftest import shipped_run, stack_data
from tests.test_endpoint_picker import epp_spec

ROOT = Path(__file__).resolve().parent.parent


def rendered(run) -> tuple[dict, dict]:
    """The router's Role and Deployment as the stack renders them."""
    (role,) = [r for r in run.by_kind("Role") if r["metadata"]["name"] == naming.ROUTER]
    (deployment,) = [d for d in run.by_kind("Deployment") if d["metadata"]["name"] == naming.ROUTER]
    return role, deployment


def launched_args(run, deployment: dict) -> list[str]:
    """The command line the router container really runs: the picker's args, or the SGLang
    router's launch script in its ConfigMap."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    if container.get("args"):
        return container["args"]
    (cm,) = [c for c in run.by_kind("ConfigMap") if c["metadata"]["name"] == f"{naming.ROUTER}-launch"]
    return cm["data"]["launch.sh"].split()


def cases():
    yield "dev-sglang", shipped_run("dev"), "sglang_router"
    yield "prod-sglang", shipped_run("prod"), "sglang_router"
    yield "prod-epp", run_spec(epp_spec("prod")), "endpoint_picker"
    yield "dev-epp", run_spec(epp_spec("dev")), "endpoint_picker"


@pytest.mark.parametrize("name,run,component", list(cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_each_router_role_grants_exactly_what_its_source_needs(name, run, component):
    """The Role's grants equal the needs of the program started with the rendered flags.

    Endpoint picker (llm-d-inference-scheduler v0.7.1 runs gateway-api-inference-extension
    v1.4.0's runner): informers for every type pkg/epp/server/controller_manager.go caches
    (pods; the InferencePool; InferenceObjective and InferenceModelRewrite whenever discovery
    finds their CRDs, controller_config.go), leases and events with --ha-enable-leader-election
    (client-go v0.35.3 tools/leaderelection/resourcelock/leaselock.go, tools/record/event.go),
    TokenReview and SubjectAccessReview with --metrics-endpoint-auth (on by default,
    pkg/epp/server/options.go; controller-runtime v0.23.3 pkg/metrics/filters/filters.go).
    sglang-router 0.3.2: lists and watches pods in --service-discovery-namespace
    (sglang_router/router.py in the wheel).
    """
    role, deployment = rendered(run)
    needs = rbac.needs_for(component, launched_args(run, deployment))
    assert [n for n in needs if n.scope != "namespace"] == [], "cluster-scoped needs rendered as a Role"
    assert rbac.granted(role["rules"]) == rbac.granted(rbac.rules(needs, "namespace"))
    assert not run.by_kind("ClusterRole")


def test_the_picker_may_list_every_type_its_manager_caches():
    """The Role the picker had (pods, endpoints, endpointslices, inferencepools) lacked the two
    CRD-gated informers: with InferenceObjective installed the manager's cache waits for an
    informer that is refused, and the picker never becomes ready
    (gateway-api-inference-extension v1.4.0 pkg/epp/server/controller_manager.go)."""
    role, _ = rendered(run_spec(epp_spec("prod")))
    grants = rbac.granted(role["rules"])
    for resource in ("inferenceobjectives", "inferencemodelrewrites"):
        assert {("inference.networking.x-k8s.io", resource, v) for v in ("list", "watch")} <= grants
    assert {("", "pods", "list"), ("inference.networking.k8s.io", "inferencepools", "watch")} <= grants


def test_the_picker_runs_without_metrics_auth_so_it_needs_no_cluster_role():
    """Metrics auth on (the picker's default) needs cluster-scoped TokenReview and
    SubjectAccessReview create (controller-runtime v0.23.3 pkg/metrics/filters/filters.go): a
    namespaced Role cannot grant them. pdstack turns it off (router_config.py says why)."""
    launch = router_launch(epp_spec("prod"))
    assert "--metrics-endpoint-auth=false" in launch.args
    with_auth = [a for a in launch.args if not a.startswith("--metrics-endpoint-auth")]
    cluster = {(n.api_group, n.resource) for n in rbac.needs_for("endpoint_picker", with_auth) if n.scope == "cluster"}
    assert cluster == {("authentication.k8s.io", "tokenreviews"), ("authorization.k8s.io", "subjectaccessreviews")}


def test_replicated_pickers_elect_a_leader_and_only_the_leader_is_ready():
    """Several picker replicas each keep their own prefix index unless they elect a leader:
    with --ha-enable-leader-election only the leader passes the "readiness" gRPC health service
    (gateway-api-inference-extension v1.4.0 cmd/epp/runner/health.go), so the gateway's
    ext-proc calls reach one index. Its chart replaces such a Deployment whole (Recreate,
    config/charts/epplib/templates/_deployment.yaml)."""
    run = run_spec(epp_spec("prod", load_balancer__replicas=3))
    role, deployment = rendered(run)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--ha-enable-leader-election" in container["args"]
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} <= rbac.granted(role["rules"])
    single = rendered(run_spec(epp_spec("prod", load_balancer__replicas=1)))[1]
    assert "--ha-enable-leader-election" not in single["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_sglang_router_reads_pods_only_and_only_in_its_namespace():
    """sglang-router 0.3.2 discovers workers by watching pods; without
    --service-discovery-namespace it watches every namespace (sglang_router/router.py)."""
    args = router_launch(parse_spec(stack_data("prod"))).args
    assert {(n.scope, n.resource) for n in rbac.needs_for("sglang_router", args)} == {("namespace", "pods")}
    without_ns = [a for a in args if a != "--service-discovery-namespace"]
    assert {n.scope for n in rbac.needs_for("sglang_router", without_ns)} == {"cluster"}


def test_engines_and_sidecars_never_get_a_token():
    """Engine pods (and llm-d's routing sidecar on them) call no API: the sidecar watches pools
    and pods only with --enable-ssrf-protection (llm-d-inference-scheduler v0.7.1
    pkg/sidecar/proxy/allowlist.go, off by default in options.go), which pdstack does not pass."""
    run = run_spec(epp_spec("prod"))
    (sa,) = [s for s in run.by_kind("ServiceAccount") if s["metadata"]["name"] == "engine"]
    assert sa["automountServiceAccountToken"] is False
    sidecars = [c for lws in run.by_kind("LeaderWorkerSet")
                for c in lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"].get("initContainers", [])
                if c["name"] == "routing-sidecar"]
    assert sidecars
    for sidecar in sidecars:
        assert rbac.needs_for("routing_sidecar", sidecar["args"]) == []
    assert rbac.needs_for("routing_sidecar", ["--enable-ssrf-protection"])


@pytest.mark.parametrize("args,default,expected", [([], True, True), ([], False, False), (["--x=false"], True, False),
                                                    (["--x"], False, True), (["--x=true"], False, True)])
def test_boolean_flags_read_as_the_programs_read_them(args, default, expected):
    assert rbac.flag_on(args, "x", default) is expected


def test_needs_name_their_source_and_pinned_modules():
    table = rbac.table()
    assert {m["module"]: m["version"] for m in table["modules"]} == {
        "sigs.k8s.io/gateway-api-inference-extension": "v1.4.0", "sigs.k8s.io/controller-runtime": "v0.23.3",
        "k8s.io/client-go": "v0.35.3"}
    go_sum = (ROOT / "upstream" / "go.sum").read_text()
    for module in table["modules"]:
        assert f"{module['module']} {module['version']} {module['sum']}" in go_sum
    for component in table["components"].values():
        for need in component["needs"]:
            assert need["source"], need


def test_the_committed_needs_are_what_the_source_says():
    """`scripts/derive_rbac.py --check` re-derives every component's API needs from its source at
    the pinned version (the Go modules upstream/go.sum pins, through the module proxy; the
    sglang-router wheel from PyPI) and exits 1 if the committed table says otherwise."""
    assert shutil.which("go"), "the go command is part of this machine (README: what runs here)"
    result = subprocess.run([sys.executable, "scripts/derive_rbac.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matches the source" in result.stdout + result.stderr
    assert json.loads((ROOT / "infra/render/pinned/rbac-needs.json").read_text())["components"]


@pytest.mark.parametrize("name,run,component", list(cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_only_pods_whose_program_calls_the_api_carry_a_token(name, run, component):
    """A ServiceAccount token mounted in a pod that never calls the API server is a credential
    for nothing but an attacker. Only the router's account is bound to a Role; every other pod
    template runs without a token (its own automountServiceAccountToken, or its account's)."""
    bound = {s["name"] for b in run.by_kind("RoleBinding") for s in b["subjects"]}
    no_token_accounts = {a["metadata"]["name"] for a in run.by_kind("ServiceAccount")
                         if a.get("automountServiceAccountToken") is False}
    for kind in ("Deployment", "StatefulSet", "Job", "LeaderWorkerSet"):
        for workload in run.by_kind(kind):
            spec = workload["spec"]
            pods = ([spec["leaderWorkerTemplate"]["workerTemplate"]["spec"],
                     spec["leaderWorkerTemplate"].get("leaderTemplate", {}).get("spec", {})]
                    if kind == "LeaderWorkerSet" else [spec["template"]["spec"]])
            for pod in filter(None, pods):
                account = pod.get("serviceAccountName", "default")
                if account in bound:
                    continue
                assert pod.get("automountServiceAccountToken") is False or account in no_token_accounts, \
                    f"{kind}/{workload['metadata']['name']} mounts a token of {account!r} and calls no API"


def test_rbac_is_derived_from_the_llm_d_version_the_images_and_contract_pin():
    """One llm-d-inference-scheduler version everywhere: the RBAC needs come from the module the
    contract check (contracts/go.mod) and the spec's picker image pin, v0.7.1, and from the
    gateway-api-inference-extension its go.mod requires (v1.4.0), both through the module proxy
    (which serves no v0.8.0)."""
    table = rbac.table()
    contract_mod = (ROOT / "contracts" / "go.mod").read_text()
    llmd = table["llm_d"]["origin"]
    assert f"{llmd['module']} {llmd['version']}" in contract_mod
    gie = next(m for m in table["modules"] if m["module"].endswith("gateway-api-inference-extension"))
    assert table["llm_d"]["gie_required"] == gie["version"]
    assert f"{gie['module']} {gie['version']}" in contract_mod
    assert all(llmd["version"] in n["source"] for n in table["components"]["routing_sidecar"]["needs"])


def test_the_picker_caches_only_its_own_pools_api_group():
    """gateway-api-inference-extension v1.4.0 pkg/epp/server/controller_manager.go caches
    v1alpha2.InferencePool or v1.InferencePool by `switch gknn.Group`, the group --pool-group names
    (default inference.networking.k8s.io, pkg/epp/server/options.go)."""
    args = router_launch(epp_spec("prod")).args
    pools = {n.api_group for n in rbac.needs_for("endpoint_picker", args) if n.resource == "inferencepools"}
    assert pools == {"inference.networking.k8s.io"}
    alpha = {n.api_group for n in rbac.needs_for("endpoint_picker", [*args, "--pool-group=inference.networking.x-k8s.io"])
             if n.resource == "inferencepools"}
    assert alpha == {"inference.networking.x-k8s.io"}
