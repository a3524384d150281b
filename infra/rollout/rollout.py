"""Roll a new revision out: record it, apply its steps in order, then move traffic to it in
canary stages, judging each stage from Prometheus. A failed step or gate leaves (or puts
back) the serving revision at 100% of traffic, on its own, and says why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from infra.prometheus import PrometheusError
from infra.rollout.canary import DEFAULT_STAGES, Gate, GatePolicy, Observation, Verdict, judge
from infra.rollout.cluster import Cluster, RecordedCluster
from infra.rollout.records import OperationRecord, Release
from infra.rollout.releases import ReleaseError, ReleaseStore
from infra.rollout.steps import Step, plan_steps
from infra.spec import SpecError, StackSpec
from infra.tracks import plan_tracks, serving_revision, splits_traffic_by_weight


class StepFailed(ReleaseError):
    pass


class RolloutRefused(ReleaseError):
    """The rollout cannot run as asked; checked before anything changed."""


class CanaryFailed(ReleaseError):
    pass


@dataclass(frozen=True)
class RolloutOptions:
    stages: tuple[int, ...] = DEFAULT_STAGES  # percent of traffic on the new revision, in order
    bake_seconds: float = 300.0  # time at each stage before it is judged
    poll_seconds: float = 5.0  # how often readiness is checked
    timeout_scale: float = 1.0  # tests shrink the steps' timeouts
    policy: GatePolicy = field(default_factory=GatePolicy)

    def __post_init__(self):
        if not self.stages or list(self.stages) != sorted(set(self.stages)) or self.stages[-1] != 100 or self.stages[0] <= 0:
            raise ValueError(f"stages {self.stages}: must rise strictly from above 0 and end at 100. Fix: e.g. 1,5,25,50,100")
        for name in ("bake_seconds", "poll_seconds", "timeout_scale"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "bake_seconds"):
                raise ValueError(f"{name} {value:g}: must be a finite number of seconds above 0 (bake may be 0). "
                                 "Fix: e.g. --bake 300")


def steps_for(spec: StackSpec) -> list[Step]:
    """The steps of this spec, from the resources the real program registers (run under mocks)."""
    from infra.offline import run_spec

    return plan_steps(spec, run_spec(spec).resources)


def apply_steps(cluster: Cluster, store: ReleaseStore, revision: int, steps: list[Step],
                options: RolloutOptions, console: Console) -> None:
    """Apply each step and wait for it to be ready; raise StepFailed at the first that is not."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        for step in steps:
            if not step.resources:
                continue
            task = progress.add_task(f"r{revision} {step.name} ({len(step.resources)} resources)", total=1)
            started = time.monotonic()
            store.audit("apply", revision, "started", step=step.name)
            cluster.apply(revision, step)
            deadline = started + step.timeout_seconds * options.timeout_scale
            while not cluster.ready(revision, step):
                if time.monotonic() > deadline:
                    waited = time.monotonic() - started
                    store.audit("apply", revision, "timed out", step=step.name, seconds=round(waited, 3))
                    progress.update(task, description=f"[red]r{revision} {step.name}: not ready after {waited:.0f}s")
                    raise StepFailed(f"step '{step.name}' of revision {revision} was not ready within "
                                     f"{step.timeout_seconds * options.timeout_scale:g}s (waiting for: "
                                     f"{', '.join(step.waits_for) or 'its resources'})")
                store.keep_alive()  # a model load can outlast half the lease
                time.sleep(options.poll_seconds)
            store.audit("apply", revision, "ready", step=step.name, seconds=round(time.monotonic() - started, 3))
            progress.update(task, completed=1, description=f"[green]r{revision} {step.name}")


def _route(cluster: Cluster, store: ReleaseStore, weights: dict[int, int]) -> None:
    cluster.set_traffic(weights)
    store.record(traffic=weights)


def _refuse_weighted_stages(spec: StackSpec, stages: tuple[int, ...]) -> None:
    if not splits_traffic_by_weight(spec) and tuple(stages) != (100,):
        # Checked before anything changes: plan_tracks would refuse the first weighted stage.
        raise RolloutRefused(f"stages {','.join(map(str, stages))}: with load_balancer.implementation gateway_epp "
                             "the gateway routes one InferencePool per rule, so revisions cannot share traffic. "
                             "Fix: --stages 100 (a blue/green switch, judged at 100%, the old revision kept warm)")


