"""The canary verdict and its queries, on their own (pure)."""

from __future__ import annotations

import math

from infra.prometheus import PrometheusAPI
from infra.render.metrics import ENGINE_METRICS, ROLE_SERIES_LABEL, increase_from_zero, p99, with_selector
from infra.rollout.canary import (BUCKET_EDGES, RELEASE_SERIES_LABEL, Observation, bucket_edges, gate_queries, judge,
                                  observe, p99_bucket)
from infra.rollout.steps import plan_steps
from infra.offline import run_spec
from infra.spec import SLOSpec
from infra.spec_checks import parse_spec
from infra.render.query_check import query_problems
from tests.conftest import stack_data, vllm_with_epp
from tests.servers import http_server, prometheus

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


def test_a_slow_kv_handoff_fails_against_the_serving_revision_only():
    """A canary whose KV transfers' p99 is more than the latency regression above the serving
    revision's fails; within it, or with nothing to compare (a first release: the spec sets no SLO
    for a transfer's time; no transfer timed: NaN), the gate is not there."""
    timed = Observation(**{**GOOD.__dict__, "kv_transfer_p99_s": 0.010})
    worse = lambda seconds: Observation(**{**GOOD.__dict__, "kv_transfer_p99_s": seconds})  # noqa: E731
    assert failed(judge(worse(0.013), timed, SLO)) == {"KV transfer p99 vs serving"}
    assert "13.0 ms, serving 10.0 ms" in judge(worse(0.013), timed, SLO).reasons()
    assert judge(worse(0.011), timed, SLO).passed
    assert "KV transfer p99 vs serving" not in {g.name for g in judge(worse(0.5), None, SLO).gates}
    assert "KV transfer p99 vs serving" not in {g.name for g in judge(GOOD, timed, SLO).gates}


# SGLang 0.5.23's sglang:kv_transfer_latency_ms buckets (ms; twin/engine_standin.py BUCKETS), in s,
# and its TTFT buckets (s).
SGLANG_KV_EDGES_S = tuple(ms / 1000 for ms in (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)) + (math.inf,)
SGLANG_TTFT_EDGES_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, math.inf)


def test_a_vs_serving_gate_fails_only_beyond_what_the_buckets_resolve():
    """A p99 from histogram_quantile over a classic histogram is known only to its bucket:
    Prometheus v3.13.1 promql/quantile.go BucketQuantile interpolates linearly inside the first
    bucket whose count reaches the rank, and reads the +Inf bucket as the last finite edge. On the
    twin a good revision failed "KV transfer p99 vs serving: 660.0 ms, serving 350.0 ms (limit x1.2)"
    with both revisions' transfers about the 500 ms edge of SGLang's 250-500-1000 ms buckets: its
    p99 may be 501 ms and the serving one's 500 ms. A canary fails only when its p99's bucket lies
    wholly above the serving p99's bucket's upper edge times the regression; so for TTFT."""
    kv = lambda ms: Observation(**{**GOOD.__dict__, "kv_transfer_p99_s": ms / 1000,  # noqa: E731
                                   "kv_transfer_buckets_s": SGLANG_KV_EDGES_S})
    within = judge(kv(660), kv(350), SLO)
    assert within.passed
    gate = next(g for g in within.gates if g.name == "KV transfer p99 vs serving")
    assert "660.0 ms, serving 350.0 ms" in gate.detail and "within the histograms' resolution" in gate.detail
    assert "canary 500-1000 ms, serving 250-500 ms" in gate.detail
    slower = judge(kv(1500), kv(350), SLO)  # its bucket 1000-2500 ms, over 500 ms x 1.2
    assert failed(slower) == {"KV transfer p99 vs serving"}
    assert "canary 1000-2500 ms, serving 250-500 ms" in slower.reasons()
    assert failed(judge(kv(5000), kv(350), SLO)) == {"KV transfer p99 vs serving"}  # past the last edge
    assert judge(kv(5000), kv(5000), SLO).passed

    ttft = lambda s: Observation(**{**GOOD.__dict__, "ttft_p99_s": s, "ttft_buckets_s": SGLANG_TTFT_EDGES_S})  # noqa: E731
    assert judge(ttft(0.7), ttft(0.5), SLO).passed  # 0.6-0.8 s against 0.4-0.6 s: one edge apart
    assert failed(judge(ttft(1.5), ttft(0.5), SLO)) == {"TTFT p99 vs serving"}  # 1-2 s over 0.6 s x 1.2


