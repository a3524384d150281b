"""twin/engine_load.py, the engine stand-ins' load: at most the flag's number of requests run, the
rest wait in arrival order, a freed slot goes to the first waiting request in the same step, the
running ones' KV counts against the capacity; and what the twin's load-spread test reads from several
instances' timelines (an instance idle while another queues; requests sent to the busier instance)."""

from __future__ import annotations

import threading

import pytest

from twin.engine_load import EngineLoad, arrivals, idle_while_queued


def _admit_in_threads(load: EngineLoad, count: int) -> tuple[list, list[threading.Thread]]:
    tickets: list = [None] * count
    threads = []
    for i in range(count):
        def run(i=i):
            tickets[i] = load.admit(10)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        with load.changed:  # each in the queue before the next arrives: arrival order is known
            load.changed.wait_for(lambda: load.running + load.waiting == min(i + 1, count))
    return tickets, threads


def test_two_run_the_rest_wait_in_arrival_order_and_a_freed_slot_passes_on_in_the_same_step():
    load = EngineLoad(2, 100)
    tickets, threads = _admit_in_threads(load, 5)
    assert (load.running, load.waiting, load.held_tokens, load.kv_usage()) == (2, 3, 20, 0.2)
    load.hold(tickets[0], 5)
    assert load.held_tokens == 25
    load.release(tickets[0])
    threads[2].join(10)
    assert tickets[2] is not None and tickets[3] is None  # the third came first among those waiting
    # no recorded moment with a free slot and a queue
    assert all(not (running < 2 and waiting) for _, running, waiting in load.timeline), list(load.timeline)
    load.release(tickets[0])  # once only
    assert (load.running, load.waiting) == (2, 2)
    for i in (1, 2, 3, 4):
        threads[i].join(10)
        load.release(tickets[i])
    assert (load.running, load.waiting, load.held_tokens) == (0, 0, 0)
    assert all(t.waited >= 0 for t in tickets) and tickets[4].waited > 0


def test_no_bound_runs_everything_and_no_capacity_reads_no_usage():
    load = EngineLoad(None, None)
    tickets = [load.admit(5) for _ in range(50)]
    assert (load.running, load.waiting, load.kv_usage()) == (50, 0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        EngineLoad(0, 10)
    assert tickets


def test_idle_while_queued_finds_an_instance_idle_while_another_queues_inside_the_window_only():
    busy = {"a": [(0.0, 0, 0), (1.0, 1, 0), (2.0, 1, 1), (4.0, 1, 0)],
            "b": [(0.0, 0, 0), (1.5, 1, 0), (3.0, 0, 0), (3.5, 1, 0)]}
    assert idle_while_queued(busy, 1.0, 5.0) == ["3.000: b idle while a (1 waiting)"]
    assert idle_while_queued(busy, 3.6, 5.0) == []
    # a queue while the other is busy is no fault: both are working
    assert idle_while_queued({"a": [(1.0, 1, 2)], "b": [(1.0, 1, 0)]}, 0.0, 2.0) == []


def test_arrivals_counts_each_request_and_those_sent_to_the_busier_instance():
    timelines = {"a": [(0.0, 0, 0), (1.0, 1, 0), (2.0, 1, 1), (5.0, 1, 0)],
                 "b": [(0.0, 0, 0), (1.5, 1, 0), (3.0, 0, 0)]}
    count, misrouted = arrivals(timelines, 0.5, 4.0)
    # a at 1.0 (both empty), b at 1.5 (b empty, a held 1: the less loaded), a at 2.0 (a held 1, b held 1)
    assert (count, misrouted) == (3, [])
    timelines["a"].insert(3, (3.5, 1, 2))  # a third to a while b held nothing
    assert arrivals(timelines, 0.5, 4.0) == (4, ["3.500: to a holding 2 while b held 0"])
    assert arrivals(timelines, 3.6, 4.0) == (0, [])
