"""Files of the Go modules pdstack pins, found where `go mod download` unpacked them.

Each module is pinned once, in one twin/*/go.mod (the cluster twin's pin set, which go.sum
verifies); this finds that pin and the module's folder in Go's module cache. The platform
program reads chart values, CRDs and manifests from there, so what it installs and what the
tests check is what the project published at the pinned version. A module not yet downloaded
is fetched with `go mod download` in its twin folder (verified against that go.sum); without Go
or the module proxy the error names the module and the command that fetches it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from infra.inputs import InputError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
TWIN_SRC = REPO_ROOT / "twin"

_REQUIRE = re.compile(r"^\s*(?:require\s+)?([A-Za-z0-9][A-Za-z0-9._~/-]*)\s+(v\S+)")


class ModuleUnavailable(InputError):
    """A pinned module that is not in the module cache and could not be downloaded."""


@dataclass(frozen=True)
class Pin:
    module: str
    version: str
    folder: str  # the twin/ folder whose go.mod pins it

    def origin(self, path: str) -> dict[str, str]:
        return {"module": self.module, "version": self.version, "path": path, "pinned_in": f"twin/{self.folder}/go.mod"}


@functools.cache
def _requirements() -> dict[str, list[tuple[str, str, bool]]]:
    """module path -> [(version, twin folder, direct?)] over every twin/*/go.mod."""
    found: dict[str, list[tuple[str, str, bool]]] = {}
    for go_mod in sorted(TWIN_SRC.glob("*/go.mod")):
        in_block = False
        for raw in go_mod.read_text().splitlines():
            stripped = raw.split("//")[0].strip()
            if stripped == "require (":
                in_block = True
                continue
            if in_block and stripped == ")":
                in_block = False
                continue
            if not (in_block or stripped.startswith("require ")):
                continue
            m = _REQUIRE.match(stripped)
            if m:
                found.setdefault(m.group(1), []).append((m.group(2), go_mod.parent.name, "// indirect" not in raw))
    return found


_TOOL_LINE = re.compile(r"^\s*tool\b", re.MULTILINE)


@functools.cache
def _pins_files(folder: str) -> bool:
    """A twin folder whose go.mod builds no program (no `tool` line: twin/crds, twin/platform) pins
    modules for their files, the CRDs, charts and manifests this package reads."""
    return not _TOOL_LINE.search((TWIN_SRC / folder / "go.mod").read_text())


def pin(module: str) -> Pin:
    """The one version the twin's go.mod files select for `module`: a direct requirement wins
    over modules other tools merely pull in, and a folder that pins files wins over one that
    builds a program with the module at another version (twin/endpoint-picker builds its picker
    on gateway-api-inference-extension v1.4.0, the CRDs are twin/crds' v1.6.0); two such pins
    that differ are an error."""
    entries = _requirements().get(module)
    if not entries:
        raise ModuleUnavailable(f"{module} is not pinned in any twin/*/go.mod. Fix: add it to twin/platform/go.mod "
                                "and run `go mod download` there")
    direct = [e for e in entries if e[2]] or entries
    direct = [e for e in direct if _pins_files(e[1])] or direct
    versions = sorted({v for v, _, _ in direct})
    if len(versions) > 1:
        raise ModuleUnavailable(f"{module} is pinned at {', '.join(versions)} in twin/*/go.mod. Fix: one version")
    version, folder, _ = direct[0]
    return Pin(module, version, folder)


def escape_module_path(path: str) -> str:
    """Go's module cache spells upper-case letters as !lower (golang.org/x/mod/module EscapePath)."""
    return re.sub(r"[A-Z]", lambda m: "!" + m.group(0).lower(), path)


@functools.cache
def _mod_cache() -> Path:
    if os.environ.get("GOMODCACHE"):
        return Path(os.environ["GOMODCACHE"])
    if shutil.which("go"):
        out = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    return Path(os.environ.get("GOPATH", Path.home() / "go")) / "pkg" / "mod"


@functools.cache
def module_dir(module: str) -> Path:
    """The unpacked module at its pinned version; downloaded (and go.sum-verified) if missing."""
    p = pin(module)
    folder = _mod_cache() / f"{escape_module_path(p.module)}@{p.version}"
    if folder.is_dir():
        return folder
    if not shutil.which("go"):
        raise ModuleUnavailable(f"{module}@{p.version} is not in the Go module cache and `go` is not on PATH. Fix: "
                                f"install Go, then `make platform-sources`")
    answer = subprocess.run(["go", "mod", "download", "-json", module], cwd=TWIN_SRC / p.folder,
                            capture_output=True, text=True)
    info = json.loads(answer.stdout or "{}")
    if answer.returncode or info.get("Error") or not info.get("Dir"):
        raise ModuleUnavailable(f"go mod download {module} (twin/{p.folder}): "
                                f"{info.get('Error') or answer.stderr.strip()}. Fix: `make platform-sources` "
                                "where the Go module proxy is reachable")
    return Path(info["Dir"])


def module_file(module: str, path: str) -> Path:
    found = module_dir(module) / path
    if not found.is_file():
        raise ModuleUnavailable(f"{module}@{pin(module).version} has no {path}")
    return found
