"""Run every rendered engine command line through the pinned engine's own validation.

Why: a flag that exists can still be refused in combination, and only the engine's code
knows its rules. This builds (once) a scratch virtualenv the way extract_engine_flags.py
does, with the pinned wheels installed --no-deps next to torch, and runs
infra/render/engine_check/probe.py there for each command (see that file for the stand-ins).
Verdicts go to infra/render/engine_check/verdicts.json, which the tests read.

    python scripts/check_engine_args.py --venv /tmp/engcheck/venv            # check what changed
    python scripts/check_engine_args.py --venv /tmp/engcheck/venv --all      # check everything again
    python scripts/check_engine_args.py --venv ... --extra 'prod/sglang/decode=<argv as JSON>'

Building the virtualenv (about 8 GB; torch's CUDA build imports on the CPU):
    python3 -m venv V && V/bin/pip install torch==2.14.1 torchvision==0.29.1 triton
    V/bin/pip install --no-deps sglang==0.5.23 vllm==0.33.0
    V/bin/pip install transformers==5.19.0 ... (what the imports ask for; see README)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.render.engine_args import weights_path  # noqa: E402
from infra.render.engine_check import (  # noqa: E402
    ENGINES, HERE, MODEL_CONFIGS, MODELS, STACKS, RenderedCommand, committed_commands, load_verdicts,
    variant_spec, write_verdicts)

PROBE_TIMEOUT_SECONDS = 600

GPU_CAP = {"H100": "9.0", "H200": "9.0", "B200": "10.0", "GB200": "10.0"}
GPU_MEM_MIB = {"H100": 81559, "H200": 143771, "B200": 183359, "GB200": 190464}


def model_dirs(tmp: Path) -> dict[str, Path]:
    """A folder with config.json per served model: what the engines read to resolve arguments."""
    dirs = {}
    for name, file in MODEL_CONFIGS.items():
        d = tmp / file.removesuffix(".json")
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text((MODELS / file).read_text())
        dirs[name] = d
    return dirs


def run_probe(venv: Path, command: RenderedCommand, argv: list[str]) -> dict:
    profile = {"engine": command.engine, "gpu_type": command.gpu_type, "gpus_per_node": command.gpus_per_node,
               "probes": command.probes, "rdma_devices": list(command.rdma_devices)}
    env = {**os.environ, "PATH": f"{HERE}:{os.environ['PATH']}", "STANDIN_GPUS": str(command.gpus_per_node),
           "STANDIN_GPU_CAP": GPU_CAP[command.gpu_type], "STANDIN_GPU_MEM_MIB": str(GPU_MEM_MIB[command.gpu_type]),
           "VLLM_LOGGING_LEVEL": "ERROR"}
    started = time.monotonic()
    try:
        out = subprocess.run([str(venv / "bin" / "python"), str(HERE / "probe.py"), json.dumps(profile), "--", *argv],
                             env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        return {"verdict": "fail", "detail": f"no verdict within {PROBE_TIMEOUT_SECONDS} s",
                "seconds": round(time.monotonic() - started, 1)}
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"verdict"')]
    result = json.loads(lines[-1]) if lines else {"verdict": "fail", "detail": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", required=True, type=Path, help="scratch virtualenv with the pinned engines")
    p.add_argument("--all", action="store_true", help="re-check commands that already have a verdict")
    p.add_argument("--extra", action="append", default=[],
                   help="LABEL=JSON_ARGV: also check (and record) a hand-written command, e.g. a known-bad one")
    args = p.parse_args(argv)
    if not (args.venv / "bin" / "python").is_file():
        p.error(f"--venv {args.venv}: no bin/python there. Fix: build the scratch virtualenv (see this script's "
                "docstring) and name its folder")
    verdicts = load_verdicts()
    commands = committed_commands()
    for item in args.extra:
        label, _, raw = item.partition("=")
        parts = label.split("/")
        try:
            extra_argv = json.loads(raw)
        except json.JSONDecodeError:
            extra_argv = None
        if len(parts) < 3 or parts[0] not in STACKS or parts[1] not in ENGINES or not isinstance(extra_argv, list):
            p.error(f"--extra {item[:80]!r}: expected STACK/ENGINE/NAME=JSON_ARGV, e.g. "
                    'prod/sglang/known-bad-x=["--tp-size", "8"], with STACK in '
                    f"{', '.join(STACKS)} and ENGINE in {', '.join(ENGINES)}")
        base = next(c for c in commands if c.label.startswith(f"{parts[0]}/{parts[1]}/"))
        commands.append(RenderedCommand(label=label, engine=base.engine, version=base.version, gpu_type=base.gpu_type,
                                        gpus_per_node=base.gpus_per_node, argv=tuple(str(a) for a in extra_argv),
                                        probes=base.probes, rdma_devices=base.rdma_devices))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs(Path(tmp))
        for command in commands:
            if command.key() in verdicts and not args.all:
                continue
            spec = variant_spec(*command.label.split("/")[:2])
            mapped = [str(dirs[spec.model.name]) if a == weights_path(spec) else a for a in command.argv]
            result = run_probe(args.venv, command, mapped)
            verdicts[command.key()] = {"label": command.label, "argv": list(command.argv), **result}
            print(f"{result['verdict']:4}  {result['seconds']:5.1f}s  {command.label}  {result['detail']}", flush=True)
            write_verdicts(verdicts)  # after each, so an interrupted run keeps what it measured
    current = {c.key() for c in commands}
    stale = [k for k, v in verdicts.items() if k not in current and "known-bad" not in v["label"]]
    for k in stale:
        del verdicts[k]
    write_verdicts(verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
