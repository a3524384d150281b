"""twin/clients.py without a twin: the thread start and stop that the scaling test's load
(twin/scaling.py Load) and the live rollout's client (twin/live.py LiveClient) share."""

from __future__ import annotations

import threading
import time

from twin.clients import ThreadClient
from twin.live import LiveClient
from twin.scaling import Load

WAIT_SECONDS = 60  # bounded waits for a thread to get going: generous for a machine at load 60


def test_every_target_runs_in_its_thread_from_the_block_until_told_to_stop():
    running = [threading.Event() for _ in range(3)]
    ended = []

    def target(n: int):
        def loop() -> None:
            running[n].set()
            client.stopping.wait()
            ended.append(n)
        return loop

    client = ThreadClient([target(n) for n in range(3)], join_seconds=WAIT_SECONDS)
    assert not any(thread.is_alive() for thread in client.threads)  # nothing runs before the block
    with client as entered:
        assert entered is client
        assert all(event.wait(WAIT_SECONDS) for event in running)
        assert ended == [] and not client.stopping.is_set()
    assert client.stopping.is_set() and sorted(ended) == [0, 1, 2]
    assert not any(thread.is_alive() for thread in client.threads)  # each joined on leaving the block


def test_the_load_counts_each_request_until_stopped(tmp_path):
    """Load's workers on a hub socket that is not there: each request fails (OSError from connecting,
    as on a twin whose hub has gone), is counted and said, and the workers end with the block."""
    missing = tmp_path / "no-hub.sock"
    with Load(missing, "10.0.0.1", 8080, "model", workers=3) as load:
        assert len(load.threads) == 3
        deadline = time.monotonic() + WAIT_SECONDS
        while load.counts["sent"] < 6 and time.monotonic() < deadline:
            assert any(t.is_alive() for t in load.threads), "every worker ended before being told to stop"
            time.sleep(0.05)
    assert not any(thread.is_alive() for thread in load.threads)
    assert load.counts["sent"] == load.counts["failed"] >= 6 and load.counts["answered"] == 0
    assert load.errors and len(load.errors) <= 20


def test_the_live_client_and_the_load_start_and_stop_their_threads_one_way():
    assert issubclass(Load, ThreadClient) and issubclass(LiveClient, ThreadClient)
    for cls in (Load, LiveClient):
        assert "__enter__" not in vars(cls) and "__exit__" not in vars(cls), cls
