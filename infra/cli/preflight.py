"""`pdctl preflight`: check every GPU host over SSH (rollout --inventory runs the same first)."""

from __future__ import annotations

import argparse

from infra.cli.common import EXIT_FAILED, console, err_console, spec_from_args, with_spec
from infra.spec import StackSpec


def register(sub) -> None:
    p = with_spec(sub.add_parser("preflight", help="check every GPU host over SSH"))
    p.add_argument("--inventory", required=True, help="inventory YAML (see stacks/inventory/)")
    p.set_defaults(func=cmd_preflight)


def preflight(spec: StackSpec, inventory_path: str) -> bool:
    from infra.rollout.preflight import Expectations, load_inventory, report_table, run_preflight

    inventory = load_inventory(inventory_path)
    report = run_preflight(inventory, Expectations.of(spec, inventory))
    console.print(report_table(report))
    (console if report.ok else err_console).print(report.summary(), highlight=False)
    return report.ok


def cmd_preflight(args: argparse.Namespace) -> int:
    return 0 if preflight(spec_from_args(args), args.inventory) else EXIT_FAILED
