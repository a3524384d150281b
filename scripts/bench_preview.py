"""How much pdstack adds to a preview: `pdctl preview --offline --stack STACK` against a bare
Pulumi program that registers the same resources (the same types, with the same inputs) under
the same kind of mocks, both as whole processes (imports included), side by side. Prints the
times and the ratios, against each form of the bare program described at BARE below.

With --with-platform, the serving stack and the platform stack its spec names: two stacks are
two programs, so each side runs two processes (the platform's CRDs are megabytes of schema: the
bare program pays to send them too).

    .venv/bin/python scripts/bench_preview.py [--stack prod] [--runs 5] [--with-platform]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The baselines: a fresh process that imports the provider modules the stack's resource types
# live in and registers each resource, with its recorded inputs, under mocks that echo the
# inputs. What is left of pdstack's time above it is its own: the spec, the layers, rendering
# and every check. Two forms of the same program:
# - `typed` (the one the target is judged on): each resource is an instance of its type's own
#   class (k8s.core.v1.Namespace, aws.s3.Bucket, ...), as any program that declares it makes it.
#   That is what Pulumi's runtime works from: it resolves a resource's outputs through its
#   class's typed properties (pulumi/runtime/rpc.py resolve_outputs, `_types.resource_types(type(res))`),
#   and pulumi_aws loads a class only when a program names it (its modules import lazily).
# - `untyped`: a plain pulumi.CustomResource of each type token: no class is loaded and no
#   output is typed, so it is cheaper than any program that declares these types would be.
# Both skip the classes' argument checks (each class's `_internal_init`), so both are lower
# bounds. pdctl sets Python's cycle collector for a short-lived command (infra/cli/__init__.py
# GC_THRESHOLD); the bare program runs with Python's defaults, as Pulumi runs a program, and once
# more, typed, with pdctl's settings, so the report shows what those settings alone are worth.
BARE = '''
import importlib
import json
import sys

if len(sys.argv) > 3:  # the collector settings pdctl uses: threshold, then frozen at exit
    import atexit
    import gc

    gc.set_threshold(*json.loads(sys.argv[3]))
    atexit.register(gc.freeze)

import pulumi
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await


class Mocks(pulumi.runtime.Mocks):
    created = 0

    def new_resource(self, args):
        Mocks.created += 1
        return f"{args.name}-id", dict(args.inputs)

    def call(self, args):
        return {}


stack = json.load(open(sys.argv[1]))
typed = sys.argv[2] == "typed"
for module in stack["modules"]:
    importlib.import_module(module)
pulumi.runtime.set_mocks(Mocks(), project="bare", stack="bench", preview=True)


def program():
    for i, (token, inputs) in enumerate(stack["resources"]):
        where = stack["classes"].get(token) if typed else None
        if where is None:
            pulumi.CustomResource(token, f"r{i}", inputs)
            continue
        cls = getattr(importlib.import_module(where[0]), where[1])
        resource = cls.__new__(cls)  # the class's own instance, registered as its constructor would
        pulumi.CustomResource.__init__(resource, token, f"r{i}", inputs)


_sync_await(run_pulumi_func(program))
if Mocks.created != len(stack["resources"]):  # a registration that failed would make it look fast
    sys.exit(f"registered {Mocks.created} of {len(stack['resources'])} resources")
'''


def provider_module(token: str) -> str:
    """The Python module a resource type's class is declared in, e.g. kubernetes:core/v1:Service
    -> pulumi_kubernetes.core.v1, rbac.authorization.k8s.io/v1:Role -> pulumi_kubernetes.rbac.v1,
    helm.sh/v4:Chart -> pulumi_kubernetes.helm.v4; a custom resource's (a kind the module its
    group's first label names does not declare): the module of CustomResource."""
    import importlib

    package, module, kind = token.split(":")
    if package != "kubernetes":
        return f"pulumi_{package}" if module.startswith("index") else f"pulumi_{package}.{module.split('/')[0]}"
    group, _, version = module.rpartition("/")
    name = f"pulumi_kubernetes.{group.split('.')[0]}.{version}"
    try:
        if hasattr(importlib.import_module(name), kind):
            return name
    except ImportError:
        pass
    return "pulumi_kubernetes.apiextensions"


def provider_class(token: str) -> tuple[str, str] | None:
    """(module, class name) of the custom resource class a provider SDK declares for `token`, or
    None (a Kubernetes custom resource's kind, or a component such as eks:index:Cluster)."""
    import importlib

    import pulumi

    module = provider_module(token)
    kind = token.split(":")[-1]
    cls = getattr(importlib.import_module(module), kind, None)
    if isinstance(cls, type) and issubclass(cls, pulumi.CustomResource) and cls.__name__ == kind:
        return module, kind
    return None


def bare_stack(run) -> dict:
    from infra.render.manifests import unwrap

    resources = [(r.type, unwrap(r.inputs)) for r in run.custom()]
    tokens = sorted({token for token, _ in resources})
    return {"modules": sorted({provider_module(token) for token in tokens}), "resources": resources,
            "classes": {token: where for token in tokens if (where := provider_class(token))}}


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--with-platform", action="store_true", help="also the platform stack the spec names")
    args = parser.parse_args()
    from infra.cli import GC_THRESHOLD
    from infra.offline import run_spec
    from infra.platform_stack.spec import load_platform_spec
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path(args.stack))
    stacks = {args.stack: spec}
    if args.with_platform:
        if spec.platform is None:
            print(f"{args.stack} names no platform stack")
            return 2
        stacks[spec.platform.name()] = load_platform_spec(REPO / spec.platform.spec)
    count = 0
    with tempfile.TemporaryDirectory() as tmp:
        commands = []
        for name, stack_spec in stacks.items():
            stack = bare_stack(run_spec(stack_spec))
            count += len(stack["resources"])
            (Path(tmp) / f"{name}.json").write_text(json.dumps(stack, default=str))
            bare = [sys.executable, "-c", BARE, str(Path(tmp) / f"{name}.json")]
            commands.append(([sys.executable, "-m", "infra.cli", "preview", "--offline", "--stack", name],
                             [*bare, "typed"], [*bare, "untyped"], [*bare, "typed", json.dumps(GC_THRESHOLD)]))
        times: list[list[float]] = [[], [], [], []]
        for _ in range(args.runs):  # interleaved, so a busy machine slows each alike
            for side, column in enumerate(times):
                column.append(sum(timed(command[side]) for command in commands))
    ours, typed, untyped, tuned = (statistics.median(column) for column in times)
    names = " + ".join(stacks)
    print(f"preview of {names}: {count} resources, median of {args.runs} runs each, whole processes "
          f"({len(stacks)} per run on each side)")
    print(f"  pdctl preview --offline           {ours:6.2f} s")
    print(f"  bare pulumi program, typed        {typed:6.2f} s   (each type's own class, same inputs, same mocks)")
    print(f"  bare pulumi program, untyped      {untyped:6.2f} s   (plain CustomResources of the same tokens)")
    print(f"  ratio                             {ours / typed:6.2f}x   (target 1.5x or less)")
    print(f"  ratio to the untyped program      {ours / untyped:6.2f}x")
    print(f"  bare, typed, pdctl's GC settings  {tuned:6.2f} s   ratio {ours / tuned:.2f}x (what the settings alone "
          "are worth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
