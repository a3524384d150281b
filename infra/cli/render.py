"""`pdctl render`: every Kubernetes manifest of a spec, schema-checked, written to a folder.
Also the schema report that preview and validate-deployment --render-job print."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from infra.cli.common import console, emit, err_console, spec_from_args, with_spec
from infra.spec import StackSpec


def register(sub) -> None:
    p = with_spec(sub.add_parser("render", help="write every Kubernetes manifest to a folder"), output=True)
    p.add_argument("--out", default="out/manifests", help="folder to write (default out/manifests)")
    p.add_argument("--engine", choices=["sglang", "vllm"], help="render for this engine instead of the spec's")
    p.set_defaults(func=cmd_render)


def render_run(spec):
    """The offline run of a serving or a platform spec, its manifests and their schema report."""
    from infra.offline import run_spec
    from infra.render.manifests import manifests, validate_manifests

    run = run_spec(spec)
    items = manifests(run)
    version = spec.environment.kubernetes_version if isinstance(spec, StackSpec) else spec.kubernetes_version
    return run, items, validate_manifests(items, version)


def validation_data(report) -> dict:
    return {"ok": report.ok, "checked": report.checked, "custom_resources": dict(sorted(report.custom_checked.items())),
            "cel_rules_not_evaluated": sum(report.cel_rules.values()),
            "unchecked_kinds": dict(sorted(report.unchecked_kinds.items())), "errors": list(report.errors)}


def print_validation(report, args: argparse.Namespace | None = None) -> None:
    if args is not None and args.output != "text":
        for line in report.errors:  # the document carries them; a person watching stderr sees them too
            err_console.print(f"[red]schema error[/red] {escape(line)}")
        return
    custom = sum(report.custom_checked.values())
    console.print(f"schema-checked {report.checked} manifests: {report.checked - custom} against the Kubernetes "
                  f"schemas, {custom} custom resources against their CRDs (unknown fields are errors)")
    for kind, n in sorted(report.custom_checked.items()):
        console.print(f"  {escape(kind)} x{n}")
    if sum(report.cel_rules.values()):
        console.print(f"[yellow]not evaluated:[/yellow] {sum(report.cel_rules.values())} CEL rules "
                      "(x-kubernetes-validations) of those CRDs; the API server runs them at apply")
    if report.unchecked_kinds:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(report.unchecked_kinds.items()))
        console.print(f"[yellow]not schema-checked (no schema vendored):[/yellow] {escape(kinds)}")
    for line in report.errors:
        err_console.print(f"[red]schema error[/red] {escape(line)}")


def cmd_render(args: argparse.Namespace) -> int:
    from infra.render.manifests import write_manifests

    spec = spec_from_args(args)
    _, items, report = render_run(spec)
    out = Path(args.out)
    written = write_manifests(items, out) if report.ok else []
    emit(args, "render", {"environment": spec.environment.name, "out": str(out),
                          "files": sorted(str(p.relative_to(out)) for p in written),
                          "validation": validation_data(report)},
         lambda: (print_validation(report), console.print(f"wrote {len(written)} manifests to {out}/") if written
                  else err_console.print("nothing written: fix the schema errors above")))
    if args.output != "text":
        print_validation(report, args)
    return 0 if report.ok else 1
