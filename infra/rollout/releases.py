"""Release history: immutable numbered revisions, a serving state, a lock and an audit log.

One folder per environment (by default `releases/<env>/` in the project, kept in git so a
pull request shows what changed):

    revisions/0007.json   what revision 7 is: spec snapshot, engine commands, images, router
                          weights. Written once (hard link, so an existing number is never
                          overwritten) and made read-only.
    state.json            what serves now: traffic per revision, and each revision's status
                          (candidate, good, failed, retired). Replaced atomically.
    audit.jsonl           who did what, when, to which revision, and how it ended. Append-only.
    lock                  the lease of the one rollout or rollback that may change this environment:
                          holder, operation, expiry and a token that state writes must still hold.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

from infra.render.engine_args import all_launches
from infra.rollout.faultpoints import before_change, process_alive, sweep_dead_writers
from infra.render.router_config import router_launch
from infra.spec import REPO_ROOT, StackSpec, parse_spec

RELEASES_DIR = REPO_ROOT / "releases"


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


class ReleaseStore:
    def __init__(self, environment: str, root: Path | None = None):
        self.environment = environment
        self.dir = (root or RELEASES_DIR) / environment
        self.revisions_dir = self.dir / "revisions"
        self.state_path = self.dir / "state.json"
        self.audit_path = self.dir / "audit.jsonl"
        self.lock_path = self.dir / "lock"

    # --- revisions (immutable) ----------------------------------------------------------------

    def revisions(self) -> list[int]:
        if not self.revisions_dir.exists():
            return []
        return sorted(int(p.stem) for p in self.revisions_dir.glob("[0-9]*.json"))

    def get(self, revision: int) -> Release:
        path = self.revisions_dir / f"{revision:04d}.json"
        if not path.exists():
            known = ", ".join(map(str, self.revisions())) or "none yet"
            raise RevisionNotFound(
                f"revision {revision} does not exist in {self.dir} (revisions: {known}). "
                "Fix: pick one of those, or run `pdctl releases` to list them")
        return Release(**json.loads(path.read_text()))

    def create(self, spec: StackSpec, message: str = "") -> Release:
        self.revisions_dir.mkdir(parents=True, exist_ok=True)
        content = release_content(spec)
        while True:
            number = (self.revisions() or [0])[-1] + 1
            release = Release(revision=number, created_at=_now(), author=actor(), message=message, **content)
            tmp = self.revisions_dir / f".{number:04d}.{os.getpid()}.tmp"
            before_change(f"create revision {number}")
            tmp.write_text(release.to_json())
            os.chmod(tmp, 0o444)
            try:
                os.link(tmp, self.revisions_dir / f"{number:04d}.json")  # fails if the number exists
                return release
            except FileExistsError:
                continue  # another writer took the number; take the next
            finally:
                tmp.unlink()

    # --- serving state -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        if not self.state_path.exists():
            return {"traffic": {}, "status": {}}
        return json.loads(self.state_path.read_text())

    def _write_state(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(f".{os.getpid()}.tmp")
        before_change("write state")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.state_path)

    def traffic(self) -> dict[int, int]:
        return {int(k): v for k, v in self.state()["traffic"].items()}

    def status(self, revision: int) -> str | None:
        return self.state()["status"].get(str(revision))

    def record(self, *, traffic: dict[int, int] | None = None, status: dict[int, str] | None = None) -> None:
        self._check_fence()
        state = self.state()
        if traffic is not None:
            state["traffic"] = {str(k): v for k, v in traffic.items() if v}
        for rev, value in (status or {}).items():
            state["status"][str(rev)] = value
        self._write_state(state)

    # --- the operation in progress --------------------------------------------------------------

    def operation(self) -> dict[str, Any] | None:
        """The rollout recorded as started and not finished (its process stopped half-way)."""
        return self.state().get("operation")

    def begin_operation(self, kind: str, revision: int | None, serving: dict[int, int]) -> None:
        """Record, before the change, what is about to change and what served before: first
        without a revision (before it is created), then with its number."""
        self._check_fence()
        state = self.state()
        started = (state.get("operation") or {}).get("started", _now())
        state["operation"] = {"kind": kind, "revision": revision, "actor": actor(), "started": started,
                              "serving_before": {str(k): v for k, v in serving.items()}}
        self._write_state(state)

    def end_operation(self) -> None:
        self._check_fence()
        state = self.state()
        if state.pop("operation", None) is not None:
            self._write_state(state)

    def good_revisions(self) -> list[int]:
        return sorted(int(k) for k, v in self.state()["status"].items() if v == "good")

    def previous_good(self) -> int | None:
        """The newest good revision other than the one serving most traffic now."""
        traffic = self.traffic()
        current = max(traffic, key=traffic.get) if traffic else None
        older = [r for r in self.good_revisions() if r != current and (current is None or r < current)]
        return older[-1] if older else None

    # --- audit log -------------------------------------------------------------------------------

    def audit(self, action: str, revision: int | None, outcome: str, **detail: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        entry = {"time": _now(), "actor": actor(), "environment": self.environment, "action": action,
                 "revision": revision, "outcome": outcome, **detail}
        before_change(f"audit {action} {outcome}")
        with self.audit_path.open("a") as f:  # one write per line: appends do not interleave
            f.write(json.dumps(entry, sort_keys=True) + "\n")

    def audit_entries(self) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line]

    # --- lease -----------------------------------------------------------------------------------

    def lease(self) -> dict[str, Any] | None:
        """The lease as recorded, or None. An unreadable one (e.g. written by an older version on
        a full disk) reads as expired, so it can be taken over."""
        try:
            held = json.loads(self.lock_path.read_text())
            return held if isinstance(held, dict) and "token" in held else {"unreadable": True}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"unreadable": True}

    @staticmethod
    def _lease_dead(held: dict[str, Any]) -> str:
        """Why a lease no longer protects anything: '' while it does."""
        if held.get("unreadable"):
            return "its lock file is unreadable"
        if datetime.fromisoformat(held["expires"]) < datetime.now(timezone.utc):
            return f"it expired at {held['expires']}"
        if held.get("host") == socket.gethostname() and not process_alive(int(held["pid"])):
            return f"its process {held['pid']} on {held['host']} is gone"
        return ""

    def _write_lease(self, lease: dict[str, Any], replace: bool) -> None:
        """Write the whole lease first, then put it in place: never an empty or half lock file."""
        tmp = self.dir / f".lock.{lease['token']}.{os.getpid()}.tmp"
        before_change("write lease")
        tmp.write_text(json.dumps(lease, sort_keys=True))
        try:
            if replace:
                os.replace(tmp, self.lock_path)
            else:
                os.link(tmp, self.lock_path)  # fails if another holder put its lease there first
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def lock(self, operation: str, force: bool = False) -> Iterator[dict[str, Any]]:
        """Hold this environment's lease for one operation. A live lease of another holder is
        refused, naming it (or, with force, taken over and said whose it was); one that
        expired, whose process is gone, or that cannot be read is taken over. Both are audited.
        State writes under it carry its token: a holder whose lease was taken stops (LeaseLost)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        held = self.lease()
        taken_from = None
        if held is not None:
            why = self._lease_dead(held)
            if not why and not force:
                raise LockHeld(
                    f"{self.environment} is locked by {held.get('operation')} of {held.get('actor')} (pid "
                    f"{held.get('pid')} on {held.get('host')}, since {held.get('since')}, lease until "
                    f"{held.get('expires')}). Nothing was changed. Fix: wait for it to finish, or take it over "
                    "with --force if that operation is stuck")
            taken_from = {**held, "why": why or "forced"}
            # Move the old lease aside under a unique name: of two takers, one wins the rename.
            aside = self.dir / f".lock.taken.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                os.rename(self.lock_path, aside)
                aside.unlink()
            except FileNotFoundError:
                pass  # another taker moved it; the link below decides who holds it
        lease = {"operation": operation, "actor": actor(), "pid": os.getpid(), "host": socket.gethostname(),
                 "since": _now(), "expires": self._expiry(), "token": secrets.token_hex(8)}
        try:
            self._write_lease(lease, replace=False)
        except FileExistsError:
            raise LockHeld(f"{self.environment} was just locked by another operation. Nothing was changed. "
                           "Fix: run `pdctl releases` to see who holds it") from None
        self._lease_token = lease["token"]
        sweep_dead_writers([*self.dir.glob("*.tmp"), *self.dir.glob(".*.tmp"), *self.revisions_dir.glob(".*.tmp")])
        if taken_from is not None:
            self.audit("lease", None, "taken over", operation=operation, previous=taken_from)
        try:
            yield lease
        finally:
            if (self.lease() or {}).get("token") == lease["token"]:  # not if another took it over
                self.lock_path.unlink(missing_ok=True)
            self._lease_token = None

    LEASE_SECONDS = 900  # renewed by every state write; a rollout writes at least once per stage

    def _expiry(self) -> str:
        return (datetime.now(timezone.utc) + timedelta(seconds=self.LEASE_SECONDS)).isoformat(timespec="milliseconds")

    def _check_fence(self) -> None:
        """A state write under a lease must still hold it (and renews it)."""
        token = getattr(self, "_lease_token", None)
        if token is None:
            return
        held = self.lease()
        if held is None or held.get("token") != token:
            raise LeaseLost(f"{self.environment}: this operation's lease was taken over "
                            f"({(held or {}).get('operation')} of {(held or {}).get('actor')} holds it now). "
                            "It stopped here; the new holder decides what serves")
        self._write_lease({**held, "expires": self._expiry()}, replace=True)
