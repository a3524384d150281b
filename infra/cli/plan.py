"""`pdctl plan`: prefill/decode counts for a workload and the SLOs (and --write them into a spec);
with --watch, the same planner as a loop on Prometheus: forecast, correct, re-plan, say what it
would change (--dry-run) or write it."""

from __future__ import annotations

import argparse
import math

from rich.markup import escape
from rich.table import Table

from infra.cli.common import console, emit, spec_from_args, spec_path, with_spec
from infra.inputs import InputError, load_model
from infra.spec import StackSpec


def register(sub) -> None:
    p = with_spec(sub.add_parser("plan", help="recommend prefill/decode counts from a workload"), output=True)
    p.add_argument("--workload", required=True, help="workload and measured capacity (see stacks/workloads/)")
    p.add_argument("--write", help="write the spec with the recommended counts and scaler targets to this path")
    p.add_argument("--watch", action="store_true",
                   help="re-plan every --interval seconds from --prometheus: forecast the request rate, correct "
                        "the model from the observed TTFT/ITL p99, and say what would change")
    p.add_argument("--prometheus", help="with --watch: Prometheus base URL")
    p.add_argument("--interval", type=float, default=300, help="with --watch: seconds between re-plans (300)")
    p.add_argument("--iterations", type=int, default=0, help="with --watch: stop after this many (0: never)")
    p.add_argument("--dry-run", action="store_true", help="with --watch: print what would change, write nothing")
    p.set_defaults(func=cmd_plan)


HISTORY_POINTS = 24  # the rate over the last two hours, one point per 5 minutes
HISTORY_STEP_SECONDS = 300


def planned(spec: StackSpec, workload_path: str):
    """The workload file and the planner's answer for this spec's pools (today's counts as `current`)."""
    from infra.planning.pd_ratio import PlanError, Workload, plan

    dep = spec.deployment
    if dep.mode != "disaggregated":
        raise InputError("deployment.mode: colocated has no prefill/decode split to plan. Fix: plan a disaggregated spec")
    workload = load_model(workload_path, Workload, "workload")
    try:
        return workload, plan(workload, slo_of(spec), dep.prefill.gpus_per_instance(), dep.decode.gpus_per_instance(),
                              current=(dep.prefill.instances, dep.decode.instances))
    except PlanError as exc:
        raise InputError(f"plan: {workload_path}: {exc}") from None


def slo_of(spec: StackSpec):
    from infra.planning.pd_ratio import SLO

    return SLO(spec.slo.ttft_p99_ms, spec.slo.tpot_p99_ms, spec.slo.tokens_per_second_per_user)


def changes(spec: StackSpec, result) -> list[str]:
    """What the plan would change in the spec: counts and the scalers' per-instance targets."""
    dep, out = spec.deployment, []
    for role in ("prefill", "decode"):
        now, want = getattr(dep, role).instances, getattr(result, f"{role}_instances")
        if now != want:
            out.append(f"deployment.{role}.instances {now} -> {want}")
    for key, value in (result.scaler_targets or {}).items():
        now = getattr(dep.autoscaling, key)
        if now is None or abs(now - value) > 1e-9 * max(1.0, abs(value)):
            out.append(f"deployment.autoscaling.{key} {'unset' if now is None else f'{now:g}'} -> {value:g}")
    return out


