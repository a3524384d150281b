"""Release history: immutable numbered revisions, a serving state, a lease and an audit log,
one set per environment, in one store every actor shares (objectstore.py: a local folder,
the embedded default for one operator, or an S3-compatible bucket, what teams use):

    revisions/0007.json   what revision 7 is: spec snapshot, engine commands, images, router
                          weights. Created once (If-None-Match): two writers never share a number.
    state.json            what serves: confirmed traffic, the tracks the environment should run
                          (written before each cluster change; the Pulumi program deploys them),
                          each revision's status, the unfinished operation. Replaced by
                          compare-and-swap on its ETag, and only by the lease's holder.
    lease.json            who may change the environment now: holder, operation, expiry and a
                          fencing number. Taken and renewed by compare-and-swap; released by
                          replacing it with a released marker (nothing is ever deleted).
    audit/<time>-<id>.json  who did what, when, to which revision, and how it ended: one object
                          an entry, created once, so appends from two machines never collide.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import re
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from infra.render.engine_args import all_launches
from infra.render.router_config import router_launch
from infra.rollout.faultpoints import process_alive
from infra.rollout.objectstore import Conflict, FolderStore, ObjectStore, StoreUnavailable, open_store
from infra.spec import REPO_ROOT, StackSpec
from infra.spec_checks import parse_spec
from infra.tracks import serving_revision

RELEASES_DIR = REPO_ROOT / "releases"
STATE, LEASE = "state.json", "lease.json"
REVISION_KEY = re.compile(r"^revisions/(\d{4,})\.json$")


class ReleaseError(RuntimeError):
    """A release operation that was refused. Nothing was changed when this is raised."""


class LockHeld(ReleaseError):
    pass


class RevisionNotFound(ReleaseError):
    pass


class LeaseLost(ReleaseError):
    """Another operation took this one's lease; this one must stop changing anything."""


def actor() -> str:
    """Who is acting: PDSTACK_ACTOR (set by CI to the approver), else the login name."""
    return os.environ.get("PDSTACK_ACTOR") or f"{getpass.getuser()}@{socket.gethostname()}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _dump(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class Release:
    revision: int
    created_at: str
    author: str
    message: str
    spec_sha256: str
    spec: dict[str, Any]
    engine_commands: dict[str, list[str]]
    router_args: list[str]
    images: dict[str, str]
    router_weights: dict[str, Any]

    def stack_spec(self) -> StackSpec:
        return parse_spec(self.spec)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True) + "\n"


def release_content(spec: StackSpec) -> dict[str, Any]:
    """What a revision records, derived from the spec by the same renderers the program uses."""
    spec_data = spec.model_dump(mode="json")
    canonical = json.dumps(spec_data, sort_keys=True).encode()
    return {
        "spec_sha256": hashlib.sha256(canonical).hexdigest(),
        "spec": spec_data,
        "engine_commands": {role: launch.args for role, launch in all_launches(spec).items()},
        "router_args": router_launch(spec).args,
        "images": {"engine": spec.engine.image, **spec.images.model_dump()},
        "router_weights": spec.deployment.load_balancer.weights.model_dump(),
    }


def store_for(spec: StackSpec, override: str | None = None) -> "ReleaseStore":
    """The environment's release store: `override` (pdctl --releases), else the spec's
    environment.release_store. A relative folder is the project's (where Pulumi runs the
    program), an override's is the caller's."""
    where = spec.environment.release_store
    url = override or where.url
    if not url.startswith("s3://"):
        base = Path(url) if override else REPO_ROOT / url
        return ReleaseStore(spec.environment.name, base.resolve())
    bucket_and_prefix = url[len("s3://"):].strip("/")
    objects = open_store(f"s3://{bucket_and_prefix}/{spec.environment.name}", where.endpoint_url, where.region)
    return ReleaseStore(spec.environment.name, objects=objects)


