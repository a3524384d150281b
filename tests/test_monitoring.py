"""Alerts read only metrics the pinned engines export, and every rule passes promtool."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from infra.offline import run_spec
from infra.render.flagsets import flagset
from infra.render.metrics import alert_rules, catalogue, exposed_series, metric_names_in
from infra.render.query_check import query_problems
from infra.spec import NAMESPACE_MAX
from tests.conftest import shipped_run
from tests.servers import require_binary


def specs_for_both_engines():
    from infra.render.engine_check import variant_spec

    for engine in ("sglang", "vllm"):
        yield variant_spec("prod", engine)


@pytest.mark.parametrize("spec", list(specs_for_both_engines()), ids=["sglang", "vllm"])
def test_every_alert_reads_series_the_pinned_engine_exposes(spec):
    """Names, types and labels from the wheels (tests/test_metrics_contract.py checks every other
    query the same way)."""
    for rule in alert_rules(spec):
        assert metric_names_in(rule.expr), rule.name
        assert query_problems(rule.expr, spec.engine.kind) == [], rule.name


def test_router_panel_reads_the_balancer_that_runs():
    """sglang-router 0.3.2 declares smg_http_requests_total (its wheel); the endpoint picker counts
    inference_objective_request_total (gateway-api-inference-extension v1.4.0
    pkg/epp/metrics/metrics.go), and exports no smg_ series."""
    import json

    from infra.components.k8s import LayerContext
    from infra.components.monitoring import dashboard
    from tests.test_endpoint_picker import epp_spec

    assert flagset("sglang-router").has_metric("smg_http_requests_total")
    spec = epp_spec("prod")
    (panel,) = [p for p in dashboard(LayerContext(spec, spec.environment.namespace))["panels"]
                if p["title"] == "Router requests"]
    assert "inference_objective_request_total" in json.dumps(panel)


def test_alert_rules_pass_promtool(tmp_path):
    promtool = require_binary("promtool")
    for stack in ("dev", "prod"):
        (rule,) = shipped_run(stack).by_kind("PrometheusRule")
        severities = {r["labels"]["severity"] for g in rule["spec"]["groups"] for r in g["rules"]}
        assert severities == {"warning", "critical"}
        path = tmp_path / f"{stack}.rules.yaml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout


def test_promtool_rejects_a_broken_expression(tmp_path):
    promtool = require_binary("promtool")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "sum(rate(x[5m]"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


def test_dashboard_has_a_panel_per_stage_latency_and_load_spread():
    import json

    (cm,) = [c for c in shipped_run("prod").by_kind("ConfigMap") if c["metadata"]["name"] == "pdstack-dashboard"]
    board = json.loads(cm["data"]["pdstack.json"])
    titles = [p["title"] for p in board["panels"]]
    assert "TTFT p99 by stage" in titles and "Running requests per instance (load spread)" in titles
    ttft = board["panels"][0]["targets"]
    # prod runs SGLang, whose PD prefill times no first token: decode times them, from each arrival.
    assert [t["legendFormat"] for t in ttft] == ["decode"]


# The alerts fire on series shaped as the engines export them: tests/test_alerts_pd_fleet.py.


def track_dashboards(engine: str, namespace: str | None = None, revisions=(7, 8)) -> dict[str, dict]:
    """Each release track's dashboard as its monitoring layer renders it, by namespace."""
    import json

    from infra.render.engine_check import variant_spec
    from infra.tracks import plan_tracks

    data = variant_spec("prod", engine).model_dump(mode="json")
    if namespace:
        data["environment"]["namespace"] = namespace
    out = {}
    for track in plan_tracks([(revisions[0], 100, data), (revisions[1], 0, data)]):
        run = run_spec(track.spec)
        (cm,) = [c for c in run.by_kind("ConfigMap") if c["metadata"]["name"] == "pdstack-dashboard"]
        out[track.namespace] = json.loads(cm["data"]["pdstack.json"])
    return out


# The longest environment namespace a spec admits: its tracks' `pdstack-<namespace>` is 71 characters.
LONG_NAMESPACE = "p" * NAMESPACE_MAX


@pytest.mark.parametrize("namespace", [None, LONG_NAMESPACE], ids=["prod", "long namespace"])
def test_each_release_track_renders_its_own_dashboard(namespace):
    """Every track rendered `pdstack-<environment>`: side by side (a canary beside the serving
    revision) Grafana kept one of them. One uid per namespace, within Grafana's 40 characters and
    its characters (grafana pkg/util/shortid_generator.go: IsShortUIDTooLong, validUIDPattern), even
    for long namespaces, whose revisions differ in their last digit."""
    import re

    boards = track_dashboards("sglang", namespace, revisions=(9998, 9999) if namespace else (7, 8))
    uids, titles = {b["uid"] for b in boards.values()}, {b["title"] for b in boards.values()}
    assert len(uids) == len(titles) == len(boards) == 2
    assert all(len(uid) <= 40 and re.fullmatch(r"[a-zA-Z0-9_-]+", uid) for uid in uids), uids


