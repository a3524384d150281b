"""Balancer replicas keep one prefix memory: the picker elects a leader, the SGLang router's
replicas each get whole API keys (tests/test_rbac.py covers the picker's election)."""

from __future__ import annotations

from dataclasses import replace

from infra.offline import run_spec
from infra.planning.prefix_affinity import ARRANGEMENTS, Workload, hit_rate
from infra.spec_checks import parse_spec
from tests.conftest import stack_data
from tests.test_endpoint_picker import epp_spec


def test_independent_trees_behind_round_robin_lose_prefix_hits_and_hashing_by_key_keeps_them():
    """N routers that each learn from a 1/N share send a conversation's next turn to a worker
    without its prefix: the model shows the loss and that hashing keys to replicas recovers it."""
    small = replace(Workload(), requests=4000, tenants=12)
    one, spread, hashed = (hit_rate(small, a) for a in ARRANGEMENTS)
    assert spread < one - 0.05
    assert hashed > one - 0.02


def test_the_gateway_hashes_each_api_key_to_one_sglang_router_replica():
    """Envoy Gateway v1.9.0 BackendTrafficPolicy: loadBalancer type ConsistentHash with a header
    (the CRD, infra/render/crds/, requires consistentHash.header for type Header); the header is
    the one SecurityPolicy's apiKeyAuth forwards the client id in (forwardClientIDHeader)."""
    run = run_spec(parse_spec(stack_data("prod")))
    (policy,) = run.by_kind("BackendTrafficPolicy")
    (security,) = run.by_kind("SecurityPolicy")
    header = security["spec"]["apiKeyAuth"]["forwardClientIDHeader"]
    assert policy["spec"]["loadBalancer"] == {"type": "ConsistentHash",
                                              "consistentHash": {"type": "Header", "header": {"name": header}}}
    (picker_policy,) = run_spec(epp_spec("prod")).by_kind("BackendTrafficPolicy")
    assert "loadBalancer" not in picker_policy["spec"]
