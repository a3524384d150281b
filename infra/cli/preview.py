"""`pdctl preview --offline`: every resource the program would create, by layer, under Pulumi's mocks."""

from __future__ import annotations

import argparse
from collections import Counter

from rich.table import Table
from rich.tree import Tree

from rich.markup import escape

from infra.cli.common import console, emit, spec_from_args, spec_path, with_spec
from infra.cli.render import print_validation, render_run, validation_data
from infra.images import placeholder_lines, placeholders
from infra.inputs import InputError

# Top of the system first, as the design lists the layers.
LAYER_ORDER = [
    "access",
    "balancers",
    "engines",
    "autoscaling",
    "kvcache",
    "identity",
    "nodepools",
    "storage",
    "monitoring",
    "tracing",
    "foundation",
    # the platform stack's
    "cloud",
    "controllers",
    "gateway",
    "observability",
    "nodes",
    "stack",
]


def register(sub) -> None:
    p = with_spec(sub.add_parser("preview", help="list every resource the program would create"), output=True)
    p.add_argument("--offline", action="store_true", help="run the program under Pulumi's mocks")
    p.set_defaults(func=cmd_preview)


def cmd_preview(args: argparse.Namespace) -> int:
    if not args.offline:
        raise InputError("preview without --offline is `pulumi preview`; this tool runs only --offline. "
                         "Fix: add --offline")
    from infra.program import load_any_spec
    from infra.spec import StackSpec

    spec = load_any_spec(spec_path(args))
    spec = spec_from_args(args) if isinstance(spec, StackSpec) else spec
    name = spec.environment.name if isinstance(spec, StackSpec) else spec.name
    run, items, report = render_run(spec)
    resources = run.custom()
    by_layer: dict[str, list] = {}
    for r in resources:
        by_layer.setdefault(r.layer, []).append(r)
    layers = sorted(by_layer, key=lambda x: (LAYER_ORDER.index(x) if x in LAYER_ORDER else len(LAYER_ORDER), x))
    kinds = {layer: dict(sorted(Counter(r.type.split(":")[-1] for r in by_layer[layer]).items())) for layer in layers}

    def text() -> None:
        tree = Tree(f"[bold]pdstack-{name}[/bold] ({len(resources)} resources, offline preview "
                    "under Pulumi mocks)")
        for layer in layers:
            branch = tree.add(f"[cyan]{layer}[/cyan] ({len(by_layer[layer])})")
            for r in by_layer[layer]:
                branch.add(f"+ {r.type}  {r.name}")
        console.print(tree)
        table = Table(title="plan by layer")
        table.add_column("layer")
        table.add_column("create", justify="right")
        table.add_column("kinds")
        for layer in layers:
            table.add_row(layer, str(len(by_layer[layer])), ", ".join(f"{k} {n}" for k, n in kinds[layer].items()))
        table.add_row("[bold]total[/bold]", f"[bold]{len(resources)}[/bold]", "")
        console.print(table)
        for line in placeholder_lines(spec):
            console.print(f"[yellow]{escape(line)}[/yellow]", highlight=False, soft_wrap=True)
        print_validation(report)

    emit(args, "preview", {
        "environment": name, "total": len(resources),
        "layers": [{"layer": layer, "create": len(by_layer[layer]), "kinds": kinds[layer],
                    "resources": [{"type": r.type, "name": r.name} for r in by_layer[layer]]} for layer in layers],
        "placeholder_images": placeholders(spec), "validation": validation_data(report)}, text)
    if args.output != "text":
        print_validation(report, args)
    return 0 if report.ok else 1
