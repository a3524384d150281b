"""The profile sweep of `pdctl validate-deployment --profile-out` (infra/validation/profile.py)
and the surface it writes (infra/validation/loadtest.py measured_workload), run against an
engine model standing in for aiperf's runs (each run: the batch the decode engines hold at a
concurrency, under their KV cache and running-request cap, and the ITL the fleet model gives
at it; issue #41). End to end with the real aiperf: tests/test_validation.py."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest

from infra.planning.fleet_model import FleetModel
from infra.planning.pd_ratio import Workload
from infra.validation.loadtest import LoadResult, LoadTestError, judge, measured_workload
from infra.validation.profile import capacity_sweep, prefill_concurrency

TTFT_SLO, ITL_SLO = 2500, 50


@dataclass(frozen=True)
class Engine:
    """Decode instances of the fleet model, each holding at most `cap` sequences (the engine's
    running-request cap) and what its KV cache holds at the run's context; a request past them
    waits, in the engine's queue (its queue gauges, read with the running one)."""

    fleet: FleetModel = FleetModel()
    instances: int = 2
    cap: int = 10_000
    gauge: bool = True  # the running-requests gauge read (--prometheus) or Little's law on aiperf's figures

    def held(self, concurrency: int, prompt: float, output: float) -> float:
        return min(concurrency / self.instances, self.cap, self.fleet.kv_cache_tokens / (prompt + output / 2))

    def run(self, concurrency: int, prompt: float = 3000, output: float = 400):
        held = self.held(concurrency, prompt, output)
        itl = self.fleet.itl_ms(held, prompt + output / 2)
        tokens_per_second = held * self.instances * 1000 / itl  # Little's law, as aiperf would measure it
        result = LoadResult("chat", concurrency, 2 * concurrency, 0, 300.0, 300.0, itl * 1.2, itl, 1000 / itl,
                            tokens_per_second, tokens_per_second / output, prompt, prompt, output, output,
                            held_batch=held if self.gauge else None,
                            kv_usage=held * (prompt + output / 2) / self.fleet.kv_cache_tokens if self.gauge else None,
                            queue_depth=concurrency / self.instances - held if self.gauge else None)
        return result, judge(result, TTFT_SLO, ITL_SLO, 20)


def test_one_default_sweep_reaches_a_wide_decode_instance_capacity_not_its_32nd_sequence():
    """Issue #41: at the default --concurrency 1,8,32 a decode instance that holds thousands of
    sequences was profiled (and planned) at 32. The capacity sweep doubles concurrency until a
    limit (here the SLO: ITL p99 reaches 50 ms near 505 sequences an instance at 3,200 tokens of
    context), refines twice, and keeps every level: the surface reaches within 2^(1/4) of the
    largest batch inside the SLO, and says where and why it stopped."""
    engine = Engine()
    found = capacity_sweep("chat", engine.run, engine.instances, max_running=None)
    assert "the SLO broke (tpot_p99" in found.stopped, found.stopped
    inside = max(r.held_batch for r, gates in found.runs if all(g.passed for g in gates))
    limit = (ITL_SLO / 1.2 - 15) / (0.04 + 4e-6 * 3200)  # the fleet model's ITL p99 at the SLO
    assert limit / 2 ** 0.25 <= inside <= limit
    assert len(found.runs) <= 14  # 11 doublings to 1,024, two refinements (the 1.25x plan sweep took 23-26)
    profile = measured_workload(found.sweep(), 1, engine.instances, "w", "t", notes=[found.stopped])
    surface = Workload.model_validate(profile).surface
    assert surface.decode.batches[-1] >= inside and found.stopped in profile["measured"]["notes"]


def test_the_sweep_stops_where_the_kv_cache_fills_or_the_engine_holds_no_more():
    """The KV cache's usage gauge (--prometheus) at 95% stops it; without Prometheus, the engine
    holding no more than before though asked twice as many does (a cap the spec does not state),
    and the spec's max_running_requests does. Each row is at the batch the engine held, once."""
    long = Engine(fleet=FleetModel(kv_cache_tokens=3.0e5, decode_ms_per_sequence=0.0, decode_ms_per_kv_token=0.0))
    found = capacity_sweep("chat", long.run, long.instances, max_running=None)
    assert "the KV cache filled" in found.stopped, found.stopped
    capped = Engine(cap=48, gauge=False, fleet=FleetModel(decode_ms_per_kv_token=0.0))
    found = capacity_sweep("chat", capped.run, capped.instances, max_running=None)
    assert "the engine held no more sequences than at concurrency 128 (48.0 an instance)" in found.stopped
    assert "a load generator that kept no more in flight; with no queue figure" in found.stopped  # no gauges
    held = [r.concurrency / 2 if r.concurrency <= 96 else 48 for r, _ in found.sweep().runs]
    batches = Workload.model_validate(measured_workload(found.sweep(), 1, 2, "w", "t")).surface.decode.batches
    assert batches == sorted(set(held)) and batches[-1] == 48  # not 64, 128: the concurrency asked
    found = capacity_sweep("chat", capped.run, capped.instances, max_running=48)
    assert "the engine's running-request cap (max_running_requests 48" in found.stopped


