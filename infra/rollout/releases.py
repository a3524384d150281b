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
                          replacing it with a released marker (nothing is ever deleted). Its
                          age is judged on the store's clock alone (its last write against the
                          store's time now), never on this machine's.
    audit/<time>-<id>.json  who did what, when, to which revision, and how it ended: one object
                          an entry, created once, so appends from two machines never collide.

Every object read is parsed by its strict model (records.py): one that is corrupt, half
written or foreign is named with its key and the fix, never acted on. A lease that cannot be
read is taken over only with --force; an operation that cannot be read is cleared by
`rollback --force` (the emergency path runs whatever the store holds besides).
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
from typing import Any, Callable, Iterator, NoReturn, TypeVar

from pydantic import BaseModel

from infra.inputs import InputError
from infra.naming import release_store_url_problem
from infra.render.engine_args import all_launches
from infra.render.router_config import router_launch
from infra.rollout.faultpoints import process_alive
from infra.rollout.objectstore import Conflict, FolderStore, ObjectStore, StoreUnavailable, open_store
from infra.rollout.records import (AuditEntry, LeaseRecord, OperationRecord, Release, StateRecord, Unreadable,
                                   parse, parse_json)
from infra.spec import REPO_ROOT, StackSpec
from infra.tracks import serving_revision

RELEASES_DIR = REPO_ROOT / "releases"
STATE, LEASE = "state.json", "lease.json"
REVISION_KEY = re.compile(r"^revisions/(\d{4,})\.json$")
M = TypeVar("M", bound=BaseModel)


class ReleaseError(RuntimeError):
    """A release operation that was refused. Nothing was changed when this is raised."""


class LockHeld(ReleaseError):
    pass


class RevisionNotFound(ReleaseError):
    pass


class LeaseLost(ReleaseError):
    """Another operation took this one's lease; this one must stop changing anything."""


class StoreObjectUnreadable(ReleaseError):
    """An object of the store is not what pdstack writes (corrupt, half written, foreign).
    `problem` says which and why, without the fix."""

    def __init__(self, message: str, problem: str = ""):
        super().__init__(message)
        self.problem = problem or message


class OperationUnreadable(StoreObjectUnreadable):
    """The recorded operation cannot be read; `rollback --force` clears it."""


class ClockSkewed(ReleaseError):
    """This machine's clock is too far from the store's: refused before anything is written."""


def actor() -> str:
    """Who is acting: PDSTACK_ACTOR (set by CI to the approver), else the login name."""
    return os.environ.get("PDSTACK_ACTOR") or f"{getpass.getuser()}@{socket.gethostname()}"


def local_now() -> datetime:
    """This machine's clock: the one place the release store reads it (the tests move it here).
    It stamps what this machine writes (record and audit times, its lease's own expiry) and
    paces its renewals; whether a lease expired is judged on the store's clock instead."""
    return datetime.now(timezone.utc)


def _now() -> str:
    return local_now().isoformat(timespec="milliseconds")


