"""Spec to the balancers' configs: encoder, prefill/decode router, expert placement. Pure.

Prefill and decode instances are meant to be picked by live load with prefix-cache affinity:
- `sglang_router`: the SGLang model gateway, `cache_aware` (radix-tree affinity, and the worker
  with the fewest requests in flight when the prompt matches little or the load spread passes the
  balance thresholds; its load is the router's own count of requests in flight, which needs
  nothing from the engine). Colocated, that holds. In PD mode the pinned 0.3.2 does NOT: its
  prefill and decode policies are instances of their own (routers/factory.rs create_pd_router)
  whose radix trees are never made (policies/registry.rs init_pd_cache_aware_policies is called
  nowhere), so `select_worker` finds no tree and picks at random; measured on the twin
  (tests/twin/test_load_spread_on_twin.py, a strict expected failure that turns when a fixed router
  is pinned). No other 0.3.2 policy is load-aware here: `power_of_two` polls a load endpoint the
  pinned engine does not serve (POLICY_POLLS), `round_robin` is static. The render says so in its
  notes (PD_RANDOM_NOTE). Workers are found by Kubernetes service discovery on the pool labels,
  so scaling needs no router restart.
- `gateway_epp`: the endpoint picker of llm-d-inference-scheduler (built on the Gateway API
  Inference Extension) with prefix-cache, queue and KV-cache-utilisation scorers and its
  disaggregation profile handler; llm-d's routing sidecar on decode pods runs the prefill hop.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import yaml

from infra import naming
from infra.render.engine_args import BOOTSTRAP_PORT, ENGINE_PORT, SIDECAR_ENGINE_PORT, weights_path
from infra.render.epp_contract import config_problems, contract, flag_problems, require
from infra.render.flagsets import flagset
from infra.render.tracing import router_trace_args
from infra.spec import SpecError, StackSpec

ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000

# Spec strategy -> sglang-router policy for the prefill side and the decode side.
SGLANG_POLICIES = {
    "cache_aware": ("cache_aware", "cache_aware"),
    "least_load": ("cache_aware", "cache_aware"),
    "power_of_two": ("power_of_two", "power_of_two"),
    "round_robin": ("round_robin", "round_robin"),
}
# The worker endpoint a sglang-router 0.3.2 policy polls for load: its LoadMonitor polls
# `{worker}/get_load` for the power_of_two policies alone (src/core/worker_manager.rs
# parse_load_response, monitor_loop); an unanswered poll reads -1, and with both candidates at -1
# power_of_two keeps its first random pick (src/policies/power_of_two.rs). Every other policy
# counts the router's own requests in flight (WorkerLoadGuard, src/routers/http/pd_router.rs).
POLICY_POLLS = {"power_of_two": "/get_load"}
# The load endpoints the pinned engine serves: SGLang 0.5.23 serves /v1/loads
# (srt/entrypoints/v1_loads.py, included by srt/entrypoints/http_server.py) and no /get_load.
# tests/test_router_load_source.py reads both from the pinned packages.
ENGINE_LOAD_ROUTES = {"sglang": frozenset({"/v1/loads"})}


def router_policy_problems(spec: StackSpec) -> list[str]:
    """A strategy whose sglang-router policies poll a load endpoint the pinned engine does not serve
    (infra/spec_checks.py reads the spec with it, so `pdctl validate` says it too)."""
    lb, engine = spec.deployment.load_balancer, spec.engine
    if lb.implementation != "sglang_router" or engine.kind not in ENGINE_LOAD_ROUTES:
        return []  # sglang_router routes SGLang only (infra/spec/ engine_capability_problems)
    served = ENGINE_LOAD_ROUTES[engine.kind]
    unserved = [p for p in SGLANG_POLICIES[lb.strategy] if p in POLICY_POLLS and POLICY_POLLS[p] not in served]
    if not unserved:
        return []
    return [f"deployment.load_balancer.strategy: {lb.strategy} makes sglang-router poll each worker's "
            f"{POLICY_POLLS[unserved[0]]}, which {engine.kind} {engine.version} does not serve: every worker would "
            "read as unloaded and the first random pick would win. Fix: cache_aware or least_load"]


# What the render's notes say of sglang-router in PD mode (see the module's docstring).
PD_RANDOM_NOTE = ("sglang-router 0.3.2 in PD mode picks prefill and decode at random, whatever the policy: its PD "
                  "policies' prefix trees are never made, so neither live load nor prefix affinity steers it "
                  "(tests/twin/test_load_spread_on_twin.py); the endpoint picker (gateway_epp) with vLLM is the "
                  "load-aware PD path measured here")


class RoundRobinWarning(UserWarning):
    """Static round robin ignores live load and prefix-cache affinity."""


@dataclass(frozen=True)
class RouterLaunch:
    implementation: str
    entrypoint: list[str]
    args: list[str]
    port: int
    metrics_port: int
    files: dict[str, str] = field(default_factory=dict)  # ConfigMap data
    notes: list[str] = field(default_factory=list)
    # Replicas elect one active leader (the others stand by, not Ready) instead of each
    # keeping its own prefix index; such a Deployment is replaced whole (Recreate), since a
    # new replica cannot become Ready while the old leader holds the lease.
    leader_elected: bool = False
    health_port: int | None = None  # gRPC health service (the picker's), else probe the serving port
    # A folder the router's pod has at this path (sglang_router_launch says why), else none.
    model_folder: str | None = None


def pool_selector(role: str) -> dict[str, str]:
    """Labels that pick the pods that serve a pool's API (each group's leader, or every node of a
    pool whose nodes serve their own ranks)."""
    return {naming.ROLE_LABEL: role, naming.SERVES_API_LABEL: "true"}


def _selector_args(selector: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in selector.items()]


def router_attempts(retries: int) -> int:
    """sglang-router 0.3.2's `--retry-max-retries` for a hop the spec retries `retries` times.

    The router counts that value as attempts, the first included: its retry loop stops once
    `attempt + 1 >= max(max_retries, 1)` (src/core/retry.rs execute_response_with_retry), so 1 is
    no retry at all, and its config validation refuses 0 (src/config/validation.rs validate_retry).
    The spec's `retries` are retries after the first attempt, as the timeout budget counts them
    (infra/spec/__init__.py: timeout x (retries + 1) attempts)."""
    return retries + 1


def sglang_router_launch(spec: StackSpec) -> RouterLaunch:
    lb, t = spec.deployment.load_balancer, spec.timeouts
    prefill_policy, decode_policy = SGLANG_POLICIES[lb.strategy]
    problems = router_policy_problems(spec)
    if problems:
        raise SpecError(problems)
    w = lb.weights
    args = [
        "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT),
        "--prometheus-host", "0.0.0.0",
        "--prometheus-port", str(ROUTER_METRICS_PORT),
        "--service-discovery",
        "--service-discovery-namespace", spec.environment.namespace,
        "--service-discovery-port", str(ENGINE_PORT["sglang"]),
        "--cache-threshold", str(w.cache_threshold),
        "--balance-abs-threshold", str(w.balance_abs_threshold),
        "--balance-rel-threshold", str(w.balance_rel_threshold),
        # sglang-router's request timeout covers the whole request, stream included: the gateway's.
        "--request-timeout-secs", str(int(t.gateway_to_router.timeout_seconds)),
        "--retry-max-retries", str(router_attempts(t.router_to_prefill.retries)),
        "--health-check-endpoint", "/health",
    ]
    if spec.deployment.mode == "disaggregated":
        args += [
            "--pd-disaggregation",
            "--prefill-policy", prefill_policy,
            "--decode-policy", decode_policy,
            "--prefill-selector", *_selector_args(pool_selector("prefill")),
            "--decode-selector", *_selector_args(pool_selector("decode")),
        ]
    else:
        args += ["--policy", prefill_policy, "--selector", *_selector_args(pool_selector("colocated"))]
    args += router_trace_args(spec)
    flagset("sglang-router").require(args, "router")
    return RouterLaunch(
        implementation="sglang_router",
        entrypoint=["python3", "-m", "sglang_router.launch_router"],
        args=args,
        port=ROUTER_PORT,
        metrics_port=ROUTER_METRICS_PORT,
        # For each worker it adds, sglang-router 0.3.2 loads a tokenizer from the model_path the
        # worker's /server_info reports, the engines' --model-path (src/core/steps/worker/local/
        # discover_metadata.rs, register_tokenizer.rs): from that folder if the router has it, else
        # by asking huggingface.co for a model of that name (src/tokenizer/factory.rs
        # create_tokenizer_async_with_chat_template), which a cluster must not do and no flag turns
        # off. The router's pod has a folder there, so the load stays local. Its routing reads no
        # tokenizer (HTTP mode: cache_aware's tree is on request text); only the router's own
        # /v1/tokenize and /v1/detokenize would, and they answer an error, as without the folder.
        model_folder=weights_path(spec),
        notes=[
            f"prefill bootstrap port from pod annotation sglang.ai/bootstrap-port={BOOTSTRAP_PORT}",
            f"policies: prefill {prefill_policy}, decode {decode_policy}",
            *([PD_RANDOM_NOTE] if spec.deployment.mode == "disaggregated" else []),
        ],
    )


PREFIX_BLOCKS_TO_MATCH = 256  # prefix blocks the picker hashes per request (its default)


def epp_config(spec: StackSpec) -> dict:
    """EndpointPickerConfig of the pinned endpoint picker (llm-d-inference-scheduler v0.7.1).

    The prefix-cache scorer hashes prompts in blocks of the engines' KV page size
    (blockSizeTokens; the older blockSize counted characters and is deprecated), so its
    affinity matches the engines' own prefix cache. In PD mode the disaggregation profile
    handler runs the decode profile, and the prefill profile when its decider says so: every
    request goes through prefill (always-disagg-pd-decider), as PD mode means and sglang-router
    does. Not prefix-based-pd-decider with nonCachedTokens 0: in the pinned picker 0 disables
    disaggregation (llm-d-inference-scheduler v0.7.1 pkg/plugins/profile/prefix_based_pd_decider.go),
    which the twin showed (the picker named no prefill pod).
    """
    w = spec.deployment.load_balancer.weights
    scorers = [
        {"pluginRef": "prefix-cache-scorer", "weight": w.prefix_cache},
        {"pluginRef": "queue-scorer", "weight": w.queue_depth},
        {"pluginRef": "kv-cache-utilization-scorer", "weight": w.kv_cache_utilization},
    ]
    if spec.deployment.load_balancer.strategy == "round_robin":
        scorers = []  # no scoring: the picker falls back to random among the filtered
    plugins = [
        {"type": "prefix-cache-scorer", "parameters": {"blockSizeTokens": spec.engine.kv_page_size,
                                                       "maxPrefixBlocksToMatch": PREFIX_BLOCKS_TO_MATCH}},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ]
    if spec.deployment.mode == "disaggregated":
        plugins += [
            {"type": "disagg-headers-handler"},  # tells the decode pod's sidecar which prefill pod to use
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "always-disagg-pd-decider"},
            {"type": "disagg-profile-handler", "parameters": {
                "profiles": {"prefill": "prefill", "decode": "decode"},
                "deciders": {"prefill": "always-disagg-pd-decider"}}},
        ]
        profiles = [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, *scorers, {"pluginRef": "max-score-picker"}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, *scorers, {"pluginRef": "max-score-picker"}]},
        ]
    else:
        plugins.append({"type": "single-profile-handler"})
        profiles = [{"name": "default", "plugins": [*scorers, {"pluginRef": "max-score-picker"}]}]
    return {
        "apiVersion": contract()["config"]["apiVersion"],
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": profiles,
    }


EPP_GRPC_PORT = 9002  # ext-proc, which the gateway calls
EPP_HEALTH_PORT = 9003  # gRPC health: services "liveness" and "readiness" (Ready only on the leader)
EPP_LEADER_ELECTION = "--ha-enable-leader-election"  # with it, "readiness" is SERVING on the elected leader only


def gateway_epp_launch(spec: StackSpec) -> RouterLaunch:
    """The picker's command line.

    - Several replicas elect a leader (--ha-enable-leader-election): the picker's prefix-cache
      scorer keeps its index in memory, so independent replicas would each see a share of the
      requests and score affinity on a partial index. With the election only the leader reports
      Ready on the "readiness" health service, so the gateway reaches the leader alone and a
      stand-by takes over within a lease period (gateway-api-inference-extension v1.4.0,
      cmd/epp/runner/health.go; its chart, config/charts/epplib/templates/_deployment.yaml, does
      the same with the Recreate strategy).
    - --metrics-endpoint-auth=false: with it on (the default), the metrics endpoint asks the API
      server to review every scraper's token (TokenReview, SubjectAccessReview: cluster-scoped
      grants, controller-runtime v0.23.3 pkg/metrics/filters/filters.go), and the ServiceMonitor
      would have to hand Prometheus a long-lived token of some account allowed `get /metrics`.
      The port is reachable only from the namespace and the monitoring namespace (NetworkPolicy)
      and carries no secret, so pdstack keeps the picker's RBAC namespaced instead.
    """
    config = epp_config(spec)
    require(config_problems(config), "EndpointPickerConfig")
    leader_elected = spec.deployment.load_balancer.replicas > 1
    args = [
        f"--pool-name={naming.INFERENCE_POOL}",
        f"--pool-namespace={spec.environment.namespace}",
        "--config-file=/etc/epp/config.yaml",
        f"--grpc-port={EPP_GRPC_PORT}",
        f"--grpc-health-port={EPP_HEALTH_PORT}",
        f"--metrics-port={ROUTER_METRICS_PORT}",
        "--metrics-endpoint-auth=false",
        *([EPP_LEADER_ELECTION] if leader_elected else []),
    ]
    require(flag_problems(args, "epp"), "endpoint picker flags")
    return RouterLaunch(
        implementation="gateway_epp",
        entrypoint=["/app/epp"],
        args=args,
        port=EPP_GRPC_PORT,
        metrics_port=ROUTER_METRICS_PORT,
        files={"config.yaml": yaml.safe_dump(config, sort_keys=False)},
        notes=[f"endpoint picker: llm-d-inference-scheduler {contract()['epp']['version']}; config and flags checked "
               "against its source (infra/render/epp_contract.py)"],
        leader_elected=leader_elected,
        health_port=EPP_HEALTH_PORT,
    )


SIDECAR_KV_CONNECTOR = {"vllm": "nixlv2", "sglang": "sglang"}  # vLLM's NixlConnector; SGLang's bootstrap


def routing_sidecar_container(spec: StackSpec) -> dict:
    """The sidecar on decode leaders: it takes the pod's serving port, the engine moves behind it."""
    connector = SIDECAR_KV_CONNECTOR[spec.engine.kind]
    args = [f"--port={ENGINE_PORT[spec.engine.kind]}", f"--vllm-port={SIDECAR_ENGINE_PORT}",
            f"--kv-connector={connector}", "--secure-proxy=false"]
    require(flag_problems(args, "sidecar"), "routing sidecar flags")
    return {
        "name": "routing-sidecar",
        "image": spec.images.routing_sidecar,
        "args": args,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT[spec.engine.kind]}],
        # A native sidecar (an init container that keeps running): up before the engine, and
        # stopped after it.
        "restartPolicy": "Always",
        "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    }


def router_launch(spec: StackSpec) -> RouterLaunch:
    lb = spec.deployment.load_balancer
    if lb.strategy == "round_robin":
        warnings.warn(
            "deployment.load_balancer.strategy: round_robin ignores live load and prefix-cache "
            "affinity. Fix: cache_aware or least_load",
            RoundRobinWarning,
            stacklevel=2,
        )
    if lb.implementation == "sglang_router":  # the spec checks guarantee an sglang engine
        return sglang_router_launch(spec)
    return gateway_epp_launch(spec)