def test_a_vs_serving_gate_judges_only_on_enough_of_the_canarys_samples_for_a_p99():
    """histogram_quantile's rank is 0.99 x the count (Prometheus v3.13.1 promql/quantile.go
    BucketQuantile): under 100 samples the p99 is the largest one. On the twin (a fresh clone's
    `make test`) a GOOD revision was rolled back at its 50% stage by "KV transfer p99 vs serving:
    195.3 ms, serving 47.9 ms; p99 buckets: canary 100-250 ms, serving 25-50 ms" from about 90
    transfers, where one outlier (a new instance's first transfer over a connection not yet made)
    is the p99. Under GatePolicy.min_samples_vs_serving the gate does not judge and says so; with
    enough samples the same figures fail; the SLO gates judge whatever the count."""
    def kv(ms, samples=math.nan):
        return Observation(**{**GOOD.__dict__, "kv_transfer_p99_s": ms / 1000, "kv_transfer_buckets_s": SGLANG_KV_EDGES_S,
                              "kv_transfer_samples": samples})
    few = judge(kv(195.3, samples=90), kv(47.9, samples=5000), SLO)
    gate = next(g for g in few.gates if g.name == "KV transfer p99 vs serving")
    assert few.passed and gate.detail.startswith("not judged: 90 samples in the window, fewer than the 100"), gate.detail
    assert failed(judge(kv(195.3, samples=150), kv(47.9), SLO)) == {"KV transfer p99 vs serving"}
    assert failed(judge(kv(195.3), kv(47.9), SLO)) == {"KV transfer p99 vs serving"}  # count not known: judged
    slow = Observation(**{**GOOD.__dict__, "ttft_p99_s": 5.0, "ttft_samples": 10})
    assert "TTFT p99 vs SLO" in failed(judge(slow, GOOD, SLO))  # the SLO gate judges a few samples too


def test_p99_bucket_is_where_histogram_quantile_put_the_quantile():
    """Prometheus v3.13.1 promql/quantile.go BucketQuantile: a quantile at a bucket's upper edge
    is that bucket's (the first whose count reaches the rank), the lowest bucket starts at 0, one
    read as the last finite edge may be in the +Inf bucket; no edges known: the value itself."""
    assert p99_bucket(0.5, SGLANG_KV_EDGES_S) == (0.25, 0.5)
    assert p99_bucket(0.66, SGLANG_KV_EDGES_S) == (0.5, 1.0)
    assert p99_bucket(0.0005, SGLANG_KV_EDGES_S) == (0.0, 0.001)
    assert p99_bucket(5.0, SGLANG_KV_EDGES_S) == (2.5, math.inf)
    assert p99_bucket(0.66, ()) == (0.66, 0.66)


def test_observe_reads_each_compared_histograms_edges_in_seconds():
    """The edges query yields one series per (gate, le); SGLang's KV transfer le is in ms."""
    for engine in ("sglang", "vllm"):
        data = stack_data("prod")
        spec = parse_spec(vllm_with_epp(data) if engine == "vllm" else data)
        query = gate_queries(spec, 7, "5m")[BUCKET_EDGES]
        assert ENGINE_METRICS[engine].kv_transfer_time_bucket in query and "group by (le)" in query
    answer = [({"gate": "kv_transfer_buckets_s", "le": le}, 1.0) for le in ("500", "+Inf", "250")]
    answer.append(({"gate": "ttft_buckets_s", "le": "0.4"}, 1.0))
    assert bucket_edges(answer, 0.001) == {"kv_transfer_buckets_s": (0.25, 0.5, math.inf), "ttft_buckets_s": (0.4,)}


def test_the_kv_transfer_time_is_read_in_seconds_where_each_engine_times_it():
    """SGLang 0.5.23 times a transfer on the prefill in ms (sglang:kv_transfer_latency_ms,
    srt/observability/metrics_collector.py, observed by disaggregation/prefill.py); vLLM 0.33.0 on
    the decode in s (vllm:nixl_xfer_time_seconds, kv_connector/v1/nixl/stats.py)."""
    for engine, name, scale in (("sglang", "sglang:kv_transfer_latency_ms_bucket", "0.001"),
                                ("vllm", "vllm:nixl_xfer_time_seconds_bucket", "1")):
        data = stack_data("dev")
        spec = parse_spec(vllm_with_epp(data) if engine == "vllm" else data)
        query = gate_queries(spec, 3, "5m")["kv_transfer_p99_s"]
        assert name in query and query.endswith(f" * {scale}"), query


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
        data = stack_data("prod")
        spec = parse_spec(vllm_with_epp(data) if engine == "vllm" else data)
        for name, query in gate_queries(spec, 7, "5m").items():
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


