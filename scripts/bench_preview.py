"""How much pdstack adds to a preview: `pdctl preview --offline --stack STACK` against a bare
pulumi-kubernetes program that registers the same number of resources under the same mocks,
both as whole processes (imports included), side by side. Prints both times and the ratio.

    .venv/bin/python scripts/bench_preview.py [--stack prod] [--runs 5]
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


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from infra.offline import run_spec
    from infra.spec import load_spec, stack_spec_path

    types = [r.type for r in run_spec(load_spec(stack_spec_path(args.stack))).custom()]
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


if __name__ == "__main__":
    sys.exit(main())
