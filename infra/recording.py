"""Run a Pulumi program under Pulumi's own mocks and record what it registers.

`pulumi.runtime.set_mocks` swaps the engine and resource monitor for in-process fakes; the
program itself is unchanged, so what is recorded here is what `pulumi preview` would send to the
providers. This module takes the program as an argument and imports no program: it sits below the
programs, and so do the renderers that read its records. Which program builds a spec, and what
its StackReferences read, is infra/offline.py's, above the programs.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import pulumi
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _ensure_event_loop, _sync_await

from infra.platform_stack.weight_cache import INSTANCE_STORE_GB

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
    remote: bool = False  # a component a provider implements (helm.v4.Chart, eks.Cluster): it creates resources
    # What the engine orders creates and deletes by (RegisterResourceRequest): `depends_on` as the
    # SDK expanded it (a local component's children, a remote component itself), the resources
    # each input's value came from, and the provider reference (`urn::id`).
    dependencies: tuple[str, ...] = ()
    property_dependencies: dict[str, tuple[str, ...]] = field(default_factory=dict)
    provider: str = ""
    deleted_with: str = ""
    retain_on_delete: bool = False
    protect: bool = False

    @property
    def depends_on_urns(self) -> set[str]:
        """Every URN this registration waits for and outlives, as the engine reads it
        (pulumi/pkg resource/graph DependencyGraph.DependenciesOf: dependencies, property
        dependencies, deleted-with and the provider; the parent is apart)."""
        urns = set(self.dependencies).union(*self.property_dependencies.values())
        if self.deleted_with:
            urns.add(self.deleted_with)
        if self.provider:
            urns.add(self.provider.rsplit("::", 1)[0])
        return urns

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
    # The stack's outputs as the engine would store them: through the SDK's own serialization,
    # which drops an output whose value is None. What a StackReference to this stack reads.
    exports: dict[str, Any] = field(default_factory=dict)

    def custom(self) -> list[RegisteredResource]:
        return [r for r in self.resources if (r.custom or r.remote) and not r.type.startswith("pulumi:providers:")
                and r.type != "pulumi:pulumi:StackReference"]

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
    """Echo inputs as outputs; give pulumi-random resources a fake result, StackReferences the
    outputs `stack_outputs` answers for their stack's name and the cloud look-ups the platform
    program makes a stand-in answer."""

    def __init__(self, stack_outputs: Callable[[str], dict]):
        self.stack_outputs = stack_outputs
        # The inputs of the registration this thread is making (Pulumi's mock monitor runs each
        # in an executor thread), so RecordingMonitor need not deserialize them a second time:
        # for the platform's CRDs that is megabytes of schema.
        self.inputs_seen = threading.local()

    def new_resource(self, args: pulumi_mocks.MockResourceArgs):
        self.inputs_seen.value = args.inputs
        state = dict(args.inputs)
        if args.typ.startswith("random:index/random"):
            state["result"] = fake_secret(args.name)
        if args.typ == "pulumi:pulumi:StackReference":
            state["outputs"] = self.stack_outputs(args.name)
        if args.resource_id and args.typ == "kubernetes:core/v1:Secret":  # a read (`Secret.get`)
            state.update(_user_secret(args.resource_id))
        if args.resource_id and args.typ == "kubernetes:core/v1:Node":  # a read (`Node.get`): an untainted node
            state.update({"apiVersion": "v1", "kind": "Node", "metadata": {"name": args.resource_id}, "spec": {}})
        arn = _mock_arn(args.typ, args.name, args.inputs)
        if arn:
            state.setdefault("arn", arn)
        if args.typ == "aws:ec2/securityGroup:SecurityGroup":  # EC2's id shape: CRD patterns check it
            return "sg-" + hashlib.sha256(args.name.encode()).hexdigest()[:17], state
        return f"{args.name}-id", state

    def call(self, args: pulumi_mocks.MockCallArgs):
        return _CALLS.get(args.token, lambda a: {})(args.args)


def _user_secret(resource_id: str) -> dict:
    """A Secret the program reads (`<namespace>/<name>`: the user's, whose values only the cluster
    holds), as a stand-in: the keys of an S3 credentials Secret, each holding a fake value."""
    namespace, _, name = resource_id.rpartition("/")
    value = base64.b64encode(fake_secret(resource_id).encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"namespace": namespace, "name": name},
            "type": "Opaque", "data": {key: value for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}


MOCK_ACCOUNT, MOCK_REGION = "000000000000", "us-east-1"


def _mock_arn(type_: str, name: str, inputs: dict) -> str | None:
    """An ARN of the shape AWS gives the resource (IAM User Guide, "IAM identifiers"; KMS key
    ARNs), so what reads it (policies, their checks against IAM's resource types) sees one."""
    if type_ == "aws:iam/role:Role":
        return f"arn:aws:iam::{MOCK_ACCOUNT}:role/{inputs.get('name') or name}"
    if type_ == "aws:iam/openIdConnectProvider:OpenIdConnectProvider":
        return f"arn:aws:iam::{MOCK_ACCOUNT}:oidc-provider/{str(inputs.get('url', name)).removeprefix('https://')}"
    if type_ == "aws:kms/key:Key":
        key_id = hashlib.sha256(name.encode()).hexdigest()
        return (f"arn:aws:kms:{MOCK_REGION}:{MOCK_ACCOUNT}:key/"
                f"{key_id[:8]}-{key_id[8:12]}-{key_id[12:16]}-{key_id[16:20]}-{key_id[20:32]}")
    return None


def _cluster(args: dict) -> dict:
    name = args.get("name", "cluster")
    return {"name": name, "arn": f"arn:aws:eks:{MOCK_REGION}:{MOCK_ACCOUNT}:cluster/{name}",
            "endpoint": f"https://{name}.eks.example", "certificateAuthorities": [{"data": "bW9jaw=="}],
            "vpcConfig": {"vpcId": "vpc-mock"}, "identities": [{"oidcs": [{"issuer": f"https://oidc.eks.example/{name}"}]}],
            # a mode that takes access entries (DescribeCluster accessConfig; tests refuse CONFIG_MAP's)
            "accessConfigs": [{"authenticationMode": "API_AND_CONFIG_MAP", "bootstrapClusterCreatorAdminPermissions": True}]}


def _instance_type(args: dict) -> dict:
    return {"instanceType": args.get("instanceType"), "totalInstanceStorage": INSTANCE_STORE_GB.get(args.get("instanceType"))}


# Stand-ins for the data sources the cloud layer reads (no cloud offline).
_CALLS = {
    "aws:eks/getCluster:getCluster": _cluster,
    "aws:ec2/getInstanceType:getInstanceType": _instance_type,
    # the VPC's subnets a filter (tag:...) selects: one, so an offline preview has what the user tagged
    "aws:ec2/getSubnets:getSubnets": lambda a: {"ids": ["subnet-0a1b2c3d4e5f60799"], "id": MOCK_REGION},
    "aws:iam/getOpenIdConnectProvider:getOpenIdConnectProvider": lambda a: {
        "arn": _mock_arn("aws:iam/openIdConnectProvider:OpenIdConnectProvider", "", a), "url": a.get("url")},
    "aws:index/getCallerIdentity:getCallerIdentity": lambda a: {
        "accountId": MOCK_ACCOUNT, "arn": f"arn:aws:iam::{MOCK_ACCOUNT}:role/mock", "userId": "MOCK", "id": MOCK_ACCOUNT},
    "aws:index/getPartition:getPartition": lambda a: {
        "partition": "aws", "dnsSuffix": "amazonaws.com", "reverseDnsPrefix": "com.amazonaws", "id": "aws"},
}


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """The stock mock monitor, also keeping each registration's type, parent and inputs."""

    def __init__(self, mocks: RecordingMocks):
        super().__init__(mocks)
        self.recorded: list[RegisteredResource] = []

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            inputs = self.mocks.inputs_seen.value  # as the stock monitor deserialized them for new_resource
            self.recorded.append(
                RegisteredResource(
                    type=request.type,
                    name=request.name,
                    parent_urn=request.parent,
                    urn=response.urn,
                    custom=bool(request.custom),
                    inputs=_integers_back(inputs),
                    ignore_changes=tuple(request.ignoreChanges),
                    remote=bool(request.remote),
                    dependencies=tuple(request.dependencies),
                    property_dependencies={key: tuple(deps.urns) for key, deps in request.propertyDependencies.items()
                                           if deps.urns},
                    provider=request.provider,
                    deleted_with=request.deletedWith,
                    retain_on_delete=bool(request.retainOnDelete),
                    protect=bool(request.protect),
                )
            )
        return response


def is_secret(value: Any) -> bool:
    return isinstance(value, dict) and value.get(_SIG_KEY) == _SECRET_SIG


def record(program, project: str = "pdstack", stack: str = "dev",
           stack_outputs: Callable[[str], dict] = lambda reference: {}) -> OfflineRun:
    """Run `program()` (a Pulumi program) under mocks; return every registration. A StackReference
    to a stack reads `stack_outputs(its name)`."""
    mocks = RecordingMocks(stack_outputs)
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.settings.SETTINGS.rpc_manager.clear()
    pulumi.runtime.settings.SETTINGS.outputs.clear()
    # A new root stack for each run: set_mocks keeps the one a previous run in this process made,
    # and with it that run's exports.
    pulumi.runtime.settings.set_root_resource(None)
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=True, monitor=monitor)
    _run_until_done_or_interrupted(program)
    exports = _sync_await(_exports_as_stored())
    # Registrations arrive in whatever order the program's outputs resolve, which differs from
    # run to run; sorted by URN, previews and renders are byte-identical and can be diffed.
    return OfflineRun(resources=sorted(monitor.recorded, key=lambda r: r.urn), exports=exports)


