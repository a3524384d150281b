"""A PD fleet simulated request by request: what `scripts/bench_planner_sim.py` measures profiles
on (through validate-deployment's own profile code) and judges plans with. It shares no formula
with the planner (no queueing formula, no Little's law, no lognormal batch): engines step, pack
prompts, run out of KV and make requests wait, as stated here. Pure (seeded).

The engine (a synthetic DeepSeek-V3; coefficients stated, not measured; those of
infra/planning/fleet_model.py where the two models overlap):

- Prefill. One forward pass takes up to `chunk_tokens` prompt tokens, first come first served:
  several short prompts packed into one pass, a long one split over passes (chunked prefill). A
  pass costs p0 + p1 x tokens + p2 x sum(token x the tokens before it in its prompt) ms: a
  fixed cost, per-token work, attention over the prefix (a prompt of L alone: p0 + p1 L +
  p2 L^2 / 2 in one pass). A request's first token comes when its prompt's last pass ends.
  The pool's balancer sends a prompt to the instance with the fewest prompt tokens queued.
- Decode. A step makes one token for every running sequence and costs d0 + d1 x B + d2 x the
  tokens of KV the B sequences hold. A sequence is admitted when fewer than
  `max_running_requests` run and its prompt and answer fit in the free KV cache (reserved
  whole); until then it waits, and the wait shows in its inter-token latency. Requests go to
  decode instances at random (each instance sees its share of a Poisson stream).
- What a user sees, as aiperf measures it: TTFT, and ITL per request
  ((end - first token) / (output tokens - 1)); p50 and p99 over requests.
- `slowdown` scales each phase's times: a fleet slower or faster than the one profiled.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from infra.planning.surface import Lengths
from infra.validation.loadtest import LoadResult


@dataclass(frozen=True)
class Engine:
    prefill_pass_ms: float = 15.0
    prefill_ms_per_token: float = 0.05
    prefill_ms_per_attention: float = 4e-6  # per token x the tokens before it in its prompt
    chunk_tokens: int = 8192
    decode_step_ms: float = 15.0
    decode_ms_per_sequence: float = 0.04
    decode_ms_per_kv_token: float = 4e-6
    kv_cache_tokens: float = 3.0e6
    max_running_requests: int = 512
    prefill_gpus: int = 8
    decode_gpus: int = 16
    slowdown: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class Mix:
    """Prompt or answer lengths: lognormal (mean, p99), or a mix of such with weights."""

    parts: tuple[tuple[float, Lengths], ...]

    @classmethod
    def of(cls, mean: float, p99: float) -> Mix:
        return cls(((1.0, Lengths(mean, p99)),))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        weights = np.array([w for w, _ in self.parts]) / sum(w for w, _ in self.parts)
        which = rng.choice(len(self.parts), size=n, p=weights)
        out = np.empty(n)
        for i, (_, d) in enumerate(self.parts):
            s = d.sigma
            out[which == i] = np.exp(math.log(d.mean) - s * s / 2 + s * rng.standard_normal(int((which == i).sum())))
        return np.maximum(1, np.round(out))

    @property
    def mean(self) -> float:
        total = sum(w for w, _ in self.parts)
        return sum(w * d.mean for w, d in self.parts) / total

    def p99(self, rng_seed: int = 0) -> float:
        return float(np.quantile(self.sample(np.random.default_rng(rng_seed), 200_000), 0.99))


class _Prefill:
    """One prefill instance: a queue of [request, tokens left, tokens done]."""

    def __init__(self, engine: Engine):
        self.e, self.queue, self.queued_tokens, self.busy_until = engine, deque(), 0.0, None

    def start(self, now: float) -> float | None:
        """Begin a pass if idle with work: its end time."""
        if self.busy_until is not None or not self.queue:
            return None
        e, budget, tokens, attention = self.e, self.e.chunk_tokens, 0, 0.0
        self.plan = []
        for item in self.queue:
            if budget <= 0:
                break
            take = min(item[1], budget)
            attention += take * (item[2] + take / 2)
            tokens += take
            budget -= take
            self.plan.append((item, take))
        ms = e.prefill_pass_ms + e.prefill_ms_per_token * tokens + e.prefill_ms_per_attention * attention
        self.busy_until = now + ms * e.slowdown[0] / 1000
        return self.busy_until

    def finish(self) -> list[int]:
        """End the pass: the requests whose prompts are done."""
        done = []
        for item, take in self.plan:
            item[1] -= take
            item[2] += take
            self.queued_tokens -= take
            if item[1] <= 0:
                done.append(item[0])
        while self.queue and self.queue[0][1] <= 0:
            self.queue.popleft()
        self.busy_until = None
        return done


class _Decode:
    """One decode instance: its running sequences as arrays (request, tokens left, context, KV
    reserved), and the requests waiting for room."""

    def __init__(self, engine: Engine):
        self.e, self.waiting, self.kv_used, self.busy_until = engine, deque(), 0.0, None
        self.ids = np.empty(0, dtype=np.int64)
        self.left, self.context, self.need = np.empty(0), np.empty(0), np.empty(0)

    @property
    def batch(self) -> int:
        return len(self.ids)

    def start(self, now: float, prompts, outputs) -> float | None:
        e = self.e
        if self.busy_until is not None:
            return None
        admitted = []
        while self.waiting and self.batch + len(admitted) < e.max_running_requests:
            r = self.waiting[0]
            need = prompts[r] + outputs[r]
            if (self.batch or admitted) and self.kv_used + need > e.kv_cache_tokens:
                break
            self.waiting.popleft()
            admitted.append(r)
            self.kv_used += need
        if admitted:
            self.ids = np.concatenate([self.ids, admitted])
            self.left = np.concatenate([self.left, [outputs[r] - 1 for r in admitted]])
            self.context = np.concatenate([self.context, [prompts[r] + 1 for r in admitted]])
            self.need = np.concatenate([self.need, [prompts[r] + outputs[r] for r in admitted]])
        if not self.batch:
            return None
        ms = e.decode_step_ms + e.decode_ms_per_sequence * self.batch + e.decode_ms_per_kv_token * self.context.sum()
        self.step_started, self.busy_until = now, now + ms * e.slowdown[1] / 1000
        return self.busy_until

    def finish(self) -> list[int]:
        self.left -= 1
        self.context += 1
        ended = self.left <= 0
        self.busy_until = None
        if not ended.any():
            return []
        done = self.ids[ended].tolist()
        self.kv_used -= float(self.need[ended].sum())
        keep = ~ended
        self.ids, self.left, self.context, self.need = self.ids[keep], self.left[keep], self.context[keep], self.need[keep]
        return done


@dataclass
class Served:
    """Per request: arrival, first token and end times (NaN: not finished in the run)."""

    arrival: np.ndarray
    first: np.ndarray
    end: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray
    steps: list = field(default_factory=list)  # (sequences, requests waiting, seconds) of every decode step
    kv_peak: float = 0.0
    duration: float = 0.0

    def held_batch(self) -> float | None:
        """The running-requests gauge as validate-deployment reads it (health.held_batch_query): the
        median over the run's time of an instance's sequences, idle time left out."""
        return self._busy_median(0)

    def queue_depth(self) -> float | None:
        """The queue gauges as validate-deployment reads them (health.queue_depth_query): the median
        over the run's busy time of the requests an instance kept waiting."""
        return self._busy_median(1)

    def _busy_median(self, column: int) -> float | None:
        """The time-weighted median of one column of the decode steps (each step lasts its seconds)."""
        if not self.steps:
            return None
        steps = np.array(self.steps)
        values, seconds = steps[:, column], steps[:, 2]
        order = np.argsort(values)
        cumulative = np.cumsum(seconds[order])
        return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])

    def ttft_ms(self, skip: float = 0.0) -> np.ndarray:
        ok = np.isfinite(self.first) & (self.arrival >= skip)
        return (self.first[ok] - self.arrival[ok]) * 1000

    def itl_ms(self, skip: float = 0.0) -> np.ndarray:
        ok = np.isfinite(self.end) & (self.outputs > 1) & (self.arrival >= skip)
        return (self.end[ok] - self.first[ok]) / (self.outputs[ok] - 1) * 1000


