"""`pdctl`: the operator's command line. Each subcommand is a thin shell over `infra`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from infra.inputs import InputError, load_model, write_output
from infra.spec import SpecError, StackSpec, load_spec, stack_spec_path, switch_engine


def _console(stderr: bool) -> Console:
    # Piped into a file or `less`, rich would assume 80 columns and cut cells; wide enough
    # instead that a table's rows stay whole (a terminal keeps its own width).
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else max(int(os.environ.get("COLUMNS") or 0), 200))


console = _console(stderr=False)
err_console = _console(stderr=True)

# Top of the system first, as the design lists the layers.
LAYER_ORDER = [
    "access",
    "balancers",
    "engines",
    "autoscaling",
    "kvcache",
    "nodepools",
    "storage",
    "monitoring",
    "tracing",
    "foundation",
    "stack",
]


def _spec_path(args: argparse.Namespace) -> Path:
    """The spec file named by a positional path, --spec, or --stack (stacks/<stack>.yaml)."""
    if args.spec_path and args.spec and Path(args.spec_path) != Path(args.spec):
        raise InputError(f"two specs given: {args.spec_path} and --spec {args.spec}. Fix: give one")
    given = args.spec_path or args.spec
    return Path(given) if given else stack_spec_path(args.stack)


def _spec_from_args(args: argparse.Namespace) -> StackSpec:
    """The spec `_spec_path` names, switched to --engine where a command has one."""
    spec = load_spec(_spec_path(args))
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


def _emit(args: argparse.Namespace, kind: str, data: dict, text) -> None:
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


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _spec_from_args(args)
    pools = {role: {"instances": p.instances, "gpus_per_instance": p.gpus_per_instance()}
             for role, p in spec.deployment.pools().items()}
    text = ", ".join(f"{role} {p['instances']}x{p['gpus_per_instance']} GPUs" for role, p in pools.items())
    _emit(args, "validate", {"environment": spec.environment.name, "valid": True, "mode": spec.deployment.mode,
                             "pools": pools},
          lambda: console.print(f"[green]ok[/green] {spec.environment.name}: {spec.deployment.mode}, {text}"))
    return 0


def _render_run(spec: StackSpec):
    from infra.offline import run_spec
    from infra.render.manifests import manifests, validate_manifests

    run = run_spec(spec)
    items = manifests(run)
    return run, items, validate_manifests(items, spec.environment.kubernetes_version)


def _validation_data(report) -> dict:
    return {"ok": report.ok, "checked": report.checked, "custom_resources": dict(sorted(report.custom_checked.items())),
            "cel_rules_not_evaluated": sum(report.cel_rules.values()),
            "unchecked_kinds": dict(sorted(report.unchecked_kinds.items())), "errors": list(report.errors)}


def _print_validation(report, args: argparse.Namespace | None = None) -> None:
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


def cmd_preview(args: argparse.Namespace) -> int:
    if not args.offline:
        raise InputError("preview without --offline is `pulumi preview`; this tool runs only --offline. "
                         "Fix: add --offline")
    spec = _spec_from_args(args)
    run, items, report = _render_run(spec)
    resources = run.custom()
    by_layer: dict[str, list] = {}
    for r in resources:
        by_layer.setdefault(r.layer, []).append(r)
    layers = sorted(by_layer, key=lambda x: (LAYER_ORDER.index(x) if x in LAYER_ORDER else len(LAYER_ORDER), x))
    kinds = {layer: dict(sorted(Counter(r.type.split(":")[-1] for r in by_layer[layer]).items())) for layer in layers}

    def text() -> None:
        tree = Tree(f"[bold]pdstack-{spec.environment.name}[/bold] ({len(resources)} resources, offline preview "
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
        _print_validation(report)

    _emit(args, "preview", {
        "environment": spec.environment.name, "total": len(resources),
        "layers": [{"layer": layer, "create": len(by_layer[layer]), "kinds": kinds[layer],
                    "resources": [{"type": r.type, "name": r.name} for r in by_layer[layer]]} for layer in layers],
        "validation": _validation_data(report)}, text)
    if args.output != "text":
        _print_validation(report, args)
    return 0 if report.ok else 1


def cmd_render(args: argparse.Namespace) -> int:
    from infra.render.manifests import write_manifests

    spec = _spec_from_args(args)
    _, items, report = _render_run(spec)
    out = Path(args.out)
    written = write_manifests(items, out) if report.ok else []
    _emit(args, "render", {"environment": spec.environment.name, "out": str(out),
                           "files": sorted(str(p.relative_to(out)) for p in written),
                           "validation": _validation_data(report)},
          lambda: (_print_validation(report), console.print(f"wrote {len(written)} manifests to {out}/") if written
                   else err_console.print("nothing written: fix the schema errors above")))
    if args.output != "text":
        _print_validation(report, args)
    return 0 if report.ok else 1


def cmd_eplb(args: argparse.Namespace) -> int:
    from infra.planning.eplb import PlacementError, load_loads, place_experts

    spec = _spec_from_args(args)
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

    _emit(args, "eplb", {"role": args.role, "placement_file": str(out), "report_file": str(report_path), **report},
          text)
    return 0


def _planned(spec: StackSpec, workload_path: str):
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
    spec = _spec_from_args(args)
    dep = spec.deployment
    workload, result = _planned(spec, args.workload)
    written, notes = None, []
    if args.write:
        from infra.spec_edit import write_counts

        notes = write_counts(_spec_path(args), args.write, result)
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

    _emit(args, "plan", {"environment": spec.environment.name, "tpot_target_ms": result.tpot_target_ms,
                         "phases": phases, "pd_ratio": {"recommended": result.pd_ratio, "spec": dep.pd_ratio},
                         "current": {"prefill_utilisation": result.current_prefill_utilisation,
                                     "decode_utilisation": result.current_decode_utilisation,
                                     "bottleneck": result.current_bottleneck},
                         "written": written, "notes": notes}, text)
    return 0


# --- changing an environment: preflight, rollout, canary, rollback ------------------------------

EXIT_FAILED, EXIT_REFUSED = 1, 3  # a rollout that stopped (and rolled back) / a refused command


def _print_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):  # only the last (free text) column may wrap: no cut times or names
        table.add_column(col, no_wrap=i < len(columns) - 1)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _changing(args: argparse.Namespace, spec: StackSpec, action) -> int:
    """Run `action(store, cluster)` on the simulated cluster file, saving it whatever happens.

    Exit codes: 0 done; 1 stopped (a failed step or gate, with traffic left on the serving
    revision); 3 refused (lock held, unknown revision, ...), nothing changed.
    """
    from infra.rollout.cluster import load_simulated  # written through on every change
    from infra.rollout.pulumi_cluster import PulumiCluster
    from infra.rollout.objectstore import StoreUnavailable
    from infra.rollout.releases import LeaseLost, ReleaseError
    from infra.rollout.rollout import CanaryFailed, StepFailed

    store = _store(args, spec)
    try:
        cluster = PulumiCluster(args.pulumi_stack, store) if args.pulumi_stack else load_simulated(args.sim)
    except InputError as exc:  # a folder, not UTF-8, not JSON
        raise InputError(f"--sim {exc}. Nothing was changed") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # another program's JSON
        raise InputError(f"--sim {args.sim}: not a simulated cluster file (no {exc} as pdctl writes it). Nothing "
                         "was changed. Fix: point --sim at a file pdctl wrote, or at a new path") from None
    try:
        action(store, cluster)
        return 0
    except (CanaryFailed, StepFailed) as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except (StoreUnavailable, LeaseLost) as exc:
        # Stopped between two changes: what it was about to do is recorded, the rest not done.
        try:
            left = f"the cluster serves {cluster.traffic()}"
        except Exception:  # noqa: BLE001 - the cluster may be what failed; the message must still go out
            left = "the cluster's traffic could not be read"
        err_console.print(f"[red]{escape(str(exc))}[/red]\nThe operation stopped there; {left}. Fix the above, then "
                          "`pdctl rollout --resume` or `--abort` (or `scripts/rollback`)", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except ReleaseError as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_REFUSED


RELEASES_HELP = ("release store: s3://bucket/prefix or a folder (default: the spec's environment.release_store, "
                 "else releases/)")


def _store(args: argparse.Namespace, spec: StackSpec):
    from infra.rollout.releases import store_for

    return store_for(spec, args.releases)


def _preflight(spec: StackSpec, inventory_path: str) -> bool:
    from infra.rollout.preflight import Expectations, load_inventory, report_table, run_preflight

    inventory = load_inventory(inventory_path)
    report = run_preflight(inventory, Expectations.of(spec, inventory))
    console.print(report_table(report))
    (console if report.ok else err_console).print(report.summary(), highlight=False)
    return report.ok


def cmd_preflight(args: argparse.Namespace) -> int:
    return 0 if _preflight(_spec_from_args(args), args.inventory) else EXIT_FAILED


def _observer(spec: StackSpec, args: argparse.Namespace):
    from infra.prometheus import PrometheusAPI
    from infra.rollout.canary import observe

    api = PrometheusAPI(args.prometheus)
    return lambda rev: observe(api, spec.engine.kind, spec.environment.namespace, rev, args.window)


def cmd_rollout(args: argparse.Namespace) -> int:
    from infra.rollout.rollout import RolloutOptions, rollout

    spec = _spec_from_args(args)
    if args.force and not args.abort:
        raise InputError("rollout: --force only goes with --abort (to take over a stuck operation's lease). "
                         "Fix: drop --force, or add --abort")
    if args.abort and args.resume:
        raise InputError("rollout: --resume and --abort are opposites. Fix: pick one")
    if args.abort:
        from infra.rollout.rollback import abort

        return _changing(args, spec, lambda store, cluster: abort(store, cluster, console=console, force=args.force))
    if not args.prometheus:
        raise InputError("rollout: --prometheus is required (the canary gates read it). Fix: e.g. "
                         "--prometheus http://prometheus.monitoring.svc:9090")
    if args.inventory and not _preflight(spec, args.inventory):
        err_console.print("rollout stopped before any change: fix the hosts above")
        return EXIT_FAILED
    try:
        options = RolloutOptions(stages=tuple(int(x) for x in args.stages.split(",")), bake_seconds=args.bake)
    except ValueError as exc:  # checked before anything changes
        raise InputError(f"--stages {args.stages} / --bake {args.bake}: {exc}".replace(
            "invalid literal for int() with base 10", "not a whole number")) from None
    observer = _observer(spec, args)  # an unusable URL is refused here, before anything changes
    if args.resume:  # the unfinished rollout's own spec and stages; --bake applies to what is left
        from infra.rollout.rollout import resume

        return _changing(args, spec, lambda store, cluster: resume(store, cluster, observer, options, console))
    return _changing(args, spec, lambda store, cluster: rollout(
        spec, store, cluster, observer, options, args.message, console))


def cmd_canary(args: argparse.Namespace) -> int:
    from infra.rollout.canary import judge

    spec = _spec_from_args(args)
    observe = _observer(spec, args)
    verdict = judge(observe(args.revision), observe(args.baseline) if args.baseline else None, spec.slo)
    _emit(args, "canary", {"revision": args.revision, "baseline": args.baseline, "passed": verdict.passed,
                           "gates": verdict.gates},
          lambda: _print_table(f"canary r{args.revision}" + (f" vs r{args.baseline}" if args.baseline else ""),
                               ("gate", "result", "detail"),
                               [(g.name, "[green]pass[/green]" if g.passed else "[red]FAIL[/red]", g.detail)
                                for g in verdict.gates]))
    return 0 if verdict.passed else EXIT_FAILED


def cmd_rollback(args: argparse.Namespace) -> int:
    from infra.rollout.rollback import rollback

    spec = _spec_from_args(args)
    return _changing(args, spec, lambda store, cluster: rollback(store, cluster, to=args.to, console=console,
                                                                 force=args.force))


def cmd_releases(args: argparse.Namespace) -> int:
    spec = _spec_from_args(args)
    store = _store(args, spec)
    traffic = store.traffic()
    revisions = []
    for rev in store.revisions():
        r = store.get(rev)
        revisions.append({"revision": rev, "created_at": r.created_at, "author": r.author,
                          "status": store.status(rev), "traffic_percent": traffic.get(rev, 0), "message": r.message})
    _emit(args, "releases", {"environment": spec.environment.name, "revisions": revisions},
          lambda: _print_table(f"releases of {spec.environment.name}",
                               ("revision", "created", "author", "status", "traffic", "message"),
                               [(str(r["revision"]), r["created_at"], r["author"], r["status"] or "",
                                 f"{r['traffic_percent']}%", r["message"]) for r in revisions]))
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    """The policy pack's rules on the offline preview (what `pulumi preview --policy-pack` runs)."""
    from infra.offline import run_spec
    from infra.policy.rules import evaluate_offline

    spec = _spec_from_args(args)
    violations = evaluate_offline(run_spec(spec))
    mandatory = [v for v in violations if v.level == "mandatory"]
    _print_table(f"policy: {spec.environment.name}", ("rule", "level", "problem"),
                 [(v.rule, v.level, v.message) for v in violations])
    console.print(f"{len(mandatory)} mandatory, {len(violations) - len(mandatory)} advisory violation(s)")
    return EXIT_FAILED if mandatory else 0