# Each role's TTFT samples per 0.1 s of a vLLM PD revision: every request passes both roles, and
# 3 in 200 wait 4 s on prefill. Prefill's p99 is in that tail; over both roles' samples (3 in 400)
# it is not.
VLLM_TTFT_PER_TICK = {"prefill": {0.2: 197, 4.0: 3}, "decode": {0.2: 200}}
TTFT_BUCKETS = (0.25, 1.0, 2.5, 5.0, math.inf)


def vllm_ttft_exposition(per_tick: dict[float, int], ticks: int) -> bytes:
    """vllm:time_to_first_token_seconds as the pinned vLLM exposes it (labels engine, model_name:
    infra/render/pinned/vllm-0.33.0-metrics.json), after `ticks` ticks of `per_tick` samples."""
    name = ENGINE_METRICS["vllm"].ttft_bucket.removesuffix("_bucket")
    labels = 'engine="0",model_name="deepseek-ai/DeepSeek-V3"'
    lines = [f"# TYPE {name} histogram"]
    for le in TTFT_BUCKETS:
        count = ticks * sum(n for value, n in per_tick.items() if value <= le)
        lines.append(f'{name}_bucket{{{labels},le="{"+Inf" if le == math.inf else le}"}} {count}')
    lines.append(f"{name}_sum{{{labels}}} {ticks * sum(value * n for value, n in per_tick.items())}")
    lines.append(f"{name}_count{{{labels}}} {ticks * sum(per_tick.values())}")
    return ("\n".join(lines) + "\n").encode()


def test_a_vllm_canary_whose_prefill_tail_is_over_the_slo_fails_the_ttft_gate(tmp_path):
    """vLLM 0.33.0 observes TTFT on prefill and on decode, each from the request's arrival at that
    instance (vllm/v1/metrics/stats.py update_from_output). The gate read one p99 over both roles'
    histograms summed, where prefill's tail was 3 in 400 samples, under the 1% a p99 shows: the
    revision passed with its prefill p99 at 4 s. Each role's p99 is judged now (a real Prometheus
    on 127.0.0.1 scraping each role's stand-in)."""
    import time

    spec = parse_spec(vllm_with_epp(stack_data("dev")))
    namespace, revision, window = spec.environment.namespace, 2, "10s"
    started = time.monotonic()

    def role_exporter(role: str):
        return http_server(lambda query: (200, vllm_ttft_exposition(
            VLLM_TTFT_PER_TICK[role], int((time.monotonic() - started) * 10))))

    with role_exporter("prefill") as prefill, role_exporter("decode") as decode:
        targets = [(int(url.rsplit(":", 1)[1]), {"namespace": namespace, RELEASE_SERIES_LABEL: str(revision),
                                                 ROLE_SERIES_LABEL: role})
                   for role, url in (("prefill", prefill), ("decode", decode))]
        with prometheus(tmp_path, targets) as url:
            api = PrometheusAPI(url)
            ttft = ENGINE_METRICS["vllm"].ttft_bucket
            deadline = time.monotonic() + 60
            while api.query(f"count(rate({ttft.replace('_bucket', '_count')}[{window}]) > 0)") != 2:
                assert time.monotonic() < deadline, "Prometheus has no TTFT rates from both stand-ins"
                time.sleep(0.5)
            summed = p99(ttft, f'{{{RELEASE_SERIES_LABEL}="{revision}"}}', window)  # what the gate read
            assert api.query(summed) <= SLO.ttft_p99_ms / 1000  # both roles' samples together: under the SLO
            canary = observe(api, spec, revision, window)
    assert canary.ttft_p99_s > SLO.ttft_p99_ms / 1000  # prefill's own p99, in its 4 s tail
    assert canary.ttft_buckets_s == TTFT_BUCKETS and canary.tpot_buckets_s == ()  # the edges the p99 was read from
    assert canary.ttft_samples > 0 and math.isnan(canary.kv_transfer_samples)  # each role's count; no transfers
    assert "TTFT p99 vs SLO" in failed(judge(canary, None, SLO))