def simulate(engine: Engine, prefill_n: int, decode_n: int, prompts: np.ndarray, outputs: np.ndarray,
             arrivals: np.ndarray | None = None, users: int = 0, rng: np.random.Generator | None = None,
             decode_only: bool = False) -> Served:
    """Requests through `prefill_n` prefill and `decode_n` decode instances: open (at `arrivals`)
    or closed (`users` each sending its next request when its last ends, as aiperf's concurrency
    mode does). `decode_only`: requests reach decode at their arrival (their prefill done)."""
    n = len(prompts)
    rng = rng or np.random.default_rng(0)
    arrival = np.full(n, np.nan)
    first, end = np.full(n, np.nan), np.full(n, np.nan)
    pre = [_Prefill(engine) for _ in range(prefill_n)]
    dec = [_Decode(engine) for _ in range(decode_n)]
    events: list[tuple[float, int, int, int]] = []  # (time, order, kind 0 arrival / 1 prefill / 2 decode, index)
    order = 0
    served = Served(arrival, first, end, prompts, outputs)
    plist, olist = prompts.tolist(), outputs.tolist()

    def push(t: float | None, kind: int, i: int) -> None:
        nonlocal order
        if t is not None:
            order += 1
            heapq.heappush(events, (t, order, kind, i))

    def to_decode(r: int, now: float) -> None:
        first[r] = now
        if olist[r] <= 1:
            finished(r, now)
            return
        d = dec[int(rng.integers(decode_n))]
        d.waiting.append(r)
        push(d.start(now, plist, olist), 2, dec.index(d))

    next_request = 0

    def finished(r: int, now: float) -> None:
        end[r] = now
        if users:
            issue(now)

    def issue(now: float) -> None:
        nonlocal next_request
        if next_request < n:
            push(now, 0, next_request)
            next_request += 1

    if users:
        for _ in range(min(users, n)):
            issue(0.0)
    else:
        for r, t in enumerate(arrivals):
            push(float(t), 0, r)
    now = 0.0
    while events:
        now, _, kind, i = heapq.heappop(events)
        if kind == 0:
            arrival[i] = now
            if decode_only:
                to_decode(i, now)
                continue
            p = min(pre, key=lambda x: x.queued_tokens)
            p.queue.append([i, plist[i], 0])
            p.queued_tokens += plist[i]
            push(p.start(now), 1, pre.index(p))
        elif kind == 1:
            p = pre[i]
            for r in p.finish():
                to_decode(r, now)
            push(p.start(now), 1, i)
        else:
            d = dec[i]
            served.steps.append((d.batch, len(d.waiting), now - d.step_started))
            served.kv_peak = max(served.kv_peak, d.kv_used / engine.kv_cache_tokens)
            for r in d.finish():
                finished(r, now)
            push(d.start(now, plist, olist), 2, i)
    served.duration = now
    return served


