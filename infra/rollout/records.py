"""What the release store holds, object by object, as strict typed models: what a reader
accepts. Every object read from the store (state, lease, revision records, audit entries, the
operation in progress) is parsed here before anything acts on it, so an object that is
corrupt, half written or written by some other program is named (its key, the field, the fix)
instead of failing later as a TypeError deep inside a rollback.

Times carry their time zone (a lease's expiry without one cannot be compared with now);
revisions, weights and fences are whole numbers in range; a status is one of the statuses
pdstack writes. Unknown keys are refused (`Strict`), except in an audit entry, whose detail is
free by design (each action records its own).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from infra.inputs import Strict, validation_problems
from infra.redaction import redact_text
from infra.spec import StackSpec
from infra.spec_checks import parse_spec

# Numbers are JSON numbers (strict: true or "5" is not a weight); a revision as a mapping key is
# the JSON object key's text, "7".
Revision = Annotated[int, Field(ge=1, strict=True)]
RevisionKey = Annotated[int, Field(ge=1)]
Weight = Annotated[int, Field(ge=0, le=100, strict=True)]
Percent = Annotated[int, Field(ge=1, le=100, strict=True)]


def _aware(text: str) -> str:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError("not an ISO 8601 time") from None
    if when.utcoffset() is None:
        raise ValueError("a time without a time zone")
    return text


AwareTime = Annotated[str, AfterValidator(_aware)]  # kept as written; checked to be one

# ECMA-48 (5th edition, 1991; ISO/IEC 6429) sequences a terminal acts on: a control sequence
# (CSI, ESC [ or 0x9B, parameter bytes 0x30-0x3F, intermediate bytes 0x20-0x2F, a final byte
# 0x40-0x7E, section 5.4), a control string (OSC, DCS, SOS, PM, APC: ESC ] P X ^ _ or their C1
# bytes, up to ST, ESC \ or 0x9C, or xterm's BEL; section 5.6) and any other escape sequence
# (ESC, intermediates, a final byte 0x30-0x7E). Each goes whole, even cut short at the end.
_ESCAPE_SEQUENCE = re.compile(r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
                              r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                              r"|\x1b[\x20-\x2f]*[\x30-\x7e]?")
_WHITESPACE_CONTROLS = re.compile(r"[\t\n\v\f\r]+")
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1


def plain_line(text: str) -> str:
    """Free text another operator will read (a release's message and author, in `pdctl
    releases`), as one line of plain text with no credential in it: terminal escape sequences
    and control characters removed (tabs and line breaks become a space), then redacted. Controls
    go first, so one put inside a token to hide it from redaction joins it again."""
    text = _WHITESPACE_CONTROLS.sub(" ", _ESCAPE_SEQUENCE.sub("", text))
    return redact_text(_CONTROLS.sub("", text))


# Cleaned whenever a record is made or read: written plain, and an older record shown plain.
PlainLine = Annotated[str, AfterValidator(plain_line)]

Status = Literal["candidate", "good", "failed", "retired", "rolled back", "abandoned"]


class Unreadable(RuntimeError):
    """A store object that is not what pdstack writes. `problems` name its fields."""

    def __init__(self, key: str, problems: list[str]):
        super().__init__(f"{key}: " + "; ".join(problems))
        self.key, self.problems = key, problems


class LeaseRecord(Strict):
    """lease.json: who may change the environment now, until when, under which fence."""

    operation: str
    actor: str
    pid: Annotated[int, Field(ge=1, strict=True)]
    host: str
    since: AwareDatetime
    # By its holder's clock, which paces its renewals; whether it expired is judged on the
    # store's clock (the object's last write), never this one (releases.py _lease_dead).
    expires: AwareDatetime
    token: Annotated[str, Field(min_length=1)]
    fence: Annotated[int, Field(ge=1, strict=True)]
    released: AwareDatetime | None = None  # given back: nobody holds it (it is never deleted)


class OperationRecord(Strict):
    """state.json `operation`: the change in progress, recorded before it is made."""

    kind: Literal["rollout"]
    revision: Revision | None  # None: recorded before its number was
    actor: str
    started: AwareTime
    serving_before: dict[RevisionKey, Weight]
    stages: Annotated[list[Percent], Field(min_length=1)]
    baseline: Revision | None = None
    stage: Percent | None = None


class StateRecord(Strict):
    """state.json. `operation` is kept raw here (any JSON) and parsed on its own
    (OperationRecord): a broken operation must not stop the emergency path, which clears it."""

    traffic: dict[RevisionKey, Weight] = {}
    tracks: dict[RevisionKey, Weight] | None = None
    status: dict[RevisionKey, Status] = {}
    fence: Annotated[int, Field(ge=0, strict=True)] = 0
    operation: Any = None


class Release(Strict):
    """revisions/NNNN.json: what a revision is, created once and never changed."""

    revision: Revision
    created_at: AwareTime
    author: PlainLine
    message: PlainLine
    spec_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    spec: dict[str, Any]
    engine_commands: dict[str, list[str]]
    router_args: list[str]
    images: dict[str, Any]  # the engine image and the spec's images section, as the spec dumps it
    router_weights: dict[str, Any]

    def stack_spec(self) -> StackSpec:
        return parse_spec(self.spec)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"


class AuditEntry(Strict):
    """audit/<time>-<id>.json: who did what to which revision, and how it ended."""

    model_config = ConfigDict(extra="allow")  # the action's own detail (step, gates, previous holder...)

    time: AwareTime
    actor: str
    environment: str
    action: str
    revision: Revision | None
    outcome: str


M = TypeVar("M", bound=BaseModel)


def parse_json(key: str, data: bytes) -> Any:
    """The JSON value of a stored object; Unreadable if it is empty, not UTF-8 or not JSON."""
    if not data.strip():
        raise Unreadable(key, ["empty (a write that never finished, or a file someone truncated)"])
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise Unreadable(key, [f"not JSON ({str(exc)[:120]})"]) from None


def parse(key: str, model: type[M], value: Any) -> M:
    """`value` (a stored object, already JSON-decoded) as `model`, or Unreadable naming fields."""
    if not isinstance(value, dict):
        raise Unreadable(key, [f"holds a JSON {type(value).__name__}, not an object of fields"])
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        # What is wrong, field by field; the fix is the store's (restore it), not an edit by hand.
        problems = [line.split(". Fix:")[0] for line in validation_problems(exc, model)]
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise Unreadable(key, [*problems[:3], *([more.lstrip("; ")] if more else [])]) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")