def test_kv_transfer_failures_that_first_appear_in_a_burst_fail_the_gate(tmp_path):
    """SGLang 0.5.23 does not seed sglang:num_transfer_failed_reqs_total (a labelled
    prometheus_client Counter, srt/observability/metrics_collector.py, incremented only on a
    failure): a decode whose first ten transfers fail between two scrapes exports the series first
    at 10, and after that (the router's circuit breaker has taken it out) it stays there. A real
    Prometheus on 127.0.0.1 scraping such a stand-in: `increase()` alone gives 0 (it starts from
    the first sample it has; Prometheus docs, querying/functions), so the gate passed the canary;
    increase_from_zero counts the 10, per pool too (what an alert groups by)."""
    import time

    spec = parse_spec(stack_data("dev"))
    namespace, revision, window = spec.environment.namespace, 2, "5m"  # nothing existed 5 min before the server
    labels = 'engine_type="decode",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    failing = []  # set once Prometheus has scraped the decode without the series

    def exposition(query: str):
        lines = [f"sglang:num_requests_total{{{labels}}} 5.0"]
        if failing:
            lines.append(f"sglang:num_transfer_failed_reqs_total{{{labels}}} 10.0")
        return 200, ("\n".join(lines) + "\n").encode()

    def until(query: str, wanted: float) -> None:
        deadline = time.monotonic() + 120
        while not api.query(query) >= wanted:
            assert time.monotonic() < deadline, f"Prometheus never had {query} >= {wanted}"
            time.sleep(0.5)

    with http_server(exposition) as decode:
        target = (int(decode.rsplit(":", 1)[1]), {"namespace": namespace, RELEASE_SERIES_LABEL: str(revision),
                                                   ROLE_SERIES_LABEL: "decode"})
        with prometheus(tmp_path, [target]) as url:
            api = PrometheusAPI(url)
            until(f"count_over_time(sglang:num_requests_total[{window}])", 2)
            failing.append(True)
            counter = ENGINE_METRICS["sglang"].kv_transfer_failures
            until(f"count_over_time({counter}[{window}])", 3)
            assert api.query(f"sum(increase({counter}[{window}])) or vector(0)") == 0  # what the gate read
            canary = observe(api, spec, revision, window)
            by_pool = api.query(increase_from_zero(counter, window, by=("namespace", ROLE_SERIES_LABEL)))
    assert canary.kv_transfer_errors == 10 and by_pool == 10
    assert "KV transfer errors" in failed(judge(canary, None, SLO))



def test_a_healthy_sglang_canary_that_aborted_nothing_passes_the_error_rate_gate(tmp_path):
    """SGLang 0.5.23 exports sglang:num_aborted_requests_total (a labelled prometheus_client
    Counter, srt/observability/metrics_collector.py, `.labels(...).inc(1)` on an abort, never
    seeded) only from its first aborted request. A revision that aborted none has no such series,
    so the gate's error rate was an empty vector over the started requests' rate, read as NaN: "no
    finished requests for the canary", and every healthy SGLang canary failed (found on the twin,
    tests/twin/test_live_rollout_on_twin.py). A real Prometheus on 127.0.0.1 scraping stand-ins:
    a revision that served requests and aborted none reads 0%; one that served none in the window
    still reads NaN (a canary must be seen to work)."""
    import time

    spec = parse_spec(stack_data("dev"))
    namespace, window = spec.environment.namespace, "10s"
    started = time.monotonic()
    name = ENGINE_METRICS["sglang"].requests_started.removesuffix("_total")

    def exporter(per_second: int):
        def exposition(_query):
            count = per_second * int(time.monotonic() - started) + 5
            return 200, (f"# TYPE {name} counter\n{name}_total{{model_name=\"{spec.model.name}\"}} {count}\n").encode()
        return http_server(exposition)

    with exporter(10) as serving, exporter(0) as idle:
        targets = [(int(url.rsplit(":", 1)[1]), {"namespace": f"{namespace}-r{revision}",
                                                 RELEASE_SERIES_LABEL: str(revision)})
                   for revision, url in ((2, serving), (3, idle))]
        with prometheus(tmp_path, targets) as url:
            api = PrometheusAPI(url)
            deadline = time.monotonic() + 60
            while not api.query(f"sum(rate({name}_total{{{RELEASE_SERIES_LABEL}=\"2\"}}[{window}]))") > 0:
                assert time.monotonic() < deadline, "Prometheus has no request rate from the stand-in"
                time.sleep(0.5)
            healthy, idle_revision = observe(api, spec, 2, window), observe(api, spec, 3, window)
    assert healthy.error_rate == 0.0
    assert "error rate" not in failed(judge(healthy, None, SLO))
    assert math.isnan(idle_revision.error_rate)
