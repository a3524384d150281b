"""`pdctl plan --watch`: the planner as a loop on a Prometheus stand-in (bounded by --iterations),
and on a real Prometheus scraping engines in release-track namespaces; and the scaler targets
`plan --write` puts in the spec, which the rendered scalers use."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from infra.cli import main
from infra.spec import REPO_ROOT
from infra.cli.plan import HISTORY_POINTS
from infra.render.metrics import ROLE_SERIES_LABEL
from tests.servers import http_server

WORKLOAD = str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")
# The pools whose TTFT histogram has samples in PD mode, as each pinned engine fills it: an SGLang
# prefill observes none, decode from the request's arrival (sglang 0.5.23
# srt/managers/tokenizer_manager.py collect_metrics); vLLM each role its own part (vllm 0.33.0
# v1/metrics/stats.py update_from_output). stacks/prod.yaml runs SGLang.
TIMES_FIRST_TOKENS = {"sglang": ("decode",), "vllm": ("prefill", "decode")}


def stand_in(rate: float, ttft_s: float, itl_s: float, counts=(8, 1), lengths=None, hit_rate=0.0, rounds=(),
             engine: str = "sglang"):
    """Prometheus answering the queries plan --watch makes: a steady `rate`, the counts, the p99s
    (TTFT from the pools `engine` times it in: no series from any other), and `lengths`
    {"prompt"/"generation": (mean, p99)} (None: no length histograms, as a 0/0 NaN).
    `rounds`: per round (1, 2, ...), a dict overriding any of rate, counts, lengths for that round
    (a round starts with its HISTORY_POINTS rate queries)."""
    from infra.cli.plan import HISTORY_POINTS

    rate_queries = [0]

    def answer(query: str):
        if query.startswith("sum(rate(") and "e2e_request_latency_seconds_count" in query:
            rate_queries[0] += 1
        now = (rounds[(rate_queries[0] - 1) // HISTORY_POINTS]
               if 0 < rate_queries[0] <= HISTORY_POINTS * len(rounds) else {})
        at = {"rate": rate, "counts": counts, "lengths": lengths, **now}
        kind = "prompt" if "prompt_tokens" in query else "generation" if "generation_tokens" in query else None
        if "prefill_effective_tokens" in query:
            value = hit_rate
        elif kind:
            mean, p99 = at["lengths"][kind] if at["lengths"] else ("NaN", "NaN")
            value = p99 if query.startswith("histogram_quantile") else mean
        elif query.startswith("count(count by"):
            value = at["counts"][0] if 'role="prefill"' in query else at["counts"][1]
        elif query.startswith("histogram_quantile") and "time_to_first_token" in query:
            if not any(f'{ROLE_SERIES_LABEL}="{role}"' in query for role in TIMES_FIRST_TOKENS[engine]):
                return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
            value = ttft_s
        elif query.startswith("histogram_quantile"):
            value = itl_s
        elif query.startswith("sum(rate(") and "e2e_request_latency_seconds_count" in query:
            value = at["rate"]
        else:
            return 400, json.dumps({"status": "error", "error": f"unexpected {query}"}).encode()
        return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {}, "value": [time.time(), str(value)]}]}}).encode()
    return http_server(answer)


def test_watch_dry_run_says_what_would_change_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with stand_in(40, 0.4, 0.02) as prom:
        assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, "--watch", "--prometheus", prom,
                     "--interval", "0", "--iterations", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("round ") == 2 and "round 2:" in out
    assert "would change: deployment.prefill.instances 8 -> " in out
    assert "deployment.autoscaling.decode_running_per_instance unset -> " in out
    assert list(tmp_path.iterdir()) == []


def test_watch_corrects_towards_what_the_fleet_shows(capsys):
    # A fleet whose decode is much slower than the workload's figure says: the correction rises.
    with stand_in(40, 0.3, 0.039) as prom:
        assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, "--watch", "--prometheus", prom,
                     "--interval", "0", "--iterations", "3", "--dry-run", "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    decode = [r["correction"]["decode"] for r in doc["rounds"]]
    assert decode[0] > 1.0 and decode == sorted(decode)
    assert all(r["observed"] and r["written"] is None for r in doc["rounds"])
    assert doc["rounds"][0]["lengths_from"].startswith("the workload file")


def test_watch_corrects_prefill_from_the_ttft_sglang_times_on_decode(capsys):
    """A PD prefill on SGLang never records TTFT: --watch read prefill's histogram, always NaN, so no
    round was ever observed and the model never corrected. Decode times each request's first token
    from its arrival, the client's TTFT: read there, first tokens at 1.2 s, slower than the model
    predicts at the counts serving, move prefill's correction up round by round."""
    with stand_in(40, 1.2, 0.02) as prom:
        assert main(watch(prom, 3, "--dry-run", "--output", "json")) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert [r["observed"] for r in rounds] == [True, True, True]
    prefill = [r["correction"]["prefill"] for r in rounds]
    assert prefill[0] > 1.0 and prefill == sorted(prefill) and prefill[-1] > prefill[0]


