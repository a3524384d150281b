"""`pdctl validate-deployment`: the launch validation of a running endpoint: its auth chain,
then an aiperf sweep judged against the SLOs, fleet checks from Prometheus, and the measured
capacity for the planner. Or the same sweep as in-cluster Jobs (--render-job), judged later (--results)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from rich.markup import escape

from infra.cli.common import (EXIT_FAILED, console, emit, err_console, print_table, promql_range, spec_from_args,
                              with_spec)
from infra.cli.plan import planned
from infra.cli.render import print_validation
from infra.inputs import InputError, http_url, write_output
from infra.prometheus import PrometheusAPI
from infra.spec import StackSpec
from infra.validation.profile import DEFAULT_MAX_CONCURRENCY, REQUESTS_PER_CONCURRENCY


def register(sub) -> None:
    p = with_spec(sub.add_parser("validate-deployment", help="check a running endpoint: auth chain, then an "
                                                             "aiperf load test against the SLOs"), output=True)
    p.add_argument("--url", required=True, help="the gateway (or one release track's router), e.g. https://api.example.com")
    p.add_argument("--api-key-env", help="environment variable holding an API key of the gateway")
    p.add_argument("--model", help="model name to request (default: the spec's model.name)")
    p.add_argument("--scenario", default="chat-shared-prefix", help="dataset shape: chat-shared-prefix, "
                                                                    "long-input-short-output, short-input-long-output")
    p.add_argument("--concurrency",
                   help="concurrency levels of the sweep (e.g. 1,8,32; the default without --profile-out), or "
                        "capacity (the default with it): from 1, doubled until the SLO breaks, the KV cache fills "
                        "or the engine holds no more, then refined; or plan: 25/50/100/125%% of the decode "
                        "concurrency the planner predicts from --workload")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"with --concurrency capacity: the most it asks for (default {DEFAULT_MAX_CONCURRENCY})")
    p.add_argument("--workload", help="with --concurrency plan: the workload file pdctl plan reads")
    p.add_argument("--requests", type=int, default=200,
                   help=f"requests per level (default 200), at least {REQUESTS_PER_CONCURRENCY}x its concurrency")
    p.add_argument("--scale", type=float, default=1.0, help="shrink the scenario's token counts by this share")
    p.add_argument("--tokenizer", help="tokenizer aiperf counts with (default: the spec's model.name)")
    p.add_argument("--aiperf", default=str(Path(sys.prefix).parent / ".venv-loadtest/bin/aiperf"),
                   help="the pinned aiperf (default: .venv-loadtest/bin/aiperf, from `make loadtest-tool`)")
    p.add_argument("--out", default="out/validation", help="folder for aiperf's own result files")
    p.add_argument("--prometheus", help="after the load: per-instance load spread, expert balance, KV-transfer "
                                        "and request failures from the engines' metrics")
    p.add_argument("--window", default="5m", type=promql_range,
                   help="PromQL range the fleet checks look back over (default 5m)")
    p.add_argument("--profile-out", help="write the measured surface as a workload file for `pdctl plan`")
    p.add_argument("--profile-lengths", default="0.05,0.5,2",
                   help="with --profile-out: prompt lengths, as shares of the scenario's, also run alone "
                        "(concurrency 1) for the prefill surface; the shortest stands for an empty prompt's cost "
                        "in the prefix-cache discount (default 0.05,0.5,2)")
    p.add_argument("--profile-contexts", default="2",
                   help="with --profile-out: prompt lengths, as shares of the scenario's, at which the whole sweep "
                        "runs again, each a row of the decode surface's ITL by context (default 2; empty: the "
                        "sweep's context only, and the planner extrapolates past it)")
    p.add_argument("--compare-url", help="run the same sweep against this endpoint too, and compare side by side")
    p.add_argument("--plot", help="write latency against load (both endpoints) as a PNG")
    p.add_argument("--render-job", help="instead of running here, write the sweep as Kubernetes Jobs to this file")
    p.add_argument("--results", help="judge the Jobs' result folders (copied off their PVC) instead of running")
    p.add_argument("--results-claim", help="with --render-job: PVC the Jobs write aiperf's results to")
    p.add_argument("--api-key-secret", help="with --render-job: SECRET/KEY of a gateway API key")
    p.set_defaults(func=cmd_validate_deployment)


def render_loadtest_jobs(args: argparse.Namespace, spec: StackSpec, scenario, concurrencies: list[int]) -> int:
    """The same sweep as Jobs for the cluster (one per concurrency level), schema-checked, to a file."""
    import yaml

    from infra.render.manifests import validate_manifests
    from infra.validation.job import loadtest_job

    if not args.results_claim or not args.api_key_secret:
        raise InputError("--render-job needs --results-claim (a PVC for aiperf's result files) and --api-key-secret "
                         "(SECRET/KEY holding a gateway API key). Fix: add both")
    secret, _, key = args.api_key_secret.partition("/")
    try:
        jobs = [manifest for c in concurrencies for manifest in loadtest_job(
            spec, args.url, scenario, c, args.requests, args.results_claim, secret, key or "key")]
    except ValueError as exc:
        raise InputError(str(exc)) from None
    report = validate_manifests(jobs, spec.environment.kubernetes_version)
    print_validation(report)
    if not report.ok:
        return EXIT_FAILED
    write_output(args.render_job, yaml.safe_dump_all(jobs, sort_keys=False))
    err_console.print(f"wrote {len(concurrencies)} Job(s) and their aiperf configs to {args.render_job}: "
                      f"kubectl apply -f {args.render_job}; "
                      f"results land on PVC {args.results_claim}")
    return 0


def planned_sweep(args: argparse.Namespace, spec: StackSpec) -> list[int]:
    """--concurrency plan: 25%, 50%, 100% and 125% of the decode concurrency the planner predicts."""
    from infra.validation.loadtest import sweep_from_plan

    if not args.workload:
        raise InputError("--concurrency plan needs --workload (the workload file pdctl plan reads). Fix: add it")
    _, predicted = planned(spec, args.workload)
    return sweep_from_plan(predicted.decode_slots_per_instance, spec.deployment.decode.instances)


def compare(args, spec, model, scenario, concurrencies, api_key, out: Path, result) -> list[dict] | None:
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


def plot(args, spec, scenario, sweep, comparison, out: Path) -> None:
    """Latency against load as a PNG, drawn in the load-test tool's environment (matplotlib)."""
    import subprocess

    python = Path(args.aiperf).parent / "python"
    series = [f"A {args.url}=" + ",".join(str(out / f"{scenario.name}-c{r.concurrency}") for r, _ in sweep.runs)]
    if comparison:
        series.append(f"B {args.compare_url}=" + ",".join(str(out / "compare" / f"{scenario.name}-c{row['concurrency']}")
                                                        for row in comparison))
    done = subprocess.run([str(python), str(Path(__file__).resolve().parents[2] / "scripts/plot_sweeps.py"),
                           "--out", args.plot, "--ttft-slo", str(spec.slo.ttft_p99_ms), "--tpot-slo",
                           str(spec.slo.tpot_p99_ms), "--title", f"{spec.environment.name}: {scenario.name}", *series],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise InputError(f"--plot {args.plot}: {' '.join(done.stderr.split()[-30:])}")


@dataclasses.dataclass
class Runner:
    """One aiperf run of a scenario at a concurrency, judged, and with --prometheus what the
    decode engines held during it (their running-requests gauge, the KV cache's usage, their queues)."""

    args: argparse.Namespace
    spec: StackSpec
    model: str
    api_key: str | None
    out: Path
    prometheus: PrometheusAPI | None
    decode_role: str

    def __call__(self, scenario, concurrency: int):
        import math
        import time

        from infra.validation.health import held_batch_query, kv_usage_query, queue_depth_query
        from infra.validation.run import run_sweep

        started = time.time()
        result, gates = run_sweep(self.args.aiperf, self.args.url, self.model, scenario, [concurrency],
                                  max(self.args.requests, REQUESTS_PER_CONCURRENCY * concurrency), self.out,
                                  self.args.tokenizer or self.spec.model.name, self.api_key, self.spec.slo,
                                  dict(os.environ)).runs[0]
        if self.prometheus is None:
            return result, gates
        seconds = math.ceil(time.time() - started)
        kind, ns = self.spec.engine.kind, self.spec.environment.namespace
        read = {field: self.prometheus.query(query(kind, ns, self.decode_role, seconds))
                for field, query in (("held_batch", held_batch_query), ("kv_usage", kv_usage_query),
                                     ("queue_depth", queue_depth_query))}
        return dataclasses.replace(result, **{f: v if math.isfinite(v) else None for f, v in read.items()}), gates


def other_length_runs(run: Runner, scenario, levels: dict[tuple[int, int], set[int]]) -> tuple[dict, list[str]]:
    """The scenario at other prompt and output lengths ((input, output) tokens -> concurrency
    levels, infra/validation/profile.py ProfilePlan). Returns the runs by (input, output), and what could not be measured (the
    surface is narrower then, the verdict unchanged)."""
    from infra.validation.loadtest import LoadTestError

    runs, missing = {}, []
    for (n, o), concurrencies in sorted(levels.items()):
        name = f"{scenario.name}-prompt{n}" + (f"-out{o}" if o != scenario.output_tokens else "")
        variant = dataclasses.replace(scenario, name=name, input_tokens=n, output_tokens=o)
        for c in sorted(concurrencies):
            try:
                runs.setdefault((n, o), []).append(run(variant, c)[0])
            except LoadTestError as exc:
                missing.append(f"prompts of {n} tokens ({o} out) at concurrency {c}: not measured ({exc})")
    return runs, missing


def shares_option(text: str, option: str) -> list[float]:
    """A list of shares of the scenario's prompt length, each above 0 and at most 16."""
    try:
        shares = sorted({float(v) for v in text.split(",") if v.strip()})
        if any(not (0 < v <= 16) for v in shares):
            raise ValueError
    except ValueError:
        raise InputError(f"{option} {text}: shares of the scenario's prompt length, above 0 and at most 16 "
                         "(e.g. 0.5,2), or empty") from None
    return shares


def cmd_validate_deployment(args: argparse.Namespace) -> int:
    """The launch validation: endpoint and auth chain, then an aiperf sweep judged against the SLOs."""
    import datetime

    from infra.rollout.canary import Gate
    from infra.validation.loadtest import SCENARIOS, LoadTestError, Sweep, measured_workload
    from infra.validation.profile import capacity_sweep
    from infra.validation.run import Validation, endpoint_gates, read_sweep

    spec = spec_from_args(args)
    if args.scenario not in SCENARIOS:
        raise InputError(f"--scenario {args.scenario}: not a scenario. Fix: one of {', '.join(SCENARIOS)}")
    elsewhere = args.render_job or args.results  # a sweep whose levels are fixed before any run
    asked = args.concurrency or ("capacity" if args.profile_out and not elsewhere else "1,8,32")
    concurrencies: list[int] | None = None  # None: the capacity sweep finds them
    if asked == "capacity":
        if elsewhere:
            raise InputError(f"--concurrency capacity chooses each level from the run before, and "
                             f"{'--render-job' if args.render_job else '--results'} needs them fixed. Fix: give "
                             "the levels, e.g. --concurrency 1,8,32")
        if args.max_concurrency < 1:
            raise InputError("--max-concurrency: 1 or more. Fix: e.g. --max-concurrency 16384")
    elif asked == "plan":
        concurrencies = planned_sweep(args, spec)
    else:
        try:
            concurrencies = sorted({int(c) for c in asked.split(",")})
            if not concurrencies or concurrencies[0] < 1:
                raise ValueError
        except ValueError:
            raise InputError(f"--concurrency {asked}: whole numbers of 1 or more (e.g. 1,8,32), capacity, or plan "
                             "(with --workload)") from None
    profile_shares = shares_option(args.profile_lengths, "--profile-lengths")
    context_shares = shares_option(args.profile_contexts, "--profile-contexts")
    if not (0 < args.scale <= 1) or args.requests < 1:
        raise InputError("--scale is a share above 0 and at most 1, --requests 1 or more. Fix: e.g. --scale 1 --requests 200")
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        raise InputError(f"--api-key-env {args.api_key_env}: that variable is empty. Fix: export it with a key of "
                         "the gateway (never on the command line)")
    # Every address is checked before the first request: a bad one must not surface after the load.
    http_url(args.url, "--url", "https://api.example.com")
    if args.compare_url:
        http_url(args.compare_url, "--compare-url", "https://baseline.example.com")
    fleet, prometheus = None, None
    if args.prometheus and not args.render_job:  # asked once now: down, or refusing a query, is said before the load
        from infra.render.metrics import balancedness_roles
        from infra.validation.health import fleet_queries

        prometheus = PrometheusAPI(args.prometheus)
        fleet = fleet_queries(spec.engine.kind, spec.environment.namespace, args.window, list(spec.deployment.pools()),
                              balancedness_roles(spec))
        for query in fleet.values():
            prometheus.vector(query)
    model = args.model or spec.model.name
    scenario = SCENARIOS[args.scenario].scaled(args.scale)
    if args.render_job:
        return render_loadtest_jobs(args, spec, scenario, concurrencies)
    out = Path(args.out)
    result = Validation(args.url)
    pools = spec.deployment.pools()
    decode_role = "decode" if "decode" in pools else "colocated"
    run = Runner(args, spec, model, api_key, out, prometheus, decode_role)
    sweep_notes: list[str] = []
    if args.results:  # the in-cluster Jobs' result folders, copied off their PVC: judged, not run again
        out = Path(args.results)
        try:
            result.sweep = read_sweep(out, scenario.name, concurrencies, spec.slo)
        except LoadTestError as exc:
            raise InputError(f"--results {args.results}: {exc}") from None
    elif result.add("endpoint", endpoint_gates(args.url, model, api_key)):
        out.mkdir(parents=True, exist_ok=True)  # only once there is something to measure
        try:
            if concurrencies is None:
                found = capacity_sweep(scenario.name, lambda c: run(scenario, c), pools[decode_role].instances,
                                       pools[decode_role].max_running_requests, args.max_concurrency)
                result.sweep, concurrencies = found.sweep(), found.concurrencies
                sweep_notes.append(f"decode sweep {found.stopped}")
            else:
                result.sweep = Sweep(scenario.name, [run(scenario, c) for c in concurrencies])
        except LoadTestError as exc:
            result.add("load test", [Gate("aiperf", False, str(exc))])
    if result.sweep:  # the lightest load is judged: it must meet the SLO (the rest measures capacity)
        result.add("load test", result.sweep.runs[0][1])
    comparison = None
    if args.compare_url and result.sweep:
        comparison = compare(args, spec, model, scenario, concurrencies, api_key, out, result)
    if fleet and result.passed:
        from infra.validation.health import fleet_gates

        result.add("fleet", fleet_gates({name: prometheus.query(q) for name, q in fleet.items()}))
    if args.plot and result.sweep:
        plot(args, spec, scenario, result.sweep, comparison, out)
    profile, profile_notes = None, []
    if args.profile_out and result.sweep and result.passed:
        import yaml

        from infra.spec import prefill_chunk_tokens
        from infra.validation.profile import ProfilePlan

        prefill_pool = pools.get("prefill", pools.get("colocated"))
        chunk = prefill_chunk_tokens(spec) * (prefill_pool.gpus_per_instance() if prefill_pool.dp_attention else 1)
        planned_runs = ProfilePlan(scenario.input_tokens, scenario.output_tokens, profile_shares, context_shares,
                                   chunk, prefill_pool.instances)
        others, missing = ({}, []) if args.results else other_length_runs(
            run, scenario, planned_runs.levels(concurrencies))
        lengths, loaded, contexts = planned_runs.inputs([r for r, _ in result.sweep.runs], others)
        when = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
        kv_tokens = None
        if fleet:
            from infra.validation.health import kv_capacity_query, kv_tokens_per_instance

            kv_tokens = kv_tokens_per_instance(spec.engine.kind, prometheus.vector(kv_capacity_query(
                spec.engine.kind, spec.environment.namespace, decode_role)))
        profile_notes.append(f"the KV cache of a {decode_role} instance: {kv_tokens:,.0f} tokens, as its engines "
                             "report it" if kv_tokens else
                             f"the KV cache of a {decode_role} instance: not measured (" +
                             ("no --prometheus" if not fleet else "its engines report no KV cache size") +
                             "); the planner caps the batch by max running requests only")
        if prometheus is None:
            sweep_notes.append("decode batches: the sequences each instance held by Little's law on aiperf's "
                               "figures (no --prometheus: the engines' running-requests gauge was not read)")
        profile = measured_workload(result.sweep, prefill_pool.instances, pools[decode_role].instances, args.url,
                                    when, lengths=lengths, contexts=contexts, loaded=loaded,
                                    max_running_requests=pools[decode_role].max_running_requests,
                                    kv_cache_tokens=kv_tokens, notes=sweep_notes + missing)
        profile_notes += profile["measured"].get("notes", [])
        write_output(args.profile_out, f"# measured by pdctl validate-deployment ({spec.environment.name}); read by "
                                       "pdctl plan --workload. capacity is per instance; arrival_rate_rps is what the "
                                       "test sustained inside the SLO: set the production peak to plan for demand\n"
                     + yaml.safe_dump(profile, sort_keys=False))
    runs = [dataclasses.asdict(r) | {"gates": g} for r, g in (result.sweep.runs if result.sweep else [])]

    def text() -> None:
        print_table(f"validation of {spec.environment.name} at {args.url}", ("stage", "gate", "result", "detail"),
                     [(stage, g.name, "[green]pass[/green]" if g.passed else "[red]FAIL[/red]", g.detail)
                      for stage, g in result.gates])
        if result.sweep:
            print_table(f"aiperf sweep: {scenario.name} ({scenario.input_tokens} in / {scenario.output_tokens} out"
                         f", {scenario.turns} turn(s))",
                         ("concurrency", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "tok/s/user", "output tok/s", "within SLO"),
                         [(str(r.concurrency), f"{r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f}",
                           f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f}", f"{r.tokens_per_second_per_user:.1f}",
                           f"{r.output_tokens_per_second:.0f}", "yes" if all(x.passed for x in g) else "no")
                          for r, g in result.sweep.runs])
        if comparison:
            print_table(f"side by side, the same load: {args.url} (A) and {args.compare_url} (B)",
                         ("concurrency", "TTFT p99 A / B ms", "TPOT p99 A / B ms", "tok/s/user A / B",
                          "output tok/s A / B", "B / A output"),
                         [(str(row["concurrency"]), f"{row['a'].ttft_p99_ms:.0f} / {row['b'].ttft_p99_ms:.0f}",
                           f"{row['a'].itl_p99_ms:.1f} / {row['b'].itl_p99_ms:.1f}",
                           f"{row['a'].tokens_per_second_per_user:.1f} / {row['b'].tokens_per_second_per_user:.1f}",
                           f"{row['a'].output_tokens_per_second:.0f} / {row['b'].output_tokens_per_second:.0f}",
                           f"{row['b'].output_tokens_per_second / row['a'].output_tokens_per_second:.2f}x")
                          for row in comparison])
        if profile:
            console.print(f"wrote {args.profile_out}: the measured surface `pdctl plan --workload` reads")
            for note in profile_notes:
                console.print(f"[yellow]{escape(note)}[/yellow]")

    emit(args, "validation", {"environment": spec.environment.name, "url": args.url, "passed": result.passed,
                               "gates": [{"stage": s, **dataclasses.asdict(g)} for s, g in result.gates],
                               "runs": runs, "profile": args.profile_out if profile else None,
                               "comparison": comparison, "plot": args.plot if result.sweep and args.plot else None}, text)
    if not result.passed:
        failed = "; ".join(f"{g.name}: {g.detail}" for _, g in result.gates if not g.passed)
        err_console.print(f"[red]validation failed: {escape(failed)}[/red]", highlight=False, soft_wrap=True)
    return 0 if result.passed else EXIT_FAILED

