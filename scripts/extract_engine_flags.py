"""Regenerate the pinned engines' flag sets and metric names in infra/render/pinned/.

Why: every engine flag pdstack renders is checked against the exact argparse parser of
the engine version we pin. The parser is only buildable where the engine imports (it
needs torch and friends), so the tables are built in a scratch virtualenv: the packages
upstream/engine-venv-requirements.txt lists and the pinned wheels (scripts/pinned_wheels.py),
all installed with --no-deps into <the upstream cache>/engines-<hash of both>/ (scripts/pinned_wheels.py CACHE), once (~7 GB).
Run from anywhere, this builds that virtualenv if needed and runs itself again inside it:

    python scripts/extract_engine_flags.py [ENGINE ...]          # rewrite the tables
    python scripts/extract_engine_flags.py --check [ENGINE ...]  # exit 1 if a committed table differs
    python scripts/extract_engine_flags.py --venv V [--out DIR]  # another virtualenv or folder

It records, for each option string, whether it takes a value and its choices; every
Prometheus metric name the package's source (or, for the Rust router, its binary) declares;
and the environment variables the engine's settings module reads (some knobs, like SGLang's
PD transfer timeouts, exist only as environment variables). Beside them, `origin`: the PyPI
package and version, the wheel's hash when pip recorded one (installed from a downloaded
wheel file), and every file of the package that was read, with its sha256 from the wheel's
RECORD, so a table can be traced to the exact wheel and re-checked.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib.metadata import distribution
from pathlib import Path

from generated import write_or_check
from pinned_wheels import cached_venv, pinned_wheel

ROOT = Path(__file__).resolve().parent.parent
PINNED = ROOT / "infra" / "render" / "pinned"
REQUIREMENTS = ROOT / "upstream" / "engine-venv-requirements.txt"
sys.path.insert(0, str(ROOT))

from infra.render.flagsets import PINNED_FILES  # noqa: E402  (the tables pdstack reads name the pins)


class Reads:
    """Files of one installed package read while building its table."""

    def __init__(self, dist: str):
        self.dist = distribution(dist.replace("_", "-"))
        self.root = Path(self.dist.locate_file(""))
        self.files: set[str] = set()

    def add(self, path: str | Path) -> None:
        self.files.add(Path(path).resolve().relative_to(self.root.resolve()).as_posix())

    def origin(self) -> dict:
        record = {f.as_posix(): f"{f.hash.mode}={f.hash.value}" for f in self.dist.files or [] if f.hash}
        direct = self.dist.read_text("direct_url.json")
        archive = json.loads(direct).get("archive_info", {}).get("hashes") if direct else None
        return {"package": self.dist.metadata["Name"], "version": self.dist.version, "index": "PyPI",
                "wheel_hashes": archive,
                "files_read": {f: record.get(f, "not in RECORD") for f in sorted(self.files)}}


def describe(parser: argparse.ArgumentParser) -> dict[str, dict]:
    flags: dict[str, dict] = {}
    for option, action in sorted(parser._option_string_actions.items()):
        if not option.startswith("--"):
            continue
        takes_value = action.nargs != 0
        choices = sorted(str(c) for c in action.choices) if action.choices else None
        many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
        flags[option] = {"takes_value": takes_value, "many_values": many, "choices": choices}
    return flags


def metric_names(dist: str, prefix: str, reads: Reads) -> list[str]:
    """Every quoted metric name with this prefix in the installed package's files."""
    import importlib.util

    root = Path(importlib.util.find_spec(dist).origin).parent
    pattern = re.compile(rb"(?<![a-z_])" + re.escape(prefix.encode()) + rb"[a-z0-9_]+")
    names: set[str] = set()
    for path in root.rglob("*"):
        if path.suffix in (".py", ".so") and path.is_file():
            found = pattern.findall(path.read_bytes())
            if found:
                reads.add(path)
                names.update(m.decode() for m in found)
    return sorted(names)


def env_names(dist: str, relative: str, pattern: str, reads: Reads) -> list[str]:
    """Environment variables the package declares in its settings module (`relative` to it)."""
    import importlib.util

    if not relative:
        return []
    root = Path(importlib.util.find_spec(dist).origin).parent
    reads.add(root / relative)
    return sorted(set(re.findall(pattern, (root / relative).read_text(), flags=re.MULTILINE)))


