"""The pinned PyPI wheels the generators of upstream-derived files read, downloaded once.

Why: `make test` regenerates every upstream-derived file and compares it with the committed one
(upstream/PROVENANCE.json lists them). The engines' wheels are large (vLLM's is ~340 MB), so each
is fetched once per version into the machine's cache (CACHE below: `$PDSTACK_UPSTREAM_CACHE`, else
`$XDG_CACHE_HOME/pdstack/upstream`, else `~/.cache/pdstack/upstream`), outside the checkout as Go's
and pip's caches are, so a fresh clone (CI's) reuses it, and read from there afterwards. pip picks the wheel this interpreter installs (CPython 3.11,
manylinux x86_64): the one whose sha256 the generated files record, so a different wheel shows
as a difference, never silently.

    from pinned_wheels import pinned_wheel, wheel_metadata   # in scripts/ (a script's own folder is on sys.path)
    wheel = pinned_wheel("vllm", "0.33.0")   # <CACHE>/wheels/vllm-0.33.0-cp38-abi3-....whl
    wheel_metadata(wheel).get_all("Requires-Dist")  # its core metadata
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_cache import cache_folder  # noqa: E402

CACHE = cache_folder("upstream", "PDSTACK_UPSTREAM_CACHE")
WHEELS = CACHE / "wheels"


def wheel_stem(dist: str, version: str) -> str:
    """How a wheel's file name starts (PEP 427: the name with runs of -_. as one underscore)."""
    return f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"


def pinned_wheel(dist: str, version: str, folder: Path = WHEELS) -> Path:
    """The wheel of `dist==version` in `folder`, downloaded (without dependencies) if not there yet.
    The download lands in a scratch folder beside it and is renamed in whole, so a test reading
    the cache at the same time never sees half a wheel."""
    stem = wheel_stem(dist, version)
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)) if folder.is_dir() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                               "-d", tmp, f"{dist}=={version}"], capture_output=True, text=True)
        got = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not got:
            raise SystemExit(f"pip download {dist}=={version}: {done.stderr.strip() or 'no wheel'}. Fix: run it where "
                             f"PyPI is reachable, or put the wheel in {folder}")
        os.replace(got[0], folder / got[0].name)
        return folder / got[0].name


def cached_venv(name: str, requirements: Path, wheels=lambda: [], size: str = "") -> Path:
    """<CACHE>/<name>: a virtualenv of `requirements` (every line pinned, installed with --no-deps,
    wheels only) and the wheels `wheels()` names, built in a scratch folder beside it and renamed
    into place whole, so an interrupted build leaves nothing that looks finished (only its bin/
    programs are run, which find their packages relative to themselves, so the rename does not
    matter to them). `name` carries a key of what it holds: another content is another folder."""
    import shutil

    venv = CACHE / name
    if venv.is_dir():
        return venv
    CACHE.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=CACHE, prefix=".building-"))
    print(f"building {venv} (once{'; ' + size if size else ''})", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(build)], check=True)
        subprocess.run([str(build / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary",
                        ":all:", "-r", str(requirements), *map(str, wheels())], check=True)
        os.rename(build, venv)
    except (subprocess.CalledProcessError, OSError) as exc:
        shutil.rmtree(build, ignore_errors=True)
        if venv.is_dir():  # another run finished first
            return venv
        raise SystemExit(f"building the virtualenv {venv} from {requirements} failed ({exc}). Fix: run it where "
                         "PyPI is reachable") from None
    return venv


def wheel_metadata(wheel: Path):
    """The wheel's METADATA (core metadata: Name, Version, Requires-Dist...) as an email.Message."""
    from email.parser import HeaderParser

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return HeaderParser().parsestr(z.read(name).decode())
