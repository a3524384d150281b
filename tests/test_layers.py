"""The layers as the mocked Pulumi program registers them, for the dev and prod specs."""

from __future__ import annotations

from infra import naming
from infra.planning.capacity import pool_capacity
from infra.offline import run_spec
from infra.recording import is_secret
from infra.render.manifests import manifests, unwrap


def pod_templates(run):
    for lws in run.by_kind("LeaderWorkerSet"):
        group = lws["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in group:
                yield lws, group[key]
    for dep in run.by_kind("Deployment"):
        yield dep, dep["spec"]["template"]


def test_node_pools_are_labelled_and_tainted_by_role(run, spec):
    pools = {p["metadata"]["labels"][naming.ROLE_LABEL]: p for p in run.by_kind("NodePool")}
    assert set(pools) == set(spec.deployment.pools())
    for role, pool in pools.items():
        template = pool["spec"]["template"]
        assert template["metadata"]["labels"][naming.ROLE_LABEL] == role
        assert {"key": naming.ROLE_LABEL, "value": role, "effect": "NoSchedule"} in template["spec"]["taints"]
        capacity = pool_capacity(spec, role)
        if capacity.static:
            assert pool["spec"]["replicas"] == capacity.static_nodes
        else:
            assert pool["spec"]["limits"]["nvidia.com/gpu"] == str(capacity.gpus)
        assert pool["spec"]["disruption"]["budgets"] == [{"nodes": spec.hardware.disruption_budget}]


def test_every_gpu_pod_selects_and_tolerates_its_pool(run):
    gpu_pods = 0
    for owner, template in pod_templates(run):
        pod = template["spec"]
        gpus = [c for c in pod["containers"] if "nvidia.com/gpu" in c["resources"].get("limits", {})]
        if not gpus:
            assert "nodeSelector" not in pod or naming.ROLE_LABEL not in pod["nodeSelector"], owner["metadata"]["name"]
            continue
        gpu_pods += 1
        role = pod["nodeSelector"][naming.ROLE_LABEL]
        assert template["metadata"]["labels"][naming.ROLE_LABEL] == role
        assert {"key": naming.ROLE_LABEL, "operator": "Equal", "value": role, "effect": "NoSchedule"} in pod["tolerations"]
    assert gpu_pods >= 2


def test_prod_group_shapes():
    from tests.conftest import shipped_run

    run = shipped_run("prod")
    groups = {g["metadata"]["name"]: g for g in run.by_kind("LeaderWorkerSet")}
    decode, prefill = groups["engine-decode"], groups["engine-prefill"]
    assert decode["spec"]["leaderWorkerTemplate"]["size"] == 16
    assert decode["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert prefill["spec"]["replicas"] == 8 and prefill["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_colocated_mode_has_one_pool_and_no_supernode_placement(colocated_spec):
    run = run_spec(colocated_spec)
    assert [p["metadata"]["name"] for p in run.by_kind("NodePool")] == ["pdstack-dev-colocated"]
    (group,) = run.by_kind("LeaderWorkerSet")
    assert "affinity" not in group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert "--disaggregation-mode" not in str(run.by_kind("ConfigMap"))


def test_api_keys_live_only_in_a_secret_and_are_secret_outputs(run, spec):
    (secret,) = run.by_kind("Secret")
    assert is_secret(secret["stringData"])
    keys = unwrap(secret["stringData"])
    assert set(keys) == {k.name for k in spec.access.api_keys}
    for value in keys.values():
        for m in manifests(run):
            if m["kind"] != "Secret":
                assert value not in str(unwrap(m))
    randoms = run.of_type("random:index/randomPassword:RandomPassword")
    assert len(randoms) == len(spec.access.api_keys)


def test_default_deny_plus_allowlist(run, spec):
    policies = {p["metadata"]["name"]: p["spec"] for p in run.by_kind("NetworkPolicy")}
    assert policies["default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    ingress = policies["allow-gateway-to-router"]["ingress"][0]["from"]
    assert [b["ipBlock"]["cidr"] for b in ingress if "ipBlock" in b] == spec.access.allowlist_cidrs
    (gateway,) = run.by_kind("Gateway")
    (proxy,) = run.by_kind("EnvoyProxy")
    service = proxy["spec"]["provider"]["kubernetes"]["envoyService"]
    assert service["loadBalancerSourceRanges"] == spec.access.allowlist_cidrs
    (auth,) = run.by_kind("SecurityPolicy")
    assert auth["spec"]["authorization"]["defaultAction"] == "Deny"
    (limits,) = run.by_kind("BackendTrafficPolicy")
    rules = limits["spec"]["rateLimit"]["local"]["rules"]
    # Local limits count in each Envoy replica (envoyproxy/gateway docs, "Local Rate Limit"):
    # each replica enforces its share of the key's limit.
    replicas = spec.access.gateway_replicas
    assert [r["limit"]["requests"] for r in rules] == [-(-k.requests_per_minute // replicas) for k in spec.access.api_keys]
    assert "type" not in limits["spec"]["rateLimit"]  # deprecated in Envoy Gateway v1.9: local/global say it
    assert gateway["spec"]["infrastructure"]["parametersRef"]["name"] == proxy["metadata"]["name"]
    # Unset, a Gateway's EnvoyProxy replaces the GatewayClass's settings whole
    # (envoyproxy/gateway v1.9.0, EnvoyProxySpec.mergeType).
    assert proxy["spec"]["mergeType"] == "StrategicMerge"
    assert proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["replicas"] == replicas


def test_global_rate_limits_count_across_replicas():
    from tests.conftest import stack_data
    from infra.spec_checks import parse_spec

    data = stack_data("prod")
    data["access"]["rate_limit_scope"] = "global"
    (limits,) = run_spec(parse_spec(data)).by_kind("BackendTrafficPolicy")
    rules = limits["spec"]["rateLimit"]["global"]["rules"]
    assert [r["limit"]["requests"] for r in rules] == [6000, 600]


def test_every_pod_that_serves_metrics_is_scraped_and_no_other():
    """Every node of an SGLang group serves its own schedulers' /metrics (sglang 0.5.23
    srt/entrypoints/engine.py: node_rank >= 1 runs launch_dummy_health_check_server with
    --enable-metrics), so the PodMonitor selects every engine pod; vLLM's headless workers serve
    nothing (vllm 0.33.0 entrypoints/cli/serve.py run_headless), so their targets are dropped
    rather than reported down (prometheus-operator v0.93.0 PodMonitor: every selected pod's port
    is a target)."""
    from tests.conftest import shipped_run

    (monitor,) = [m for m in shipped_run("prod").by_kind("PodMonitor") if m["metadata"]["name"] == "engines"]
    assert "matchLabels" not in monitor["spec"]["selector"]
    assert "relabelings" not in monitor["spec"]["podMetricsEndpoints"][0]
    assert naming.LWS_WORKER_INDEX_LABEL in monitor["spec"]["podTargetLabels"]


def test_the_kv_cache_master_metrics_port_is_scraped():
    """The Mooncake master serves its own /metrics on --metrics_port (the pinned wheel's
    mooncake_master, run on the twin: tests/twin/test_metrics_on_twin.py finds it answering there),
    exposed as its Service's `metrics` port: a ServiceMonitor selects that Service and port, so the
    process is a target like the router and the engines. Was: a port nothing scraped."""
    from tests.conftest import shipped_run

    run = shipped_run("prod")
    (master,) = [s for s in run.by_kind("Service") if s["metadata"]["name"] == naming.MOONCAKE_MASTER]
    monitors = [m for m in run.by_kind("ServiceMonitor") if m["spec"]["selector"]["matchLabels"].items()
                <= master["metadata"]["labels"].items()]
    assert [[e["port"] for e in m["spec"]["endpoints"]] for m in monitors] == [["metrics"]]
    assert "metrics" in [p["name"] for p in master["spec"]["ports"]]


def _services(run) -> dict[str, dict]:
    return {s["metadata"]["name"]: s for s in run.by_kind("Service")}


def test_router_engine_and_cache_are_wired_to_services_the_program_made(run, spec):
    services = _services(run)
    ns = spec.environment.namespace
    # The route sends traffic to the router Service.
    (route,) = run.by_kind("HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert backend["name"] in services and backend["port"] in [p["port"] for p in services[backend["name"]]["spec"]["ports"]]
    # Every cluster URL any config names resolves to a Service of ours.
    import re

    texts = " ".join(str(m.get("data", "")) + str(m.get("spec", "")) for m in manifests(run))
    hosts = set(re.findall(r"([a-z0-9-]+)\." + re.escape(ns) + r"\.svc\.cluster\.local", texts))
    assert hosts, "expected cluster URLs in the rendered configs"
    assert hosts <= set(services), hosts - set(services)
    # The router discovers engines by selectors that match the engines' leader pods.
    launch = next(m for m in run.by_kind("ConfigMap") if m["metadata"]["name"] == "router-launch")["data"]["launch.sh"]
    for role in spec.deployment.pools():
        assert f"{naming.ROLE_LABEL}={role}" in launch
        svc = services[naming.engine_http(role)]
        group = next(g for g in run.by_kind("LeaderWorkerSet") if g["metadata"]["name"] == naming.engine(role))
        tmpl = group["spec"]["leaderWorkerTemplate"].get("leaderTemplate") or group["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        labels = {**tmpl["metadata"]["labels"], naming.LWS_WORKER_INDEX_LABEL: "0"}  # LWS adds the index
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())


def test_kv_cache_store_has_a_service_and_engines_point_at_it(run, spec):
    services = _services(run)
    assert "mooncake-master" in services
    for _, template in pod_templates(run):
        for c in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "MOONCAKE_MASTER" in env:
                assert env["MOONCAKE_MASTER"].startswith(f"mooncake-master.{spec.environment.namespace}.svc")


def test_weights_are_verified_before_the_engine_starts(run):
    for group in run.by_kind("LeaderWorkerSet"):
        tmpl = group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        (init,) = tmpl["initContainers"]
        assert init["command"][:2] == ["/bin/sh", "-c"] and "sha256sum -c" in init["command"][2]


def test_prod_preview_lists_every_layer_with_counts():
    from infra.cli import main

    import io

    from infra.cli import common as cli

    buffer = io.StringIO()
    cli.console.file = buffer
    try:
        assert main(["preview", "--offline", "--stack", "prod"]) == 0
    finally:
        cli.console.file = None
    out = buffer.getvalue()
    for layer in ("access", "balancers", "engines", "kvcache", "nodepools", "storage", "monitoring", "foundation"):
        assert f"{layer} (" in out, layer


def test_dedicated_encoder_pool_exists_where_prefill_is_told_to_call_it():
    from infra.spec_checks import parse_spec
    from tests.conftest import stack_data

    data = stack_data("dev")
    data["model"]["multimodal"] = True
    data["deployment"]["load_balancer"]["encoder"] = {"mode": "dedicated", "workers": 2}
    run = run_spec(parse_spec(data))
    services = _services(run)
    assert "encoder" in services
    (encoder,) = [d for d in run.by_kind("Deployment") if d["metadata"]["name"] == "encoder"]
    assert encoder["spec"]["replicas"] == 2
    assert "--encoder-only" in encoder["spec"]["template"]["spec"]["containers"][0]["command"]
    launch = next(m for m in run.by_kind("ConfigMap") if m["metadata"]["name"] == "engine-prefill-launch")
    assert "--encoder-urls http://encoder.pdstack-dev.svc.cluster.local:30000" in launch["data"]["launch.sh"]
    from infra.render.manifests import validate_manifests

    assert validate_manifests(manifests(run), "1.33").errors == []


def test_expert_placement_file_reaches_the_engine(tmp_path):
    """The expert balancer: a pdctl eplb placement is shipped and loaded at engine start."""
    import json

    from infra.spec_checks import parse_spec
    from tests.conftest import stack_data

    placement = tmp_path / "dev-decode.json"
    placement.write_text(json.dumps({"physical_to_logical_map": [list(range(128))] * 48}))
    data = stack_data("dev")
    data["deployment"]["decode"]["expert_placement"] = str(placement)  # absolute, or relative to the project
    run = run_spec(parse_spec(data))
    (cm,) = [c for c in run.by_kind("ConfigMap") if c["metadata"]["name"] == "expert-placement"]
    assert json.loads(cm["data"]["decode.json"])["physical_to_logical_map"][0][:3] == [0, 1, 2]
    launch = next(m for m in run.by_kind("ConfigMap") if m["metadata"]["name"] == "engine-decode-launch")
    assert "--init-expert-location /etc/pdstack/expert-placement/decode.json" in launch["data"]["launch.sh"]
    group = next(g for g in run.by_kind("LeaderWorkerSet") if g["metadata"]["name"] == "engine-decode")
    volumes = group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["volumes"]
    assert {"name": "expert-placement", "configMap": {"name": "expert-placement"}} in volumes
