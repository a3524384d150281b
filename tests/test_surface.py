"""The surface planner (infra/planning/surface.py, pd_ratio.plan) judged on the stated fleet
model (infra/planning/fleet_model.py): what it plans must meet the SLO there, not in its own
estimate."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from infra.inputs import InputError, load_model
from infra.planning.fleet_model import FleetModel, measure_surface, serve, workload_for, fewest
from infra.planning.pd_ratio import SLO, PlanError, Workload, decode_batch_cap, plan
from infra.planning.surface import Lengths, Notes, Surface, erlang_c, itl_ms, prefill_ms

FLEET = FleetModel()
SURFACE = measure_surface(FLEET)
SLO_BENCH = SLO(ttft_p99_ms=2500, tpot_p99_ms=50, tokens_per_second_per_user=20)


def counts(rate, inputs, outputs, hit_rate=0.0, surface=SURFACE, slo=SLO_BENCH):
    p = plan(workload_for(rate, inputs, outputs, hit_rate, surface=surface), slo, 8, 16)
    return p.prefill_instances, p.decode_instances


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(0.5, 150), input_mean=st.floats(500, 8000), output_mean=st.floats(100, 2000),
       spread=st.floats(1.0, 2.5), hit_rate=st.sampled_from([0.0, 0.3, 0.6]))
@example(rate=128.0, input_mean=6768.0, output_mean=100.0, spread=2.0, hit_rate=0.0)  # 61 prefill for 59
def test_what_the_surface_planner_asks_for_meets_the_slo_on_the_fleet(rate, input_mean, output_mean, spread, hit_rate):
    inputs, outputs = Lengths(input_mean, input_mean * spread), Lengths(output_mean, output_mean * spread)
    p, d = counts(rate, inputs, outputs, hit_rate)
    assert serve(FLEET, rate, inputs, outputs, hit_rate, p, d).meets(2500, 50)
    best = fewest(FLEET, rate, inputs, outputs, hit_rate, 2500, 50)
    # Interpolating a convex cost errs up, by a share of the cost, not a number of instances:
    # the model's prefill cost is a + b*L + c*L^2 (none negative), and over a sweep step from L0
    # to 2*L0 its chord lies above it by at most c*L0^2/4, a ninth of the cost there (at least
    # 2.25*c*L0^2); with prefix hits the cached prefix's cost is bounded from below by the
    # neighbouring chords: 12%. So a ninth (12%) more prefill instances, rounded up, and one more
    # for the count's own rounding; one decode instance. The grid's GPU ratios: the bench's.
    assert best[1] <= d <= best[1] + 1
    assert best[0] <= p <= math.ceil(best[0] * (1.12 if hit_rate else 10 / 9)) + 1


def test_lengths_are_the_lognormal_of_their_mean_and_p99():
    d = Lengths(3000, 7000)
    assert math.exp(2.3263 * d.sigma - d.sigma ** 2 / 2) == pytest.approx(7000 / 3000, rel=1e-3)
    q = d.quantiles(4096)
    assert sum(q) / len(q) == pytest.approx(3000, rel=0.01)
    assert Lengths(100, 100).sigma == 0.0


def test_prefill_is_interpolated_between_measured_lengths_and_exact_at_them():
    notes = Notes()
    assert prefill_ms(SURFACE, "ttft", 4096, 0, notes) == pytest.approx(FLEET.prefill_time_ms(4096))
    between = prefill_ms(SURFACE, "ttft", 6000, 0, notes)
    # The chord of a convex cost lies above it: interpolation errs towards more instances.
    assert FLEET.prefill_time_ms(6000) <= between <= FLEET.prefill_time_ms(8192)
    assert notes.lines == []


@settings(deadline=None)  # the first example imports scipy.optimize
@given(length=st.floats(32769, 200000))
def test_prompts_beyond_the_sweep_are_extrapolated_along_the_fitted_cost_and_named(length):
    """Issue #41: past the longest measured prompt the cost grew as (L / L_max)^2, 2-2.5x the
    prefill needed where it is mostly linear. Along a + bL + cL^2 fitted to the measured lengths
    it is the cost itself where the cost is one (the fleet model's), and a mostly linear cost
    (sweeps of 3-4 lengths, as validate-deployment writes) is not squared; named in the notes."""
    notes = Notes()
    assert prefill_ms(SURFACE, "ttft", length, 0, notes) == pytest.approx(FLEET.prefill_time_ms(length), rel=1e-6)
    assert "beyond the longest measured (32768)" in notes.lines[0] and "fitted" in notes.lines[0]
    linear = FleetModel(prefill_ms_per_token2=1e-7)
    short = measure_surface(linear).model_copy(update={"prefill": [
        p for p in measure_surface(linear).prefill if p.input_tokens in (150, 256, 1024, 4096)]})
    assert prefill_ms(short, "service", length, 0, Notes()) <= 1.05 * linear.prefill_time_ms(length)


@given(context=st.floats(32769, 300000), batch=st.floats(1, 512))
def test_contexts_beyond_the_grid_are_extrapolated_above_the_truth_and_named(context, batch):
    notes = Notes()
    assert itl_ms(SURFACE, batch, context, notes) >= FLEET.itl_ms(batch, context) - 1e-9
    assert "ITL extrapolated as C / C_max" in notes.lines[0]


def test_prefix_cache_hits_discount_the_cached_prefix_work():
    # Half of an 8192-token prompt cached: the work of tokens 4096..8192, which the fleet states as
    # a + b (1 - h) L + c (1 - h^2) L^2; the surface's estimate errs up by at most its shortest
    # prompt's work beyond an empty one's (32 tokens: 1.6 ms).
    truth = FLEET.prefill_time_ms(8192, 0.5)
    assert truth <= prefill_ms(SURFACE, "ttft", 8192, 0.5, Notes()) <= truth + 1.7
    inputs, outputs = Lengths(6000, 14000), Lengths(300, 700)
    cold, warm = counts(60, inputs, outputs), counts(60, inputs, outputs, hit_rate=0.6)
    assert warm[0] < cold[0] and warm[1] == cold[1]


@given(length=st.floats(1, 32768), hit_rate=st.floats(0, 0.95))
def test_the_prefix_discount_never_promises_less_work_than_the_fleet_does(length, hit_rate):
    for which in ("ttft", "service"):
        assert prefill_ms(SURFACE, which, length, hit_rate, Notes()) >= FLEET.prefill_time_ms(length, hit_rate) - 1e-9


def test_decode_batch_is_capped_by_the_kv_cache_at_the_context_and_by_max_running_requests():
    notes = Notes()
    assert decode_batch_cap(SURFACE, 10000, notes) == pytest.approx(300)  # 3M tokens / 10k per sequence
    assert "by the KV cache" in notes.lines[0]
    assert decode_batch_cap(SURFACE, 1000, Notes()) == 512  # the engine's cap (and the largest measured batch)
    small_kv = SURFACE.model_copy(update={"kv_cache_tokens": 1.0e6})
    inputs, outputs = Lengths(8000, 18000), Lengths(2000, 4600)
    assert counts(50, inputs, outputs, surface=small_kv)[1] > counts(50, inputs, outputs)[1]
    # The cap is what the fleet enforces: the plan keeps the p99 batch under it.
    p = plan(workload_for(50, inputs, outputs, surface=small_kv), SLO_BENCH, 8, 16)
    assert p.decode_batch_per_instance + 2.3263 * math.sqrt(p.decode_batch_per_instance) <= p.decode_batch_cap


def test_planning_for_the_p99_of_the_lengths_not_their_mean():
    # The same means, a longer tail: more prefill for TTFT p99, more decode for the longer contexts.
    narrow = counts(80, Lengths(4000, 4400), Lengths(1000, 1100))
    wide = counts(80, Lengths(4000, 12000), Lengths(1000, 3000))
    assert wide[0] > narrow[0] and wide[1] >= narrow[1]


def test_an_slo_the_surface_cannot_meet_is_a_clear_error():
    with pytest.raises(PlanError, match="a p99 prompt of 40000 tokens alone takes"):
        counts(10, Lengths(8000, 40000), Lengths(500, 1000))


def test_a_workload_gives_one_capacity_and_a_bad_surface_names_its_field(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("arrival_rate_rps: 1\ninput_tokens: {mean: 1, p99: 2}\noutput_tokens: {mean: 1, p99: 2}\n"
                    "capacity: {prefill_tokens_per_second: 1, decode: [{tpot_ms: 1, concurrency: 1}]}\n"
                    "surface:\n  prefill: [{input_tokens: 1, ttft_ms: 1, tokens_per_second: 1}]\n"
                    "  decode: {contexts: [1], batches: [1], itl_ms: [[1]]}\n")
    with pytest.raises(InputError, match="give exactly one of capacity"):
        load_model(both, Workload, "workload")
    ragged = tmp_path / "ragged.yaml"
    ragged.write_text("arrival_rate_rps: 1\ninput_tokens: {mean: 1, p99: 2}\noutput_tokens: {mean: 1, p99: 2}\n"
                      "surface:\n  prefill: [{input_tokens: 1, ttft_ms: 1, tokens_per_second: 1}]\n"
                      "  decode: {contexts: [1, 2], batches: [1], itl_ms: [[1]]}\n")
    with pytest.raises(InputError, match=r"(?s)ragged.yaml.*surface.decode: itl_ms must be 2 rows"):
        load_model(ragged, Workload, "workload")


def test_a_surface_round_trips_through_yaml(tmp_path):
    import yaml

    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(workload_for(10, Lengths(2000, 4000), Lengths(300, 600),
                                                surface=SURFACE).model_dump(exclude_none=True)))
    assert load_model(path, Workload, "workload").surface == SURFACE
    assert isinstance(SURFACE, Surface)


def erlang_c_by_the_sum(servers: int, offered: Fraction) -> float:
    """Erlang C as the textbook writes it (Erlang's C formula, Kleinrock, Queueing Systems I, 1975,
    section 3.5, M/M/m), summed term by term in exact rationals:
    (a^c / c!) (c / (c - a)) / (sum_{k<c} a^k / k! + that)."""
    term, total = Fraction(1), Fraction(0)
    for k in range(servers):
        total += term
        term = term * offered / (k + 1)
    tail = term * servers / (servers - offered)
    return float(tail / (total + tail))


@pytest.mark.parametrize("servers", [1, 2, 3, 7, 10, 64, 99, 100, 101, 400])
def test_erlang_c_agrees_with_the_textbook_sum(servers):
    for rho in ("1/1000000", "1/100", "3/10", "1/2", "4/5", "19/20", "99/100", "199/200", "999/1000",
                "999999/1000000"):
        offered = servers * Fraction(rho)
        exact = erlang_c_by_the_sum(servers, offered)
        assert erlang_c(servers, float(offered)) == pytest.approx(exact, rel=1e-11, abs=1e-300), (servers, rho)
    assert erlang_c(servers, servers) == 1.0 and erlang_c(servers, 0.0) == 0.0


def test_erlang_c_closed_forms_for_one_and_two_servers():
    """M/M/1 waits with probability rho (Kleinrock, Queueing Systems I, section 3.2); M/M/2 with
    2 rho^2 / (1 + rho) (Erlang's C formula at m = 2 by hand: p0 = (1 - rho) / (1 + rho))."""
    for rho in (0.1, 0.5, 0.9, 0.999):
        assert erlang_c(1, rho) == pytest.approx(rho, rel=1e-12)
        assert erlang_c(2, 2 * rho) == pytest.approx(2 * rho * rho / (1 + rho), rel=1e-12)


@pytest.mark.parametrize("servers", [10 ** 6, 10 ** 9, 10 ** 12, 10 ** 15])
def test_erlang_c_at_a_huge_count_reaches_the_halfin_whitt_limit(servers):
    """Issue #36, 4(b): Erlang C summed over the count took hours at 1e9 servers (the term-by-term
    Erlang B recursion). At (1 - rho) sqrt(c) = beta it tends, as c grows, to
    1 / (1 + beta Phi(beta) / phi(beta)) (Halfin and Whitt, Heavy-traffic limits for queues with
    many exponential servers, Operations Research 29(3), 1981), an answer known without summing
    anything; the gap shrinks as 1 / sqrt(c)."""
    from statistics import NormalDist

    unit = NormalDist()
    for beta in (0.25, 1.0, 2.0):
        limit = 1 / (1 + beta * unit.cdf(beta) / unit.pdf(beta))
        got = erlang_c(servers, servers - beta * math.sqrt(servers))
        assert got == pytest.approx(limit, abs=2 / math.sqrt(servers)), (servers, beta)
    # Beyond what a float's rho can tell from 1 at 1e300 servers, every load below c waits with
    # probability 0 (beta is at least 1e134), and it says so at once.
    assert erlang_c(10 ** 300, 0.999999 * 1e300) == 0.0


def test_an_old_capacity_file_whose_curve_plateaus_at_the_engines_cap_is_planned(tmp_path, capsys):
    """Issue #41 item 3: a capacity curve measured past the engine's cap repeats its concurrency
    (the engine held 128 however many were asked); `pdctl plan` ended in `unexpected error:
    ValidationError ... batches must be positive and rising`, an internal field. The format is
    read (README: "still read"): the repeat is one point at the slowest TPOT, and the plan says so."""
    from infra.cli import main

    old = tmp_path / "old.yaml"
    old.write_text("arrival_rate_rps: 10\ninput_tokens: {mean: 2000, p99: 4000}\noutput_tokens: {mean: 300, p99: 600}\n"
                   "capacity:\n  prefill_tokens_per_second: 20000\n  decode:\n"
                   "    - {tpot_ms: 20, concurrency: 8}\n    - {tpot_ms: 30, concurrency: 64}\n"
                   "    - {tpot_ms: 40, concurrency: 128}\n    - {tpot_ms: 55, concurrency: 128}\n")
    capsys.readouterr()
    assert main(["plan", "--stack", "prod", "--workload", str(old)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "capacity.decode: a concurrency measured more than once" in out and "ValidationError" not in out
    surface = load_model(old, Workload, "workload").measured_surface()
    assert surface.decode.batches == [8, 64, 128] and surface.decode.itl_ms == [[20, 30, 55]]


def test_a_context_shorter_than_the_shortest_row_is_read_along_the_two_shortest_rows():
    """Issue #41: a profile's rows are at the scenario's context and twice its prompt
    (validate-deployment's default); a load with shorter prompts was read at the shortest row, so
    one profile for every load over-sized its decode. Along the two shortest rows ITL is the
    fleet's own where it is affine in the context (the fleet model's), said in the notes."""
    rows = SURFACE.decode.model_copy(update={"contexts": [4096, 8192], "itl_ms": SURFACE.decode.itl_ms[2:4]})
    surface = SURFACE.model_copy(update={"decode": rows})
    notes = Notes()
    assert itl_ms(surface, 256, 1500, notes) == pytest.approx(FLEET.itl_ms(256, 1500))
    assert "below the shortest measured (4096)" in notes.lines[0]
    assert itl_ms(surface, 1, 10, Notes()) >= surface.decode.itl_ms[0][0]  # never below the least measured
