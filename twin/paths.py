"""Where the twin keeps things: its sources in twin/, everything it makes under .twin/ (ignored)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from scripts.machine_cache import cache_folder

TWIN_SRC = Path(__file__).resolve().parent
ROOT = TWIN_SRC.parent
# PDSTACK_TWIN_DIR moves the state (a second twin beside the first, or a shorter path).
STATE_DIR = Path(os.environ.get("PDSTACK_TWIN_DIR", ROOT / ".twin"))
# Built programs live in the machine's cache, keyed by go.mod and go.sum (twin/build.py), so a
# fresh clone, or a second twin's state folder, reuses them: scripts/machine_cache.py.
BIN_DIR = cache_folder("twin-bin", "PDSTACK_TWIN_BIN")
RUN_DIR = STATE_DIR / "run"  # one started twin: certificates, data, logs, processes
KUBECONFIG = STATE_DIR / "kubeconfig"
LOCK = STATE_DIR / "twin.lock"  # flock held by `up` and then by the supervisor, for the twin's life
CONTEXT = "pdstack-twin"


def private_folder(path: Path) -> Path:
    """`path` as a folder only its owner may enter (0700): made so if missing, tightened if not.
    The twin's folders hold private keys, etcd's data (Secrets included) and the kubeconfig."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def script_module(name: str):
    """A module of scripts/ (no package: its scripts import their neighbours by name)."""
    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(scripts)
