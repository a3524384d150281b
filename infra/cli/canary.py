"""`pdctl canary`: judge a revision's gates once, from Prometheus (what each rollout stage runs)."""

from __future__ import annotations

import argparse

from infra.cli.common import EXIT_FAILED, emit, print_table, promql_range, spec_from_args, with_spec
from infra.spec import StackSpec


def with_gates(p: argparse.ArgumentParser, required: bool = True) -> argparse.ArgumentParser:
    """The options of a command that judges the canary gates from Prometheus."""
    p.add_argument("--prometheus", required=required, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--window", default="5m", type=promql_range,
                   help="PromQL range each gate looks back over (default 5m)")
    return p


def register(sub) -> None:
    p = with_gates(with_spec(sub.add_parser("canary", help="judge a revision's gates once, from Prometheus"),
                             output=True))
    p.add_argument("--revision", type=int, required=True)
    p.add_argument("--baseline", type=int, help="the serving revision to compare with")
    p.set_defaults(func=cmd_canary)


def observer(spec: StackSpec, args: argparse.Namespace):
    from infra.prometheus import PrometheusAPI
    from infra.rollout.canary import observe

    api = PrometheusAPI(args.prometheus)
    return lambda rev: observe(api, spec, rev, args.window)


def cmd_canary(args: argparse.Namespace) -> int:
    from infra.rollout.canary import judge

    spec = spec_from_args(args)
    observe = observer(spec, args)
    verdict = judge(observe(args.revision), observe(args.baseline) if args.baseline else None, spec.slo)
    emit(args, "canary", {"revision": args.revision, "baseline": args.baseline, "passed": verdict.passed,
                          "gates": verdict.gates},
         lambda: print_table(f"canary r{args.revision}" + (f" vs r{args.baseline}" if args.baseline else ""),
                             ("gate", "result", "detail"),
                             [(g.name, "[green]pass[/green]" if g.passed else "[red]FAIL[/red]", g.detail)
                              for g in verdict.gates]))
    return 0 if verdict.passed else EXIT_FAILED