def parser_sources(dist: str, reads: Reads) -> None:
    """The package's modules that define the parser: every one of its modules loaded by now."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and (module.__name__ == dist or module.__name__.startswith(dist + ".")):
            reads.add(inspect.getsourcefile(module) or file)


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def vllm_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def sglang_router_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    return parser


SOURCES = {
    "sglang": (
        "sglang",
        sglang_parser,
        "sglang wheel from PyPI, sglang/srt/server_args.py ServerArgs.add_cli_args "
        "(fields in sglang/srt/arg_groups/fields/)",
        "python3 -m sglang.launch_server",
        "sglang:",
        ("srt/environ.py", r"^\s+(SGLANG_[A-Z0-9_]+)\s*=\s*Env"),  # class Envs
    ),
    "vllm": (
        "vllm",
        vllm_parser,
        "vllm wheel from PyPI, vllm/entrypoints/common/cli_args.py make_arg_parser "
        "(engine flags from vllm/engine/arg_utils.py EngineArgs.add_cli_args)",
        "vllm serve",
        "vllm:",
        ("envs.py", r'^\s+"(VLLM_[A-Z0-9_]+)":'),  # environment_variables
    ),
    "sglang-router": (
        "sglang_router",
        sglang_router_parser,
        "sglang-router wheel from PyPI, sglang_router/router_args.py RouterArgs.add_cli_args",
        "python3 -m sglang_router.launch_router",
        "smg_",
        ("", ""),
    ),
}


def pinned_version(name: str) -> str:
    return PINNED_FILES[name].removeprefix(f"{name}-").removesuffix(".json")


def venv_key() -> str:
    """What the virtualenv holds: the requirements (not the file's comments) and the engines' pins."""
    wanted = [line.strip() for line in REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    pins = sorted((SOURCES[n][0].replace("_", "-"), pinned_version(n)) for n in SOURCES)
    return hashlib.sha256(json.dumps([wanted, pins]).encode()).hexdigest()[:16]


def engine_venv() -> Path:
    """<CACHE>/engines-<key> (pinned_wheels.py cached_venv): the requirements and the engines' own wheels."""
    return cached_venv(f"engines-{venv_key()}", REQUIREMENTS,
                       lambda: [pinned_wheel(SOURCES[n][0].replace("_", "-"), pinned_version(n)) for n in SOURCES],
                       "~7 GB")


def tables(only: list[str]) -> dict[str, str]:
    """Build each table with the engines this interpreter imports; file name -> text."""
    from importlib.metadata import version

    written = {}
    for name, (dist, build, source, entrypoint, metric_prefix, (env_file, env_pattern)) in SOURCES.items():
        if name not in only:
            continue
        pinned = version(dist.replace("_", "-"))
        if pinned != pinned_version(name):
            raise SystemExit(f"{sys.prefix} has {dist} {pinned}, infra/render/flagsets.py reads {PINNED_FILES[name]}. "
                             "Fix: run it in the virtualenv this script builds (no --venv)")
        reads = Reads(dist)
        flags = describe(build())
        parser_sources(dist, reads)
        table = {
            "engine": name,
            "version": pinned,
            "source": source,
            "entrypoint": entrypoint,
            "flags": flags,
            "metrics": metric_names(dist, metric_prefix, reads),
            "env_vars": env_names(dist, env_file, env_pattern, reads),
            "origin": reads.origin(),
        }
        written[f"{name}-{pinned}.json"] = json.dumps(table, indent=1, sort_keys=True) + "\n"
        print(f"{name}-{pinned}.json: {len(table['flags'])} flags, {len(table['metrics'])} metrics", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engines", nargs="*", metavar="ENGINE", help=f"some of {', '.join(SOURCES)} (default: all)")
    p.add_argument("--check", action="store_true", help="compare with the committed tables; exit 1 on a difference")
    p.add_argument("--out", type=Path, default=PINNED, help="where the tables go (default infra/render/pinned)")
    p.add_argument("--venv", type=Path, help="a virtualenv with the pinned engines (default: build <upstream cache>/engines-*)")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the run in the virtualenv
    args = p.parse_args(argv)
    only = args.engines or list(SOURCES)
    if unknown := sorted(set(only) - set(SOURCES)):
        p.error(f"unknown engine {', '.join(unknown)}: choose from {', '.join(SOURCES)}")
    if args.inside:
        for name, text in tables(only).items():
            (args.out / name).write_text(text)
        return 0
    venv = args.venv or engine_venv()
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([str(venv / "bin" / "python"), __file__, "--inside", "--out", tmp, *only],
                              env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        if done.returncode != 0:
            return done.returncode
        made = {args.out / f.name: f.read_text() for f in sorted(Path(tmp).glob("*.json"))}
    return write_or_check(made, args.check, "what the pinned engine parses", "python scripts/extract_engine_flags.py")


if __name__ == "__main__":
    sys.exit(main())