def watch_queries(spec: StackSpec) -> dict[str, str]:
    """The PromQL one round of --watch reads (tests/test_metrics_contract.py checks each against
    the pinned engines' series): the request rate, the counts serving, their TTFT p99 (where the
    engine times prefill's requests' first token: infra/render/metrics.py ttft_pool) and ITL p99, the
    length distributions of the last hour (prompts where prefill sees them, outputs at decode),
    and prefill's prefix-cache hit rate.

    Each reads the environment wherever it serves from: its namespace and its release tracks'
    (`<namespace>-r<revision>`, infra/tracks.py), summed, since the load the fleet must carry is
    all of theirs (a canary's share included) and the plan is for the pools whole. The counts are
    the instances of the namespaces that served requests in the window: a track kept warm at
    weight 0 holds instances that carry none of the load whose p99 the correction reads."""
    from infra.render.metrics import (ENGINE_METRICS, ROLE_SERIES_LABEL, every_series_with_selector,
                                      instances_query, p99, ttft_pool, with_selector)
    from infra.tracks import namespaces_matcher

    m = ENGINE_METRICS[spec.engine.kind]
    every = namespaces_matcher(spec.environment.namespace)
    prefill, decode = (f'{{{every},{ROLE_SERIES_LABEL}="{role}"}}' for role in ("prefill", "decode"))
    timing_first_tokens = f'{{{every},{ROLE_SERIES_LABEL}="{ttft_pool(spec, "prefill")}"}}'
    requests = f"rate({with_selector(m.requests_total, decode)}[5m])"
    serving = f"sum by (namespace) ({requests}) > 0"
    out = {"rate": f"sum({requests})",
           "prefill_instances": instances_query(m.running, prefill, serving),
           "decode_instances": instances_query(m.running, decode, serving),
           "ttft_p99_s": p99(m.ttft_bucket, timing_first_tokens), "itl_p99_s": p99(m.tpot_bucket, decode),
           "prefix_hit_rate": every_series_with_selector(m.prefix_hit_ratio(by=()), prefill)}
    for name, histogram, sel in (("input", m.prompt_length, prefill), ("output", m.output_length, decode)):
        out[f"{name}_mean"] = (f"sum(rate({with_selector(histogram + '_sum', sel)}[1h])) / "
                               f"sum(rate({with_selector(histogram + '_count', sel)}[1h]))")
        out[f"{name}_p99"] = p99(histogram + "_bucket", sel, "1h")
    return out


def plausible(spec: StackSpec) -> dict[str, tuple[float, float, bool, str]]:
    """What each figure one round reads can be: (lowest, highest, whole, where the highest comes
    from). A value outside is no data for that round, said so and never planned on: a counter
    reset, a broken exporter or a hostile series must not size the fleet, nor stop the loop.
    Counts are whole and at most what the pool's nodes hold (its maximum and rollout surge,
    within the quota: infra/planning/capacity.py); lengths a token at least, at most the model's
    context."""
    from infra.planning.capacity import pool_capacity

    inf, context = math.inf, spec.model.context_length
    out = {"rate": (0.0, inf, False, ""), "ttft_p99_s": (0.0, inf, False, ""), "itl_p99_s": (0.0, inf, False, ""),
           "prefix_hit_rate": (0.0, 1.0, False, "a share")}
    for role in ("prefill", "decode"):
        pool = pool_capacity(spec, role)
        out[f"{role}_instances"] = (0.0, pool.gpus // pool.gpus_per_instance, True,
                                    f"what the {role} pool's nodes hold: deployment.{role}.scaling.max_instances "
                                    "and rollout_surge_instances, within hardware.max_gpus")
    for name in ("input_mean", "input_p99", "output_mean", "output_p99"):
        out[name] = (1.0, float(context), False, "model.context_length")  # a request has a token at least
    return out


def outside(name: str, value: float, bounds: tuple[float, float, bool, str]) -> str | None:
    """Why `value` is no data for `name`, or None if it is plausible (NaN, no series, is said elsewhere)."""
    low, high, whole, ceiling = bounds
    if math.isnan(value):
        return None
    if math.isinf(value):
        return f"{name} {value:g} is not a finite number"
    if value < low:
        return f"{name} {value:g} is below {low:g}"
    if value > high:
        return f"{name} {value:g} is above {high:g}{f' ({ceiling})' if ceiling else ''}"
    if whole and not value.is_integer():
        return f"{name} {value:g} is not a whole number"
    return None


