"""The canary verdict and its queries, on their own (pure)."""

from __future__ import annotations

import math

from infra.render.metrics import with_selector
from infra.rollout.canary import Observation, gate_queries, judge
from infra.rollout.steps import plan_steps
from infra.offline import run_spec
from infra.spec import SLOSpec
from infra.render.query_check import query_problems

SLO = SLOSpec(ttft_p99_ms=2000, tpot_p99_ms=50, tokens_per_second_per_user=15, max_error_rate=0.01)
GOOD = Observation(ttft_p99_s=0.5, tpot_p99_s=0.03, error_rate=0.001, kv_transfer_errors=0)


def failed(verdict) -> set[str]:
    return {g.name for g in verdict.gates if not g.passed}


def test_a_canary_like_the_serving_revision_passes():
    assert judge(GOOD, GOOD, SLO).passed


def test_each_gate_fails_on_its_own():
    worse = lambda **kw: Observation(**{**GOOD.__dict__, **kw})  # noqa: E731
    assert failed(judge(worse(ttft_p99_s=2.5), GOOD, SLO)) == {"TTFT p99 vs SLO", "TTFT p99 vs serving"}
    assert failed(judge(worse(ttft_p99_s=0.7), GOOD, SLO)) == {"TTFT p99 vs serving"}  # within SLO, 40% worse
    assert failed(judge(worse(tpot_p99_s=0.06), GOOD, SLO)) == {"TPOT p99 vs SLO", "TPOT p99 vs serving"}
    assert failed(judge(worse(error_rate=0.008), GOOD, SLO)) == {"error rate vs serving"}
    assert failed(judge(worse(error_rate=0.02), None, SLO)) == {"error rate vs SLO"}
    assert failed(judge(worse(kv_transfer_errors=3), GOOD, SLO)) == {"KV transfer errors"}


def test_no_data_fails_rather_than_passes():
    blind = Observation(math.nan, math.nan, math.nan, math.nan)
    assert not judge(blind, GOOD, SLO).passed
    assert "no samples" in judge(blind, GOOD, SLO).reasons()


def test_first_release_is_judged_against_the_slo_only():
    assert {g.name for g in judge(GOOD, None, SLO).gates} == {
        "TTFT p99 vs SLO", "TPOT p99 vs SLO", "error rate vs SLO", "KV transfer errors"}


def test_queries_select_one_revision_of_one_environment_and_name_real_metrics():
    import re

    for engine in ("sglang", "vllm"):
        for name, query in gate_queries(engine, "pdstack-prod", 7, "5m").items():
            assert 'namespace=~"pdstack-prod(-r7)?"' in query and 'pdstack_io_release="7"' in query, (engine, name)
            names = set(re.findall(r"\b(?:sglang|vllm):[A-Za-z0-9_:]*", query))
            assert names and query_problems(query, engine) == [], (engine, name, names)


def test_with_selector_merges_into_an_existing_selector():
    assert with_selector("m", '{a="1"}') == 'm{a="1"}'
    assert with_selector('m{r="x"}', '{a="1"}') == 'm{r="x",a="1"}'
    assert with_selector("m", "") == "m"


def test_colocated_mode_has_one_engine_step(colocated_spec):
    steps = [s.name for s in plan_steps(colocated_spec, run_spec(colocated_spec).resources)]
    assert steps == ["initialise environment", "split pools", "deploy prefill", "deploy kv cache and balancers",
                     "open access", "verify"]
