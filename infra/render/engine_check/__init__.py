"""Which rendered engine command lines the pinned engines' own validation has passed.

`scripts/check_engine_args.py` runs every rendered prefill/decode/colocated command line
(leader and worker) of every committed spec and engine variant through the engine's own
argument resolution and checks (`probe.py`, in a scratch virtualenv of several GB, so CI does
not build it) and records each verdict in `verdicts.json`, keyed by a hash of the command and
the hardware it was checked for. The test suite fails when a rendered command has no recorded
passing verdict: change a flag, and the check must be run again.

The command is taken from the real launch script: /bin/sh runs it with LWS's environment for
the leader (worker index 0) and a worker (index 1), with the engine's entry point replaced by
a program that prints its arguments, so shell expansion is what a pod would do.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.render.engine_args import EngineLaunch, all_launches
from infra.spec import StackSpec, stack_spec_path
from infra.spec_checks import load_spec, switch_engine

HERE = Path(__file__).resolve().parent
VERDICTS = HERE / "verdicts.json"
MODELS = HERE / "models"
# The model config each served model is checked with (public dimensions, no weights).
MODEL_CONFIGS = {"deepseek-ai/DeepSeek-V3": "deepseek-v3.json", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json"}
STACKS = ("dev", "prod")
ENGINES = ("sglang", "vllm")


def variant_spec(stack: str, engine: str) -> StackSpec:
    """A committed stack with the engine switched as `render --engine` switches it (its own image, and
    for vLLM the balancer and KV connector it can use)."""
    return switch_engine(load_spec(stack_spec_path(stack)), engine)[0]


@dataclass(frozen=True)
class RenderedCommand:
    label: str  # e.g. "prod/vllm/decode/worker"
    engine: str
    version: str
    gpu_type: str
    gpus_per_node: int
    argv: tuple[str, ...]  # after the entry point (`sglang.launch_server` / `vllm serve`)
    probes: dict
    rdma_devices: tuple[str, ...] = ()

    def key(self) -> str:
        body = json.dumps([self.engine, self.version, self.gpu_type, self.gpus_per_node, list(self.argv),
                           self.probes, list(self.rdma_devices)], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


def launch_argv(launch: EngineLaunch, worker_index: int) -> list[str]:
    """The argv the launch script execs for one pod of the group, expanded by /bin/sh."""
    with tempfile.TemporaryDirectory() as tmp:
        printer = Path(tmp) / ("python3" if launch.engine == "sglang" else "vllm")
        printer.write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
        printer.chmod(printer.stat().st_mode | stat.S_IXUSR)
        env = {"PATH": f"{tmp}:/usr/bin:/bin", "LWS_WORKER_INDEX": str(worker_index),
               "LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": str(launch.nodes)}
        out = subprocess.run(["/bin/sh", "-c", launch.script()], env=env, capture_output=True, check=True).stdout
    argv = out.decode().split("\0")[:-1]
    skip = 2 if launch.engine == "sglang" else 1  # "-m sglang.launch_server" / "serve"
    return argv[skip:]


def dense_mlp_probe(spec: StackSpec) -> dict:
    m = spec.model
    if spec.engine.kind != "sglang" or not m.num_dense_layers() or not m.fp8_block_size:
        return {}
    width = m.dense_intermediate_size
    hidden = json.loads((MODELS / MODEL_CONFIGS[m.name]).read_text())["hidden_size"]
    return {"dense_mlp": {"intermediate_size": width, "hidden_size": hidden, "block": m.fp8_block_size}}


def rendered_commands(spec: StackSpec, name: str) -> list[RenderedCommand]:
    commands = []
    for role, launch in all_launches(spec).items():
        pods = [("leader", 0)] + ([("worker", 1)] if launch.nodes > 1 else [])
        for pod, index in pods:
            commands.append(RenderedCommand(
                label=f"{name}/{role}/{pod}", engine=launch.engine, version=launch.version,
                gpu_type=spec.hardware.gpu_type, gpus_per_node=spec.hardware.gpus_per_node,
                argv=tuple(launch_argv(launch, index)), probes=dense_mlp_probe(spec),
                rdma_devices=tuple(spec.hardware.fabric.devices if spec.hardware.fabric else ())))
    return commands


def committed_commands() -> list[RenderedCommand]:
    """Every engine command line of every committed spec and engine variant."""
    return [c for stack in STACKS for engine in ENGINES
            for c in rendered_commands(variant_spec(stack, engine), f"{stack}/{engine}")]


def load_verdicts(path: Path = VERDICTS) -> dict[str, dict]:
    if not path.exists():
        return {}
    return json.loads(path.read_text())["verdicts"]


def unverified(commands: list[RenderedCommand], verdicts: dict[str, dict]) -> list[str]:
    """One line per command without a recorded passing verdict."""
    lines = []
    for c in commands:
        v = verdicts.get(c.key())
        if v is None:
            lines.append(f"{c.label}: never checked. Fix: run scripts/check_engine_args.py")
        elif v["verdict"] != "pass":
            lines.append(f"{c.label}: {c.engine} {c.version} refused it: {v['detail']}")
    return lines


def write_verdicts(verdicts: dict[str, dict], path: Path = VERDICTS) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"about": __doc__.splitlines()[0],
                               "verdicts": dict(sorted(verdicts.items()))}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
