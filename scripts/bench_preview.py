"""How much pdstack adds to a preview: `pdctl preview --offline --stack STACK` against a bare
pulumi-kubernetes program that registers the same number of resources under the same mocks,
both as whole processes (imports included), side by side. Prints both times and the ratio.

With --with-platform, the serving stack and the platform stack its spec names are previewed
(two pdctl processes) against one bare program registering every resource of both with the same
inputs (the platform's CRDs are megabytes of schema: a bare program pays to send them too).

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

# The baseline: the same resource types, as many of each, registered with nothing but a name
# under the same kind of mocks, in a fresh process that does nothing else. What is left of
# pdstack's time above it is its own: the spec, the layers, rendering and every check.
BARE = '''
import importlib
import json
import sys

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await


class Mocks(pulumi.runtime.Mocks):
    def new_resource(self, args):
        return f"{args.name}-id", dict(args.inputs)

    def call(self, args):
        return {}, None


types = json.load(open(sys.argv[1]))
pulumi.runtime.set_mocks(Mocks(), project="bare", stack="bench", preview=True)


def resource(i, token):
    pkg, module, kind = token.split(":")
    name = f"r{i}"
    if pkg == "random":
        return getattr(pulumi_random, kind)(name, length=16)
    group, _, version = module.rpartition("/")
    python_module = {"core": "core"}.get(group, group.replace(".k8s.io", "").replace(".", "_"))
    try:
        cls = getattr(importlib.import_module(f"pulumi_kubernetes.{python_module}.{version}"), kind)
    except (ImportError, AttributeError):  # a custom resource
        return k8s.apiextensions.CustomResource(name, api_version=module, kind=kind,
                                                metadata={"name": name, "namespace": "bench"})
    args = {"metadata": {"name": name, "namespace": "bench"}}
    while True:  # an empty value for each property the type requires (spec, role_ref, ...)
        try:
            return cls(name, **args)
        except TypeError as exc:
            args[str(exc).split("'")[1]] = {}


def program():
    for i, token in enumerate(types):
        resource(i, token)


_sync_await(run_pulumi_func(program))
'''

# The same resources with the same inputs, each registered as a plain custom resource of its type.
BARE_INPUTS = '''
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


resources = json.load(open(sys.argv[1]))
pulumi.runtime.set_mocks(Mocks(), project="bare", stack="bench", preview=True)


def program():
    for i, (token, inputs) in enumerate(resources):
        pulumi.CustomResource(token, f"r{i}", inputs)


_sync_await(run_pulumi_func(program))
'''


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
    from infra.spec import stack_spec_path
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path(args.stack))
    if args.with_platform:
        return with_platform(spec, args)
    types = [r.type for r in run_spec(spec).custom()]
    count = len(types)
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text(BARE)
        (Path(tmp) / "types.json").write_text(json.dumps(types))
        pdctl = [sys.executable, "-m", "infra.cli", "preview", "--offline", "--stack", args.stack]
        ours, theirs = [], []
        for _ in range(args.runs):  # interleaved, so a busy machine slows both alike
            ours.append(timed(pdctl))
            theirs.append(timed([sys.executable, str(bare), str(Path(tmp) / "types.json")]))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"preview of {args.stack}: {count} resources, median of {args.runs} runs each, whole processes")
    print(f"  pdctl preview --offline   {a:6.2f} s")
    print(f"  bare pulumi-kubernetes    {b:6.2f} s   (the same resource types and counts, same mocks)")
    print(f"  ratio                     {a / b:6.2f}x   (target 1.5x or less)")
    return 0


def with_platform(spec, args) -> int:
    from infra.offline import run_spec
    from infra.platform_stack.spec import load_platform_spec
    from infra.render.manifests import unwrap
    from infra.spec import REPO_ROOT

    if spec.platform is None:
        print(f"{args.stack} names no platform stack")
        return 2
    platform = load_platform_spec(REPO_ROOT / spec.platform.spec)
    resources = [(r.type, unwrap(r.inputs)) for run in (run_spec(spec), run_spec(platform)) for r in run.custom()]
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text(BARE_INPUTS)
        (Path(tmp) / "resources.json").write_text(json.dumps(resources, default=str))
        pdctl = [sys.executable, "-m", "infra.cli", "preview", "--offline", "--stack"]
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(timed(pdctl + [args.stack]) + timed(pdctl + [spec.platform.name()]))
            theirs.append(timed([sys.executable, str(bare), str(Path(tmp) / "resources.json")]))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"preview of {args.stack} + {spec.platform.name()}: {len(resources)} resources, median of {args.runs} runs")
    print(f"  pdctl preview --offline x2  {a:6.2f} s   (two processes: serving, then platform)")
    print(f"  bare pulumi program         {b:6.2f} s   (one process: the same resources with the same inputs)")
    print(f"  ratio                       {a / b:6.2f}x   (target 1.5x or less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