class ReleaseStore:
    LEASE_SECONDS = 900  # renewed by every state write; a rollout writes at least once per stage

    def __init__(self, environment: str, root: Path | None = None, objects: ObjectStore | None = None):
        self.environment = environment
        self.objects: ObjectStore = objects or FolderStore((root or RELEASES_DIR) / environment)
        self.location = self.objects.location
        self._held: dict[str, Any] | None = None  # the lease this process holds, while it does
        self._state_copy: tuple[dict[str, Any], str | None] | None = None  # see _read_state

    def _json(self, key: str) -> tuple[dict[str, Any], str] | None:
        found = self.objects.read(key)
        if found is None:
            return None
        try:
            data = json.loads(found[0])
        except ValueError as exc:
            raise ReleaseError(f"release store {self.location}: {key} is not JSON ({exc}). Nothing was changed. "
                               "Fix: restore it from the bucket's object versions or from git") from None
        if not isinstance(data, dict):
            raise ReleaseError(f"release store {self.location}: {key} is not a JSON object. Fix: restore it")
        return data, found[1]

    # --- revisions (immutable) ----------------------------------------------------------------

    def revisions(self) -> list[int]:
        """Numbered revision records; anything else in the folder (a stray copy) is ignored."""
        return sorted(int(m.group(1)) for key in self.objects.list("revisions/") if (m := REVISION_KEY.match(key)))

    def get(self, revision: int) -> Release:
        key = f"revisions/{revision:04d}.json"
        found = self._json(key)
        if found is None:
            known = ", ".join(map(str, self.revisions())) or "none yet"
            raise RevisionNotFound(
                f"revision {revision} does not exist in {self.location} (revisions: {known}). "
                "Fix: pick one of those, or run `pdctl releases` to list them")
        try:
            return Release(**found[0])
        except TypeError as exc:
            raise ReleaseError(f"release store {self.location}: {key} is not a revision record ({exc}). "
                               "Fix: restore it from the bucket's object versions or from git") from None

    def create(self, spec: StackSpec, message: str = "") -> Release:
        content = release_content(spec)
        while True:
            number = (self.revisions() or [0])[-1] + 1
            release = Release(revision=number, created_at=_now(), author=actor(), message=message, **content)
            try:
                self.objects.create(f"revisions/{number:04d}.json", release.to_json().encode())
                return release
            except Conflict:
                continue  # another writer took the number; take the next

    # --- serving state -------------------------------------------------------------------------

    def _read_state(self) -> tuple[dict[str, Any], str | None]:
        """The state and its ETag. While this process holds the lease nobody else writes it (a
        writer that does makes the next compare-and-swap fail), so the last copy read or
        written is kept: one request per change instead of one per question."""
        if self._held is not None and self._state_copy is not None:
            return json.loads(json.dumps(self._state_copy[0])), self._state_copy[1]
        found = self._json(STATE)
        state, etag = found if found else ({}, None)
        if self._held is not None:
            self._state_copy = (json.loads(json.dumps(state)), etag)
        return state, etag

    def state(self) -> dict[str, Any]:
        state = self._read_state()[0]
        state.setdefault("traffic", {})
        state.setdefault("status", {})
        return state

    def _update_state(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Read, change and compare-and-swap the state. Under a lease, the write carries its
        fencing number: a state already written under a newer lease means this one was taken."""
        self.keep_alive()
        fence = (self._held or {}).get("fence")
        for _ in range(8):  # a conflict is a writer without the lease (none in pdstack) or a race
            state, etag = self._read_state()
            if fence is not None and state.get("fence", 0) > fence:
                current = self.lease() or {}
                self._held, self._state_copy = None, None
                raise LeaseLost(f"{self.environment}: this operation's lease was taken over ({current.get('operation')} "
                                f"of {current.get('actor')} holds it now; fence {state['fence']} > {fence}). It "
                                "stopped here; the new holder decides what serves")
            state.setdefault("traffic", {})
            state.setdefault("status", {})
            change(state)
            if fence is not None:
                state["fence"] = fence
            try:
                data = _dump(state)
                etag = self.objects.create(STATE, data) if etag is None else self.objects.replace(STATE, data, etag)
                if self._held is not None:
                    self._state_copy = (state, etag)
                return
            except Conflict:
                self._state_copy = None  # someone wrote it: read it again
                continue
        raise LeaseLost(f"{self.environment}: the state kept changing under this operation; it stopped here")

    def traffic(self) -> dict[int, int]:
        return {int(k): v for k, v in self.state()["traffic"].items()}

    def status(self, revision: int) -> str | None:
        return self.state()["status"].get(str(revision))

    def record(self, *, traffic: dict[int, int] | None = None, status: dict[int, str] | None = None) -> None:
        """An outcome: the traffic the cluster confirmed, and revisions' statuses."""
        def change(state: dict[str, Any]) -> None:
            if traffic is not None:
                state["traffic"] = {str(k): v for k, v in traffic.items() if v}
            for rev, value in (status or {}).items():
                state["status"][str(rev)] = value
        self._update_state(change)

    def tracks(self) -> dict[int, int] | None:
        """The tracks the environment should run (revision -> weight, standbys at 0), or None
        before any rollout: what the Pulumi program deploys."""
        tracks = self.state().get("tracks")
        return None if tracks is None else {int(k): v for k, v in tracks.items()}

    def intend(self, tracks: dict[int, int]) -> None:
        """Record, before a cluster change, the tracks it will leave."""
        self._update_state(lambda state: state.__setitem__("tracks", {str(k): v for k, v in sorted(tracks.items())}))

    # --- the operation in progress --------------------------------------------------------------

    def operation(self) -> dict[str, Any] | None:
        """The rollout recorded as started and not finished (its process stopped half-way)."""
        return self.state().get("operation")

    def begin_operation(self, kind: str, revision: int | None, serving: dict[int, int], **progress: Any) -> None:
        """Record, before the change, what is about to change and what served before: first
        without a revision (before it is created), then with its number, then each stage."""
        def change(state: dict[str, Any]) -> None:
            previous = state.get("operation") or {}
            state["operation"] = {**previous, "kind": kind, "revision": revision, "actor": actor(),
                                  "started": previous.get("started", _now()),
                                  "serving_before": {str(k): v for k, v in serving.items()}, **progress}
        self._update_state(change)

    def end_operation(self) -> None:
        if self.operation() is not None:
            self._update_state(lambda state: state.pop("operation", None))

    def good_revisions(self) -> list[int]:
        return sorted(int(k) for k, v in self.state()["status"].items() if v == "good")

    def previous_good(self) -> int | None:
        """The newest good revision other than the one serving most traffic now."""
        traffic = self.traffic()
        current = serving_revision(traffic)
        older = [r for r in self.good_revisions() if r != current and (current is None or r < current)]
        return older[-1] if older else None

    # --- audit log -------------------------------------------------------------------------------

    def audit(self, action: str, revision: int | None, outcome: str, **detail: Any) -> None:
        from infra.redaction import redact_data  # an operator's --message may quote a credential

        entry = {"time": _now(), "actor": actor(), "environment": self.environment, "action": action,
                 "revision": revision, "outcome": outcome, **detail}
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
        while True:
            try:
                self.objects.create(f"audit/{stamp}-{secrets.token_hex(4)}.json", _dump(redact_data(entry)))
                return
            except Conflict:
                continue

    def audit_entries(self) -> list[dict[str, Any]]:
        entries = []
        for key in self.objects.list("audit/"):
            found = self._json(key)
            if found:
                entries.append(found[0])
        return entries

    # --- lease -----------------------------------------------------------------------------------

    def _read_lease(self) -> tuple[dict[str, Any], str] | None:
        """The lease as stored. An unreadable one (written by an older version, say) reads as
        expired, so it can be taken over."""
        found = self.objects.read(LEASE)
        if found is None:
            return None
        try:
            held = json.loads(found[0])
            return (held if isinstance(held, dict) and "token" in held else {"unreadable": True}), found[1]
        except ValueError:
            return {"unreadable": True}, found[1]

    def lease(self) -> dict[str, Any] | None:
        """The live lease's holder, or None when nobody holds it."""
        found = self._read_lease()
        return None if found is None or found[0].get("released") else found[0]

    @staticmethod
    def _lease_dead(held: dict[str, Any]) -> str:
        """Why a lease no longer protects anything: '' while it does."""
        if held.get("unreadable"):
            return "its lease record is unreadable"
        if datetime.fromisoformat(held["expires"]) < datetime.now(timezone.utc):
            return f"it expired at {held['expires']}"
        if held.get("host") == socket.gethostname() and not process_alive(int(held["pid"])):
            return f"its process {held['pid']} on {held['host']} is gone"
        return ""

    def _expiry(self) -> str:
        return (datetime.now(timezone.utc) + timedelta(seconds=self.LEASE_SECONDS)).isoformat(timespec="milliseconds")

    @contextlib.contextmanager
    def lock(self, operation: str, force: bool = False) -> Iterator[dict[str, Any]]:
        """Hold this environment's lease for one operation. A live lease of another holder is
        refused, naming it (or, with force, taken over, saying whose it was); one that expired,
        whose process is gone, or that cannot be read is taken over. Both are audited. Each
        state write under it renews it and carries its fencing number: a holder whose lease was
        taken stops at its next state write (LeaseLost)."""
        found = self._read_lease()
        held, etag = found if found else (None, None)
        taken_from = None
        if held is not None and not held.get("released"):
            why = self._lease_dead(held)
            if not why and not force:
                raise self._locked_by(held)
            taken_from = {k: v for k, v in {**held, "why": why or "forced"}.items() if k != "token"}
        lease = {"operation": operation, "actor": actor(), "pid": os.getpid(), "host": socket.gethostname(),
                 "since": _now(), "expires": self._expiry(), "token": secrets.token_hex(8),
                 "fence": int((held or {}).get("fence", 0)) + 1}
        try:
            if etag is None:
                etag = self.objects.create(LEASE, _dump(lease))
            else:
                etag = self.objects.replace(LEASE, _dump(lease), etag)
        except Conflict:  # another taker won the same moment: name it
            now = self.lease() or {}
            raise LockHeld(f"{self.environment} was just locked by {now.get('operation')} of {now.get('actor')} "
                           f"(pid {now.get('pid')} on {now.get('host')}). Nothing was changed. Fix: wait for it "
                           "to finish") from None
        self._held = {**lease, "etag": etag}
        try:
            # Fence first: from this write on, a write of the previous holder fails its
            # compare-and-swap, reads the newer fence and stops (LeaseLost).
            self._update_state(lambda state: None)
            self.objects.sweep()
            if taken_from is not None:
                self.audit("lease", None, "taken over", operation=operation, previous=taken_from)
            yield lease
        finally:
            self._release()

    def _locked_by(self, held: dict[str, Any]) -> LockHeld:
        return LockHeld(
            f"{self.environment} is locked by {held.get('operation')} of {held.get('actor')} (pid "
            f"{held.get('pid')} on {held.get('host')}, since {held.get('since')}, lease until "
            f"{held.get('expires')}). Nothing was changed. Fix: wait for it to finish, or take it over "
            "with --force if that operation is stuck")

    def refuse_if_locked(self) -> None:
        """Raise LockHeld, naming the holder, while a live lease is held: an operation found
        unfinished under it is running, not stopped."""
        held = self.lease()
        if held is not None and not self._lease_dead(held):
            raise self._locked_by(held)

    def _release(self) -> None:
        """Give the lease back if this process still holds it. A store that cannot be written
        now leaves it, to be taken over as its process is gone or it expires."""
        held, self._held, self._state_copy = self._held, None, None
        if held is None:
            return
        with contextlib.suppress(Conflict, StoreUnavailable):
            released = {k: v for k, v in held.items() if k != "etag"}
            self.objects.replace(LEASE, _dump({**released, "released": _now()}), held["etag"])

    def keep_alive(self) -> None:
        """Renew the lease once half of it has run out (each state write calls this; so do long
        waits). A lease taken over meanwhile raises LeaseLost."""
        if self._held is None:
            return
        left = datetime.fromisoformat(self._held["expires"]) - datetime.now(timezone.utc)
        if left.total_seconds() < self.LEASE_SECONDS / 2:
            self._renew()

    def _renew(self) -> None:
        if self._held is None:
            return
        lease = {k: v for k, v in self._held.items() if k != "etag"}
        try:
            etag = self.objects.replace(LEASE, _dump({**lease, "expires": self._expiry()}), self._held["etag"])
        except Conflict:
            current = self.lease() or {}
            self._held, self._state_copy = None, None
            raise LeaseLost(f"{self.environment}: this operation's lease was taken over "
                            f"({current.get('operation')} of {current.get('actor')} holds it now). "
                            "It stopped here; the new holder decides what serves") from None
        self._held = {**self._held, "expires": self._expiry(), "etag": etag}