def _p(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else math.nan


def aiperf_run(engine: Engine, concurrency: int, input_tokens: int, output_tokens: int, requests: int,
               prefill_n: int = 1, decode_n: int = 1, scenario: str = "sim") -> LoadResult:
    """What aiperf reports of a run at a fixed concurrency (fixed lengths, as its synthetic
    dataset with stddev 0), with the decode engines' running-requests and queue gauges (medians
    over their steps' time) and the KV cache's highest usage, as --prometheus reads them."""
    prompts = np.full(requests, float(input_tokens))
    outputs = np.full(requests, float(output_tokens))
    s = simulate(engine, prefill_n, decode_n, prompts, outputs, users=concurrency)
    ttft, itl = s.ttft_ms(), s.itl_ms()
    duration = max(s.duration, 1e-9)
    tokens = float(outputs[np.isfinite(s.end)].sum())
    return LoadResult(scenario, concurrency, requests, 0, _p(ttft, 0.99), _p(ttft, 0.5),
                      _p(itl, 0.99) if len(itl) else math.nan, _p(itl, 0.5) if len(itl) else math.nan,
                      1000 / _p(itl, 0.5) if len(itl) else math.nan, tokens / duration, requests / duration,
                      float(input_tokens), float(input_tokens), float(output_tokens), float(output_tokens),
                      held_batch=s.held_batch() if output_tokens > 1 else None,
                      queue_depth=s.queue_depth() if output_tokens > 1 else None,
                      kv_usage=s.kv_peak)


def poisson(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    return np.cumsum(rng.exponential(1 / rate, n))


def ttft_p99(engine: Engine, rate: float, inputs: Mix, prefill_n: int, requests: int = 3000, seed: int = 1) -> float:
    """TTFT p99 of a prefill pool of `prefill_n` at Poisson arrivals (its queue does not depend on
    decode), the first tenth of the run left out (the fleet starts empty)."""
    rng = np.random.default_rng(seed)
    prompts, arrivals = inputs.sample(rng, requests), poisson(rate, requests, rng)
    run = simulate(engine, prefill_n, 1, prompts, np.ones(requests), arrivals)
    return _p(run.ttft_ms(arrivals[requests // 10]), 0.99)


def itl_p99(engine: Engine, rate: float, inputs: Mix, outputs: Mix, decode_n: int, requests: int = 3000,
            seed: int = 1) -> float:
    """ITL p99 of one decode instance at its share of the rate (requests reach decode instances at
    random: each sees a Poisson stream of rate / decode_n), the first tenth left out."""
    rng = np.random.default_rng(seed + 1)
    prompts, answers = inputs.sample(rng, requests), outputs.sample(rng, requests)
    arrivals = poisson(rate / decode_n, requests, rng)
    run = simulate(engine, 1, 1, prompts, answers, arrivals, decode_only=True)
    return _p(run.itl_ms(arrivals[requests // 10]), 0.99)
