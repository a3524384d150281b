"""Roll back: put all traffic on the previous good revision (or a named one) and verify it.

Everything that can refuse is checked before anything changes: the revision must exist
and must not be one that failed, and no other rollout may hold the lock. When the target
still runs as a warm standby (the revision before the last successful rollout always
does), a rollback is one traffic change plus a health check. A revision that is no longer
deployed is applied again first, which on a real cluster takes as long as loading the
model (minutes, not seconds): the command says so when it happens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Console

from infra.rollout.cluster import Cluster, RecordedCluster
from infra.rollout.records import OperationRecord
from infra.rollout.releases import OperationUnreadable, ReleaseError, ReleaseStore
from infra.rollout.rollout import RolloutOptions, apply_steps, say_to, steps_for
from infra.tracks import serving_revision


@dataclass(frozen=True)
class RollbackResult:
    revision: int
    previous_traffic: dict[int, int]
    seconds: float
    redeployed: bool


def unfinished_operation(store: ReleaseStore, force: bool) -> tuple[OperationRecord | None, str | None]:
    """The unfinished operation, or with `force` (None, why) when it cannot be read: the
    emergency path clears it instead of stopping at it. Without force, OperationUnreadable."""
    try:
        return store.operation(), None
    except OperationUnreadable as exc:
        if not force:
            raise
        return None, exc.problem


def choose_target(store: ReleaseStore, to: int | None, unfinished: OperationRecord | None,
                  broken: str | None = None) -> int:
    """The named revision; else, after an operation that never finished (`unfinished`, as
    recorded), the one that served before it (recorded, not guessed); after one that cannot be
    read (`broken`), the newest good revision (a rollout's own revision is good only once it
    finished); else the previous good one."""
    if to is None and unfinished is not None and unfinished.serving_before:
        to = serving_revision(dict(unfinished.serving_before))
    if to is None and broken is not None and store.good_revisions():
        to = store.good_revisions()[-1]
    if to is None:
        to = store.previous_good()
        if to is None:
            raise ReleaseError(f"{store.environment} has no earlier good revision to roll back to "
                               f"(good: {store.good_revisions() or 'none'}). Fix: name one with --to")
    # Its record must be readable: the Pulumi program deploys each track from its record.
    store.get(to)  # RevisionNotFound with the list of revisions, or the record named as unreadable
    if store.status(to) == "failed":
        raise ReleaseError(f"revision {to} failed its rollout. Fix: pick a good one: {store.good_revisions()}")
    return to


def rollback(store: ReleaseStore, cluster: Cluster, to: int | None = None, verify_seconds: float = 30.0,
             poll_seconds: float = 0.5, console: Console | None = None, force: bool = False,
             abort: bool = False) -> RollbackResult:
    """Emergency path: works with or without an unfinished operation (and, with force, takes
    over a live lease or one that cannot be read, and clears an operation that cannot be
    read). `abort` also takes down the unfinished operation's revision."""
    console = console or Console()
    started = time.monotonic()
    cluster = RecordedCluster(cluster, store)
    unfinished, broken = unfinished_operation(store, force)
    target = choose_target(store, to, unfinished, broken)
    with store.lock("abort" if abort else "rollback", force=force):
        if broken is not None:
            say_to(console)(f"{broken}: clearing it (--force)")
        before = cluster.hold(say_to(console))  # the cluster fenced, the store following it
        store.audit("rollback", target, "started", serving=before)
        redeployed = False
        if not cluster.deployed(target):
            console.print(f"[yellow]revision {target} is not running: applying it again (on a real cluster "
                          "this waits for the model to load)[/]")
            spec = store.get(target).stack_spec()
            apply_steps(cluster, store, target, [s for s in steps_for(spec) if not s.shared and s.name != "verify"],
                        RolloutOptions(poll_seconds=poll_seconds), console)
            redeployed = True
        if not cluster.healthy(target):
            store.audit("rollback", target, "refused", reason="target not healthy", serving=before)
            raise ReleaseError(f"revision {target} is not healthy, so traffic was left as it was ({before}). "
                               "Fix: check its pods, or roll back to another revision with --to")
        cluster.set_traffic({target: 100})
        store.record(traffic={target: 100}, status={target: "good"})
        deadline = time.monotonic() + verify_seconds
        while not cluster.healthy(target):
            if time.monotonic() > deadline:
                cluster.set_traffic(before)
                store.record(traffic=before)
                store.audit("rollback", target, "failed", reason="unhealthy after the switch", serving=before)
                raise ReleaseError(f"revision {target} became unhealthy after taking traffic; traffic was put back "
                                   f"as it was ({before})")
            time.sleep(poll_seconds)
        for rev, share in before.items():
            if rev != target and share:
                store.record(status={rev: "rolled back"})
        if unfinished is not None or broken is not None:
            abandoned = unfinished.revision if unfinished is not None else None
            if abandoned is not None and abandoned != target:
                store.record(status={abandoned: "failed" if abort else "rolled back"})
                if abort and cluster.deployed(abandoned):
                    cluster.retire(abandoned)
            # A revision created just before the crash, never given a status, is not left orphaned.
            for rev in store.revisions():
                if store.status(rev) is None and rev != target:
                    store.record(status={rev: "abandoned"})
            store.end_operation()
            kind = unfinished.kind if unfinished is not None else "rollout"
            store.audit(kind, abandoned, "aborted" if abort else "rolled back", serving=target,
                        **({"cleared_unreadable_operation": broken} if broken else {}))
        seconds = time.monotonic() - started
        store.audit("rollback", target, "succeeded", seconds=round(seconds, 3), previous=before, redeployed=redeployed)
    console.print(f"[green]revision {target} serves 100%[/] (was {before}) in {seconds:.2f}s")
    return RollbackResult(target, before, seconds, redeployed)


def abort(store: ReleaseStore, cluster: Cluster, console: Console | None = None,
          force: bool = False) -> RollbackResult | None:
    """After a crash: end the unfinished rollout (traffic back to what served before it, its
    revision taken down); with none, clear a lease its stopped process left (audited), fencing
    the cluster against that process."""
    console = console or Console()
    unfinished, broken = unfinished_operation(store, force)
    if unfinished is not None or broken is not None:
        return rollback(store, cluster, console=console, force=force, abort=True)
    if store.lease() is None:
        raise ReleaseError(f"{store.environment} has no unfinished rollout to abort. Nothing was changed")
    with store.lock("abort", force=force):  # refused while its holder lives; a stale one is taken over
        RecordedCluster(cluster, store).hold(say_to(console))
    console.print("no unfinished rollout: the lease its stopped process left was cleared")
    return None
