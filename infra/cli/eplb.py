"""`pdctl eplb`: place redundant experts from measured loads, for the engine to load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from infra.cli.common import console, emit, spec_from_args, with_spec
from infra.inputs import InputError, write_output


def register(sub) -> None:
    p = with_spec(sub.add_parser("eplb", help="place redundant experts from measured loads"), output=True)
    p.add_argument("--role", default="decode", help="pool to place for (default decode)")
    p.add_argument("--loads", required=True, help="load file: JSON logical_count or CSV layer,expert,count")
    p.add_argument("--policy", choices=["auto", "hierarchical", "global"], default="auto")
    p.add_argument("--out", required=True, help="placement JSON for the engine; a .report.json goes beside it")
    p.set_defaults(func=cmd_eplb)


def cmd_eplb(args: argparse.Namespace) -> int:
    from infra.planning.eplb import PlacementError, load_loads, place_experts

    spec = spec_from_args(args)
    pools = spec.deployment.pools()
    if args.role not in pools:
        raise InputError(f"--role {args.role}: not a pool of this stack. Fix: one of {', '.join(pools)}")
    phase = pools[args.role]
    gpn = spec.hardware.gpus_per_node
    model = spec.model
    try:
        loads = load_loads(args.loads, model.num_routed_experts)
        if loads.shape[1] != model.num_routed_experts:
            raise PlacementError(f"{args.loads}: {loads.shape[1]} experts, the model has {model.num_routed_experts}")
        if loads.shape[0] == model.num_layers and model.num_dense_layers():
            loads = loads[model.num_dense_layers():]  # a recorder dump: dense rows carry no load
        if loads.shape[0] != model.num_moe_layers:
            raise PlacementError(f"{args.loads}: {loads.shape[0]} layers; the model has {model.num_moe_layers} "
                                 f"MoE layers (of {model.num_layers}). Fix: a load file for this model")
        result = place_experts(loads, phase.redundant_experts, phase.nodes_per_instance(gpn),
                               phase.gpus_per_instance(), model.num_expert_groups, policy=args.policy)
    except PlacementError as exc:
        raise InputError(f"eplb: {exc}") from None
    out = Path(args.out)
    report_path = out.with_suffix(".report.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(out, json.dumps(result.engine_file(model.num_layers)))
    report = result.report()
    write_output(report_path, json.dumps(report, indent=1))

    def text() -> None:
        table = Table(title=f"expert placement, {args.role}: {result.policy} policy, {report['slots']} slots on "
                            f"{report['gpus']} GPUs")
        for col in ("", "mean imbalance", "worst imbalance"):
            table.add_column(col)
        for label, key in (("before (engine default)", "imbalance_before"), ("after", "imbalance_after")):
            table.add_row(label, f"{report[key]['mean']:.3f}", f"{report[key]['worst']:.3f}")
        console.print(table)
        console.print(f"wrote {out} (set deployment.{args.role}.expert_placement to it) and {report_path}")

    emit(args, "eplb", {"role": args.role, "placement_file": str(out), "report_file": str(report_path), **report},
         text)
    return 0
