"""PD ratio planner on hand-worked examples: the single-figure baseline (`plan_single_figure`) by hand,
and `plan` on the same files (a degenerate surface). The surface planner has tests/test_surface.py."""

from __future__ import annotations

import pytest

from infra.planning.pd_ratio import SLO, PlanError, Workload, plan, plan_single_figure, slots_at


def workload(**over) -> Workload:
    data = {
        "arrival_rate_rps": 40,
        "input_tokens": {"mean": 3000, "p99": 12000},
        "output_tokens": {"mean": 400, "p99": 2000},
        "headroom": 0.2,
        "capacity": {"prefill_tokens_per_second": 60000,
                     "decode": [{"tpot_ms": 20, "concurrency": 300}, {"tpot_ms": 40, "concurrency": 1200}]},
    }
    data.update(over)
    return Workload.model_validate(data)


SLO_PROD = SLO(ttft_p99_ms=1500, tpot_p99_ms=40, tokens_per_second_per_user=20)


def test_hand_worked_prod_example():
    # TPOT target = min(40, 1000/20 = 50) = 40 ms -> 1200 slots per decode instance.
    # Decode demand = 40 rps x 400 tokens x 0.040 s = 640 slots; 640 / (1200 x 0.8) -> 1 instance.
    # Prefill demand = 40 x 3000 = 120k tokens/s; p99 prompt alone 12000/60000 = 200 ms,
    # so TTFT allows utilisation 1 - 200/1500 = 0.867 > 0.8 headroom cap; 120k/(60k x 0.8) = 2.5 -> 3.
    p = plan_single_figure(workload(), SLO_PROD, prefill_gpus=8, decode_gpus=64, current=(8, 1))
    assert (p.prefill_instances, p.decode_instances) == (3, 1)
    assert p.pd_ratio == "3:8"  # 24 GPUs : 64 GPUs
    assert p.decode_utilisation == pytest.approx(640 / 1200)
    assert p.prefill_headroom == pytest.approx(1 - 120000 / 180000)


def test_bottleneck_decode_kv_piles_up():
    # Today 8 prefill instances are 25% busy, the one decode instance 53%: decode is the bottleneck.
    p = plan_single_figure(workload(), SLO_PROD, 8, 64, current=(8, 1))
    assert p.current_bottleneck == "decode: KV cache piles up"
    assert p.current_prefill_utilisation == pytest.approx(0.25)


def test_bottleneck_decode_waits_for_prefill():
    # Long prompts, short answers: 40 x 20000 = 800k tokens/s of prefill on 2 instances (667%).
    p = plan_single_figure(workload(input_tokens={"mean": 20000, "p99": 60000}, output_tokens={"mean": 50, "p99": 100}),
             SLO(ttft_p99_ms=5000, tpot_p99_ms=40, tokens_per_second_per_user=20), 8, 64, current=(2, 1))
    assert p.current_bottleneck == "prefill: decode waits for prefill"
    # 800k / (60k x min(0.8, 1 - 1000/5000 = 0.8)) = 16.67 -> 17 instances
    assert p.prefill_instances == 17


def test_ttft_forces_more_prefill_than_headroom_alone():
    # p99 prompt alone 600 ms against a 1000 ms SLO caps utilisation at 0.4:
    # 120k / (60k x 0.4) = 5 instances (not 3).
    p = plan_single_figure(workload(input_tokens={"mean": 3000, "p99": 36000}), SLO(1000, 40, 20), 8, 64)
    assert p.prefill_instances == 5


def test_tpot_interpolates_between_measured_points():
    assert slots_at(workload().capacity, 30) == pytest.approx(750)


@pytest.mark.parametrize("planner", [plan, plan_single_figure])
def test_unmeetable_slos_are_clear_errors(planner):
    with pytest.raises(PlanError, match="no decode instance count can meet TPOT 10 ms"):
        planner(workload(), SLO(1500, 10, 20), 8, 64)
    with pytest.raises(PlanError, match="no prefill instance count can meet TTFT p99 150 ms"):
        planner(workload(), SLO(150, 40, 20), 8, 64)


def test_one_capacity_figure_is_a_degenerate_surface_and_the_plan_says_so():
    # The surface planner on the file format before surfaces: the same counts as the single
    # figure here (3 prefill, 1 decode), and a note that the figure was applied to every length.
    p = plan(workload(), SLO_PROD, 8, 64, current=(8, 1))
    assert (p.prefill_instances, p.decode_instances) == (3, 1)
    assert p.ttft_p99_ms <= 1500 and p.itl_p99_ms <= 40
    assert any("degenerate surface" in n for n in p.notes)
    assert p.current_bottleneck == "decode: KV cache piles up"


def test_pdctl_plan_writes_a_valid_spec(tmp_path):
    from infra.cli import main
    from infra.spec import REPO_ROOT
    from infra.spec_checks import load_spec

    out = tmp_path / "prod.yaml"
    assert main(["plan", "--stack", "prod", "--workload", str(REPO_ROOT / "stacks/workloads/prod-chat.yaml"), "--write", str(out)]) == 0
    spec = load_spec(out)
    assert (spec.deployment.prefill.instances, spec.deployment.decode.instances) == (3, 1)
    assert spec.deployment.pd_ratio == "3:8"