def _time_arg(text: str | None) -> float | None:
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

    spec = _spec_from_args(args)
    at = _time_arg(args.at)
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
        _print_table(f"GPU cost of {spec.environment.name}, last {args.window}",
                     ("role", "GPU-hours", "idle GPU-hours", "idle share", "instances avg", "instances max"),
                     [(r.role, f"{r.gpu_hours:.1f}", f"{r.idle_gpu_hours:.1f}", f"{r.idle_share:.1%}",
                       f"{r.avg_instances:.2f}", f"{r.max_instances:.0f}") for r in report.roles])
        console.print(f"total {total:.1f} GPU-hours, {idle:.1f} idle ({idle / total:.1%})" if total else "no GPU samples")
        _print_table(f"instances idle (GPU util < {args.idle_below:g}%) more than {args.idle_instance_share:.0%} of "
                     "the time", ("namespace", "role", "instance", "idle share", "hours seen"),
                     [(i.namespace, i.role, i.group, f"{i.idle_share:.1%}", f"{i.hours:.1f}")
                      for i in report.idle_instances])
        if args.inventory:
            _print_table("node cache entries older than their retention",
                         ("host", "what", "path", "age h", "retention h"),
                         [(e.host, e.what, e.path, f"{e.age_hours:.0f}", f"{e.retention_hours:g}") for e in stale])

    _emit(args, "cost", {"environment": spec.environment.name, "window": args.window,
                         "roles": [dict(dataclasses.asdict(r), idle_share=r.idle_share) for r in report.roles],
                         "total_gpu_hours": total, "idle_gpu_hours": idle, "idle_instances": report.idle_instances,
                         "stale_cache_entries": stale, "not_scanned": unreachable}, text)
    for line in unreachable:
        err_console.print(f"[yellow]not scanned: {line}[/yellow]")
    return 0


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
    after = _spec_from_args(args)
    before, against = spec_at(args.against, args.stack, _spec_path(args))
    report = diff_specs(before, after)
    # Markdown is one more way to show it to a person; json goes through the one emitter.
    _emit(args, "diff", {"against": against, **as_data(report)},
          lambda: sys.stdout.write(markdown(report, f"`{against}`") if args.output == "markdown"
                                   else text(report, against)))
    hit = [c for c in fail_on if c in report.classes()]
    if hit:
        err_console.print(f"[red]--fail-on: {', '.join(hit)} in this change[/red]", highlight=False)
        return EXIT_FAILED
    return 0