def observe(prom, spec: StackSpec, now: float):
    """The live figures one round reads: the request rate over the last two hours, the counts
    serving with the TTFT/ITL p99 they showed, the last hour's lengths {input/output:
    (mean, p99)} and prefill's prefix-cache hit rate (None where Prometheus has no data), and
    what was taken as no data for being implausible (`plausible`), each said."""
    from infra.planning.control import Observation

    q, bounds, no_data = watch_queries(spec), plausible(spec), []
    history = [prom.query(q["rate"], now - k * HISTORY_STEP_SECONDS) for k in range(HISTORY_POINTS - 1, -1, -1)]
    wrong = [why for why in (outside("rate", v, bounds["rate"]) for v in history) if why]
    if wrong:
        no_data.append(f"{wrong[0]}: {len(wrong)} of the {HISTORY_POINTS} points of the last 2 h like it")
    history = [v for v in history if not math.isnan(v) and not outside("rate", v, bounds["rate"])]
    f = {name: prom.query(q[name], now) for name in q if name != "rate"}
    for name, value in f.items():
        why = outside(name, value, bounds[name])
        if why:
            no_data.append(why)
            f[name] = math.nan
    observation = None
    if history and all(math.isfinite(f[k]) and f[k] > 0 for k in ("prefill_instances", "decode_instances",
                                                                   "ttft_p99_s", "itl_p99_s")):
        observation = Observation(history[-1], int(f["prefill_instances"]), int(f["decode_instances"]),
                                  f["ttft_p99_s"] * 1000, f["itl_p99_s"] * 1000)
    lengths = {name: (f[f"{name}_mean"], max(f[f"{name}_mean"], f[f"{name}_p99"])) for name in ("input", "output")}
    if not all(math.isfinite(v) and v > 0 for pair in lengths.values() for v in pair):
        lengths = None
    hit = f["prefix_hit_rate"] if math.isfinite(f["prefix_hit_rate"]) and 0 <= f["prefix_hit_rate"] < 1 else None
    return history, observation, lengths, hit, no_data


def cmd_watch(args: argparse.Namespace, spec: StackSpec) -> int:
    """Re-plan on an interval: forecast, correct, plan; print (and unless --dry-run, write) the
    change. A round with no plan, or one the spec refuses (spec_edit.planned_spec: the same
    reader --write answers to), is reported and skipped, and the loop goes on."""
    import time

    from infra.planning.control import replan
    from infra.planning.pd_ratio import PlanError, TokenStats, Workload
    from infra.planning.surface import Correction
    from infra.prometheus import PrometheusAPI
    from infra.spec import SpecError
    from infra.spec_edit import planned_spec, write_counts

    if not args.prometheus:
        raise InputError("--watch reads the live rate and latencies: it needs --prometheus URL. Fix: add it")
    if not args.dry_run and not args.write:
        raise InputError("--watch writes what it would change to --write PATH, or prints it with --dry-run. "
                         "Fix: add one of them")
    if not (0 <= args.interval < 86400) or args.iterations < 0:  # NaN fails the first test too
        raise InputError("--interval: seconds, 0 or more and under a day; --iterations: 0 or more. Fix: e.g. "
                         "--interval 300 --iterations 12")
    prom = PrometheusAPI(args.prometheus)
    workload = load_model(args.workload, Workload, "workload")
    dep = spec.deployment
    correction, rounds, n = Correction(), [], 0
    while True:
        n += 1
        history, observation, lengths, hit_rate, no_data = observe(prom, spec, time.time())
        current = workload if lengths is None else workload.model_copy(update={
            "input_tokens": TokenStats(mean=lengths["input"][0], p99=lengths["input"][1]),
            "output_tokens": TokenStats(mean=lengths["output"][0], p99=lengths["output"][1])})
        if hit_rate is not None:
            current = current.model_copy(update={"prefix_cache_hit_rate": hit_rate})
        step, would, written, skipped = None, [], None, None
        try:
            step = replan(current, slo_of(spec), dep.prefill.gpus_per_instance(), dep.decode.gpus_per_instance(),
                          history, max(1, round((args.interval + 600) / HISTORY_STEP_SECONDS)), observation,
                          correction)
        except PlanError as exc:
            skipped = [f"no plan this round: {args.workload}: {exc}"]
        if step is not None:
            correction = step.correction
            would = changes(spec, step.plan)
            try:
                if would and args.dry_run:
                    planned_spec(spec_path(args), step.plan, spec_path(args), "--dry-run")
                elif would:
                    write_counts(spec_path(args), args.write, step.plan)
                    written = args.write
            except SpecError as exc:
                skipped, would = ["the spec refuses this plan, so it is not proposed: " + p for p in exc.problems], []
        source = "forecast (q95) of the last 2 h" if history else "the workload file (no rate in Prometheus)"
        lengths_from = "Prometheus, last hour" if lengths else "the workload file (no length histograms in Prometheus)"
        rounds.append({"iteration": n, "rate_rps": step.rate if step else None, "rate_from": source,
                       "lengths_from": lengths_from, "no_data": no_data,
                       "input_tokens": dict(current.input_tokens), "output_tokens": dict(current.output_tokens),
                       "prefix_cache_hit_rate": current.prefix_cache_hit_rate,
                       "observed": observation is not None,
                       "correction": {"prefill": correction.prefill, "decode": correction.decode},
                       "prefill_instances": step.plan.prefill_instances if step else None,
                       "decode_instances": step.plan.decode_instances if step else None,
                       "changes": would, "written": written, "skipped": skipped})
        if getattr(args, "output", "text") == "text":
            print_round(rounds[-1], args.dry_run)
        if args.iterations and n >= args.iterations:
            break
        time.sleep(args.interval)
    emit(args, "plan-watch", {"environment": spec.environment.name, "dry_run": args.dry_run, "rounds": rounds},
         lambda: None)
    return 0


