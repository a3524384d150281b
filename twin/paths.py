"""Where the twin keeps things: its sources in twin/, everything it makes under .twin/ (ignored)."""

from __future__ import annotations

import os
from pathlib import Path

TWIN_SRC = Path(__file__).resolve().parent
ROOT = TWIN_SRC.parent
# PDSTACK_TWIN_DIR moves the state (a second twin beside the first, or a shorter path).
STATE_DIR = Path(os.environ.get("PDSTACK_TWIN_DIR", ROOT / ".twin"))
BIN_DIR = STATE_DIR / "bin"
RUN_DIR = STATE_DIR / "run"  # one started twin: certificates, data, logs, processes
KUBECONFIG = STATE_DIR / "kubeconfig"
CONTEXT = "pdstack-twin"