def _render_loadtest_jobs(args: argparse.Namespace, spec: StackSpec, scenario, concurrencies: list[int]) -> int:
    """The same sweep as Jobs for the cluster (one per concurrency level), schema-checked, to a file."""
    import yaml

    from infra.render.manifests import validate_manifests
    from infra.validation.job import loadtest_job

    if not args.results_claim or not args.api_key_secret:
        raise InputError("--render-job needs --results-claim (a PVC for aiperf's result files) and --api-key-secret "
                         "(SECRET/KEY holding a gateway API key). Fix: add both")
    secret, _, key = args.api_key_secret.partition("/")
    try:
        jobs = [loadtest_job(spec, args.url, scenario, c, args.requests, args.results_claim, secret, key or "key")
                for c in concurrencies]
    except ValueError as exc:
        raise InputError(str(exc)) from None
    report = validate_manifests(jobs, spec.environment.kubernetes_version)
    _print_validation(report)
    if not report.ok:
        return EXIT_FAILED
    write_output(args.render_job, yaml.safe_dump_all(jobs, sort_keys=False))
    err_console.print(f"wrote {len(jobs)} Job(s) to {args.render_job}: kubectl apply -f {args.render_job}; "
                      f"results land on PVC {args.results_claim}")
    return 0


def _planned_sweep(args: argparse.Namespace, spec: StackSpec) -> list[int]:
    """--concurrency plan: 25%, 50%, 100% and 125% of the decode concurrency the planner predicts."""
    from infra.validation.loadtest import sweep_from_plan

    if not args.workload:
        raise InputError("--concurrency plan needs --workload (the workload file pdctl plan reads). Fix: add it")
    _, predicted = _planned(spec, args.workload)
    return sweep_from_plan(predicted.decode_slots_per_instance, spec.deployment.decode.instances)