def test_watch_plans_for_the_lengths_prometheus_saw(capsys):
    # Prompts four times the workload file's (12000 mean, 40000 p99): more prefill for the same rate.
    runs = {}
    for name, lengths in (("file", None), ("live", {"prompt": (12000, 40000), "generation": (400, 2000)})):
        with stand_in(40, 0.3, 0.02, lengths=lengths) as prom:
            assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, "--watch", "--prometheus", prom,
                         "--interval", "0", "--iterations", "1", "--dry-run", "--output", "json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["rounds"][0]
    assert runs["live"]["lengths_from"] == "Prometheus, last hour"
    assert runs["live"]["input_tokens"] == {"mean": 12000, "p99": 40000}
    assert runs["live"]["prefill_instances"] > runs["file"]["prefill_instances"]


def test_watch_discounts_the_prefix_cache_hit_rate_prefill_shows(capsys):
    rounds = []
    for hit_rate in (0.0, 0.7):
        with stand_in(120, 0.3, 0.02, hit_rate=hit_rate) as prom:
            assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, "--watch", "--prometheus", prom,
                         "--interval", "0", "--iterations", "1", "--dry-run", "--output", "json"]) == 0
        rounds.append(json.loads(capsys.readouterr().out)["rounds"][0])
    assert [r["prefix_cache_hit_rate"] for r in rounds] == [0.0, 0.7]
    assert rounds[1]["prefill_instances"] < rounds[0]["prefill_instances"]


def test_watch_writes_the_plan_and_its_scaler_targets(tmp_path, capsys):
    from infra.spec_checks import load_spec

    out = tmp_path / "prod.yaml"
    with stand_in(40, 0.4, 0.02) as prom:
        assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, "--watch", "--prometheus", prom,
                     "--interval", "0", "--iterations", "1", "--write", str(out)]) == 0
    spec = load_spec(out)
    assert spec.deployment.autoscaling.decode_running_per_instance > 0
    assert f"wrote {out}" in capsys.readouterr().out


def test_plan_write_sets_the_scalers_from_the_plan_and_the_stack_renders_them(tmp_path):
    from infra.planning.autoscaling import signals
    from infra.spec_checks import load_spec

    out = tmp_path / "prod.yaml"
    assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, "--write", str(out)]) == 0
    spec = load_spec(out)
    targets = {s.name: s.target for role in ("prefill", "decode") for s in signals(spec, role)}
    auto = spec.deployment.autoscaling
    assert targets["running_requests"] == auto.decode_running_per_instance
    assert targets["generation_tokens_per_s"] == auto.decode_tokens_per_second_per_instance
    assert targets["queue_depth"] == auto.prefill_queue_per_instance
    assert auto.decode_running_per_instance == 1122  # the slots at 40 ms on the prod-chat curve, p99 batch


