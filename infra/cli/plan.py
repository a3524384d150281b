"""`pdctl plan`: prefill/decode counts for a workload and the SLOs (and --write them into a spec)."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

from infra.cli.common import console, emit, spec_from_args, spec_path, with_spec
from infra.inputs import InputError, load_model
from infra.spec import StackSpec


def register(sub) -> None:
    p = with_spec(sub.add_parser("plan", help="recommend prefill/decode counts from a workload"), output=True)
    p.add_argument("--workload", required=True, help="workload and measured capacity (see stacks/workloads/)")
    p.add_argument("--write", help="write the spec with the recommended counts to this path")
    p.set_defaults(func=cmd_plan)


def planned(spec: StackSpec, workload_path: str):
    """The workload file and the planner's answer for this spec's pools (today's counts as `current`)."""
    from infra.planning.pd_ratio import SLO, PlanError, Workload, plan

    dep = spec.deployment
    if dep.mode != "disaggregated":
        raise InputError("deployment.mode: colocated has no prefill/decode split to plan. Fix: plan a disaggregated spec")
    workload = load_model(workload_path, Workload, "workload")
    try:
        return workload, plan(workload, SLO(spec.slo.ttft_p99_ms, spec.slo.tpot_p99_ms,
                                            spec.slo.tokens_per_second_per_user),
                              dep.prefill.gpus_per_instance(), dep.decode.gpus_per_instance(),
                              current=(dep.prefill.instances, dep.decode.instances))
    except PlanError as exc:
        raise InputError(f"plan: {workload_path}: {exc}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    dep = spec.deployment
    workload, result = planned(spec, args.workload)
    written, notes = None, []
    if args.write:
        from infra.spec_edit import write_counts

        notes = write_counts(spec_path(args), args.write, result)
        written = args.write
    phases = {role: {"now": getattr(dep, role).instances, "recommended": getattr(result, f"{role}_instances"),
                     "gpus": getattr(result, f"{role}_gpus"), "utilisation": getattr(result, f"{role}_utilisation"),
                     "headroom": getattr(result, f"{role}_headroom")} for role in ("prefill", "decode")}

    def text() -> None:
        table = Table(title=f"PD plan for {spec.environment.name} (TPOT target {result.tpot_target_ms:g} ms)")
        for col in ("phase", "now", "recommended", "GPUs", "utilisation", "headroom"):
            table.add_column(col)
        for role, p in phases.items():
            table.add_row(role, str(p["now"]), str(p["recommended"]), str(p["gpus"]), f"{p['utilisation']:.0%}",
                          f"{p['headroom']:.0%}")
        console.print(table)
        console.print(f"card ratio {result.pd_ratio} (spec says {dep.pd_ratio})")
        console.print(f"with today's counts: prefill {result.current_prefill_utilisation:.0%}, decode "
                      f"{result.current_decode_utilisation:.0%} busy; bottleneck is {result.current_bottleneck}")
        m = workload.measured
        console.print(f"capacity measured by {m.tool} ({m.scenario}) at {m.where} on {m.when}" if m else
                      "capacity typed in by hand: measure it with `pdctl validate-deployment --profile-out`")
        for note in notes:
            console.print(f"[yellow]{escape(note)}[/yellow]")
        if written:
            console.print(f"wrote {written}")

    emit(args, "plan", {"environment": spec.environment.name, "tpot_target_ms": result.tpot_target_ms,
                        "phases": phases, "pd_ratio": {"recommended": result.pd_ratio, "spec": dep.pd_ratio},
                        "current": {"prefill_utilisation": result.current_prefill_utilisation,
                                    "decode_utilisation": result.current_decode_utilisation,
                                    "bottleneck": result.current_bottleneck},
                        "written": written, "notes": notes}, text)
    return 0
