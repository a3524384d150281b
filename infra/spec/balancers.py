"""How requests reach the engines: the load balancer (router or endpoint picker), its
encoders, and how long each hop of a request may take."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from infra.inputs import Strict
from infra.spec._base import PositiveInt, Seconds


class RouterWeights(Strict):
    """Endpoint-picker scorer weights (gateway_epp) or cache-aware thresholds (sglang_router)."""

    prefix_cache: Annotated[float, Field(ge=0)] = 3.0
    queue_depth: Annotated[float, Field(ge=0)] = 2.0
    kv_cache_utilization: Annotated[float, Field(ge=0)] = 1.0
    cache_threshold: Annotated[float, Field(ge=0, le=1)] = 0.5
    balance_abs_threshold: Annotated[int, Field(ge=0)] = 32
    balance_rel_threshold: Annotated[float, Field(ge=1)] = 1.1


class EncoderSpec(Strict):
    mode: Literal["engine", "dedicated"] = "engine"
    workers: Annotated[int, Field(ge=0)] = 0


class LoadBalancerSpec(Strict):
    strategy: Literal["least_load", "cache_aware", "power_of_two", "round_robin"] = "cache_aware"
    implementation: Literal["sglang_router", "gateway_epp"] = "sglang_router"
    replicas: PositiveInt = 2
    weights: RouterWeights = RouterWeights()
    encoder: EncoderSpec = EncoderSpec()


class HopSpec(Strict):
    timeout_seconds: Seconds
    retries: Annotated[int, Field(ge=0, le=5)] = 1


class TimeoutsSpec(Strict):
    """How long each hop of a request may take, outermost first.

    - gateway_to_router: the whole request, stream included: the Envoy route's request timeout,
      and the router's --request-timeout-secs, which in sglang-router is a whole-request timeout
      too (a shorter one cuts streams the gateway allows).
    - router_to_prefill: one attempt at the prefill side, up to the prompt's KV being handed over
      (queue and prefill included), retried `retries` times by the router. The engines give up on
      the hop after as long: SGLang's PD bootstrap and waiting timeouts (both 300 s by default).
    - prefill_to_decode_kv: the KV transfer once prefill is done: how long the prefill side holds
      a request's KV for its decode peer (vLLM's NIXL kv_lease_duration).
    """

    gateway_to_router: HopSpec = HopSpec(timeout_seconds=900, retries=0)
    router_to_prefill: HopSpec = HopSpec(timeout_seconds=280, retries=2)
    prefill_to_decode_kv: HopSpec = HopSpec(timeout_seconds=30, retries=1)