def _unfinished_refusal(store: ReleaseStore, unfinished: OperationRecord) -> RolloutRefused:
    return RolloutRefused(
        f"{store.environment}: the {unfinished.kind} of revision {unfinished.revision} by "
        f"{unfinished.actor} (started {unfinished.started}"
        + (f", at its {unfinished.stage}% stage" if unfinished.stage else "")
        + ") never finished. Nothing was changed. Fix: `pdctl rollout --resume` (carry on from that stage), "
        "`pdctl rollout --abort` (traffic back to what served before it) or `scripts/rollback`")


def say_to(console: Console) -> Callable[[str], None]:
    """How the commands tell the operator what reconciling found (markup in it is text)."""
    return lambda text: console.print(f"[yellow]{escape(text)}[/yellow]", highlight=False, soft_wrap=True)


def _refuse_unless_it_fits(store: ReleaseStore, spec: StackSpec, baseline: int | None) -> None:
    """The new revision's track beside the serving one, as the program will plan them
    (plan_tracks): refused here, before anything changes, rather than by `pulumi up` later."""
    revisions = store.revisions()  # one listing: a request on the S3 store
    if baseline is None or baseline not in revisions:
        return
    upcoming = store.next_revision()
    try:
        plan_tracks([(baseline, 100, store.get(baseline).spec), (upcoming, 0, spec.model_dump(mode="json"))])
    except SpecError as exc:
        raise RolloutRefused(f"revision {upcoming} cannot run beside revision {baseline}, which serves: "
                             + "; ".join(exc.problems) + ". Nothing was changed") from None


def _refuse_unless_judgeable(observe: Callable[[int], Observation], revision: int) -> None:
    """The gates' queries asked once before anything changes: a Prometheus that is down, or that
    refuses a query (HTTP 400), would otherwise fail the first stage only after the revision was
    deployed and took traffic. No answer yet (no series) is fine; no answer at all is not."""
    try:
        observe(revision)
    except PrometheusError as exc:
        raise PrometheusError(f"{exc}. The canary gates cannot be read, so nothing was changed. Fix: check "
                              "--prometheus and --window, then run again") from None


def rollout(spec: StackSpec, store: ReleaseStore, cluster: Cluster, observe: Callable[[int], Observation],
            options: RolloutOptions = RolloutOptions(), message: str = "", console: Console | None = None) -> Release:
    """Deploy `spec` as a new revision beside the serving one and canary it to 100%."""
    console = console or Console()
    _refuse_weighted_stages(spec, options.stages)
    cluster = RecordedCluster(cluster, store)
    # Refusals are checked before the lease is taken, so a refused rollout writes nothing;
    # the unfinished operation again under it, as another may have started meanwhile. Reading
    # the cluster first also proves it answers (a missing Pulumi CLI, say).
    store.refuse_if_locked()
    unfinished = store.operation()
    if unfinished is not None:
        raise _unfinished_refusal(store, unfinished)
    live = cluster.traffic()
    _refuse_unless_it_fits(store, spec, serving_revision(live))
    _refuse_unless_judgeable(observe, serving_revision(live) or max(store.revisions(), default=0) + 1)
    steps = steps_for(spec)  # the program under mocks: seconds, so after the quick refusals
    with store.lock("rollout"):
        unfinished = store.operation()  # again: another may have started meanwhile
        if unfinished is not None:
            raise _unfinished_refusal(store, unfinished)
        serving = cluster.hold(say_to(console))  # the cluster fenced, the store following it
        baseline = serving_revision(serving)
        stages = list(options.stages) if baseline is not None else [100]
        # Intent first, with the revision's number reserved: a crash (or a takeover) from here
        # leaves an operation that names it, so the number is never left without a status.
        rev = store.next_revision()
        store.begin_operation("rollout", rev, serving, stages=stages, baseline=baseline)
        # One warm standby is kept (the baseline, after this rollout); older ones make room.
        for standby in sorted(set(store.tracks() or {}) - set(serving)):
            if cluster.deployed(standby):
                cluster.retire(standby)
            store.record(status={standby: "retired"})
        release = store.create(spec, message, revision=rev)
        store.record(status={rev: "candidate"})
        store.audit("rollout", rev, "started", serving=serving, message=release.message)  # as recorded: plain
        _deploy(spec, store, cluster, rev, steps, options, console)
        _canary(spec, store, cluster, observe, rev, baseline, stages, options, console)
        return release


