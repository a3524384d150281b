"""Run the real Pulumi program under Pulumi's own mocks and collect what it registers.

This is how pdstack previews and renders without a Pulumi CLI or a cluster, and the one
fixture the tests share. `pulumi.runtime.set_mocks` swaps the engine and resource monitor
for in-process fakes; the program itself is unchanged, so what is recorded here is what
`pulumi preview` would send to the providers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pulumi
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.spec import StackSpec

SECRET_PLACEHOLDER = "<secret>"
_SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
_SIG_KEY = "4dabf18193072939515e22adb298388d"


@dataclass
class RegisteredResource:
    type: str
    name: str
    parent_urn: str
    urn: str
    custom: bool
    inputs: dict[str, Any] = field(default_factory=dict)
    ignore_changes: tuple[str, ...] = ()

    @property
    def layer(self) -> str:
        """The pdstack layer this resource belongs to (from its parent chain in the URN)."""
        qualified = self.urn.split("::")[2]  # e.g. pdstack:access:Access$kubernetes:core/v1:Secret
        for part in qualified.split("$"):
            if part.startswith("pdstack:"):
                return part.split(":")[1]
        return "stack"


@dataclass
class OfflineRun:
    resources: list[RegisteredResource]

    def custom(self) -> list[RegisteredResource]:
        return [r for r in self.resources if r.custom and not r.type.startswith("pulumi:providers:")]

    def of_type(self, type_: str) -> list[RegisteredResource]:
        return [r for r in self.resources if r.type == type_]

    def by_kind(self, kind: str) -> list[dict]:
        """Kubernetes manifests of one kind (plain, secrets still wrapped)."""
        return [m for m in (manifest_of(r) for r in self.custom()) if m and m["kind"] == kind]


# The order kubectl and helm print an object in; other top-level keys follow, sorted.
_MANIFEST_KEY_ORDER = ("apiVersion", "kind", "metadata", "spec", "data", "stringData", "type")


def manifest_of(resource: RegisteredResource) -> dict | None:
    """The manifest a kubernetes:* resource sends to the API server, secrets still wrapped."""
    if not resource.type.startswith("kubernetes:") or "apiVersion" not in resource.inputs:
        return None  # providers and other non-object resources
    fields = {k: v for k, v in resource.inputs.items() if not k.startswith("__")}
    first = [k for k in _MANIFEST_KEY_ORDER if k in fields]
    return {k: fields[k] for k in first + sorted(set(fields) - set(first))}


def _integers_back(value: Any) -> Any:
    """Pulumi's wire format (a protobuf Struct) carries every number as a double, so 8000
    arrives as 8000.0; the providers turn them back, and so does this, for what we render."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integers_back(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integers_back(v) for v in value]
    return value


def fake_secret(seed: str) -> str:
    """A stand-in for a generated secret, unique per resource, for offline runs only."""
    return "mock-" + hashlib.sha256(seed.encode()).hexdigest()[:24]


class RecordingMocks(pulumi_mocks.Mocks):
    """Echo inputs as outputs; give pulumi-random resources a fake result."""

    def new_resource(self, args: pulumi_mocks.MockResourceArgs):
        state = dict(args.inputs)
        if args.typ.startswith("random:index/random"):
            state["result"] = fake_secret(args.name)
        return f"{args.name}-id", state

    def call(self, args: pulumi_mocks.MockCallArgs):
        return {}, None


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """The stock mock monitor, also keeping each registration's type, parent and inputs."""

    def __init__(self, mocks: pulumi_mocks.Mocks):
        super().__init__(mocks)
        self.recorded: list[RegisteredResource] = []

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            inputs = pulumi.runtime.rpc.deserialize_properties(request.object, keep_internal=True)
            self.recorded.append(
                RegisteredResource(
                    type=request.type,
                    name=request.name,
                    parent_urn=request.parent,
                    urn=response.urn,
                    custom=bool(request.custom),
                    inputs=_integers_back(inputs),
                    ignore_changes=tuple(request.ignoreChanges),
                )
            )
        return response


def is_secret(value: Any) -> bool:
    return isinstance(value, dict) and value.get(_SIG_KEY) == _SECRET_SIG


def run_offline(program, project: str = "pdstack", stack: str = "dev") -> OfflineRun:
    """Run `program()` (a Pulumi program) under mocks; return every registration."""
    mocks = RecordingMocks()
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.settings.SETTINGS.rpc_manager.clear()
    pulumi.runtime.settings.SETTINGS.outputs.clear()
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=True, monitor=monitor)
    _sync_await(run_pulumi_func(program))
    # Registrations arrive in whatever order the program's outputs resolve, which differs from
    # run to run; sorted by URN, previews and renders are byte-identical and can be diffed.
    return OfflineRun(resources=sorted(monitor.recorded, key=lambda r: r.urn))


def run_spec(spec: StackSpec, project: str = "pdstack") -> OfflineRun:
    from infra.program import build_stack

    return run_offline(lambda: build_stack(spec), project=project, stack=spec.environment.name)
