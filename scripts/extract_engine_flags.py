"""Regenerate the pinned engines' flag sets and metric names in infra/render/pinned/.

Why: every engine flag pdstack renders is checked against the exact argparse parser of
the engine version we pin. The parser is only buildable where the engine imports (it
needs torch and friends), so this script is run by hand in a scratch virtualenv that has
the pinned wheels installed with --no-deps, and its JSON output is committed:

    pip download --no-deps sglang==0.5.23 vllm==0.33.0 sglang-router==0.3.2
    pip install --no-deps <the three wheels> torch msgspec ...   # whatever the imports ask for
    VLLM_TARGET_DEVICE=cpu python scripts/extract_engine_flags.py infra/render/pinned [ENGINE ...]

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
import inspect
import json
import re
import sys
from importlib.metadata import distribution
from pathlib import Path


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


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "infra/render/pinned")
    only = sys.argv[2:] or list(SOURCES)  # engine names, to regenerate some tables only
    from importlib.metadata import version

    for name, (dist, build, source, entrypoint, metric_prefix, (env_file, env_pattern)) in SOURCES.items():
        if name not in only:
            continue
        pinned = version(dist.replace("_", "-"))
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
        path = out / f"{name}-{pinned}.json"
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"{path}: {len(table['flags'])} flags, {len(table['metrics'])} metrics")


if __name__ == "__main__":
    main()
