"""Clients on the twin that send requests from threads until told to stop: the start and stop that
twin/scaling.py `Load` and twin/live.py `LiveClient` share (each names what its threads do)."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

Self = TypeVar("Self", bound="ThreadClient")


class ThreadClient:
    """One daemon thread per target, all started on entering the block; on leaving it, `stopping` is
    set (each target's loop ends on it) and each thread is waited for up to `join_seconds` (a
    request in flight ends within its own timeout, which the client's `join_seconds` covers)."""

    def __init__(self, targets: list[Callable[[], None]], join_seconds: float):
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=target, daemon=True) for target in targets]
        self.join_seconds = join_seconds

    def __enter__(self: Self) -> Self:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=self.join_seconds)
