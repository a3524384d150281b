"""The source distribution of a pinned PyPI release, downloaded once into the machine's
upstream cache (scripts/pinned_wheels.py CACHE), folder sdists/.

Why: sglang-router is Rust inside its wheel (a compiled .so); what its policies read lives only in
its sdist's source. pip cannot fetch that sdist alone (`pip download` builds its metadata, which
needs cargo and the crate's git dependencies), so this reads the project's page of PyPI's simple
index, the one pip reads (PEP 691 JSON), takes the release's sdist, and keeps it only when its
sha256 is the one the index lists. tests/test_router_load_source.py reads it from the cache.

    python scripts/pinned_sdist.py sglang-router 0.3.2
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pinned_wheels import CACHE  # noqa: E402

SDISTS = CACHE / "sdists"


def sdist_name(dist: str, version: str) -> str:
    """How the release's sdist is named (PEP 625: the normalised name, underscores for runs of -_.)."""
    return f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}.tar.gz"


def cached_sdist(dist: str, version: str, folder: Path = SDISTS) -> Path | None:
    """The sdist of `dist==version` in `folder`, if it was downloaded."""
    path = folder / sdist_name(dist, version)
    return path if path.is_file() else None


def download_sdist(dist: str, version: str, folder: Path = SDISTS) -> Path:
    found = cached_sdist(dist, version, folder)
    if found:
        return found
    name = sdist_name(dist, version)
    page = urllib.request.Request(f"https://pypi.org/simple/{dist}/",
                                  headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(page, timeout=60) as answer:
        files = json.load(answer)["files"]
    (sdist,) = [f for f in files if f["filename"] == name]
    with urllib.request.urlopen(sdist["url"], timeout=300) as answer:
        body = answer.read()
    if hashlib.sha256(body).hexdigest() != sdist["hashes"]["sha256"]:
        raise SystemExit(f"{name}: sha256 differs from the one the index lists; not kept")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".download-", delete=False) as tmp:
        tmp.write(body)
    target = folder / name
    os.replace(tmp.name, target)  # whole, so a reader never sees half a file
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python scripts/pinned_sdist.py <dist> <version>")
    print(download_sdist(sys.argv[1], sys.argv[2]))
