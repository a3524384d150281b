"""`pdctl diff`: what a change does to the fleet, the spec against another state of it."""

from __future__ import annotations

import argparse
import sys

from infra.cli.common import EXIT_FAILED, emit, err_console, spec_from_args, spec_path, with_spec
from infra.inputs import InputError


def register(sub) -> None:
    p = with_spec(sub.add_parser("diff", help="what a change does to the fleet: restarts, node replacement, "
                                              "traffic, flags, policy"))
    p.add_argument("--against", default="merge-base",
                   help="a git ref, or a spec file, to compare with (default: the merge base with main)")
    p.add_argument("--output", "-o", choices=["text", "markdown", "json"], default="text")
    p.add_argument("--fail-on", help="exit 1 if any of these impact classes occur, e.g. restart,node-replacement")
    p.set_defaults(func=cmd_diff)


def cmd_diff(args: argparse.Namespace) -> int:
    """What a change does to the fleet: the spec against another state of it, both rendered offline."""
    from infra.review.compare import diff_specs, spec_at
    from infra.review.diff import IMPACT_CLASSES
    from infra.review.report import as_data, markdown, text

    fail_on = [c.strip() for c in (args.fail_on or "").split(",") if c.strip()]
    unknown = [c for c in fail_on if c not in IMPACT_CLASSES]
    if unknown:
        raise InputError(f"--fail-on {args.fail_on}: {', '.join(unknown)} is not an impact class. Fix: some of "
                         f"{', '.join(IMPACT_CLASSES)}")
    after = spec_from_args(args)
    before, against = spec_at(args.against, args.stack, spec_path(args))
    report = diff_specs(before, after)
    # Markdown is one more way to show it to a person; json goes through the one emitter.
    emit(args, "diff", {"against": against, **as_data(report)},
         lambda: sys.stdout.write(markdown(report, f"`{against}`") if args.output == "markdown"
                                  else text(report, against)))
    hit = [c for c in fail_on if c in report.classes()]
    if hit:
        err_console.print(f"[red]--fail-on: {', '.join(hit)} in this change[/red]", highlight=False)
        return EXIT_FAILED
    return 0
