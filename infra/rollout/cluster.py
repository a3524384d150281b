"""Where rollout steps land. `Cluster` is the interface the rollout, canary and rollback use.

A revision runs as its own track (its engines and router) beside the one serving now, so
traffic can move between them at the gateway by weight and move back in one change.
Environment-wide steps (namespace, policies, node pools) are shared by every revision.

Every change carries the fence of the lease it is made under, and the cluster keeps the
highest fence it was changed under (on a real cluster: the `pdstack.io/fence` annotation of
the gateway's HTTPRoute, written with a resourceVersion precondition; pulumi_cluster.py). A
change carrying an older fence than the cluster's is refused (`FenceRefused`), like a
compare-and-swap: a process paused while another took its lease over, then continued, cannot
put its stale traffic back, because the new holder raised the cluster's fence first.

`InMemoryCluster` implements the interface for tests and the rollback benchmark (this
machine has no Kubernetes API server): it keeps what was applied, makes it ready after a
simulated latency, and records every traffic change. Kept in a file (`--sim`), it is shared
by separate commands the way an API server is: each read loads the file, each change loads it,
compares fences and writes it under an flock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

from infra.rollout.faultpoints import before_change, sweep_dead_writers
from infra.rollout.releases import LeaseLost
from infra.rollout.steps import ROUTER_STEP, Step
from infra.tracks import serving_revision


class Cluster(Protocol):
    def apply(self, revision: int, step: Step, fence: int) -> None: ...
    def ready(self, revision: int, step: Step) -> bool: ...
    def deployed(self, revision: int) -> bool: ...
    def healthy(self, revision: int) -> bool: ...
    def set_traffic(self, weights: dict[int, int], fence: int) -> None: ...
    def traffic(self) -> dict[int, int]: ...
    def retire(self, revision: int, fence: int) -> None: ...
    def raise_fence(self, fence: int) -> None: ...


class FenceRefused(LeaseLost):
    """A cluster change carrying an older fence than the cluster's: another operation took
    this one's lease over and changed the cluster since. Nothing was changed by this one."""


def fence_refused(what: str, fence: int, current: int) -> FenceRefused:
    return FenceRefused(f"{what} refused: it carries fence {fence}, and the cluster was changed under fence "
                        f"{current} since, by the operation that took this one's lease over. This one stopped "
                        "here; the new holder decides what serves")


def check_weights(weights: dict[int, int]) -> dict[int, int]:
    weights = {r: w for r, w in weights.items() if w}
    if sum(weights.values()) != 100 or any(w < 0 for w in weights.values()):
        raise ValueError(f"traffic weights {weights} must be non-negative and add up to 100")
    return weights


