"""`pdctl policy`: the policy pack's rules on the offline preview."""

from __future__ import annotations

import argparse

from infra.cli.common import EXIT_FAILED, console, print_table, spec_from_args, with_spec


def register(sub) -> None:
    with_spec(sub.add_parser("policy", help="run the policy pack's rules on the offline preview")).set_defaults(func=cmd_policy)


def cmd_policy(args: argparse.Namespace) -> int:
    """The policy pack's rules on the offline preview (what `pulumi preview --policy-pack` runs)."""
    from infra.offline import run_spec
    from infra.policy.rules import evaluate_offline

    spec = spec_from_args(args)
    violations = evaluate_offline(run_spec(spec))
    mandatory = [v for v in violations if v.level == "mandatory"]
    print_table(f"policy: {spec.environment.name}", ("rule", "level", "problem"),
                [(v.rule, v.level, v.message) for v in violations])
    console.print(f"{len(mandatory)} mandatory, {len(violations) - len(mandatory)} advisory violation(s)")
    return EXIT_FAILED if mandatory else 0