def _compare(args, spec, model, scenario, concurrencies, api_key, out: Path, result) -> list[dict] | None:
    """The same sweep against a second endpoint (a colocated baseline, the previous revision):
    one table, as the design's "compare on the same test set" asks. Informational: no gate."""
    from infra.rollout.canary import Gate
    from infra.validation.loadtest import LoadTestError
    from infra.validation.run import endpoint_gates, run_sweep

    reached = endpoint_gates(args.compare_url, model, api_key)
    if not reached[0].passed:
        result.add("compare", [Gate(f"{reached[0].name} (B)", False, reached[0].detail)])
        return None
    try:
        other = run_sweep(args.aiperf, args.compare_url, model, scenario, concurrencies, args.requests,
                          out / "compare", args.tokenizer or spec.model.name, api_key, spec.slo, dict(os.environ))
    except LoadTestError as exc:
        result.add("compare", [Gate("aiperf (B)", False, str(exc))])
        return None
    b = {r.concurrency: r for r, _ in other.runs}
    return [{"concurrency": r.concurrency, "a": r, "b": b[r.concurrency]} for r, _ in result.sweep.runs
            if r.concurrency in b]


def _plot(args, spec, scenario, sweep, comparison, out: Path) -> None:
    """Latency against load as a PNG, drawn in the load-test tool's environment (matplotlib)."""
    import subprocess

    python = Path(args.aiperf).parent / "python"
    series = [f"A {args.url}=" + ",".join(str(out / f"{scenario.name}-c{r.concurrency}") for r, _ in sweep.runs)]
    if comparison:
        series.append(f"B {args.compare_url}=" + ",".join(str(out / "compare" / f"{scenario.name}-c{row['concurrency']}")
                                                        for row in comparison))
    done = subprocess.run([str(python), str(Path(__file__).resolve().parent.parent / "scripts/plot_sweeps.py"),
                           "--out", args.plot, "--ttft-slo", str(spec.slo.ttft_p99_ms), "--tpot-slo",
                           str(spec.slo.tpot_p99_ms), "--title", f"{spec.environment.name}: {scenario.name}", *series],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise InputError(f"--plot {args.plot}: {' '.join(done.stderr.split()[-30:])}")


def cmd_validate_deployment(args: argparse.Namespace) -> int:
    """The launch validation: endpoint and auth chain, then an aiperf sweep judged against the SLOs."""
    import datetime

    from infra.rollout.canary import Gate
    from infra.validation.loadtest import SCENARIOS, LoadTestError, measured_workload
    from infra.validation.run import Validation, endpoint_gates, read_sweep, run_sweep

    spec = _spec_from_args(args)
    if args.scenario not in SCENARIOS:
        raise InputError(f"--scenario {args.scenario}: not a scenario. Fix: one of {', '.join(SCENARIOS)}")
    if args.concurrency == "plan":
        concurrencies = _planned_sweep(args, spec)
    else:
        try:
            concurrencies = sorted({int(c) for c in args.concurrency.split(",")})
            if not concurrencies or concurrencies[0] < 1:
                raise ValueError
        except ValueError:
            raise InputError(f"--concurrency {args.concurrency}: whole numbers of 1 or more (e.g. 1,8,32), or plan "
                             "(with --workload)") from None
    if not (0 < args.scale <= 1) or args.requests < 1:
        raise InputError("--scale is a share above 0 and at most 1, --requests 1 or more. Fix: e.g. --scale 1 --requests 200")
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        raise InputError(f"--api-key-env {args.api_key_env}: that variable is empty. Fix: export it with a key of "
                         "the gateway (never on the command line)")
    model = args.model or spec.model.name
    scenario = SCENARIOS[args.scenario].scaled(args.scale)
    if args.render_job:
        return _render_loadtest_jobs(args, spec, scenario, concurrencies)
    out = Path(args.out)
    result = Validation(args.url)
    if args.results:  # the in-cluster Jobs' result folders, copied off their PVC: judged, not run again
        out = Path(args.results)
        try:
            result.sweep = read_sweep(out, scenario.name, concurrencies, spec.slo)
        except LoadTestError as exc:
            raise InputError(f"--results {args.results}: {exc}") from None
    elif result.add("endpoint", endpoint_gates(args.url, model, api_key)):
        out.mkdir(parents=True, exist_ok=True)  # only once there is something to measure
        try:
            result.sweep = run_sweep(args.aiperf, args.url, model, scenario, concurrencies, args.requests, out,
                                     args.tokenizer or spec.model.name, api_key, spec.slo, dict(os.environ))
        except LoadTestError as exc:
            result.add("load test", [Gate("aiperf", False, str(exc))])
    if result.sweep:  # the lightest load is judged: it must meet the SLO (the rest measures capacity)
        result.add("load test", result.sweep.runs[0][1])
    comparison = None
    if args.compare_url and result.sweep:
        comparison = _compare(args, spec, model, scenario, concurrencies, api_key, out, result)
    if args.prometheus and result.passed:
        from infra.prometheus import PrometheusAPI
        from infra.validation.health import fleet_gates, fleet_queries

        api = PrometheusAPI(args.prometheus)
        queries = fleet_queries(spec.engine.kind, spec.environment.namespace, args.window,
                                list(spec.deployment.pools()))
        result.add("fleet", fleet_gates({name: api.query(q) for name, q in queries.items()}))
    if args.plot and result.sweep:
        _plot(args, spec, scenario, result.sweep, comparison, out)
    profile = None
    if args.profile_out and result.sweep and result.passed:
        import yaml

        dep = spec.deployment
        pools = dep.pools()
        when = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
        profile = measured_workload(result.sweep, pools.get("prefill", pools.get("colocated")).instances,
                                    pools.get("decode", pools.get("colocated")).instances, args.url, when)
        write_output(args.profile_out, f"# measured by pdctl validate-deployment ({spec.environment.name}); read by "
                                       "pdctl plan --workload. capacity is per instance; arrival_rate_rps is what the "
                                       "test sustained inside the SLO: set the production peak to plan for demand\n"
                     + yaml.safe_dump(profile, sort_keys=False))
    runs = [dataclasses.asdict(r) | {"gates": g} for r, g in (result.sweep.runs if result.sweep else [])]

    def text() -> None:
        _print_table(f"validation of {spec.environment.name} at {args.url}", ("stage", "gate", "result", "detail"),
                     [(stage, g.name, "[green]pass[/green]" if g.passed else "[red]FAIL[/red]", g.detail)
                      for stage, g in result.gates])
        if result.sweep:
            _print_table(f"aiperf sweep: {scenario.name} ({scenario.input_tokens} in / {scenario.output_tokens} out"
                         f", {scenario.turns} turn(s))",
                         ("concurrency", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "tok/s/user", "output tok/s", "within SLO"),
                         [(str(r.concurrency), f"{r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f}",
                           f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f}", f"{r.tokens_per_second_per_user:.1f}",
                           f"{r.output_tokens_per_second:.0f}", "yes" if all(x.passed for x in g) else "no")
                          for r, g in result.sweep.runs])
        if comparison:
            _print_table(f"side by side, the same load: {args.url} (A) and {args.compare_url} (B)",
                         ("concurrency", "TTFT p99 A / B ms", "TPOT p99 A / B ms", "tok/s/user A / B",
                          "output tok/s A / B", "B / A output"),
                         [(str(row["concurrency"]), f"{row['a'].ttft_p99_ms:.0f} / {row['b'].ttft_p99_ms:.0f}",
                           f"{row['a'].itl_p99_ms:.1f} / {row['b'].itl_p99_ms:.1f}",
                           f"{row['a'].tokens_per_second_per_user:.1f} / {row['b'].tokens_per_second_per_user:.1f}",
                           f"{row['a'].output_tokens_per_second:.0f} / {row['b'].output_tokens_per_second:.0f}",
                           f"{row['b'].output_tokens_per_second / row['a'].output_tokens_per_second:.2f}x")
                          for row in comparison])
        if profile:
            console.print(f"wrote {args.profile_out}: the measured capacity `pdctl plan --workload` reads")

    _emit(args, "validation", {"environment": spec.environment.name, "url": args.url, "passed": result.passed,
                               "gates": [{"stage": s, **dataclasses.asdict(g)} for s, g in result.gates],
                               "runs": runs, "profile": args.profile_out if profile else None,
                               "comparison": comparison, "plot": args.plot if result.sweep and args.plot else None}, text)
    if not result.passed:
        failed = "; ".join(f"{g.name}: {g.detail}" for _, g in result.gates if not g.passed)
        err_console.print(f"[red]validation failed: {escape(failed)}[/red]", highlight=False, soft_wrap=True)
    return 0 if result.passed else EXIT_FAILED


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdstack")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed: run `make setup`)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdctl", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    parser.add_argument("--version", action="version", version=f"pdctl (pdstack) {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_spec(p: argparse.ArgumentParser, output: bool = False) -> argparse.ArgumentParser:
        p.add_argument("spec_path", nargs="?", metavar="SPEC", help="path of a spec file (same as --spec)")
        p.add_argument("--stack", default="dev", help="stack name: reads stacks/<stack>.yaml (default dev)")
        p.add_argument("--spec", help="path of a spec file (overrides --stack)")
        if output:
            p.add_argument("--output", "-o", choices=["text", "json", "yaml"], default="text",
                           help="text for a person (default), or a json/yaml document (see README.md)")
        return p

    with_spec(sub.add_parser("validate", help="check a spec; writes nothing"), output=True).set_defaults(func=cmd_validate)
    p = with_spec(sub.add_parser("preview", help="list every resource the program would create"), output=True)
    p.add_argument("--offline", action="store_true", help="run the program under Pulumi's mocks")
    p.set_defaults(func=cmd_preview)
    p = with_spec(sub.add_parser("render", help="write every Kubernetes manifest to a folder"), output=True)
    p.add_argument("--out", default="out/manifests", help="folder to write (default out/manifests)")
    p.add_argument("--engine", choices=["sglang", "vllm"], help="render for this engine instead of the spec's")
    p.set_defaults(func=cmd_render)
    p = with_spec(sub.add_parser("eplb", help="place redundant experts from measured loads"), output=True)
    p.add_argument("--role", default="decode", help="pool to place for (default decode)")
    p.add_argument("--loads", required=True, help="load file: JSON logical_count or CSV layer,expert,count")
    p.add_argument("--policy", choices=["auto", "hierarchical", "global"], default="auto")
    p.add_argument("--out", required=True, help="placement JSON for the engine; a .report.json goes beside it")
    p.set_defaults(func=cmd_eplb)
    p = with_spec(sub.add_parser("plan", help="recommend prefill/decode counts from a workload"), output=True)
    p.add_argument("--workload", required=True, help="workload and measured capacity (see stacks/workloads/)")
    p.add_argument("--write", help="write the spec with the recommended counts to this path")
    p.set_defaults(func=cmd_plan)

    def changing(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        with_spec(p)
        p.add_argument("--releases", help=RELEASES_HELP)
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--pulumi-stack", help="the real stack, through Pulumi's Automation API (needs the CLI)")
        # Where there is no cluster (CI, this machine): a simulated one kept in a file, so that a
        # rollout and a later rollback see the same state.
        where.add_argument("--sim", help="simulated cluster state file (created if missing)")
        return p

    def gated(p: argparse.ArgumentParser, required: bool = True) -> argparse.ArgumentParser:
        p.add_argument("--prometheus", required=required, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
        p.add_argument("--window", default="5m", help="PromQL range each gate looks back over (default 5m)")
        return p

    p = with_spec(sub.add_parser("preflight", help="check every GPU host over SSH"))
    p.add_argument("--inventory", required=True, help="inventory YAML (see stacks/inventory/)")
    p.set_defaults(func=cmd_preflight)
    p = gated(changing(sub.add_parser("rollout", help="deploy the spec as a new revision and canary it")),
              required=False)  # not needed for --abort; checked in cmd_rollout
    p.add_argument("--inventory", help="run the SSH preflight on these hosts first")
    p.add_argument("--stages", default="1,5,25,50,100", help="canary traffic shares in percent")
    p.add_argument("--bake", type=float, default=300.0, help="seconds at each stage before judging")
    p.add_argument("--message", default="", help="why this release (kept in its record)")
    p.add_argument("--abort", action="store_true",
                   help="end an unfinished rollout: traffic back to what served before it, its revision taken down")
    p.add_argument("--resume", action="store_true",
                   help="carry on an unfinished rollout from its recorded canary stage")
    p.add_argument("--force", action="store_true", help="with --abort: take over a live lease (audited)")
    p.set_defaults(func=cmd_rollout)
    p = gated(with_spec(sub.add_parser("canary", help="judge a revision's gates once, from Prometheus"), output=True))
    p.add_argument("--revision", type=int, required=True)
    p.add_argument("--baseline", type=int, help="the serving revision to compare with")
    p.set_defaults(func=cmd_canary)
    p = changing(sub.add_parser("rollback", help="send all traffic back to the previous good revision"))
    p.add_argument("--to", type=int, help="roll back to this revision instead")
    p.add_argument("--force", action="store_true", help="take over a live lease (says whose it was; audited)")
    p.set_defaults(func=cmd_rollback)
    p = with_spec(sub.add_parser("cost", help="GPU-hours, idle share and stale caches"), output=True)
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--window", default="24h", help="how far back (PromQL duration, default 24h)")
    p.add_argument("--at", help="end of the window: unix seconds or ISO time (default now)")
    p.add_argument("--idle-below", type=float, default=5.0, help="GPU utilisation %% that counts as idle")
    p.add_argument("--idle-instance-share", type=float, default=0.5, help="flag instances idle more than this share")
    p.add_argument("--inventory", help="also list stale node cache folders on these hosts (SSH)")
    p.set_defaults(func=cmd_cost)
    with_spec(sub.add_parser("policy", help="run the policy pack's rules on the offline preview")).set_defaults(func=cmd_policy)
    p = with_spec(sub.add_parser("validate-deployment", help="check a running endpoint: auth chain, then an "
                                                             "aiperf load test against the SLOs"), output=True)
    p.add_argument("--url", required=True, help="the gateway (or one release track's router), e.g. https://api.example.com")
    p.add_argument("--api-key-env", help="environment variable holding an API key of the gateway")
    p.add_argument("--model", help="model name to request (default: the spec's model.name)")
    p.add_argument("--scenario", default="chat-shared-prefix", help="dataset shape: chat-shared-prefix, "
                                                                    "long-input-short-output, short-input-long-output")
    p.add_argument("--concurrency", default="1,8,32",
                   help="concurrency levels of the sweep (default 1,8,32), or plan: 25/50/100/125%% of the "
                        "decode concurrency the planner predicts from --workload")
    p.add_argument("--workload", help="with --concurrency plan: the workload file pdctl plan reads")
    p.add_argument("--requests", type=int, default=200, help="requests per level (default 200)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink the scenario's token counts by this share")
    p.add_argument("--tokenizer", help="tokenizer aiperf counts with (default: the spec's model.name)")
    p.add_argument("--aiperf", default=str(Path(sys.prefix).parent / ".venv-loadtest/bin/aiperf"),
                   help="the pinned aiperf (default: .venv-loadtest/bin/aiperf, from `make loadtest-tool`)")
    p.add_argument("--out", default="out/validation", help="folder for aiperf's own result files")
    p.add_argument("--prometheus", help="after the load: per-instance load spread, expert balance, KV-transfer "
                                        "and request failures from the engines' metrics")
    p.add_argument("--window", default="5m", help="PromQL range the fleet checks look back over (default 5m)")
    p.add_argument("--profile-out", help="write the measured capacity as a workload file for `pdctl plan`")
    p.add_argument("--compare-url", help="run the same sweep against this endpoint too, and compare side by side")
    p.add_argument("--plot", help="write latency against load (both endpoints) as a PNG")
    p.add_argument("--render-job", help="instead of running here, write the sweep as Kubernetes Jobs to this file")
    p.add_argument("--results", help="judge the Jobs' result folders (copied off their PVC) instead of running")
    p.add_argument("--results-claim", help="with --render-job: PVC the Jobs write aiperf's results to")
    p.add_argument("--api-key-secret", help="with --render-job: SECRET/KEY of a gateway API key")
    p.set_defaults(func=cmd_validate_deployment)
    p = with_spec(sub.add_parser("diff", help="what a change does to the fleet: restarts, node replacement, "
                                              "traffic, flags, policy"))
    p.add_argument("--against", default="merge-base",
                   help="a git ref, or a spec file, to compare with (default: the merge base with main)")
    p.add_argument("--output", "-o", choices=["text", "markdown", "json"], default="text")
    p.add_argument("--fail-on", help="exit 1 if any of these impact classes occur, e.g. restart,node-replacement")
    p.set_defaults(func=cmd_diff)
    p = with_spec(sub.add_parser("releases", help="list revisions, their status and traffic"), output=True)
    p.add_argument("--releases", help=RELEASES_HELP)
    p.set_defaults(func=cmd_releases)
    return parser


def main(argv: list[str] | None = None) -> int:
    """One boundary: expected failures become a message and an exit code (2 input, 1 a check
    failed, 3 refused); anything else a short line, and the traceback only with --debug."""
    from infra.prometheus import PrometheusError
    from infra.rollout.objectstore import StoreUnavailable
    from infra.rollout.releases import ReleaseError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, InputError) as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return 2
    except OSError as exc:  # a disk that is full, read-only or gone, while writing an output
        where = exc.filename or "a file"
        err_console.print(f"[red]cannot write {escape(str(where))}: {escape(exc.strerror or str(exc))}. Fix: check "
                          "the disk and the path, then run again[/red]", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except (PrometheusError, StoreUnavailable) as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except ReleaseError as exc:  # e.g. a corrupt record, read by `releases`
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - the boundary: no traceback reaches a user without --debug
        if args.debug:
            raise
        err_console.print(f"[red]unexpected error: {type(exc).__name__}: {escape(str(exc))}[/red] "
                          "(run again with --debug for the traceback)", highlight=False, soft_wrap=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