@dataclass
class InMemoryCluster:
    apply_latency: float = 0.0  # seconds one apply (one API round of changes) takes
    ready_latency: float = 0.0  # seconds from apply until the step's resources are ready
    health_latency: float = 0.0  # seconds one health check takes (kubectl wait on a real cluster)
    never_ready: set[tuple[int, str]] = field(default_factory=set)  # (revision, step) that hang
    unhealthy: set[int] = field(default_factory=set)
    applied: dict[object, dict[str, tuple[str, ...]]] = field(default_factory=dict)  # revision|"shared" -> step -> resources
    ready_at: dict[tuple[object, str], float] = field(default_factory=dict)
    weights: dict[int, int] = field(default_factory=dict)
    traffic_log: list[dict[int, int]] = field(default_factory=list)
    fence: int = 0  # the highest fence a change was made under (the route's pdstack.io/fence)
    # A simulated cluster kept in a file is written after every change, as a real cluster
    # keeps what was applied even if the process that applied it dies the next moment.
    saved_to: str | None = None

    def _key(self, revision: int, step: Step) -> object:
        return "shared" if step.shared else revision

    def _load(self) -> None:
        """What the file holds now (another process may have changed it): a read of the API server."""
        if self.saved_to is not None and Path(self.saved_to).exists():
            _fill(self, _read(self.saved_to))

    @contextlib.contextmanager
    def _change(self, what: str, fence: int, latency: float) -> Iterator[None]:
        """One change, as an API server makes it: the fault point and the latency first (a
        process stopped there holds nothing), then, under the file's lock, the current state,
        the fence compared, the change, and the state written whole."""
        before_change(what)
        time.sleep(latency)
        with _locked(self.saved_to):
            self._load()
            if fence < self.fence:
                raise fence_refused(what, fence, self.fence)
            yield
            self.fence = fence
            if self.saved_to is not None:
                save_simulated(self, self.saved_to)

    def raise_fence(self, fence: int) -> None:
        with self._change(f"fence {fence}", fence, latency=0.0):  # one annotation: no rollout, no push
            pass

    def apply(self, revision: int, step: Step, fence: int) -> None:
        with self._change(f"apply {step.name} r{revision}", fence, self.apply_latency):
            key = self._key(revision, step)
            self.applied.setdefault(key, {})[step.name] = step.resources
            self.ready_at[(key, step.name)] = time.monotonic() + self.ready_latency

    def ready(self, revision: int, step: Step) -> bool:
        self._load()
        if (revision, step.name) in self.never_ready:
            return False
        at = self.ready_at.get((self._key(revision, step), step.name))
        return at is not None and time.monotonic() >= at

    def deployed(self, revision: int) -> bool:
        # The router comes in the last per-revision step, after the engines were ready.
        self._load()
        return ROUTER_STEP in self.applied.get(revision, {})

    def healthy(self, revision: int) -> bool:
        time.sleep(self.health_latency)
        return self.deployed(revision) and revision not in self.unhealthy

    def set_traffic(self, weights: dict[int, int], fence: int) -> None:
        weights = check_weights(weights)
        missing = [r for r in weights if not self.deployed(r)]
        if missing:
            raise ValueError(f"cannot route to revision(s) {missing}: not deployed")
        with self._change(f"traffic {weights}", fence, self.apply_latency):  # one route update
            self.weights = dict(weights)
            self.traffic_log.append(dict(weights))

    def traffic(self) -> dict[int, int]:
        self._load()
        return dict(self.weights)

    def retire(self, revision: int, fence: int) -> None:
        self._load()
        if self.weights.get(revision):
            raise ValueError(f"revision {revision} still takes {self.weights[revision]}% of traffic")
        with self._change(f"retire r{revision}", fence, self.apply_latency):
            self.applied.pop(revision, None)


# --- a simulated cluster kept in a file, so separate commands (rollout, then rollback) share it --


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    """The simulated cluster file's lock (the kernel drops it when its holder dies)."""
    if path is None:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(path) -> dict:
    from infra.inputs import load_json

    return load_json(path, "simulated cluster")


def _fill(cluster: InMemoryCluster, data: dict) -> None:
    """`cluster` as the file's `data` says; what this process saw become ready stays ready
    when it did, anything new is ready now (what was ready when saved is ready now)."""
    now = time.monotonic()
    cluster.apply_latency, cluster.ready_latency = data["apply_latency"], data["ready_latency"]
    cluster.unhealthy = set(data["unhealthy"])
    applied = {("shared" if key == "shared" else int(key)): {step: tuple(names) for step, names in steps.items()}
               for key, steps in data["applied"].items()}
    cluster.ready_at = {(owner, step): cluster.ready_at.get((owner, step), now)
                        for owner, steps in applied.items() for step in steps}
    cluster.applied = applied
    cluster.weights = {int(r): w for r, w in data["weights"].items()}
    cluster.traffic_log = [{int(r): w for r, w in entry.items()} for entry in data["traffic_log"]]
    cluster.fence = int(data.get("fence", 0))  # files written before fencing: 0


def load_simulated(path) -> InMemoryCluster:
    """The simulated cluster saved at `path` (a new, empty one if the file does not exist)."""
    path = Path(path)
    sweep_dead_writers(path.parent.glob(f"{path.name}.*.tmp"))
    cluster = InMemoryCluster(saved_to=str(path))
    if path.exists():
        _fill(cluster, _read(path))
    return cluster


