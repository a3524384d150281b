"""What every pdctl command shares: the consoles, the one emitter of json/yaml documents,
tables, the exit codes, and how a command finds its spec."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra.inputs import InputError
from infra.spec import StackSpec, stack_spec_path
from infra.spec_checks import load_spec, switch_engine

EXIT_FAILED, EXIT_REFUSED = 1, 3  # a rollout that stopped (and rolled back) / a refused command


def _console(stderr: bool) -> Console:
    # Piped into a file or `less`, rich would assume 80 columns and cut cells; wide enough
    # instead that a table's rows stay whole (a terminal keeps its own width). Everything it
    # prints goes through the one redaction (infra/redaction.py).
    from infra.redaction import RedactingStream

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=RedactingStream("stderr" if stderr else "stdout"),
                   width=None if stream.isatty() else max(int(os.environ.get("COLUMNS") or 0), 200))


console = _console(stderr=False)
err_console = _console(stderr=True)


def with_spec(p: argparse.ArgumentParser, output: bool = False) -> argparse.ArgumentParser:
    """The options every command that reads a spec takes (and --output where it emits a document)."""
    p.add_argument("spec_path", nargs="?", metavar="SPEC", help="path of a spec file (same as --spec)")
    p.add_argument("--stack", default="dev", help="stack name: reads stacks/<stack>.yaml (default dev)")
    p.add_argument("--spec", help="path of a spec file (overrides --stack)")
    if output:
        p.add_argument("--output", "-o", choices=["text", "json", "yaml"], default="text",
                       help="text for a person (default), or a json/yaml document (see README.md)")
    return p


def promql_range(text: str) -> str:
    """argparse type of an option that becomes a PromQL range (--window): refused at parsing, before
    a command reads or changes anything, rather than by Prometheus's 400 half way through."""
    from infra.prometheus import range_seconds

    try:
        range_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}. Fix: e.g. --window 5m") from None
    return text


def spec_path(args: argparse.Namespace) -> Path:
    """The spec file named by a positional path, --spec, or --stack (stacks/<stack>.yaml)."""
    if args.spec_path and args.spec and Path(args.spec_path) != Path(args.spec):
        raise InputError(f"two specs given: {args.spec_path} and --spec {args.spec}. Fix: give one")
    given = args.spec_path or args.spec
    return Path(given) if given else stack_spec_path(args.stack)


def spec_from_args(args: argparse.Namespace) -> StackSpec:
    """The spec `spec_path` names, switched to --engine where a command has one."""
    spec = load_spec(spec_path(args))
    if getattr(args, "engine", None):
        spec, notes = switch_engine(spec, args.engine)
        for note in notes:
            err_console.print(f"[yellow]--engine {args.engine}: {escape(note)}[/yellow]", highlight=False)
    return spec


def _plain(value):
    """JSON-safe: dataclasses as mappings, NaN and infinity (no data) as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def emit(args: argparse.Namespace, kind: str, data: dict, text) -> None:
    """With --output json or yaml, `data` under a `kind` and `version` (the shapes README.md
    documents) is all that goes to stdout; otherwise (text, markdown) `text()` prints it for a person."""
    fmt = getattr(args, "output", "text")
    if fmt not in ("json", "yaml"):
        text()
        return
    doc = {"kind": f"pdstack/{kind}", "version": 1, **_plain(data)}
    if fmt == "json":
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(doc, sort_keys=False))


def print_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):  # only the last (free text) column may wrap: no cut times or names
        table.add_column(col, no_wrap=i < len(columns) - 1)
    for row in rows:
        table.add_row(*row)
    console.print(table)