def print_round(r: dict, dry_run: bool) -> None:
    """One round of --watch for a person: what it planned for and from what, then each value
    taken as no data, and the changes or why the round was skipped."""
    c, i, o = r["correction"], r["input_tokens"], r["output_tokens"]
    planned = (f"plan for {r['rate_rps']:.1f} req/s ({r['rate_from']})" if r["rate_rps"] is not None else
               f"no plan (rate from {r['rate_from']})")
    counts = f"; prefill {r['prefill_instances']}, decode {r['decode_instances']}" if r["rate_rps"] is not None else ""
    console.print(f"round {r['iteration']}: {planned}; correction prefill {c['prefill']:.2f} decode {c['decode']:.2f}"
                  f"{'' if r['observed'] else ' (no observed p99: not corrected)'}; lengths from {r['lengths_from']} "
                  f"(input {i['mean']:.0f}/{i['p99']:.0f}, output {o['mean']:.0f}/{o['p99']:.0f} mean/p99){counts}")
    for why in r["no_data"]:
        console.print(f"  [yellow]no data this round: {escape(why)}[/yellow]")
    for why in r["skipped"] or []:
        console.print(f"  [yellow]skipped: {escape(why)}[/yellow]")
    if not r["skipped"]:
        for line in r["changes"] or ["nothing"]:
            console.print(f"  {'would change' if dry_run else 'change'}: {escape(line)}")
    if r["written"]:
        console.print(f"  wrote {r['written']}")


def cmd_plan(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    dep = spec.deployment
    if args.watch:
        return cmd_watch(args, spec)
    if args.prometheus or args.dry_run or args.iterations:
        raise InputError("--prometheus, --dry-run and --iterations go with --watch. Fix: add --watch, or drop them")
    workload, result = planned(spec, args.workload)
    written, notes = None, []
    if args.write:
        from infra.spec_edit import write_counts

        notes = write_counts(spec_path(args), args.write, result)
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
        console.print(f"predicted at the recommended counts: TTFT p99 {result.ttft_p99_ms:.0f} ms (SLO "
                      f"{spec.slo.ttft_p99_ms:g}), ITL p99 {result.itl_p99_ms:.1f} ms (target {result.tpot_target_ms:g}); "
                      f"decode holds {result.decode_batch_per_instance:.0f} sequences an instance (cap "
                      f"{result.decode_batch_cap:.0f})")
        console.print("scaler targets per instance (the plan's model): " + ", ".join(
            f"{k} {v:g}" for k, v in result.scaler_targets.items()))
        for note in result.notes:
            console.print(f"note: {escape(note)}")
        m = workload.measured
        console.print(f"capacity measured by {m.tool} ({m.scenario}) at {m.where} on {m.when}" if m else
                      "capacity typed in by hand: measure it with `pdctl validate-deployment --profile-out`")
        for note in m.notes if m else ():
            console.print(f"measured: {escape(note)}")
        for note in notes:
            console.print(f"[yellow]{escape(note)}[/yellow]")
        if written:
            console.print(f"wrote {written}")

    emit(args, "plan", {"environment": spec.environment.name, "tpot_target_ms": result.tpot_target_ms,
                        "phases": phases, "pd_ratio": {"recommended": result.pd_ratio, "spec": dep.pd_ratio},
                        "current": {"prefill_utilisation": result.current_prefill_utilisation,
                                    "decode_utilisation": result.current_decode_utilisation,
                                    "bottleneck": result.current_bottleneck},
                        "predicted": {"ttft_p99_ms": result.ttft_p99_ms, "itl_p99_ms": result.itl_p99_ms,
                                      "decode_batch_per_instance": result.decode_batch_per_instance,
                                      "decode_batch_cap": result.decode_batch_cap},
                        "scaler_targets": result.scaler_targets, "plan_notes": list(result.notes),
                        "written": written, "notes": notes}, text)
    return 0