def test_a_plateau_with_requests_queued_at_the_engine_is_its_cap():
    """An engine at its cap queues what it cannot run (SGLang 0.5.23 srt/disaggregation/decode.py:
    past --max-running-requests a decode instance's requests wait in its waiting queue,
    sglang:num_queue_reqs; vLLM 0.33.0's vllm:num_requests_waiting): a plateau with a queue is a
    cap, and the profile says how many waited."""
    capped = Engine(cap=48, fleet=FleetModel(decode_ms_per_kv_token=0.0))
    found = capacity_sweep("chat", capped.run, capped.instances, max_running=None)
    assert "the engine held no more sequences than at concurrency 128 (48.0 an instance, 80.0 more queued at " \
           "it): a cap" in found.stopped, found.stopped


def test_a_plateau_with_nothing_queued_is_the_load_generators_limit_not_a_cap():
    """Issue #41, session 5: on a busy machine aiperf kept fewer requests in flight than asked, the
    engine's running-requests gauge read what it kept, and the sweep stopped at "a cap" the engine
    never had (the stand-in at load ~100: 1 held at concurrency 2 of its cap 2). A plateau with
    nothing queued at the engine (test_a_plateau_with_requests_queued_at_the_engine_is_its_cap) is
    the load generator's: said so with the fix, no bisection towards it, and the profile the
    planner reads says no cap."""
    engine = Engine()
    in_flight = 48  # what a starved aiperf keeps in flight whatever the concurrency asked

    def starved(concurrency: int):
        result, gates = engine.run(min(concurrency, in_flight))
        return dataclasses.replace(result, concurrency=concurrency), gates

    found = capacity_sweep("chat", starved, engine.instances, max_running=None)
    assert "aiperf kept only 24.0 of the 64 requests asked in flight a decode instance and nothing queued at the " \
           "engine: the load generator, not the engine, was the limit" in found.stopped, found.stopped
    assert "a cap" not in found.stopped and "Fix: run validate-deployment from a machine with CPU to spare" in found.stopped
    assert found.concurrencies[-2:] == [64, 128]  # no bisection towards what aiperf kept in flight
    notes = Workload.model_validate(measured_workload(found.sweep(), 1, engine.instances, "w", "t",
                                                      notes=[found.stopped])).measured.notes
    assert found.stopped in notes and not any("a cap" in n for n in notes)


def test_a_longer_context_row_is_read_at_the_batches_its_engines_held():
    """Issue #41: rows recorded the concurrency asked, so past the KV cache the row at twice the
    prompt (its engines holding fewer sequences) lay below the first, and ITL fell with context.
    At the batches held, read at the first row's batches, ITL rises with context at each."""
    engine = Engine(fleet=FleetModel(kv_cache_tokens=1.2e6))
    found = capacity_sweep("chat", engine.run, engine.instances, max_running=None)
    levels = found.concurrencies
    longer = [engine.run(c, prompt=6000)[0] for c in levels]
    notes: list[str] = []
    profile = measured_workload(found.sweep(), 1, engine.instances, "w", "t", contexts=[longer], notes=notes)
    decode = Workload.model_validate(profile).surface.decode
    assert len(decode.contexts) == 2
    assert all(b >= a for a, b in zip(*decode.itl_ms)), decode
    assert any("extrapolated as the first row rises there" in n for n in profile["measured"]["notes"])


def test_prefill_holds_the_throughput_measured_under_load_and_says_where_it_has_none():
    """A prompt alone shows its TTFT; the tokens/s the surface holds is what a prefill instance
    computed with several prompts in flight (issue #41: engines pack many prompts into one
    chunked pass), paired with the run alone of the same prompts (a multi-turn scenario's
    prompts are shorter with one output token a turn). A length with no run under load keeps a
    prompt alone's, said so."""
    alone = LoadResult("chat", 1, 10, 0, 200.0, 200.0, 20.0, 20.0, 50.0, 50.0, 0.25, 1000, 1000, 200, 200)
    other = LoadResult("chat", 1, 10, 0, 900.0, 900.0, 20.0, 20.0, 50.0, 50.0, 0.25, 4000, 4000, 200, 200)
    loaded = LoadResult("chat", 16, 32, 0, 600.0, 600.0, 20.0, 20.0, 50.0, 0.0, 30.0, 700, 700, 1, 1)
    from infra.validation.loadtest import Sweep

    profile = measured_workload(Sweep("chat", [(alone, judge(alone, TTFT_SLO, ITL_SLO, 20))]), 2, 1, "w", "t",
                                lengths=[other], loaded=[(alone, loaded)])
    prefill = {p["input_tokens"]: p for p in profile["surface"]["prefill"]}
    assert prefill[1000]["ttft_ms"] == 200 and prefill[1000]["tokens_per_second"] == pytest.approx(700 * 30 / 2)
    assert prefill[4000]["tokens_per_second"] == pytest.approx(4000 / 0.9, rel=1e-3)
    assert any(n.startswith("prefill at 4000 tokens: no run under load") for n in profile["measured"]["notes"])
    # Enough prompts in flight to fill each instance's chunked pass, two at least.
    assert prefill_concurrency(1000, 16384, 3) == 17 * 3 and prefill_concurrency(32000, 8192, 1) == 2