def save_simulated(cluster: InMemoryCluster, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"apply_latency": cluster.apply_latency, "ready_latency": cluster.ready_latency,
            "unhealthy": sorted(cluster.unhealthy),
            "applied": {str(k): {s: list(n) for s, n in v.items()} for k, v in cluster.applied.items()},
            "weights": cluster.weights, "traffic_log": cluster.traffic_log, "fence": cluster.fence}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# --- every change recorded as intent first, and fenced ---------------------------------------


@dataclass
class RecordedCluster:
    """A cluster whose every change is written to the release store first, as the tracks it
    will leave (`ReleaseStore.intend`): a crash between the two leaves intent, never an
    unrecorded change, and the Pulumi program deploys exactly those tracks. Before each change
    the lease is checked in the store, and the change carries the lease's fence, which the
    cluster compares with its own (see the module's docstring)."""

    cluster: Cluster
    store: object  # ReleaseStore (not imported: releases.py does not know clusters)

    def _tracks(self) -> dict[int, int]:
        """The recorded tracks; before the first record, what the cluster serves, less revision 0
        (an environment deployed before tracks is no revision: the first rollout cuts over from
        it, and a track 0 would be refused by the store's own model)."""
        recorded = self.store.tracks()
        if recorded is not None:
            return recorded
        return {r: w for r, w in self.cluster.traffic().items() if r}

    def _intend(self, tracks: dict[int, int]) -> int:
        """Record the tracks (if they change), then check the lease: the fence to change under."""
        if tracks != self.store.tracks():
            self.store.intend(tracks)
        return self.store.check_held()

    def hold(self, say: Callable[[str], None]) -> dict[int, int]:
        """Right after taking the lease, before the first change: raise the cluster's fence to
        this lease's, so a change by any earlier holder (one paused, then continued) is refused
        from now on; then reconcile. Returns what the cluster serves, by revision."""
        self.cluster.raise_fence(self.store.check_held())
        return self.reconcile(say)

    def reconcile(self, say: Callable[[str], None]) -> dict[int, int]:
        """The reconcile rule: the cluster is the truth for traffic. Where the store's confirmed
        traffic, or its tracks' weights, differ from what the cluster serves, the difference is
        said, audited, and the store is made to follow the cluster (one fenced state write)
        before anything acts; the operation then acts from what really serves. Revision 0 (the
        environment deployed before tracks) is not a revision and is never written."""
        live = self.cluster.traffic()
        serving = {r: w for r, w in live.items() if r}
        recorded, tracks = self.store.traffic(), self.store.tracks()
        routed = {r: w for r, w in (tracks or {}).items() if w}
        if serving == recorded and (tracks is None or routed == serving):
            return serving
        say(f"the cluster serves {live}, the release store says {recorded} (tracks {tracks}): the store now "
            "follows the cluster (the cluster is the truth for traffic)")
        self.store.follow(serving)
        self.store.audit("reconcile", serving_revision(serving), "store follows the cluster", cluster=serving,
                         store={"traffic": recorded, "tracks": tracks})
        return serving

    def apply(self, revision: int, step: Step) -> None:
        tracks = self._tracks()
        fence = self._intend({**tracks, revision: tracks.get(revision, 0)})
        self.cluster.apply(revision, step, fence)

    def set_traffic(self, weights: dict[int, int]) -> None:
        fence = self._intend({**{r: 0 for r in self._tracks()}, **check_weights(weights)})
        self.cluster.set_traffic(weights, fence)

    def retire(self, revision: int) -> None:
        fence = self._intend({r: w for r, w in self._tracks().items() if r != revision})
        self.cluster.retire(revision, fence)

    def ready(self, revision: int, step: Step) -> bool:
        return self.cluster.ready(revision, step)

    def deployed(self, revision: int) -> bool:
        return self.cluster.deployed(revision)

    def healthy(self, revision: int) -> bool:
        return self.cluster.healthy(revision)

    def traffic(self) -> dict[int, int]:
        return self.cluster.traffic()
