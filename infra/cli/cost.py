"""`pdctl cost`: GPU-hours, idle share and idle instances from Prometheus; stale caches over SSH."""

from __future__ import annotations

import argparse
import dataclasses
import math

from infra.cli.common import console, emit, err_console, print_table, promql_range, spec_from_args, with_spec
from infra.inputs import InputError


def register(sub) -> None:
    p = with_spec(sub.add_parser("cost", help="GPU-hours, idle share and stale caches"), output=True)
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--window", default="24h", type=promql_range, help="how far back (PromQL duration, default 24h)")
    p.add_argument("--at", help="end of the window: unix seconds or ISO time (default now)")
    p.add_argument("--idle-below", type=float, default=5.0, help="GPU utilisation %% that counts as idle")
    p.add_argument("--idle-instance-share", type=float, default=0.5, help="flag instances idle more than this share")
    p.add_argument("--inventory", help="also list stale node cache folders on these hosts (SSH)")
    p.set_defaults(func=cmd_cost)


def time_arg(text: str | None) -> float | None:
    """Unix seconds or an ISO 8601 time (UTC if no zone); None means now."""
    if not text:
        return None
    from datetime import datetime, timezone

    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise InputError(f"--at {text}: neither unix seconds nor an ISO 8601 time. Fix: e.g. "
                             "--at 2026-12-01T18:00:00Z or --at 1764612000") from None
        return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(seconds) or seconds < 0:
        raise InputError(f"--at {text}: not a time. Fix: unix seconds since 1970, or an ISO 8601 time")
    return seconds


def cmd_cost(args: argparse.Namespace) -> int:
    """GPU-hours per role, idle share and idle instances from Prometheus; stale caches over SSH."""
    import time

    from infra.prometheus import PrometheusAPI
    from infra.reports.cost import cost_report, scan_caches

    spec = spec_from_args(args)
    at = time_arg(args.at)
    for name in ("idle_below", "idle_instance_share"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 <= value <= (100 if name == "idle_below" else 1)):
            raise InputError(f"--{name.replace('_', '-')} {value:g}: out of range. Fix: "
                             + ("a GPU utilisation percentage, 0 to 100" if name == "idle_below" else "a share, 0 to 1"))
    from infra.rollout.preflight import load_inventory

    inventory = load_inventory(args.inventory) if args.inventory else None  # a bad file is said before any query
    report = cost_report(PrometheusAPI(args.prometheus), spec.environment.namespace, args.window, at,
                         args.idle_below, args.idle_instance_share)
    total = sum(r.gpu_hours for r in report.roles)
    idle = sum(r.idle_gpu_hours for r in report.roles)
    stale, unreachable = scan_caches(inventory, spec, at or time.time()) if inventory else ([], [])

    def text() -> None:
        print_table(f"GPU cost of {spec.environment.name}, last {args.window}",
                    ("role", "GPU-hours", "idle GPU-hours", "idle share", "instances avg", "instances max"),
                    [(r.role, f"{r.gpu_hours:.1f}", f"{r.idle_gpu_hours:.1f}", f"{r.idle_share:.1%}",
                      f"{r.avg_instances:.2f}", f"{r.max_instances:.0f}") for r in report.roles])
        console.print(f"total {total:.1f} GPU-hours, {idle:.1f} idle ({idle / total:.1%})" if total else "no GPU samples")
        print_table(f"instances idle (GPU util < {args.idle_below:g}%) more than {args.idle_instance_share:.0%} of "
                    "the time", ("namespace", "role", "instance", "idle share", "hours seen"),
                    [(i.namespace, i.role, i.group, f"{i.idle_share:.1%}", f"{i.hours:.1f}")
                     for i in report.idle_instances])
        if args.inventory:
            print_table("node cache entries older than their retention",
                        ("host", "what", "path", "age h", "retention h"),
                        [(e.host, e.what, e.path, f"{e.age_hours:.0f}", f"{e.retention_hours:g}") for e in stale])

    emit(args, "cost", {"environment": spec.environment.name, "window": args.window,
                        "roles": [dict(dataclasses.asdict(r), idle_share=r.idle_share) for r in report.roles],
                        "total_gpu_hours": total, "idle_gpu_hours": idle, "idle_instances": report.idle_instances,
                        "stale_cache_entries": stale, "not_scanned": unreachable}, text)
    for line in unreachable:
        err_console.print(f"[yellow]not scanned: {line}[/yellow]")
    return 0
