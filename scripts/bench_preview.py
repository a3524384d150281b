"""How much pdstack adds to a preview: `pdctl preview --offline --stack STACK` against a bare
Pulumi program that registers the same resources (the same types, with the same inputs) under
the same kind of mocks, both as whole processes (imports included), side by side. Prints both
times and the ratio.

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

# The baseline: a fresh process that imports the provider modules the stack's resource types
# live in (what a program that declares them pays) and registers each resource, with its
# recorded inputs, as a plain custom resource of its type, under mocks that echo the inputs.
# What is left of pdstack's time above it is its own: the spec, the layers, rendering and
# every check.
BARE = '''
import importlib
import json
import sys

import pulumi
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await


class Mocks(pulumi.runtime.Mocks):
    def new_resource(self, args):
        return f"{args.name}-id", dict(args.inputs)

    def call(self, args):
        return {}


stack = json.load(open(sys.argv[1]))
for module in stack["modules"]:
    importlib.import_module(module)
pulumi.runtime.set_mocks(Mocks(), project="bare", stack="bench", preview=True)


def program():
    for i, (token, inputs) in enumerate(stack["resources"]):
        pulumi.CustomResource(token, f"r{i}", inputs)


_sync_await(run_pulumi_func(program))
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


def bare_stack(run) -> dict:
    from infra.render.manifests import unwrap

    resources = [(r.type, unwrap(r.inputs)) for r in run.custom()]
    return {"modules": sorted({provider_module(token) for token, _ in resources}), "resources": resources}


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
            commands.append(([sys.executable, "-m", "infra.cli", "preview", "--offline", "--stack", name],
                             [sys.executable, "-c", BARE, str(Path(tmp) / f"{name}.json")]))
        ours, theirs = [], []
        for _ in range(args.runs):  # interleaved, so a busy machine slows both alike
            ours.append(sum(timed(pdctl) for pdctl, _ in commands))
            theirs.append(sum(timed(bare) for _, bare in commands))
    a, b = statistics.median(ours), statistics.median(theirs)
    names = " + ".join(stacks)
    print(f"preview of {names}: {count} resources, median of {args.runs} runs each, whole processes "
          f"({len(stacks)} per run on each side)")
    print(f"  pdctl preview --offline   {a:6.2f} s")
    print(f"  bare pulumi program       {b:6.2f} s   (the same resources with the same inputs, same mocks)")
    print(f"  ratio                     {a / b:6.2f}x   (target 1.5x or less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
