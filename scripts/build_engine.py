"""Build the real Pulumi engine pieces from the Go modules pinned in engine/*/go.mod.

Why: `pulumi preview`, the policy pack and the rollout's Automation API path are only shown
to work by running them under the real Pulumi CLI and the real Kubernetes provider. Neither
may be downloaded as a binary here, so both are built from the Go module proxy, at the
versions engine/cli/go.mod and engine/kubernetes/go.mod pin (their go.sum checks every
module). Each module is its own build: their dependency graphs differ (the provider's
pulumi/pkg is older than the CLI's).

Binaries go to the machine's cache (scripts/machine_cache.py: `$PDSTACK_ENGINE_BIN`, else
~/.cache/pdstack/engine-bin/<module>-<key>/), keyed by the hash of that module's go.mod and
go.sum, so a build runs once per pin on a machine, whichever clone asks; each is written into a
temporary folder first and renamed into place whole, under a lock. .engine/path/ (in the
checkout) then holds links to the current binaries: the folder to put first on PATH, where the CLI finds its plugins ("ambient" plugins) without
downloading any.

    python3 scripts/build_engine.py            # builds what is missing; prints each build's time
    python3 scripts/build_engine.py --check    # exit 1 if a build is missing, build nothing

The Go caches are the environment's (GOCACHE, GOMODCACHE): set both to empty folders to
time a cold build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_cache import building, cache_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
OUT = ROOT / ".engine"
PATH_DIR = OUT / "path"
BIN = cache_folder("engine-bin", "PDSTACK_ENGINE_BIN")


@dataclass(frozen=True)
class Binary:
    name: str          # the executable's name, as the Pulumi CLI looks it up on PATH
    package: str       # the Go package of its main
    version_var: str   # the variable its build sets to the module version (-X)
    # Files the upstream build generates beside main before compiling (its `go generate`):
    # generator file -> the files it writes, read from the package's folder.
    generated: tuple[str, tuple[str, ...]] | None = None


@dataclass(frozen=True)
class Module:
    folder: str        # engine/<folder>: go.mod, go.sum
    binaries: tuple[Binary, ...]


MODULES = (
    Module("cli", (Binary("pulumi", "github.com/pulumi/pulumi/pkg/v3/cmd/pulumi",
                          "github.com/pulumi/pulumi/sdk/v3/go/common/version.Version"),)),
    # pulumi-kubernetes' Makefile runs `go generate` in the command's folder first: generate.go
    # stamps the version into schema.json and writes the two *-embed.json files main embeds.
    Module("kubernetes", (Binary("pulumi-resource-kubernetes",
                                 "github.com/pulumi/pulumi-kubernetes/provider/v4/cmd/pulumi-resource-kubernetes",
                                 "github.com/pulumi/pulumi-kubernetes/provider/v4/pkg/version.Version",
                                 ("generate.go", ("schema-embed.json", "terraform-mapping-embed.json"))),)),
)


class BuildError(Exception):
    pass


def _go(args: list[str], cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run(["go", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise BuildError(f"go {' '.join(args)} (in {cwd.relative_to(ROOT)}) failed:\n{done.stderr.strip()}")
    return done.stdout


def module_key(module: Module) -> str:
    folder = ENGINE / module.folder
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:16]


def build_dir(module: Module) -> Path:
    return BIN / f"{module.folder}-{module_key(module)}"


def _module_of(package: str, folder: Path) -> dict:
    """The pinned module holding a package: Path, Version, Dir (downloaded and checked against go.sum)."""
    # -e: a package whose embedded files are generated first (see Binary.generated) lists with an error
    path = json.loads(_go(["list", "-e", "-json", "-find", package], folder))["Module"]["Path"]
    return json.loads(_go(["mod", "download", "-json", path], folder))


def _generate(binary: Binary, source: dict, version: str, folder: Path, work: Path) -> list[str]:
    """Run the upstream generator in a writable copy of the module (the module cache is
    read-only, and go build refuses overlays into it); return the -modfile flag that builds
    from that copy: the pinned go.mod and go.sum plus one replace of the module by its copy."""
    generator, outputs = binary.generated
    copy = work / "src"
    shutil.copytree(source["Dir"], copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    package_dir = copy / binary.package.removeprefix(source["Path"]).lstrip("/")
    tool = work / "generator"
    _go(["build", "-o", str(tool), str(package_dir / generator)], folder)
    done = subprocess.run([str(tool)], cwd=package_dir, capture_output=True, text=True,
                          env={**os.environ, "VERSION": version})
    missing = [name for name in outputs if not (package_dir / name).is_file()]
    if done.returncode != 0 or missing:
        raise BuildError(f"{generator} of {binary.package} failed: {done.stderr.strip() or f'no {missing}'}")
    modfile = work / "go.mod"
    modfile.write_text((folder / "go.mod").read_text()
                       + f"\nreplace {source['Path']} {source['Version']} => {copy}\n")
    shutil.copy(folder / "go.sum", work / "go.sum")
    return [f"-modfile={modfile}"]


def build(module: Module) -> float | None:
    """Build one module's binaries unless this pin's are there; seconds taken, or None."""
    target = build_dir(module)
    with building(target):
        if all((target / b.name).is_file() for b in module.binaries):
            return None
        return _build_into(module, target)


def _build_into(module: Module, target: Path) -> float:
    folder = ENGINE / module.folder
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        work = Path(tmp)
        staged = work / "bin"
        staged.mkdir()
        for binary in module.binaries:
            source = _module_of(binary.package, folder)
            version = source["Version"]
            flags = _generate(binary, source, version.lstrip("v"), folder, work) if binary.generated else []
            _go(["build", "-trimpath", *flags, "-o", str(staged / binary.name),
                 f"-ldflags=-s -w -X {binary.version_var}={version}", binary.package], folder)
        (staged / "BUILT_FROM.json").write_text(json.dumps({
            "go.mod": f"engine/{module.folder}/go.mod", "key": module_key(module),
            "binaries": {b.name: {"package": b.package, "module": _module_of(b.package, folder)["Path"],
                                  "version": _module_of(b.package, folder)["Version"]} for b in module.binaries},
        }, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return time.monotonic() - started


def link_path() -> None:
    """.engine/path: links to the current binaries, replaced whole."""
    OUT.mkdir(exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=OUT, prefix=".path-"))
    for module in MODULES:
        for binary in module.binaries:
            (staged / binary.name).symlink_to(build_dir(module) / binary.name)
    old = OUT / ".path-old"
    if PATH_DIR.exists():
        PATH_DIR.rename(old)
    staged.rename(PATH_DIR)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether every build is there")
    args = p.parse_args(argv)
    if shutil.which("go") is None:
        print("build_engine: no `go` on PATH. Fix: install Go 1.26 (the module proxy must be reachable)", file=sys.stderr)
        return 2
    missing = [m.folder for m in MODULES if not all((build_dir(m) / b.name).is_file() for b in m.binaries)]
    if args.check:
        print("missing: " + ", ".join(missing) if missing else "every engine build is there")
        return 1 if missing else 0
    for module in MODULES:
        try:
            took = build(module)
        except BuildError as exc:
            print(f"build_engine: {exc}", file=sys.stderr)
            return 1
        where = build_dir(module)
        print(f"{module.folder}: {'built in %.0f s' % took if took is not None else 'cached'} -> {where}")
    link_path()
    print(f"put {PATH_DIR.relative_to(ROOT)} first on PATH")
    return 0


if __name__ == "__main__":
    sys.exit(main())
