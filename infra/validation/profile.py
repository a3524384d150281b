"""The profile sweep: how `pdctl validate-deployment --profile-out` finds what one instance of
each pool can do, in one run. Pure: each run is `measure(concurrency)`, the caller's.

- Decode. Concurrency grows geometrically (x GROWTH a run, from 1) until a run meets a limit:
  decode's SLO breaks (ITL, tokens/s per user, errors: TTFT is prefill's), the KV cache fills (its usage gauge at KV_FULL or more, read from the
  engines' metrics), the engine's running-request cap is reached, or the engine holds no more
  sequences than at the level before though twice as many were asked: a cap the spec does not
  state if requests queued at the engine meanwhile (its queue gauges, read with --prometheus);
  with nothing queued, the load generator kept no more in flight (aiperf on a busy machine falls
  behind), which is no cap of the engine's and said so; without the gauges the two cannot be told
  apart, said so too. Then REFINE_RUNS more runs bisect, geometrically, between the last level inside every
  limit and the first past one. The surface keeps every level (the planner interpolates between
  them and never plans past the largest), each at the batch the engine held: its
  running-requests gauge over the run, or, without Prometheus, Little's law on aiperf's own
  figures (sequences decoding = output tokens/s x ITL: each makes 1000 / ITL tokens a second),
  never more than the concurrency asked. Where and why it stopped is said in the profile.
  A fixed sweep (--concurrency 1,8,32) stops where its list does: an instance that holds 5,000
  sequences is then planned at 32 (issue #41).
- Prefill under load. A prompt alone shows its TTFT, not what an engine that packs several
  prompts into one chunked pass computes per second: each prompt length runs again with
  enough prompts in flight to fill a pass on every prefill instance (the engine's chunk over
  the length, at least MIN_PROMPTS_IN_FLIGHT), one output token each, and its prompt tokens/s
  per instance is the throughput the surface holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from infra.validation.loadtest import Gate, LoadResult, LoadTestError, Sweep, held_batch

GROWTH = 2  # concurrency a run over the one before: 13 runs reach 4,096
REFINE_RUNS = 2  # bisections between the last level inside the limits and the first past one: within 2^(1/4)
KV_FULL = 0.95  # share of the KV cache in use at which it counts as full (engines preempt or retract near it)
PLATEAU = 1.15  # a doubled concurrency the engine held less than 1.15x more of: its cap
CAP_REACHED = 0.95  # held batch over the engine's max running requests at which the cap counts as reached
MIN_PROMPTS_IN_FLIGHT = 2
MAX_PROMPTS_IN_FLIGHT = 64  # per prefill instance
DEFAULT_MAX_CONCURRENCY = 16384
# Decode's limit is its own SLO: a run's TTFT is prefill's (and, at a fixed concurrency, the first
# burst of every sequence at once queueing for it), which the prefill runs measure apart.
PREFILL_GATES = ("ttft_p99",)
REQUESTS_PER_CONCURRENCY = 2  # a level runs at least this many requests a slot: most of it at its concurrency

Run = tuple[LoadResult, list[Gate]]


class LoadGeneratorLimit(str):
    """Why a run is past what the load generator kept in flight, not past a limit of the engine's:
    levels between the last inside and it measure the generator, so the sweep does not bisect."""


def past_limit(run: Run, before: Run | None, decode_instances: int, max_running: int | None) -> str | None:
    """Why this run is past a limit of the decode pool, or None."""
    result, gates = run
    failed = [g.name for g in gates if not g.passed and g.name not in PREFILL_GATES]
    if failed:
        return f"the SLO broke ({', '.join(failed)})"
    if result.kv_usage is not None and result.kv_usage >= KV_FULL:
        return f"the KV cache filled ({result.kv_usage:.0%} in use)"
    held = held_batch(result, decode_instances)
    if max_running and held >= CAP_REACHED * max_running:
        return f"the engine's running-request cap (max_running_requests {max_running} an instance)"
    if before is not None and result.concurrency >= 1.5 * before[0].concurrency and \
            held < PLATEAU * held_batch(before[0], decode_instances):
        if any(g.name in PREFILL_GATES and not g.passed for g in gates):  # the sequences queued for prefill
            return (f"prefill fed decode no more sequences than at concurrency {before[0].concurrency} "
                    f"({held:.1f} a decode instance; TTFT over the SLO): decode's capacity is past what was "
                    "measured. Fix: more prefill instances per decode instance while profiling")
        held_as_before = (f"the engine held no more sequences than at concurrency {before[0].concurrency} "
                          f"({held:.1f} an instance")
        if result.queue_depth is None:
            return (f"{held_as_before}): a cap, or a load generator that kept no more in flight; with no queue "
                    "figure (the engines' queue gauges, read with --prometheus) the two cannot be told apart")
        if result.queue_depth > 0:  # an engine at its cap queues what it cannot run
            return f"{held_as_before}, {result.queue_depth:.1f} more queued at it): a cap"
        return LoadGeneratorLimit(
            f"aiperf kept only {held:.1f} of the {result.concurrency / decode_instances:g} requests asked in flight "
            "a decode instance and nothing queued at the engine: the load generator, not the engine, was the limit, "
            "and the surface ends below the engine's capacity. Fix: run validate-deployment from a machine with CPU "
            "to spare for aiperf")
    return None


@dataclass
class CapacitySweep:
    """The runs in the order they were made, and where and why the sweep stopped."""

    scenario: str
    runs: list[Run] = field(default_factory=list)
    stopped: str = ""

    def sweep(self) -> Sweep:
        """The runs by rising concurrency, as a fixed sweep's (judged and printed the same way)."""
        return Sweep(self.scenario, sorted(self.runs, key=lambda r: r[0].concurrency))

    @property
    def concurrencies(self) -> list[int]:
        return sorted(r.concurrency for r, _ in self.runs)