def resume(store: ReleaseStore, cluster: Cluster, observe: Callable[[int], Observation],
           options: RolloutOptions = RolloutOptions(), console: Console | None = None) -> Release:
    """Carry on the unfinished rollout from its recorded stage: deploy what is missing (steps
    are idempotent), route the stage in flight again, judge it, and go on."""
    console = console or Console()
    cluster = RecordedCluster(cluster, store)
    store.refuse_if_locked()  # before the lease is taken: a refused resume writes nothing
    if store.operation() is None:
        raise RolloutRefused(f"{store.environment} has no unfinished rollout to resume. Nothing was changed")
    with store.lock("resume"):
        unfinished = store.operation()  # again: another may have ended it meanwhile
        if unfinished is None:
            raise RolloutRefused(f"{store.environment} has no unfinished rollout to resume. Nothing was changed")
        rev = unfinished.revision
        if unfinished.kind != "rollout" or rev is None or rev not in store.revisions():
            raise RolloutRefused(f"{store.environment}: the unfinished {unfinished.kind} stopped before its "
                                 "revision was recorded, so there is nothing to resume. Nothing was changed. Fix: "
                                 "`pdctl rollout --abort`, then roll out again")
        if store.status(rev) == "failed":
            raise RolloutRefused(f"revision {rev} already failed its rollout; there is nothing to resume. Nothing "
                                 "was changed. Fix: `pdctl rollout --abort`")
        release = store.get(rev)
        spec = release.stack_spec()
        baseline, stages = unfinished.baseline, unfinished.stages
        if baseline is not None and not cluster.healthy(baseline):
            raise RolloutRefused(f"revision {baseline}, which served before, is not healthy, so the canary has "
                                 "nothing to fall back to. Nothing was changed. Fix: `scripts/rollback --to N`")
        _refuse_unless_judgeable(observe, rev)
        cluster.hold(say_to(console))
        stage = unfinished.stage
        remaining = stages[stages.index(stage):] if stage in stages else stages
        console.print(f"resuming the rollout of r{rev} at {remaining[0]}% (stages {remaining}); the cluster "
                      f"serves {cluster.traffic()}")
        store.audit("rollout", rev, "resumed", stage=remaining[0], serving=cluster.traffic())
        if not cluster.deployed(rev) or not cluster.healthy(rev):
            _deploy(spec, store, cluster, rev, steps_for(spec), options, console)
        _canary(spec, store, cluster, observe, rev, baseline, remaining, options, console)
        return release


def _deploy(spec: StackSpec, store: ReleaseStore, cluster: Cluster, rev: int, steps: list[Step],
            options: RolloutOptions, console: Console) -> None:
    try:
        apply_steps(cluster, store, rev, [s for s in steps if s.name != "verify"], options, console)
        if not cluster.healthy(rev):
            raise StepFailed(f"revision {rev} is deployed but not healthy")
    except StepFailed as exc:
        _abandon(cluster, store, rev, str(exc))
        raise


def _canary(spec: StackSpec, store: ReleaseStore, cluster: Cluster, observe: Callable[[int], Observation], rev: int,
            baseline: int | None, stages: list[int], options: RolloutOptions, console: Console) -> None:
    """Move traffic to `rev` stage by stage, judging each; at the first failed gate all of it
    goes back to `baseline`. Each stage is recorded before its traffic moves (for --resume)."""
    operation = store.operation()
    serving_before = dict(operation.serving_before) if operation else {}
    for stage in stages:
        weights = {rev: stage, **({baseline: 100 - stage} if baseline is not None and stage < 100 else {})}
        store.begin_operation("rollout", rev, serving_before, stages=list(stages), baseline=baseline, stage=stage)
        _route(cluster, store, weights)
        console.print(f"canary r{rev}: {stage}% of traffic, baking {options.bake_seconds:g}s")
        _bake(store, console, options.bake_seconds, f"r{rev} at {stage}%",
              lambda: _readings(observe, rev, baseline))
        verdict = observed_verdict(store, observe, rev, baseline, spec, options)
        store.audit("canary", rev, "passed" if verdict.passed else "failed", stage=stage, gates=_gates(verdict))
        console.print(f"  {'[green]pass' if verdict.passed else '[red]FAIL'}[/] {verdict.reasons()}")
        if not verdict.passed and baseline is not None:
            _route(cluster, store, {baseline: 100})
            _abandon(cluster, store, rev, f"canary failed at {stage}%: {verdict.reasons()}")
            raise CanaryFailed(f"revision {rev} failed its canary at {stage}% ({verdict.reasons()}); "
                               f"revision {baseline} serves 100% again")
        if not verdict.passed:
            store.record(status={rev: "failed"})
            store.audit("rollout", rev, "failed", reason=verdict.reasons())
            store.end_operation()
            raise CanaryFailed(f"revision {rev} (the first) misses its SLO: {verdict.reasons()}. "
                               "It is still serving: there is no earlier revision to fall back to")
    store.record(status={rev: "good"})
    # The previous revision stays deployed as a warm standby: rolling back to it is then a
    # traffic change, which is what keeps `scripts/rollback` under a minute.
    store.audit("rollout", rev, "succeeded", standby=baseline)
    store.end_operation()  # last: until here a crash leaves the operation for --resume or --abort
    console.print(f"[green]revision {rev} serves 100%[/]" + (f"; r{baseline} kept warm for rollback" if baseline else ""))