@pytest.mark.parametrize("argv, says", [
    (["--watch", "--dry-run"], "--watch reads the live rate and latencies: it needs --prometheus URL"),
    (["--watch", "--prometheus", "http://127.0.0.1:9"], "--watch writes what it would change to --write PATH"),
    (["--dry-run"], "--prometheus, --dry-run and --iterations go with --watch"),
    (["--watch", "--dry-run", "--prometheus", "http://127.0.0.1:9", "--interval", "nan"], "--interval: seconds"),
])
def test_watch_options_are_checked_before_anything_runs(argv, says, capsys):
    assert main(["plan", "--stack", "prod", "--workload", WORKLOAD, *argv]) == 2
    assert says in capsys.readouterr().err


def watch(prom: str, iterations: int, *more: str) -> list[str]:
    return ["plan", "--stack", "prod", "--workload", WORKLOAD, "--watch", "--prometheus", prom, "--interval", "0",
            "--iterations", str(iterations), *more]


def test_a_negative_rate_is_no_data_for_its_round_and_the_watch_goes_on(capsys):
    """Issue #36, 4(a): a negative request rate (a counter reset seen through a broken recording
    rule, or a hostile series) ended the watch with `unexpected error: ValueError: math domain
    error` (the correction took it as the load and Erlang C went negative). It is no data for
    that round, said so; the round plans from the workload file and the next from Prometheus."""
    with stand_in(40, 0.4, 0.02, rounds=[{}, {"rate": -5}, {}]) as prom:
        assert main(watch(prom, 3, "--dry-run", "--output", "json")) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert [r["no_data"] for r in rounds] == [
        [], [f"rate -5 is below 0: {HISTORY_POINTS} of the {HISTORY_POINTS} points of the last 2 h like it"], []]
    assert [r["observed"] for r in rounds] == [True, False, True]
    assert rounds[1]["rate_from"] == "the workload file (no rate in Prometheus)"
    assert rounds[1]["rate_rps"] == 40 and all(r["skipped"] is None for r in rounds)


@pytest.mark.parametrize("counts, says", [
    ((1e9, 1), "prefill_instances 1e+09 is above 9 (what the prefill pool's nodes hold: "
               "deployment.prefill.scaling.max_instances and rollout_surge_instances, within hardware.max_gpus)"),
    ((8, 1e300), "decode_instances 1e+300 is above 3 (what the decode pool's nodes hold"),
    ((2.5, 1), "prefill_instances 2.5 is not a whole number"),
    ((-1, 1), "prefill_instances -1 is below 0"),
])
def test_an_implausible_instance_count_is_no_data_not_an_endless_round(counts, says, capsys):
    """Issue #36, 4(b): an instance count of 1e9 made the first round run for hours (Erlang C
    summed term by term over the count, at every step of the correction's bisection) and 1e300
    never ended. The pools can hold no more than their nodes (stacks/prod.yaml: prefill 8 + 1
    surge; decode 2 + 1 surge, one NVLink domain each), and a count is whole: anything else is
    no data for the round (no correction from it), said so, and the plan goes on."""
    with stand_in(40, 0.4, 0.02, rounds=[{"counts": counts}, {}]) as prom:
        assert main(watch(prom, 2, "--dry-run", "--output", "json")) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert len(rounds[0]["no_data"]) == 1 and rounds[0]["no_data"][0].startswith(says), rounds[0]["no_data"]
    assert [r["observed"] for r in rounds] == [False, True] and rounds[1]["no_data"] == []
    assert rounds[0]["prefill_instances"] == rounds[1]["prefill_instances"]  # planned as if it were not there


@pytest.mark.parametrize("lengths, says", [
    ({"prompt": (1e300, 1e300), "generation": (400, 2000)},
     ["input_mean 1e+300 is above 131072 (model.context_length)",
      "input_p99 1e+300 is above 131072 (model.context_length)"]),
    ({"prompt": (3000, 12000), "generation": (1e-300, 1)}, ["output_mean 1e-300 is below 1"]),
])
def test_lengths_no_request_can_have_are_no_data(lengths, says, capsys):
    """Prompts longer than model.context_length cannot have been served (the planner's
    extrapolation overflowed: `unexpected error`), nor can a request have less than a token
    (a mean squared underflowed to a division by zero): the workload file's lengths stand in."""
    with stand_in(40, 0.4, 0.02, lengths=lengths) as prom:
        assert main(watch(prom, 1, "--dry-run", "--output", "json")) == 0
    r = json.loads(capsys.readouterr().out)["rounds"][0]
    assert r["no_data"] == says and r["skipped"] is None
    assert r["lengths_from"].startswith("the workload file") and r["input_tokens"] == {"mean": 3000, "p99": 12000}