async def _exports_as_stored() -> dict[str, Any]:
    """The root stack's `pulumi.export`s, serialized as the SDK sends them to the engine
    (pulumi/runtime/rpc.py serialize_properties: a None value is left out) and read back."""
    from pulumi.runtime import rpc
    from pulumi.runtime.settings import get_root_resource

    root = get_root_resource()
    struct = await rpc.serialize_properties(dict(getattr(root, "outputs", {}) or {}), {})
    return rpc.deserialize_properties(struct)


def _run_until_done_or_interrupted(program) -> None:
    """Run `program` as Pulumi's language host does (`run_pulumi_func`), except that a Ctrl-C
    ends the run with KeyboardInterrupt.

    Pulumi catches whatever the program's body raises, KeyboardInterrupt included, and then
    waits for every registration the program started before it re-raises (pulumi/runtime/
    stack.py `run_pulumi_func`, `except BaseException`). A Ctrl-C that lands inside a resource's
    constructor, after its URN's future is made and before its registration is queued
    (pulumi/runtime/resource.py `register_resource`, across the slow `_get_stack_trace`), leaves
    a future nobody will resolve; its children wait on it, and so that wait never ends
    (`pdctl preview --offline` hung after a Ctrl-C in CI). So the body's interrupt also cancels
    the run, and every task still pending is cancelled and run to its end, as `asyncio.run`
    does, leaving no "Task was destroyed but it is pending" behind."""
    loop = _ensure_event_loop()
    interrupted = False

    def program_or_interrupt():
        nonlocal interrupted
        try:
            return program()
        except KeyboardInterrupt:
            interrupted = True
            run.cancel()  # run_pulumi_func's wait for the registrations ends at its first await
            raise

    run = asyncio.ensure_future(run_pulumi_func(program_or_interrupt), loop=loop)
    try:
        _sync_await(run)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        _cancel_pending_tasks(loop)
        raise KeyboardInterrupt from None
    except KeyboardInterrupt:  # raised in a task's step: Task re-raises it out of the loop
        _cancel_pending_tasks(loop)
        raise


def _cancel_pending_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what an interrupted run left pending and let it end. The run also leaves
    coroutines it made but never started (an Output's `future()`, `is_known()`); they are
    collected here, with Python's "never awaited" warning silenced, since that is what
    stopping a program half way means, not a fault to report."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        del pending  # the tasks hold the last references to those coroutines
        gc.collect()