def test_a_run_aiperf_cannot_finish_ends_the_sweep_there_said_so():
    engine = Engine()

    def measure(concurrency: int):
        if concurrency > 64:
            raise LoadTestError(f"aiperf at concurrency {concurrency} ran past 900s")
        return engine.run(concurrency)

    found = capacity_sweep("chat", measure, engine.instances, max_running=None)
    assert found.concurrencies[-1] < 128 and "aiperf could not finish at concurrency" in found.stopped
    with pytest.raises(LoadTestError):
        capacity_sweep("chat", lambda c: measure(1000), engine.instances, max_running=None)
    assert math.isfinite(found.runs[-1][0].itl_p50_ms)


def test_the_capacity_sweep_is_refused_where_levels_must_be_fixed_before_any_run(tmp_path, capsys):
    """In-cluster Jobs (--render-job) and their results (--results) have their levels fixed before
    the first run; the capacity sweep picks each from the one before. Refused, naming both, and
    nothing written."""
    from infra.cli import main

    jobs = tmp_path / "jobs.yaml"
    assert main(["validate-deployment", "--stack", "dev", "--url", "http://127.0.0.1:9", "--concurrency", "capacity",
                 "--render-job", str(jobs), "--results-claim", "r", "--api-key-secret", "s/k"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--concurrency capacity chooses each level from the run before, and --render-job needs them fixed" in err
    assert not jobs.exists()
    assert main(["validate-deployment", "--stack", "dev", "--url", "http://127.0.0.1:9", "--max-concurrency", "0",
                 "--profile-out", str(tmp_path / "p.yaml")]) == 2
    assert "--max-concurrency: 1 or more" in capsys.readouterr().err


def test_a_ttft_over_the_slo_does_not_stop_decodes_sweep():
    """TTFT is prefill's: at a fixed concurrency every sequence starts at once and the first burst
    queues for prefill (the request-by-request fleet of scripts/bench_planner_sim.py stopped at 128
    of ~500 on it). Decode's sweep stops on decode's gates; the TTFT gate still judges the run."""
    engine = Engine()

    def measure(concurrency: int):
        result, _ = engine.run(concurrency)
        slow_first_token = dataclasses.replace(result, ttft_p99_ms=TTFT_SLO * 2 if concurrency >= 64 else 300.0)
        return slow_first_token, judge(slow_first_token, TTFT_SLO, ITL_SLO, 20)

    found = capacity_sweep("chat", measure, engine.instances, max_running=None)
    assert found.concurrencies[-1] > 64 and "the SLO broke (tpot_p99" in found.stopped, found.stopped


def test_a_sweep_starved_by_prefill_says_so_not_that_the_engine_is_capped():
    """With too few prefill instances for the decode pool, the sequences queue for prefill: decode
    holds no more however many are asked, and TTFT is over the SLO. That is not decode's cap (the
    simulated fleet of scripts/bench_planner_sim.py, profiled at 4000/200 on 8 prefill instances,
    was planned at twice the decode instances it needed): the profile says which, and the fix."""
    engine = Engine(cap=60, fleet=FleetModel(decode_ms_per_kv_token=0.0))

    def measure(concurrency: int):
        result, _ = engine.run(concurrency)
        starved = dataclasses.replace(result, ttft_p99_ms=TTFT_SLO * 3 if concurrency > 120 else 300.0)
        return starved, judge(starved, TTFT_SLO, ITL_SLO, 20)

    found = capacity_sweep("chat", measure, engine.instances, max_running=None)
    assert "prefill fed decode no more sequences than at concurrency 128" in found.stopped, found.stopped
    assert "Fix: more prefill instances per decode instance" in found.stopped


def test_littles_law_reads_the_mean_inter_token_time_not_the_median():
    """Little's law (L = lambda W) holds for means: the sequences a decode instance held on average
    are its tokens/s times the mean time between a sequence's tokens. Two sequences held, each
    mostly at 20 ms a token with stalls that make the mean 30 ms (a busy machine): 66.7 tokens/s.
    With the median (20 ms) the run read 1.3 held, and a capped engine's next level read as a rise
    past the plateau (tests/test_validation.py's sweep went on to 8 on a loaded machine)."""
    from infra.validation.loadtest import littles_law_batch
    held, mean_ms, median_ms = 2, 30.0, 20.0
    tokens_per_second = held * 1000 / mean_ms
    result = LoadResult("chat", 8, 16, 0, 300.0, 300.0, 60.0, median_ms, 1000 / median_ms, tokens_per_second,
                        1.0, 3000, 3000, 400, 400, itl_mean_ms=mean_ms)
    assert littles_law_batch(result, 1) == pytest.approx(held)
    assert littles_law_batch(dataclasses.replace(result, itl_mean_ms=math.nan), 1) == pytest.approx(held * median_ms / mean_ms)
