"""`pdctl plan --watch`: the planner as a loop on a Prometheus stand-in (bounded by --iterations),
and the scaler targets `plan --write` puts in the spec, which the rendered scalers use."""

from __future__ import annotations

import json
import time

import pytest

from infra.cli import main
from infra.spec import REPO_ROOT
from tests.servers import http_server

WORKLOAD = str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")


def stand_in(rate: float, ttft_s: float, itl_s: float, counts=(8, 1), lengths=None, hit_rate=0.0):
    """Prometheus answering the queries plan --watch makes: a steady `rate`, the counts, the p99s,
    and `lengths` {"prompt"/"generation": (mean, p99)} (None: no length histograms, as a 0/0 NaN)."""
    def answer(query: str):
        kind = "prompt" if "prompt_tokens" in query else "generation" if "generation_tokens" in query else None
        if "cache_hit_rate" in query:
            value = hit_rate
        elif kind:
            mean, p99 = lengths[kind] if lengths else ("NaN", "NaN")
            value = p99 if query.startswith("histogram_quantile") else mean
        elif query.startswith("count(count by"):
            value = counts[0] if 'role="prefill"' in query else counts[1]
        elif query.startswith("histogram_quantile"):
            value = ttft_s if "time_to_first_token" in query else itl_s
        elif "e2e_request_latency_seconds_count" in query:
            value = rate
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
