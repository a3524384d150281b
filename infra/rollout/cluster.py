"""Where rollout steps land. `Cluster` is the interface the rollout, canary and rollback use.

A revision runs as its own track (its engines and router) beside the one serving now, so
traffic can move between them at the gateway by weight and move back in one change.
Environment-wide steps (namespace, policies, node pools) are shared by every revision.

`InMemoryCluster` implements the interface for tests and the rollback benchmark (this
machine has no Kubernetes API server): it keeps what was applied, makes it ready after a
simulated latency, and records every traffic change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from infra.rollout.faultpoints import before_change, sweep_dead_writers
from infra.rollout.steps import ROUTER_STEP, Step


class Cluster(Protocol):
    def apply(self, revision: int, step: Step) -> None: ...
    def ready(self, revision: int, step: Step) -> bool: ...
    def deployed(self, revision: int) -> bool: ...
    def healthy(self, revision: int) -> bool: ...
    def set_traffic(self, weights: dict[int, int]) -> None: ...
    def traffic(self) -> dict[int, int]: ...
    def retire(self, revision: int) -> None: ...


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
    # A simulated cluster kept in a file is written after every change, as a real cluster
    # keeps what was applied even if the process that applied it dies the next moment.
    saved_to: str | None = None

    def _changed(self) -> None:
        if self.saved_to is not None:
            save_simulated(self, self.saved_to)

    def _key(self, revision: int, step: Step) -> object:
        return "shared" if step.shared else revision

    def apply(self, revision: int, step: Step) -> None:
        before_change(f"apply {step.name} r{revision}")
        time.sleep(self.apply_latency)
        key = self._key(revision, step)
        self.applied.setdefault(key, {})[step.name] = step.resources
        self.ready_at[(key, step.name)] = time.monotonic() + self.ready_latency
        self._changed()

    def ready(self, revision: int, step: Step) -> bool:
        if (revision, step.name) in self.never_ready:
            return False
        at = self.ready_at.get((self._key(revision, step), step.name))
        return at is not None and time.monotonic() >= at

    def deployed(self, revision: int) -> bool:
        # The router comes in the last per-revision step, after the engines were ready.
        return ROUTER_STEP in self.applied.get(revision, {})

    def healthy(self, revision: int) -> bool:
        time.sleep(self.health_latency)
        return self.deployed(revision) and revision not in self.unhealthy

    def set_traffic(self, weights: dict[int, int]) -> None:
        weights = check_weights(weights)
        missing = [r for r in weights if not self.deployed(r)]
        if missing:
            raise ValueError(f"cannot route to revision(s) {missing}: not deployed")
        before_change(f"traffic {weights}")
        time.sleep(self.apply_latency)  # one route update
        self.weights = dict(weights)
        self.traffic_log.append(dict(weights))
        self._changed()

    def traffic(self) -> dict[int, int]:
        return dict(self.weights)

    def retire(self, revision: int) -> None:
        if self.weights.get(revision):
            raise ValueError(f"revision {revision} still takes {self.weights[revision]}% of traffic")
        before_change(f"retire r{revision}")
        time.sleep(self.apply_latency)
        self.applied.pop(revision, None)
        self._changed()


# --- a simulated cluster kept in a file, so separate commands (rollout, then rollback) share it --


def load_simulated(path) -> InMemoryCluster:
    """The simulated cluster saved at `path` (a new, empty one if the file does not exist)."""
    from pathlib import Path

    path = Path(path)
    sweep_dead_writers(path.parent.glob(f"{path.name}.*.tmp"))
    if not path.exists():
        return InMemoryCluster(saved_to=str(path))
    from infra.inputs import load_json

    data = load_json(path, "simulated cluster")
    now = time.monotonic()
    cluster = InMemoryCluster(apply_latency=data["apply_latency"], ready_latency=data["ready_latency"],
                              unhealthy=set(data["unhealthy"]), saved_to=str(path))
    for key, steps in data["applied"].items():
        owner = "shared" if key == "shared" else int(key)
        cluster.applied[owner] = {step: tuple(names) for step, names in steps.items()}
        for step in steps:
            cluster.ready_at[(owner, step)] = now  # what was ready when saved is ready now
    cluster.weights = {int(r): w for r, w in data["weights"].items()}
    cluster.traffic_log = [{int(r): w for r, w in entry.items()} for entry in data["traffic_log"]]
    return cluster


def save_simulated(cluster: InMemoryCluster, path) -> None:
    import json
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"apply_latency": cluster.apply_latency, "ready_latency": cluster.ready_latency,
            "unhealthy": sorted(cluster.unhealthy),
            "applied": {str(k): {s: list(n) for s, n in v.items()} for k, v in cluster.applied.items()},
            "weights": cluster.weights, "traffic_log": cluster.traffic_log}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# --- every change recorded as intent first ------------------------------------------------------


@dataclass
class RecordedCluster:
    """A cluster whose every change is written to the release store first, as the tracks it
    will leave (`ReleaseStore.intend`): a crash between the two leaves intent, never an
    unrecorded change, and the Pulumi program deploys exactly those tracks."""

    cluster: Cluster
    store: object  # ReleaseStore (not imported: releases.py does not know clusters)

    def _tracks(self) -> dict[int, int]:
        recorded = self.store.tracks()
        return recorded if recorded is not None else self.cluster.traffic()

    def _intend(self, tracks: dict[int, int]) -> None:
        if tracks != self.store.tracks():
            self.store.intend(tracks)

    def apply(self, revision: int, step: Step) -> None:
        tracks = self._tracks()
        self._intend({**tracks, revision: tracks.get(revision, 0)})
        self.cluster.apply(revision, step)

    def set_traffic(self, weights: dict[int, int]) -> None:
        self._intend({**{r: 0 for r in self._tracks()}, **check_weights(weights)})
        self.cluster.set_traffic(weights)

    def retire(self, revision: int) -> None:
        self._intend({r: w for r, w in self._tracks().items() if r != revision})
        self.cluster.retire(revision)

    def ready(self, revision: int, step: Step) -> bool:
        return self.cluster.ready(revision, step)

    def deployed(self, revision: int) -> bool:
        return self.cluster.deployed(revision)

    def healthy(self, revision: int) -> bool:
        return self.cluster.healthy(revision)

    def traffic(self) -> dict[int, int]:
        return self.cluster.traffic()
