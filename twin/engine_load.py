"""An engine stand-in's load: a bounded number of running requests, the rest waiting in arrival
order, and the KV the running ones hold. Standalone (twin/engine_standin.py imports it from beside
itself, in the engines' virtualenv); nothing here knows an engine's flags or metric names.

The engines schedule this way: SGLang 0.5.23 runs at most --max-running-requests at once and keeps
the rest in its waiting queue (sglang:num_running_reqs, sglang:num_queue_reqs; sglang:token_usage is
the tokens the running requests hold over the pool's capacity); vLLM 0.33.0 likewise with
--max-num-seqs (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc).
A waiting request holds no KV; a running one holds its prompt and each token made so far.

A slot a request frees goes to the first waiting request in the same step (no moment where an
instance with a queue has a free slot), and every change is kept on a timeline (wall-clock time,
running, waiting), so that a test can line up several instances' timelines and see whether one sat
idle while another queued.
"""

from __future__ import annotations

import collections
import threading
import time

TIMELINE_LENGTH = 50_000  # changes kept (each request makes at most three)


class Ticket:
    """One request's place: waiting until `admitted`, then holding `tokens` of KV until released."""
    __slots__ = ("tokens", "admitted", "released", "arrived", "waited")

    def __init__(self, tokens: int):
        self.tokens, self.admitted, self.released = tokens, False, False
        self.arrived, self.waited = time.monotonic(), 0.0


class EngineLoad:
    def __init__(self, max_running: int | None, kv_capacity_tokens: int | None):
        """`max_running` None: no bound (every request runs at once); `kv_capacity_tokens` None:
        no capacity known (usage reads 0)."""
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running {max_running}: an engine runs at least one request")
        self.max_running, self.kv_capacity_tokens = max_running, kv_capacity_tokens
        self.changed = threading.Condition()
        self.queue: collections.deque[Ticket] = collections.deque()
        self.running = 0
        self.held_tokens = 0
        self.timeline: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=TIMELINE_LENGTH)
        self._record()

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def _free(self) -> bool:
        return self.max_running is None or self.running < self.max_running

    def _record(self) -> None:
        self.timeline.append((time.time(), self.running, self.waiting))

    def _run(self, ticket: Ticket) -> None:
        ticket.admitted, ticket.waited = True, time.monotonic() - ticket.arrived
        self.running += 1
        self.held_tokens += ticket.tokens

    def admit(self, tokens: int) -> Ticket:
        """Wait for a slot (behind the requests that came first); the request then holds `tokens`."""
        ticket = Ticket(tokens)
        with self.changed:
            if not self.queue and self._free():
                self._run(ticket)
            else:
                self.queue.append(ticket)
            self._record()
            while not ticket.admitted:
                self.changed.wait()
        return ticket

    def hold(self, ticket: Ticket, tokens: int = 1) -> None:
        """A running request holds `tokens` more (one more token made)."""
        with self.changed:
            if ticket.admitted and not ticket.released:
                ticket.tokens += tokens
                self.held_tokens += tokens

    def release(self, ticket: Ticket) -> None:
        """The request is done (answered or failed): its slot goes to the first waiting one. Once only."""
        with self.changed:
            if ticket.released or not ticket.admitted:
                return
            ticket.released = True
            self.running -= 1
            self.held_tokens -= ticket.tokens
            while self.queue and self._free():
                self._run(self.queue.popleft())
            self._record()
            self.changed.notify_all()

    def kv_usage(self) -> float:
        """The KV the running requests hold over the capacity (0..1; 0 when none is known)."""
        if not self.kv_capacity_tokens:
            return 0.0
        return min(1.0, self.held_tokens / self.kv_capacity_tokens)

    def snapshot(self) -> dict:
        """Now, and every change so far: what GET /twin/load answers."""
        with self.changed:
            return {"max_running": self.max_running, "running": self.running, "waiting": self.waiting,
                    "kv_tokens": self.held_tokens, "kv_capacity_tokens": self.kv_capacity_tokens,
                    "kv_usage": self.kv_usage(), "timeline": list(self.timeline)}


def idle_while_queued(timelines: dict[str, list], start: float, end: float) -> list[str]:
    """The moments in [start, end] at which one instance had nothing running and nothing waiting
    while another had requests waiting, from each instance's timeline ((time, running, waiting)
    per change, in order): what "no instance idle while another queues" rules out."""
    events = sorted((t, name, running, waiting) for name, timeline in timelines.items()
                    for t, running, waiting in timeline)
    state: dict[str, tuple[int, int]] = {}  # an instance counts from its first record on
    found = []
    for i, (t, name, running, waiting) in enumerate(events):
        state[name] = (running, waiting)
        if not start <= t <= end or (i + 1 < len(events) and events[i + 1][0] == t):
            continue  # outside the window, or more changes at this same instant
        idle = sorted(n for n, (r, w) in state.items() if r == 0 and w == 0)
        queued = sorted(f"{n} ({w} waiting)" for n, (r, w) in state.items() if w > 0)
        if idle and queued:
            found.append(f"{t:.3f}: {', '.join(idle)} idle while {', '.join(queued)}")
    return found


def arrivals(timelines: dict[str, list], start: float, end: float) -> tuple[int, list[str]]:
    """The requests that arrived in [start, end], and those of them that found their instance
    holding more (running + waiting) than another instance held at that moment: a balancer that
    sends each request to the least-loaded instance makes none of the latter (one that reads the
    load late, a few); a random or static choice makes them whenever the loads differ."""
    events = sorted((t, name, running + waiting) for name, timeline in timelines.items()
                    for t, running, waiting in timeline)
    held: dict[str, int] = {}
    count, misrouted = 0, []
    for t, name, now in events:
        before = held.get(name, 0)
        held[name] = now
        if now <= before or not start <= t <= end:
            continue
        count += 1
        others = {n: h for n, h in held.items() if n != name}
        if others and before > min(others.values()):
            least = min(others, key=others.get)
            misrouted.append(f"{t:.3f}: to {name} holding {before} while {least} held {others[least]}")
    return count, misrouted