def capacity_sweep(scenario: str, measure: Callable[[int], Run], decode_instances: int,
                   max_running: int | None, max_concurrency: int = DEFAULT_MAX_CONCURRENCY) -> CapacitySweep:
    """Concurrency x GROWTH from 1 until a run is past a limit, then REFINE_RUNS bisections.
    `max_running` is per decode instance (the spec's), `max_concurrency` the whole sweep's.
    A run aiperf could not finish past the first stops the sweep there, said so."""
    out = CapacitySweep(scenario)

    def run(concurrency: int, before: Run | None) -> str | None:
        try:
            made = measure(concurrency)
        except LoadTestError as exc:
            if not out.runs:
                raise
            return f"aiperf could not finish at concurrency {concurrency} ({exc})"
        out.runs.append(made)
        return past_limit(made, before, decode_instances, max_running)

    inside: Run | None = None
    concurrency, why = 1, None
    while True:
        why = run(concurrency, inside)
        if why or concurrency >= max_concurrency:
            break
        inside = out.runs[-1]
        concurrency = min(max_concurrency, concurrency * GROWTH)
    if why is None:
        out.stopped = (f"stopped at concurrency {concurrency}, the sweep's most (--max-concurrency) with no limit "
                       "met: the surface ends below the engine's capacity. Fix: a higher --max-concurrency")
        return out
    first_past, first_why = concurrency, why
    for _ in range(0 if isinstance(why, LoadGeneratorLimit) else REFINE_RUNS):
        low = inside[0].concurrency if inside else 0
        middle = round(math.sqrt(max(low, 1) * first_past))
        if inside is None or middle <= low or middle >= first_past:
            break
        why = run(middle, inside)
        if why:
            first_past, first_why = middle, why
        else:
            inside = out.runs[-1]
    held = f"{held_batch(inside[0], decode_instances):.1f} sequences an instance" if inside else "none"
    out.stopped = (f"stopped at concurrency {first_past}: {first_why}; the most inside every limit: concurrency "
                   f"{inside[0].concurrency if inside else 'none'} ({held})")
    return out


def prefill_concurrency(prompt_tokens: int, chunk_tokens_per_instance: int, prefill_instances: int) -> int:
    """Prompts in flight that fill one chunked pass on every prefill instance."""
    per_instance = min(MAX_PROMPTS_IN_FLIGHT, max(MIN_PROMPTS_IN_FLIGHT, math.ceil(chunk_tokens_per_instance
                                                                                    / max(prompt_tokens, 1))))
    return per_instance * prefill_instances


@dataclass(frozen=True)
class ProfilePlan:
    """Which runs besides the decode sweep a profile takes, and which of them feed each part of
    the surface (measured_workload): at the scenario's prompt length and at `length_shares` of
    it, a prompt alone (concurrency 1: TTFT) and the same prompts under load (one output token,
    prefill_concurrency in flight: tokens/s); at `context_shares` of it, the sweep's levels again
    (a decode row at a longer context). Runs are keyed (input tokens, output tokens)."""

    input_tokens: int
    output_tokens: int
    length_shares: list[float]
    context_shares: list[float]
    chunk_tokens_per_instance: int
    prefill_instances: int

    def length(self, share: float) -> int:
        return max(1, round(self.input_tokens * share))

    def levels(self, sweep_levels: list[int]) -> dict[tuple[int, int], set[int]]:
        """(input, output) tokens -> concurrency levels, the sweep's own runs left out."""
        out: dict[tuple[int, int], set[int]] = {}
        for n in {self.input_tokens} | {self.length(share) for share in self.length_shares}:
            if n != self.input_tokens:
                out.setdefault((n, self.output_tokens), set()).add(1)  # alone: TTFT
            if self.output_tokens != 1:
                out.setdefault((n, 1), set()).add(prefill_concurrency(n, self.chunk_tokens_per_instance,
                                                                      self.prefill_instances))  # under load
        for n in {self.length(share) for share in self.context_shares} - {self.input_tokens}:
            out.setdefault((n, self.output_tokens), set()).update(sweep_levels)
        return out

    def inputs(self, sweep: list[LoadResult], others: dict[tuple[int, int], list[LoadResult]]):
        """measured_workload's `lengths` (alone, at other lengths), `loaded` (pairs: alone, under
        load) and `contexts` (rows at longer prompts) from the sweep's runs and the others."""
        alone = {n: r for (n, o), runs in others.items() for r in runs if r.concurrency == 1 and o == self.output_tokens}
        alone[self.input_tokens] = min(sweep, key=lambda r: r.concurrency)
        loaded = [(alone[n], r) for (n, o), runs in others.items() if o == 1 != self.output_tokens and n in alone
                  for r in runs]
        context_lengths = {self.length(share) for share in self.context_shares}
        contexts = [runs for (n, o), runs in others.items() if n in context_lengths and o == self.output_tokens]
        return [r for n, r in alone.items() if n != self.input_tokens], loaded, contexts