BAKE_TICK_SECONDS = 30.0  # how often a bake renews the lease and, on a terminal, reads the gates


def _bake(store: ReleaseStore, console: Console, seconds: float, what: str, peek: Callable[[], str]) -> None:
    """Wait out a stage's bake, renewing the lease. On a terminal: a countdown with the gates'
    latest readings (five minutes of silence looks like a hang); elsewhere (CI, a log) quiet."""
    bake_until = time.monotonic() + seconds
    with Progress(TextColumn("  baking {task.description}"), BarColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[readings]}"), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task(what, total=seconds, readings="")
        while (left := bake_until - time.monotonic()) > 0:
            if console.is_terminal:
                progress.update(task, readings=peek())
            time.sleep(min(left, BAKE_TICK_SECONDS))
            progress.update(task, completed=min(seconds, seconds - (bake_until - time.monotonic())))
            store.keep_alive()


def _readings(observe: Callable[[int], Observation], rev: int, baseline: int | None) -> str:
    """The gates' inputs right now, for a person watching: never a verdict, never a failure."""
    def line(o: Observation) -> str:
        return (f"TTFT p99 {o.ttft_p99_s * 1000:.0f} ms, TPOT p99 {o.tpot_p99_s * 1000:.0f} ms, "
                f"errors {o.error_rate:.2%}, KV transfer errors {o.kv_transfer_errors:g}")

    try:
        text = f"r{rev}: {line(observe(rev))}"
        return text + (f" | r{baseline}: {line(observe(baseline))}" if baseline is not None else "")
    except PrometheusError as exc:
        return f"no reading ({str(exc)[:60]})"


OBSERVE_ATTEMPTS = 3  # tries per stage before an unanswered query fails the gate


def observed_verdict(store: ReleaseStore, observe: Callable[[int], Observation], rev: int, baseline: int | None,
                     spec: StackSpec, options: RolloutOptions) -> Verdict:
    """The stage's verdict. Prometheus failing to answer (after bounded retries inside the
    stage) is a failed gate, never an exception: traffic must not stay on a revision nobody
    judged. Each try's queries end by the client's deadline, and the lease is renewed between
    tries, so a slow Prometheus cannot let it run out."""
    error = ""
    for attempt in range(OBSERVE_ATTEMPTS):
        try:
            canary = observe(rev)
            return judge(canary, observe(baseline) if baseline is not None else None, spec.slo, options.policy)
        except PrometheusError as exc:
            error = str(exc)
            time.sleep(options.poll_seconds * (attempt + 1))
            store.keep_alive()
    return Verdict((Gate("metrics", False, f"no answer after {OBSERVE_ATTEMPTS} tries: {error}"),))


def _gates(verdict: Verdict) -> list[dict]:
    return [{"gate": g.name, "passed": g.passed, "detail": g.detail} for g in verdict.gates]


def _abandon(cluster: Cluster, store: ReleaseStore, rev: int, reason: str) -> None:
    """A revision that failed: take it down (it has no traffic) and say so in the history."""
    store.record(status={rev: "failed"})
    cluster.retire(rev)
    store.audit("rollout", rev, "failed", reason=reason, serving=store.traffic())
    store.end_operation()