def _dump(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


def release_content(spec: StackSpec) -> dict[str, Any]:
    """What a revision records, derived from the spec by the same renderers the program uses."""
    spec_data = spec.model_dump(mode="json")
    canonical = json.dumps(spec_data, sort_keys=True).encode()
    return {
        "spec_sha256": hashlib.sha256(canonical).hexdigest(),
        "spec": spec_data,
        "engine_commands": {role: launch.args for role, launch in all_launches(spec).items()},
        "router_args": router_launch(spec).args,
        "images": {"engine": spec.engine_image().image, **spec.images.model_dump()},
        "router_weights": spec.deployment.load_balancer.weights.model_dump(),
    }


def store_for(spec: StackSpec, override: str | None = None) -> "ReleaseStore":
    """The environment's release store: `override` (pdctl --releases), else the spec's
    environment.release_store. A relative folder is the project's (where Pulumi runs the
    program), an override's is the caller's. A URL that is neither (`s3:/bucket`) is refused."""
    where = spec.environment.release_store
    url = where.url if override is None else override
    problem = release_store_url_problem(url)
    if problem:  # the spec's was checked when it was parsed
        raise InputError(f"--releases {url[:80]!r}: {problem}")
    if not url.startswith("s3://"):
        base = Path(url) if override is not None else REPO_ROOT / url
        return ReleaseStore(spec.environment.name, base.resolve())
    bucket_and_prefix = url[len("s3://"):].strip("/")
    objects = open_store(f"s3://{bucket_and_prefix}/{spec.environment.name}", where.endpoint_url, where.region)
    return ReleaseStore(spec.environment.name, objects=objects)


@dataclass(frozen=True)
class BrokenLease:
    """A lease.json pdstack cannot read: whether its holder still runs is unknown."""

    why: str


# How far this machine's clock may be from the store's. A clock kept by NTP is within a second;
# the store's Date has whole seconds. Past this, what this machine writes (its lease's expiry,
# record and audit times, the audit log's order) would be off by as much, and older pdctl
# versions, which judged a lease by its recorded expiry, would misjudge its leases.
MAX_CLOCK_SKEW = timedelta(seconds=60)


@dataclass(frozen=True)
class LeaseSeen:
    """lease.json as read, with the store's own times: `written` when the store last wrote it
    (taken or renewed), `store_now` the store's time as it answered, both on the store's clock;
    `skew` how far this machine's clock is ahead of it (behind: negative; 0 within the read)."""

    held: LeaseRecord | BrokenLease | None
    etag: str | None
    written: datetime | None
    store_now: datetime
    skew: timedelta

    def expires(self, seconds: int) -> datetime | None:
        """When the lease runs out on the store's clock: `seconds` after its last write."""
        return None if self.written is None else self.written + timedelta(seconds=seconds)


def _duration(delta: timedelta) -> str:
    minutes, seconds = divmod(round(abs(delta.total_seconds())), 60)
    return " ".join([*([f"{minutes} min"] if minutes else []), *([f"{seconds} s"] if seconds or not minutes else [])])


class ReleaseStore:
    LEASE_SECONDS = 900  # renewed by every state write; a rollout writes at least once per stage

    def __init__(self, environment: str, root: Path | None = None, objects: ObjectStore | None = None):
        self.environment = environment
        self.objects: ObjectStore = objects or FolderStore((root or RELEASES_DIR) / environment)
        self.location = self.objects.location
        self._held: LeaseRecord | None = None  # the lease this process holds, while it does
        self._held_etag: str | None = None
        self._state_copy: tuple[dict[str, Any], str | None] | None = None  # see _read_state

    # --- reading objects: each parsed by its model (records.py) ---------------------------------

    def _unreadable(self, exc: Unreadable, fix: str, cls: type[StoreObjectUnreadable] = StoreObjectUnreadable
                    ) -> StoreObjectUnreadable:
        problem = f"release store {self.location}: {exc.key} cannot be read: {'; '.join(exc.problems)}"
        return cls(f"{problem}. Nothing was changed. Fix: {fix}", problem)

    def _restore_fix(self, key: str) -> str:
        where = ("the bucket's object versions (aws s3api list-object-versions)" if self.location.startswith("s3://")
                 else "a backup of the folder")
        return f"restore {key} from {where}, or move it away if it is not pdstack's"

    def _object(self, key: str, model: type[M]) -> tuple[M, str] | None:
        found = self.objects.read(key)
        if found is None:
            return None
        try:
            return parse(key, model, parse_json(key, found[0])), found[1]
        except Unreadable as exc:
            raise self._unreadable(exc, self._restore_fix(key)) from None

    # --- revisions (immutable) ----------------------------------------------------------------

    def revisions(self) -> list[int]:
        """Numbered revision records; anything else in the folder (a stray copy) is ignored."""
        return sorted(int(m.group(1)) for key in self.objects.list("revisions/") if (m := REVISION_KEY.match(key)))

    def get(self, revision: int) -> Release:
        key = f"revisions/{revision:04d}.json"
        found = self._object(key, Release)
        if found is None:
            known = ", ".join(map(str, self.revisions())) or "none yet"
            raise RevisionNotFound(
                f"revision {revision} does not exist in {self.location} (revisions: {known}). "
                "Fix: pick one of those, or run `pdctl releases` to list them")
        if found[0].revision != revision:
            raise StoreObjectUnreadable(f"release store {self.location}: {key} records revision "
                                        f"{found[0].revision}. Nothing was changed. Fix: {self._restore_fix(key)}")
        return found[0]

    def next_revision(self) -> int:
        """The number the next revision takes: above every record and every number the state
        names (one an operation reserved before a crash, then recorded as abandoned)."""
        state = self.state()
        named = [*self.revisions(), *map(int, state["status"]), *map(int, state["traffic"]),
                 *map(int, state.get("tracks") or {})]
        operation = state.get("operation")
        if isinstance(operation, dict) and isinstance(operation.get("revision"), int):
            named.append(operation["revision"])
        return max(named, default=0) + 1

    def create(self, spec: StackSpec, message: str = "", revision: int | None = None) -> Release:
        """Record `spec` as revision `revision` (one an operation reserved: a Conflict means
        somebody else wrote it, so this one stops), or as the next free number."""
        content = release_content(spec)
        while True:
            number = revision or (self.revisions() or [0])[-1] + 1
            release = Release(revision=number, created_at=_now(), author=actor(), message=message, **content)
            try:
                self.objects.create(f"revisions/{number:04d}.json", release.to_json().encode())
                return release
            except Conflict:
                if revision is not None:
                    raise LeaseLost(f"{self.environment}: revision {revision}, reserved by this operation, was "
                                    "written by another; it stopped here") from None
                continue  # another writer took the number; take the next

    # --- serving state -------------------------------------------------------------------------

    def _read_state(self) -> tuple[dict[str, Any], str | None]:
        """The state (checked by StateRecord) and its ETag. While this process holds the lease
        nobody else writes it (a writer that does makes the next compare-and-swap fail), so
        the last copy read or written is kept: one request per change instead of one per question."""
        if self._held is not None and self._state_copy is not None:
            return json.loads(json.dumps(self._state_copy[0])), self._state_copy[1]
        found = self._object(STATE, StateRecord)
        state, etag = (found[0].model_dump(mode="json", exclude_none=True), found[1]) if found else ({}, None)
        state.setdefault("traffic", {})
        state.setdefault("status", {})
        if self._held is not None:
            self._state_copy = (json.loads(json.dumps(state)), etag)
        return state, etag

    def state(self) -> dict[str, Any]:
        return self._read_state()[0]

    def _update_state(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Read, change and compare-and-swap the state. Under a lease, the write carries its
        fencing number: a state already written under a newer lease means this one was taken."""
        self.keep_alive()
        fence = self._held.fence if self._held is not None else None
        for _ in range(8):  # a conflict is a writer without the lease (none in pdstack) or a race
            state, etag = self._read_state()
            if fence is not None and state.get("fence", 0) > fence:
                self._lost(f"fence {state['fence']} > {fence}")
            change(state)
            if fence is not None:
                state["fence"] = fence
            try:
                parse(STATE, StateRecord, state)  # never write what a reader would refuse
            except Unreadable as exc:
                raise ReleaseError(f"{self.environment}: pdstack would write a state it cannot read ({exc}); "
                                   "nothing was written") from None
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

    def _lost(self, detail: str) -> NoReturn:
        current = self.lease()
        self._held, self._held_etag, self._state_copy = None, None, None
        holder = (f"{current.operation} of {current.actor} holds it now" if isinstance(current, LeaseRecord)
                  else "nobody holds it now")
        raise LeaseLost(f"{self.environment}: this operation's lease was taken over ({holder}; {detail}). It "
                        "stopped here; the new holder decides what serves")

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

    def follow(self, traffic: dict[int, int]) -> None:
        """Make the store say what the cluster serves (the reconcile rule, rollout/cluster.py):
        confirmed traffic is the cluster's, and so are the tracks' weights (standbys stay at 0)."""
        def change(state: dict[str, Any]) -> None:
            state["traffic"] = {str(k): v for k, v in traffic.items() if v}
            tracks = {int(k): 0 for k in state.get("tracks") or {}} | traffic
            state["tracks"] = {str(k): v for k, v in sorted(tracks.items())}
        self._update_state(change)

    # --- the operation in progress --------------------------------------------------------------

    def operation(self) -> OperationRecord | None:
        """The rollout recorded as started and not finished (its process stopped half-way).
        OperationUnreadable if it is there but cannot be read."""
        raw = self.state().get("operation")
        if raw is None:
            return None
        try:
            return parse(f"{STATE} operation", OperationRecord, raw)
        except Unreadable as exc:
            raise self._unreadable(exc, "`pdctl rollback --force` (or `pdctl rollout --abort --force`) puts all "
                                        "traffic on the newest good revision and clears it (audited); or "
                                        + self._restore_fix(STATE), OperationUnreadable) from None

    def begin_operation(self, kind: str, revision: int | None, serving: dict[int, int], **progress: Any) -> None:
        """Record, before the change, what is about to change and what served before: first
        with its reserved revision number, then each stage."""
        def change(state: dict[str, Any]) -> None:
            previous = state.get("operation") or {}
            operation = OperationRecord(kind=kind, revision=revision, actor=actor(),
                                        started=previous.get("started", _now()), serving_before=serving, **progress)
            state["operation"] = operation.model_dump(mode="json", exclude_none=True)
        self._update_state(change)

    def end_operation(self) -> None:
        """Clear the operation (a broken one too: this is how it is cleared)."""
        if self.state().get("operation") is not None:
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
        stamp = local_now().strftime("%Y%m%dT%H%M%S.%f")
        while True:
            try:
                self.objects.create(f"audit/{stamp}-{secrets.token_hex(4)}.json", _dump(redact_data(entry)))
                return
            except Conflict:
                continue

    def audit_entries(self) -> list[dict[str, Any]]:
        """Every entry, oldest first, each checked by AuditEntry."""
        entries = []
        for key in self.objects.list("audit/"):
            found = self._object(key, AuditEntry)
            if found:
                entries.append(found[0].model_dump(mode="json"))
        return entries

    # --- lease -----------------------------------------------------------------------------------

    def _read_lease(self) -> LeaseSeen:
        """The lease as stored, its ETag and the store's times. One that cannot be read is a
        BrokenLease: whether its holder runs is unknown, so it is taken over only with --force."""
        before = local_now()
        dated = self.objects.read_dated(LEASE)
        after = local_now()
        store_now = dated.now or after  # a store that gives no time: this machine's clock stands in
        # The store answered between `before` and `after` by this clock, and within the second
        # after `store_now` by its own (S3's Date has whole seconds): the skew is at least this.
        latest = store_now + timedelta(seconds=1)
        skew = before - latest if before > latest else after - store_now if after < store_now else timedelta(0)
        held: LeaseRecord | BrokenLease | None = None
        if dated.found is not None:
            try:
                held = parse(LEASE, LeaseRecord, parse_json(LEASE, dated.found[0]))
            except Unreadable as exc:
                held = BrokenLease("; ".join(exc.problems))
        return LeaseSeen(held, dated.found[1] if dated.found else None, dated.modified, store_now, skew)

    def lease(self) -> LeaseRecord | BrokenLease | None:
        """The live lease's holder (or a lease that cannot be read), None when nobody holds it."""
        held = self._read_lease().held
        return None if isinstance(held, LeaseRecord) and held.released is not None else held

    def _lease_dead(self, held: LeaseRecord, seen: LeaseSeen) -> str:
        """Why a lease no longer protects anything: '' while it does. Judged on the store's
        clock only: it expires LEASE_SECONDS after the store last wrote it (its holder renews it
        from half-life on), so a holder that renews is never found expired, whatever the clock
        of the machine asking, or of the holder, says."""
        expires = seen.expires(self.LEASE_SECONDS)
        if expires is not None and expires <= seen.store_now:
            return (f"it expired at {expires.isoformat(timespec='seconds')} by the store's clock "
                    f"({_duration(timedelta(seconds=self.LEASE_SECONDS))} after the store last wrote it)")
        if held.host == socket.gethostname() and not process_alive(held.pid):
            return f"its process {held.pid} on {held.host} is gone"
        return ""

    def _refuse_skewed_clock(self, seen: LeaseSeen) -> None:
        if abs(seen.skew) <= MAX_CLOCK_SKEW:
            return
        raise ClockSkewed(
            f"this machine's clock is about {_duration(seen.skew)} "
            f"{'ahead of' if seen.skew > timedelta(0) else 'behind'} "
            f"the release store's ({self.location} said {seen.store_now.isoformat(timespec='seconds')}; the limit is "
            f"{_duration(MAX_CLOCK_SKEW)}). Leases are judged on the store's clock, but what this machine writes "
            "(its lease's expiry, record and audit times) would be that far off. Nothing was changed. Fix: "
            "synchronise this machine's clock (NTP: `timedatectl set-ntp true`, then `chronyc tracking` or "
            "`timedatectl timesync-status`), then run again")

    def _expiry(self) -> datetime:
        return (local_now() + timedelta(seconds=self.LEASE_SECONDS)).replace(microsecond=0)

    def _write_lease(self, lease: LeaseRecord, etag: str | None) -> str:
        data = _dump(lease.model_dump(mode="json", exclude_none=True))
        return self.objects.create(LEASE, data) if etag is None else self.objects.replace(LEASE, data, etag)

    @contextlib.contextmanager
    def lock(self, operation: str, force: bool = False) -> Iterator[LeaseRecord]:
        """Hold this environment's lease for one operation. A live lease of another holder is
        refused, naming it (or, with force, taken over, saying whose it was); one that expired
        or whose process is gone is taken over; one that cannot be read only with force. Each
        takeover is audited. The fence is above every fence used before (the old lease's and
        the state's), is written into the state first, and each state write under it renews
        it and carries it: a holder whose lease was taken stops at its next write (LeaseLost)."""
        seen = self._read_lease()
        # With --force the operator takes the lease whatever its age, so no clock decides anything:
        # an emergency rollback is not held up by NTP. The skew goes into the takeover's audit.
        if not force:
            self._refuse_skewed_clock(seen)
        held, etag = seen.held, seen.etag
        taken_from = None
        if isinstance(held, BrokenLease):
            if not force:
                raise self._locked_by(held)
            taken_from = {"why": f"its lease record is unreadable ({held.why})"}
        elif held is not None and held.released is None:
            why = self._lease_dead(held, seen)
            if not why and not force:
                raise self._locked_by(held, seen.expires(self.LEASE_SECONDS))
            taken_from = {**held.model_dump(mode="json", exclude={"token", "released"}), "why": why or "forced"}
        if taken_from is not None and abs(seen.skew) > MAX_CLOCK_SKEW:
            taken_from["clock_skew_seconds"] = round(seen.skew.total_seconds())
        fence = max(held.fence if isinstance(held, LeaseRecord) else 0, self.state().get("fence", 0)) + 1
        now = local_now()
        lease = LeaseRecord(operation=operation, actor=actor(), pid=os.getpid(), host=socket.gethostname(),
                            since=now, expires=self._expiry(), token=secrets.token_hex(8), fence=fence)
        try:
            etag = self._write_lease(lease, etag)
        except Conflict:  # another taker won the same moment: name it
            now_held = self.lease()
            raise (self._locked_by(now_held, just=True) if now_held is not None else LockHeld(
                f"{self.environment} was just locked by another operation. Nothing was changed. Fix: run again")) from None
        self._held, self._held_etag = lease, etag
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

    def _locked_by(self, held: LeaseRecord | BrokenLease, until: datetime | None = None, just: bool = False
                   ) -> LockHeld:
        if isinstance(held, BrokenLease):
            return LockHeld(
                f"release store {self.location}: {LEASE} cannot be read ({held.why}), so whether an operation holds "
                f"{self.environment} is unknown. Nothing was changed. Fix: make sure no rollout or rollback of "
                f"{self.environment} is running (here, on another machine, in CI), then take it over with --force "
                "(`pdctl rollback --force`, or `pdctl rollout --abort --force`)")
        if just:
            return LockHeld(f"{self.environment} was just locked by {held.operation} of {held.actor} (pid {held.pid} "
                            f"on {held.host}). Nothing was changed. Fix: wait for it to finish")
        return LockHeld(
            f"{self.environment} is locked by {held.operation} of {held.actor} (pid {held.pid} on {held.host}, since "
            f"{held.since.isoformat()}, lease until {(until or held.expires).isoformat(timespec='seconds')} by the "
            "store's clock unless renewed). Nothing was changed. Fix: wait for it to finish, or take it over with "
            "--force if that operation is stuck")

    def refuse_if_locked(self) -> None:
        """Raise LockHeld, naming the holder, while a live lease is held (or one that cannot be
        read): an operation found unfinished under it is running, not stopped."""
        seen = self._read_lease()
        self._refuse_skewed_clock(seen)
        held = seen.held
        if isinstance(held, BrokenLease):
            raise self._locked_by(held)
        if held is not None and held.released is None and not self._lease_dead(held, seen):
            raise self._locked_by(held, seen.expires(self.LEASE_SECONDS))

    def check_held(self) -> int:
        """This process's fence, after checking, in the store itself, that it still holds the
        lease: called before every cluster change (a paused process must not act on a lease
        another took meanwhile). LeaseLost if it does not."""
        if self._held is None:
            raise LeaseLost(f"{self.environment}: this operation holds no lease; it stopped here")
        stored = self._read_lease().held
        if not isinstance(stored, LeaseRecord) or stored.token != self._held.token or stored.released is not None:
            self._lost(f"the lease in {self.location} is no longer this operation's")
        self.keep_alive()
        return self._held.fence

    def _release(self) -> None:
        """Give the lease back if this process still holds it. A store that cannot be written
        now leaves it, to be taken over as its process is gone or it expires."""
        held, etag = self._held, self._held_etag
        self._held, self._held_etag, self._state_copy = None, None, None
        if held is None:
            return
        with contextlib.suppress(Conflict, StoreUnavailable):
            released = held.model_copy(update={"released": local_now()})
            self._write_lease(released, etag)

    def keep_alive(self) -> None:
        """Renew the lease once half of it has run out (each state write calls this; so do long
        waits). A lease taken over meanwhile raises LeaseLost."""
        if self._held is None:
            return
        left = self._held.expires - local_now()
        if left.total_seconds() < self.LEASE_SECONDS / 2:
            self._renew()

    def _renew(self) -> None:
        if self._held is None:
            return
        renewed = self._held.model_copy(update={"expires": self._expiry()})
        try:
            self._held_etag = self._write_lease(renewed, self._held_etag)
        except Conflict:
            self._lost("its lease record changed")
        self._held = renewed
