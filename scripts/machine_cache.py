"""The machine's cache: what pdstack downloads or builds once per pin, kept outside the checkout.

Why: CI runs on a fresh clone. Go's and pip's caches already live outside it, so the pinned
wheels, the engines' CPU virtualenv, the Pulumi engine's binaries and the twin's binaries live
there too: a fresh clone on a machine that built a pin before finds it and builds nothing. Every
entry is keyed by a hash of what it was built from (go.mod and go.sum, wheel versions), so two
checkouts at different pins share the cache without overwriting each other's builds.

    cache_folder("twin-bin", "PDSTACK_TWIN_BIN")  # $PDSTACK_TWIN_BIN, else $XDG_CACHE_HOME/pdstack/twin-bin,
                                                  # else ~/.cache/pdstack/twin-bin
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def cache_folder(name: str, env_var: str) -> Path:
    """The folder `name` of the machine's pdstack cache; `env_var` moves it."""
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdstack" / name


@contextlib.contextmanager
def building(target: Path):
    """Hold an flock beside `target` while it is built, so two checkouts (or two `make` runs) that
    need the same pin build it once: the second waits, then finds it there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