def test_a_workload_file_with_less_than_a_token_a_request_is_refused_naming_the_field(tmp_path, capsys):
    workload = tmp_path / "w.yaml"
    workload.write_text(Path(WORKLOAD).read_text().replace("output_tokens: {mean: 400,", "output_tokens: {mean: 1e-300,"))
    assert main(["plan", "--stack", "prod", "--workload", str(workload)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "output_tokens.mean: Input should be greater than or equal to 1" in err and "unexpected" not in err, err


def test_a_round_whose_plan_the_spec_refuses_is_skipped_and_the_watch_goes_on(tmp_path, capsys):
    """Issue #36, 4(c): one round at 1e5 req/s with --write ended the whole watch with exit 2 (the
    planned spec needs 10,242 prefill nodes against a quota of 288 GPUs). That round is reported
    and skipped, the rounds around it are written, and what it observed moves no correction (the
    model has the fleet's counts overloaded at that rate: a decode batch beyond what an instance
    may hold), where it moved decode's down by the most a step may (x0.8) before."""
    out = tmp_path / "prod.yaml"
    with stand_in(40, 0.4, 0.02, rounds=[{}, {"rate": 1e5}, {}]) as prom:
        assert main(watch(prom, 3, "--write", str(out), "--output", "json")) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert [r["written"] for r in rounds] == [str(out), None, str(out)]
    refused = rounds[1]["skipped"]
    assert rounds[1]["changes"] == [] and refused and all(
        line.startswith(f"the spec refuses this plan, so it is not proposed: --write {out}: the planned spec would "
                        "be invalid: ") for line in refused)
    assert any("hardware.max_gpus: the pools reserve" in line and "but the quota is 288" in line for line in refused)
    assert rounds[1]["correction"] == rounds[0]["correction"] != {"prefill": 1.0, "decode": 1.0}


def test_a_dry_run_says_when_the_spec_would_refuse_its_plan(tmp_path, capsys, monkeypatch):
    """Issue #36, 4: with --dry-run, 1e6 req/s proposed 51,158 prefill and 14,293 decode instances
    for prod without a word of doubt. The dry run asks the spec's own reader, as --write does,
    and proposes nothing the spec refuses."""
    monkeypatch.chdir(tmp_path)
    with stand_in(1e6, 0.4, 0.02) as prom:
        assert main(watch(prom, 1, "--dry-run")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "prefill 51158, decode 14293" in out  # what the model asks for, printed
    assert ("skipped: the spec refuses this plan, so it is not proposed: --dry-run: the planned spec would be "
            "invalid: hardware.max_gpus: the pools reserve 1438488 GPUs") in out
    assert "would change" not in out and list(tmp_path.iterdir()) == []


def test_a_round_with_no_plan_at_all_is_skipped_and_says_the_rate(capsys):
    """Past 65,536 instances the planner has no count: the round says so, with the rate, and the next one plans."""
    with stand_in(40, 0.4, 0.02, rounds=[{"rate": 1e9}, {}]) as prom:
        assert main(watch(prom, 2, "--dry-run", "--output", "json")) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert rounds[0]["skipped"] == [f"no plan this round: {WORKLOAD}: at 1000000000.0 req/s: no instance count up "
                                    "to 65536 meets the SLO. Fix: check the workload's rate and lengths"]
    assert rounds[0]["prefill_instances"] is None and rounds[1]["skipped"] is None


# --- a real Prometheus scraping engines in the environment's release tracks -----------------------

TRACKS_NS = "pdstack-prod"  # stacks/prod.yaml's environment.namespace
# namespace -> (prefill leaders, decode leaders, requests a tick, prompt tokens, ITL s, prefix hit share):
# two tracks serving (a canary at about a quarter), a third kept warm at weight 0 (instances, no
# requests), and another environment whose name begins with this one's and carries more than both.
TRACK_PODS = {f"{TRACKS_NS}-r7": (2, 1, 3, 1000, 0.015, 0.5), f"{TRACKS_NS}-r8": (1, 1, 1, 5000, 0.04, 0.0),
              f"{TRACKS_NS}-r6": (1, 1, 0, 1000, 0.015, 0.5), f"{TRACKS_NS}-research": (3, 2, 10, 20000, 0.2, 0.9)}


class TrackPod:
    """One engine leader pod's /metrics, shaped as the pinned SGLang exports it (the catalogue's
    types and label names, tests/engine_exporter.py), fed on a clock: a decode pod's requests with
    their TTFT, ITL and output lengths, a prefill pod's prompts and their prefix-cache tokens
    (sglang 0.5.23 srt/observability/metrics_collector.py prefill_effective_tokens_total, by mode)."""

    def __init__(self, role: str, requests: int, prompt: int, itl_s: float, hit: float):
        from prometheus_client import CollectorRegistry

        from infra.render.metrics import catalogue
        from tests.engine_exporter import LABEL_VALUES, SGLANG, TYPES

        def metric(name: str, **kwargs):
            entry = catalogue("sglang")["metrics"][name]
            made = TYPES[entry["type"]](name, name, labelnames=entry["labels"], registry=self.registry, **kwargs)
            return lambda **values: made.labels(**{k: {**LABEL_VALUES, **values}[k] for k in entry["labels"]})

        self.registry, self.role, self.requests, self.prompt, self.itl_s, self.hit = (
            CollectorRegistry(), role, requests, prompt, itl_s, hit)
        metric(SGLANG.running)().set(requests)
        self.e2e = metric("sglang:e2e_request_latency_seconds")()
        self.ttft = metric(SGLANG.ttft_bucket.removesuffix("_bucket"), buckets=(0.1, 0.25, 0.5, 1, 2.5))()
        self.itl = metric(SGLANG.tpot_bucket.removesuffix("_bucket"), buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.25))()
        self.prompts = metric(SGLANG.prompt_length, buckets=(500, 1000, 2000, 5000, 10000, 20000))()
        self.outputs = metric(SGLANG.output_length, buckets=(100, 200, 400, 800))()
        self.effective = metric("sglang:prefill_effective_tokens_total")

    def tick(self) -> None:
        for _ in range(self.requests):
            if self.role == "decode":
                self.e2e.observe(2.0)
                self.ttft.observe(0.3)
                self.outputs.observe(300)
                for _ in range(5):
                    self.itl.observe(self.itl_s)
            else:
                self.prompts.observe(self.prompt)
                self.effective(mode="input").inc(self.prompt * (1 - self.hit))
                self.effective(mode="device_hit").inc(self.prompt * self.hit)


@pytest.fixture(scope="module")
def tracks_prometheus(tmp_path_factory):
    """A real Prometheus (Debian's, on loopback) scraping TRACK_PODS's leaders, each with the target
    labels the PodMonitor gives it (namespace, role, worker index 0)."""
    import threading
    from contextlib import ExitStack
    from infra.prometheus import PrometheusAPI
    from infra.render.metrics import WORKER_SERIES_LABEL
    from tests.engine_exporter import metrics_handler
    from tests.servers import prometheus, serving

    pods, targets = [], []
    with ExitStack() as stack:
        for namespace, (prefills, decodes, requests, prompt, itl_s, hit) in TRACK_PODS.items():
            for role, n in (("prefill", prefills), ("decode", decodes)):
                for group in range(n):
                    pod = TrackPod(role, requests, prompt, itl_s, hit)
                    url = stack.enter_context(serving(metrics_handler(pod.registry)))
                    pods.append(pod)
                    targets.append((int(url.rsplit(":", 1)[1]), {
                        "namespace": namespace, "pod": f"engine-{role}-{group}", ROLE_SERIES_LABEL: role,
                        WORKER_SERIES_LABEL: "0"}))
        stop = threading.Event()

        def feed():
            while not stop.wait(0.2):
                for pod in pods:
                    pod.tick()

        threading.Thread(target=feed, daemon=True).start()
        stack.callback(stop.set)
        api = PrometheusAPI(stack.enter_context(prometheus(tmp_path_factory.mktemp("prom"), targets)))
        # Every pod the test reads has a rate: the decodes' requests and the prefills' prompts (a rate
        # needs two scrapes of each; on a loaded machine the prefills' came after the decodes').
        serving_decodes = sum(d for _, d, r, *_ in TRACK_PODS.values() if r)
        serving_prefills = sum(p for p, _, r, *_ in TRACK_PODS.values() if r)
        deadline = time.monotonic() + 300
        while (api.query("count(rate(sglang:e2e_request_latency_seconds_count[5m]) > 0)") != serving_decodes
               or api.query("count(rate(sglang:prompt_tokens_histogram_count[5m]) > 0)") != serving_prefills):
            assert time.monotonic() < deadline, "Prometheus has no rates from the engines"
            time.sleep(0.5)
        yield api


def test_the_watch_reads_the_environment_in_every_release_track_it_serves_from(tracks_prometheus, capsys):
    """Once a rollout serves from release-track namespaces (`<namespace>-r<revision>`,
    infra/tracks.py), the watch read `namespace="pdstack-prod"` alone: no rate, counts or p99 at all,
    and it planned from the workload file as if nothing served. The serving load is the sum over the
    tracks (the canary's share with the rest), the counts are the instances of the tracks that took
    requests (not the warm standby's), and another environment whose namespace begins the same is
    none of it."""
    from infra.cli.plan import observe
    from infra.spec_checks import load_spec
    from infra.spec import stack_spec_path

    api, spec = tracks_prometheus, load_spec(stack_spec_path("prod"))
    assert spec.environment.namespace == TRACKS_NS
    now = time.time()
    history, observation, lengths, hit_rate, no_data = observe(api, spec, now)
    track_rates = [api.query(f'sum(rate(sglang:e2e_request_latency_seconds_count{{namespace="{ns}"}}[5m]))', now)
                   for ns in (f"{TRACKS_NS}-r7", f"{TRACKS_NS}-r8")]
    assert all(r > 0 for r in track_rates) and no_data == []
    assert observation is not None and history[-1] == pytest.approx(sum(track_rates), rel=1e-9)
    assert (observation.prefill, observation.decode) == (3, 2)
    assert 20 < observation.itl_p99_ms <= 50  # r8's 40 ms tail (a quarter of the steps), not research's 200 ms
    assert 1000 < lengths["input"][0] < 5000  # r7's 1000-token prompts and r8's 5000, not research's 20000
    assert 0 < hit_rate < 0.5  # token-weighted over r7 (half hits) and r8 (none), one figure for the pool

    assert main(watch(api.url, 1, "--dry-run", "--output", "json")) == 0
    (r,) = json.loads(capsys.readouterr().out)["rounds"]
    assert r["observed"] and r["rate_from"] == "forecast (q95) of the last 2 h"
    assert r["lengths_from"] == "Prometheus, last hour" and r["no_data"] == []


def test_the_namespace_is_matched_as_itself_in_promql(tracks_prometheus):
    """The environment's namespace goes into a PromQL regex string: RE2's `.` matches any character
    and a quote would end the string (Prometheus's PromQL strings take Go's escapes, promql/parser
    lex.go; its regex matchers are RE2, anchored). Escaped, `pdstack.prod` matches no series of
    `pdstack-prod`, and a quote is a character, not a parse error."""
    from infra.tracks import namespaces_matcher

    api = tracks_prometheus
    assert api.query(f"count(sglang:num_running_reqs{{{namespaces_matcher(TRACKS_NS)}}})") == 7  # r6, r7, r8
    for namespace in ("pdstack.prod", 'pdstack"prod'):
        assert math.isnan(api.query(f"count(sglang:num_running_reqs{{{namespaces_matcher(namespace)}}})"))