ROUTER_SERIES = {"sglang_router": "smg_http_requests_total", "gateway_epp": "inference_objective_request_total"}


def panel_inputs(engine: str, revisions) -> list[dict]:
    """The series every panel reads, of the tracks in `revisions`, as the engines export them
    (tests/test_alerts_pd_fleet.py), with their running requests and the balancer's requests."""
    from infra.render.engine_check import variant_spec
    from tests.test_alerts_pd_fleet import fleet, pods, series

    running = "sglang:num_running_reqs" if engine == "sglang" else "vllm:num_requests_running"
    wanted = {p.namespace for p in pods(engine) if p.revision in revisions}
    out = [s for s in fleet(engine, {}) if re.search(r'namespace="([^"]+)"', s["series"]).group(1) in wanted]
    out += [series(p, running, "10x60") for p in pods(engine) if p.revision in revisions]
    router = ROUTER_SERIES[variant_spec("prod", engine).deployment.load_balancer.implementation]
    out += [{"series": f'{router}{{namespace="{ns}",pod="router-0",job="router",instance="router-0:9090"}}',
             "values": "0+60x60"} for ns in sorted(wanted)]
    return out


def promtool_test(tmp_path, tests: list[dict]) -> str:
    """`promtool test rules` on these test groups, with no rule file; its complaints, if any."""
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run([require_binary("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def reads(expr: str, something: bool) -> dict:
    """A check that `expr` yields some series at minute 40 (or none)."""
    return {"expr": f"count({expr}) > bool 0", "eval_time": "40m",
            "exp_samples": [{"labels": "{}", "value": 1}] if something else []}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_panel_reads_the_namespace_picked_and_no_other(tmp_path, engine):
    """The queue, running-requests, KV, KV-transfer and router panels summed every namespace: the
    canary's load showed as the serving revision's. With the dashboard's `namespace` variable at the
    serving track, each panel reads that track's series, and nothing when only the canary exports.
    Evaluated by `promtool test rules` on series shaped as the engines export them."""
    from tests.test_alerts_pd_fleet import CANARY, SERVING

    boards = track_dashboards(engine)
    serving = f"pdstack-prod-r{SERVING}"
    exprs = [t["expr"].replace("$namespace", serving) for p in boards[serving]["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    failed = promtool_test(tmp_path, [
        {"interval": "1m", "input_series": panel_inputs(engine, [SERVING, CANARY]),
         "promql_expr_test": [reads(e, True) for e in exprs]},
        {"interval": "1m", "input_series": panel_inputs(engine, [CANARY]),
         "promql_expr_test": [reads(e, False) for e in exprs]}])
    assert not failed, failed


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_environments_dashboard_offers_its_namespace_and_its_release_tracks(tmp_path, engine):
    """The platform's Grafana shows one dashboard per environment (infra/platform_stack/components/
    observability.py), whose series live in its release tracks' namespaces once a rollout ran: its
    `namespace` variable offers the environment's namespace and `<namespace>-r<revision>`, from the
    series that exist, and not a namespace that only starts alike."""
    from infra.components.k8s import LayerContext
    from infra.components.monitoring import dashboard
    from infra.render.engine_check import variant_spec
    from tests.test_alerts_pd_fleet import CANARY, SERVING

    spec = variant_spec("prod", engine)
    (variable,) = dashboard(LayerContext(spec, spec.environment.namespace))["templating"]["list"]
    assert (variable["name"], variable["multi"], variable["includeAll"]) == ("namespace", False, False)
    offered = re.fullmatch(r"label_values\((.+), namespace\)", variable["query"]).group(1)
    elsewhere = [{"series": re.sub(r'namespace="[^"]+"', f'namespace="{ns}"', s["series"]), "values": s["values"]}
                 for ns in ("pdstack-prod", "pdstack-prod-research") for s in panel_inputs(engine, [SERVING])]
    failed = promtool_test(tmp_path, [
        {"interval": "1m", "input_series": panel_inputs(engine, [SERVING, CANARY]) + elsewhere,
         "promql_expr_test": [{"expr": f"count by (namespace) ({offered}) > bool 0", "eval_time": "40m",
                               "exp_samples": [{"labels": f'{{namespace="{ns}"}}', "value": 1}
                                               for ns in ("pdstack-prod", "pdstack-prod-r7", "pdstack-prod-r8")]}]}])
    assert not failed, failed


def test_catalogue_series_names_follow_prometheus_client():
    assert catalogue("sglang")["metrics"]["sglang:eplb_balancedness"]["type"] == "summary"
    assert {"sglang:eplb_balancedness_sum", "sglang:eplb_balancedness_count"} <= set(exposed_series("sglang"))


def test_grafana_logs_in_with_a_generated_password_and_shows_what_each_serving_stack_publishes():
    """Grafana's admin login is a pulumi-random password in a Secret its container reads
    (GF_SECURITY_ADMIN_PASSWORD: Grafana docs, "Configure Grafana", environment variables
    GF_<SECTION>_<KEY> override [security] admin_password), marked secret in the stack's state;
    before, none was set and Grafana's default admin/admin stood. Its dashboards are the serving
    stacks' own ConfigMaps (labelled grafana_dashboard, every namespace, release tracks'
    included), which a sidecar (kiwigrid/k8s-sidecar, the grafana chart's; its README's LABEL,
    LABEL_VALUE, FOLDER, NAMESPACE=ALL, UNIQUE_FILENAMES) copies into the folder Grafana's file
    provider reads again and again; before, the platform rendered each environment's dashboard
    into its own ConfigMap at its last `pulumi up`, and a serving change never reached Grafana."""
    from infra.platform_stack.spec import load_platform_spec
    from infra.recording import is_secret
    from infra.render.manifests import manifests, unwrap

    spec = load_platform_spec("stacks/platform-prod.yaml")
    platform = shipped_run("platform-prod")
    objects = {(m["kind"], m["metadata"]["name"]): m for m in (unwrap(r) for r in manifests(platform))}
    (password,) = platform.of_type("random:index/randomPassword:RandomPassword")
    assert password.inputs["length"] >= 32
    grafana = objects[("Deployment", "grafana")]["spec"]["template"]["spec"]
    (main,) = [c for c in grafana["containers"] if c["name"] == "grafana"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in main["env"]}
    assert refs["GF_SECURITY_ADMIN_PASSWORD"]["name"] == refs["GF_SECURITY_ADMIN_USER"]["name"]
    (secret,) = [r for r in platform.of_type("kubernetes:core/v1:Secret")
                 if r.inputs["metadata"]["name"] == refs["GF_SECURITY_ADMIN_PASSWORD"]["name"]]
    assert secret.inputs["metadata"]["namespace"] == spec.monitoring_namespace
    from infra.recording import fake_secret

    data = secret.inputs["stringData"]
    assert is_secret(data)  # the whole of stringData is a secret in the state
    assert data["value"][refs["GF_SECURITY_ADMIN_PASSWORD"]["key"]] == fake_secret("grafana-admin")  # the mocks' result
    assert secret.property_dependencies["stringData"] == (password.urn,)

    # No dashboard of the platform's own: each is the serving stack's, found by its label.
    def dashboards(objects) -> list[dict]:
        return [m for m in objects if m["kind"] == "ConfigMap" and any(
            key.endswith(".json") and "panels" in json.loads(v) for key, v in (m.get("data") or {}).items())]

    assert dashboards(objects.values()) == []
    serving = shipped_run("prod")
    published = dashboards(map(unwrap, manifests(serving)))
    assert published
    (sidecar,) = [c for c in grafana["containers"] if c["name"] != "grafana"]
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert all(m["metadata"]["labels"].get(env["LABEL"]) == env["LABEL_VALUE"] for m in published)
    assert (env["NAMESPACE"], env["RESOURCE"], env["UNIQUE_FILENAMES"]) == ("ALL", "configmap", "true")
    assert sidecar["image"] == spec.images.grafana_sidecar
    provisioning = json.loads(objects[("ConfigMap", "grafana-provisioning")]["data"]["dashboards.yaml"])
    (provider,) = provisioning["providers"]
    assert provider["options"]["path"] == env["FOLDER"] and provider["updateIntervalSeconds"] > 0
    folders = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in grafana["containers"]}
    assert folders["grafana"][env["FOLDER"]] == folders[sidecar["name"]][env["FOLDER"]]
    (binding,) = [m for k, m in objects.items() if k[0] == "ClusterRoleBinding" and m["roleRef"]["name"] == "grafana-dashboards"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": grafana["serviceAccountName"],
                                    "namespace": spec.monitoring_namespace}]
    (role,) = [m for k, m in objects.items() if k == ("ClusterRole", "grafana-dashboards")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]
