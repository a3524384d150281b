"""Load tests with NVIDIA's aiperf, pinned, and what pdstack makes of its results. Pure: aiperf's
config file for a scenario, the tool's own result file read at its pinned schema, the SLO
gates, and the measured capacity written as the workload profile `pdctl plan` reads.

Why aiperf (compared in README.md): it measures TTFT and inter-token latency per streamed
chunk, has multi-turn and shared-prefix synthetic datasets, SLO goodput, and installs without
PyTorch (1.2 GB against guidellm's 6 GB with torch; inference-perf needs Python 3.12).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from infra.planning.surface import held_batches
from infra.rollout.canary import Gate  # one gate type for every verdict: name, passed, detail

AIPERF_VERSION = "0.13.0"  # pinned in pyproject.toml's `loadtest` extra; the Job's image is the same release
RESULT_FILE = "profile_export_aiperf.json"
RESULT_SCHEMA = "1.4"  # profile_export_aiperf.json's schema_version at that release
RANDOM_SEED = 7  # one synthetic dataset for every run, so two runs (or endpoints) see the same prompts


class LoadTestError(RuntimeError):
    """The tool did not run, or left no result pdstack can read; the message says which."""


@dataclass(frozen=True)
class Scenario:
    """A dataset shape that exercises what PD serving is for (aiperf's synthetic generators)."""

    name: str
    input_tokens: int
    output_tokens: int
    turns: int = 1  # multi-turn conversations re-send their history: the prefix cache's work
    shared_prefix_tokens: int = 0  # a system prompt every conversation shares

    def dataset(self, entries: int) -> dict:
        """aiperf's synthetic dataset of this shape (its config's `benchmark.datasets` entry)."""
        out: dict = {"name": "main", "type": "synthetic", "entries": entries, "random_seed": RANDOM_SEED,
                     "prompts": {"isl": {"mean": self.input_tokens, "stddev": 0},
                                 "osl": {"mean": self.output_tokens, "stddev": 0}}}
        if self.turns > 1:
            out["turns"] = {"mean": self.turns, "stddev": 0}
        if self.shared_prefix_tokens:
            out["prefix_prompts"] = {"shared_system_length": self.shared_prefix_tokens}
        return out

    def scaled(self, factor: float) -> "Scenario":
        """The same shape, smaller (for a loopback stand-in or a smoke run)."""
        n = lambda v: max(1, round(v * factor))  # noqa: E731
        return Scenario(self.name, n(self.input_tokens), n(self.output_tokens), self.turns,
                        n(self.shared_prefix_tokens) if self.shared_prefix_tokens else 0)


SCENARIOS = {
    "chat-shared-prefix": Scenario("chat-shared-prefix", 400, 200, turns=4, shared_prefix_tokens=2000),
    "long-input-short-output": Scenario("long-input-short-output", 8000, 64),
    "short-input-long-output": Scenario("short-input-long-output", 128, 1024),
}


# aiperf reads an API key from its config file as `${VAR}` (aiperf 0.13.0, config/endpoint.py
# EndpointConfig.api_key and config/loader/env_vars.py substitute_env_vars), never from its
# command line here: /proc/<pid>/cmdline is readable by every user of the machine, a process's
# environment only by its owner. aiperf hands the key to its own workers the same way
# (orchestrator/local_executor.py, AIPERF_INJECTED_API_KEY, popped by each child).
AIPERF_API_KEY_ENV = "PDSTACK_AIPERF_API_KEY"


def aiperf_config(url: str, model: str, scenario: Scenario, concurrency: int, requests: int, out_dir: Path,
                  tokenizer: str, with_api_key: bool) -> dict:
    """One aiperf run at a fixed concurrency, as aiperf's own config file (`aiperf profile
    --config`, schemaVersion 2.0): streaming chat, so TTFT and ITL are measured per chunk. With
    `with_api_key` the key is read from $PDSTACK_AIPERF_API_KEY when aiperf loads the file."""
    endpoint = {"urls": [url], "type": "chat", "streaming": True,
                **({"api_key": f"${{{AIPERF_API_KEY_ENV}}}"} if with_api_key else {})}
    return {"schemaVersion": "2.0", "random_seed": RANDOM_SEED, "benchmark": {
        "models": {"items": [{"name": model}]},
        "endpoint": endpoint,
        "datasets": [scenario.dataset(entries=requests)],
        "phases": [{"name": "profiling", "type": "concurrency", "concurrency": concurrency, "requests": requests}],
        "artifacts": {"dir": str(out_dir), "auto_plot": False},
        "tokenizer": {"name": tokenizer},
        "server_metrics": {"enabled": False},
        "runtime": {"ui": "none"},
    }}


def aiperf_command(aiperf: str, config_file: str | Path) -> list[str]:
    return [aiperf, "profile", "--config", str(config_file)]


SWEEP_SHARES = (0.25, 0.5, 1.0, 1.25)  # of the planner's predicted capacity: up to it, and past it


def sweep_from_plan(decode_slots_per_instance: float, decode_instances: int) -> list[int]:
    """Concurrency levels around what the planner predicts the decode pool holds at the TPOT
    target: the sweep must reach it and go past it, or the capacity it reports is a guess."""
    capacity = decode_slots_per_instance * decode_instances
    return sorted({max(1, round(capacity * share)) for share in SWEEP_SHARES})


@dataclass(frozen=True)
class LoadResult:
    """What one run measured, from the tool's own result file."""

    scenario: str
    concurrency: int
    requests: int
    errors: int
    ttft_p99_ms: float
    ttft_p50_ms: float
    itl_p99_ms: float  # inter-token latency: the TPOT a user sees
    itl_p50_ms: float
    tokens_per_second_per_user: float  # p50 of per-request output tokens/s
    output_tokens_per_second: float  # all requests together
    requests_per_second: float
    input_tokens_mean: float
    input_tokens_p99: float
    output_tokens_mean: float
    output_tokens_p99: float
    # Read from the engines' metrics over the run (validate-deployment --prometheus), None where not:
    held_batch: float | None = None  # sequences one decode instance held (its running-requests gauge)
    kv_usage: float | None = None  # the decode pool's highest share of KV cache in use
    queue_depth: float | None = None  # requests one decode instance kept waiting (its queue gauges)
    itl_mean_ms: float = math.nan  # the mean inter-token latency: Little's law is a law of means


def littles_law_batch(result: LoadResult, decode_instances: int) -> float:
    """Sequences one decode instance held during a run, from aiperf's own figures (Little's law):
    output tokens/s times the MEAN time between one sequence's tokens, at most the concurrency
    asked. Little's law holds for means (the time-averaged number held is the arrival rate times
    the mean time held): with the median, a run whose inter-token times are skewed (a busy
    machine's stalls) read a smaller batch than it held, and a cap read as a rise. The median
    stands in only for a result without the mean. Ramp-up and the last requests' tail count in the
    run's tokens/s: it errs low, which puts each ITL at a smaller batch (towards more instances)."""
    asked = result.concurrency / decode_instances
    itl_ms = result.itl_mean_ms if math.isfinite(result.itl_mean_ms) else result.itl_p50_ms
    if not (math.isfinite(result.output_tokens_per_second) and math.isfinite(itl_ms)):
        return asked
    return min(asked, result.output_tokens_per_second * itl_ms / 1000 / decode_instances)


def held_batch(result: LoadResult, decode_instances: int) -> float:
    """The batch a run's decode instances held: the running-requests gauge's where it was read."""
    return result.held_batch if result.held_batch is not None else littles_law_batch(result, decode_instances)


def read_result(path: Path, scenario: str, concurrency: int) -> LoadResult:
    """aiperf's profile_export_aiperf.json, checked against the schema pdstack was written for."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise LoadTestError(f"{path}: aiperf wrote no result (see its log beside it)") from None
    except (OSError, ValueError) as exc:
        raise LoadTestError(f"{path}: not aiperf's result file ({exc})") from None
    if str(data.get("schema_version")) != RESULT_SCHEMA or data.get("aiperf_version") != AIPERF_VERSION:
        raise LoadTestError(f"{path}: schema {data.get('schema_version')} from aiperf {data.get('aiperf_version')}; "
                            f"pdstack reads schema {RESULT_SCHEMA} of aiperf {AIPERF_VERSION}. Fix: the pinned aiperf")

    def metric(name: str, stat: str) -> float:
        value = (data.get(name) or {}).get(stat)
        return float(value) if value is not None else math.nan

    count = int(metric("request_count", "avg")) if not math.isnan(metric("request_count", "avg")) else 0
    errors = sum(int(e.get("count", 0)) for e in data.get("error_summary") or [])
    return LoadResult(scenario, concurrency, count, errors,
                      metric("time_to_first_token", "p99"), metric("time_to_first_token", "p50"),
                      metric("inter_token_latency", "p99"), metric("inter_token_latency", "p50"),
                      metric("output_token_throughput_per_user", "p50"), metric("output_token_throughput", "avg"),
                      metric("request_throughput", "avg"),
                      metric("input_sequence_length", "avg"), metric("input_sequence_length", "p99"),
                      metric("output_sequence_length", "avg"), metric("output_sequence_length", "p99"),
                      itl_mean_ms=metric("inter_token_latency", "avg"))


def judge(result: LoadResult, ttft_p99_ms: float, tpot_p99_ms: float, tokens_per_second_per_user: float,
          max_error_rate: float = 0.0) -> list[Gate]:
    """The spec's SLOs against one run. A missing figure fails its gate: no data is no pass."""
    def gate(name: str, value: float, limit: float, below: bool, unit: str) -> Gate:
        ok = not math.isnan(value) and (value <= limit if below else value >= limit)
        return Gate(name, ok, f"{value:.1f} {unit} ({'at most' if below else 'at least'} {limit:g})")

    error_rate = result.errors / max(result.requests + result.errors, 1)
    return [gate("ttft_p99", result.ttft_p99_ms, ttft_p99_ms, True, "ms"),
            gate("tpot_p99", result.itl_p99_ms, tpot_p99_ms, True, "ms"),
            gate("tokens_per_second_per_user", result.tokens_per_second_per_user, tokens_per_second_per_user, False,
                 "tokens/s"),
            Gate("errors", error_rate <= max_error_rate and result.requests > 0,
                 f"{result.errors} failed of {result.requests + result.errors} requests")]


@dataclass
class Sweep:
    """Runs of one scenario at rising concurrency, each judged."""

    scenario: str
    runs: list[tuple[LoadResult, list[Gate]]] = field(default_factory=list)

    def passed(self) -> bool:
        return bool(self.runs) and all(g.passed for g in self.runs[0][1])  # the lightest load must meet the SLO

    def best_within_slo(self) -> LoadResult | None:
        ok = [r for r, gates in self.runs if all(g.passed for g in gates)]
        return max(ok, key=lambda r: r.concurrency) if ok else None


def _context(runs: list[LoadResult]) -> float:
    """Tokens a running sequence holds on average over its life: its prompt and half its output."""
    return round(sum(r.input_tokens_mean + r.output_tokens_mean / 2 for r in runs) / len(runs), 1)


def _decode_row(runs: list[LoadResult], decode_instances: int) -> list[tuple[float, float]]:
    """ITL (p50) by the batch the engine held, one point a batch (held_batches: past the
    engine's cap several runs held the same)."""
    return held_batches([(round(held_batch(r, decode_instances), 3), round(r.itl_p50_ms, 2)) for r in runs
                         if math.isfinite(r.itl_p50_ms) and r.itl_p50_ms > 0])


def _on_batches(row: list[tuple[float, float]], first: list[tuple[float, float]]) -> tuple[list[float], int]:
    """A row's ITL at the first row's batches: linear between its own points; past them (a batch
    its engines did not hold: at a longer context the KV cache holds fewer) it rises as the first
    row does there, scaled by how much more the row rose than the first over the batches both
    held (exact where ITL is affine in the batch, its slope growing with the context). Returns
    the ITLs and how many were extrapolated."""
    xs, ys = [b for b, _ in row], [t for _, t in row]
    fx, fy = [b for b, _ in first], [t for _, t in first]

    def at(x: float, pxs: list[float], pys: list[float]) -> float:
        i = min(max(bisect.bisect_left(pxs, x), 1), len(pxs) - 1)
        return pys[i - 1] + (x - pxs[i - 1]) * (pys[i] - pys[i - 1]) / (pxs[i] - pxs[i - 1])

    low, high = max(xs[0], fx[0]), min(xs[-1], fx[-1])
    first_rise = at(high, fx, fy) - at(low, fx, fy)
    scale = max(1.0, (at(high, xs, ys) - at(low, xs, ys)) / first_rise) if first_rise > 0 else 1.0
    out, outside = [], 0
    for b, f in first:
        if xs[0] <= b <= xs[-1]:
            out.append(round(at(b, xs, ys), 2))
            continue
        outside += 1
        edge = xs[-1] if b > xs[-1] else xs[0]
        out.append(round(max(min(ys), at(edge, xs, ys) + (f - at(edge, fx, fy)) * scale), 2))
    return out, outside


def decode_grid(rows: dict[float, list[tuple[float, float]]], notes: list[str] | None = None) -> dict:
    """The decode surface's grid from rows of ITL by held batch, one row a context. The first row
    (the sweep's own) sets the batches; another row, measured at the batches its engines held,
    is read at them (_on_batches) if it has two points or more, and left out, said so, if not."""
    first = next(iter(rows.values()))
    batches = [b for b, _ in first]
    grid = {next(iter(rows)): [t for _, t in first]}
    for context, row in list(rows.items())[1:]:
        if len(row) < 2 or context in grid:
            if notes is not None:
                notes.append(f"decode: the row at a context of {context:g} tokens is left out: "
                             f"{'one' if len(row) < 2 else 'a second'} row there")
            continue
        grid[context], outside = _on_batches(row, first)
        if outside and notes is not None:
            notes.append(f"decode: at a context of {context:g} tokens the engines held {row[0][0]:g} to "
                         f"{row[-1][0]:g} sequences; the ITL of {outside} other batch(es) of the grid is "
                         "extrapolated as the first row rises there, scaled by how much more this row rose")
    contexts = sorted(grid)
    return {"contexts": contexts, "batches": batches, "itl_ms": [grid[c] for c in contexts]}


def measured_workload(sweep: Sweep, prefill_instances: int, decode_instances: int, where: str, when: str,
                      headroom: float = 0.2, lengths: list[LoadResult] | tuple = (),
                      contexts: list[list[LoadResult]] | tuple = (), max_running_requests: int | None = None,
                      kv_cache_tokens: float | None = None,
                      loaded: list[tuple[LoadResult, LoadResult]] | tuple = (),
                      notes: list[str] | tuple = ()) -> dict:
    """The workload profile `pdctl plan --workload` reads, from a sweep: the traffic shape seen,
    and the surface one instance of each pool showed (infra/planning/surface.py), with where and
    when it was measured, and `notes` on how (where the sweep stopped and why):
    - prefill, by prompt length: TTFT (p50) of a prompt alone, from every run at concurrency 1
      (the sweep's own and `lengths`, the same scenario at other prompt lengths; with none, the
      sweep's lightest run stands in: its TTFT holds some queueing, errs up), and the prompt
      tokens/s one instance computes under load, from `loaded`: (a run alone, the same prompts
      under load: several in flight, one output token each, infra/validation/profile.py); a length
      with no run under load (or one with failed requests, set aside) keeps a prompt alone's
      tokens/s (errs low: an engine batches prompts), said in the notes with why;
    - decode, by context and batch: ITL (p50, the typical step; the planner adds the batch's
      spread) at the batch each decode instance held (its running-requests gauge, or Little's
      law on aiperf's figures: held_batch), at the context the sequences hold on average
      (input + output / 2): the sweep's row, and one row for each of `contexts` (the same levels
      at other prompt lengths), read at the first row's batches (decode_grid); past the longest
      context the planner extrapolates, and says so;
    - the engine's max running requests from the spec, and the KV cache one decode instance
      holds, in tokens, as its engines report it (`kv_cache_tokens`, from Prometheus: see
      infra/validation/health.py kv_tokens_per_instance), or none if that was not read."""
    best = sweep.best_within_slo()
    if best is None:
        raise LoadTestError(f"{sweep.scenario}: no run met the SLO, so no capacity can be stated. Fix: the "
                            "deployment (balancing and cache settings first), or a lighter sweep")
    notes = list(notes)
    runs = [r for r, _ in sweep.runs]
    alone = [r for r in [*runs, *lengths] if r.concurrency == 1 and r.ttft_p50_ms > 0] or \
        [min(runs, key=lambda r: r.concurrency)]
    prefill = {round(r.input_tokens_mean, 1): r.ttft_p50_ms for r in alone
               if math.isfinite(r.input_tokens_mean) and math.isfinite(r.ttft_p50_ms) and r.input_tokens_mean > 0}
    decode = _decode_row(runs, decode_instances)
    if not prefill or not decode:
        raise LoadTestError(f"{sweep.scenario}: aiperf reported no TTFT or ITL, so no surface can be stated. Fix: "
                            "a streaming endpoint (TTFT and ITL are measured per chunk)")
    throughput = _loaded_throughput(loaded, prefill_instances)
    # A run under load with failed requests is set aside (its requests/s counts what failed
    # fast): the note says so, not that none was made.
    failed = {round(alone.input_tokens_mean, 1): r for alone, r in loaded if r.errors}
    alone_only = [f"{n:g} tokens" + (f" (its run under load set aside: {failed[n].errors} of "
                              f"{failed[n].requests + failed[n].errors} requests failed)" if n in failed else "")
                  for n in sorted(prefill) if n not in throughput]
    if alone_only:
        notes.append(f"prefill at {', '.join(alone_only)}: no run under load, so the tokens/s of a prompt "
                     "alone (an engine that batches prompts computes more: errs towards more instances)")
    surface = {
        "prefill": [{"input_tokens": n, "ttft_ms": round(t, 2),
                     "tokens_per_second": round(throughput.get(n, n / t * 1000), 1)}
                    for n, t in sorted(prefill.items())],
        "decode": decode_grid({_context([best]): decode,
                               **{_context(other): _decode_row(other, decode_instances) for other in contexts if other}},
                              notes),
    }
    if kv_cache_tokens:
        surface["kv_cache_tokens"] = round(kv_cache_tokens)
    if max_running_requests:
        surface["max_running_requests"] = max_running_requests
    return {
        "arrival_rate_rps": round(best.requests_per_second, 3),
        "input_tokens": {"mean": round(best.input_tokens_mean, 1), "p99": round(best.input_tokens_p99, 1)},
        "output_tokens": {"mean": round(best.output_tokens_mean, 1), "p99": round(best.output_tokens_p99, 1)},
        "headroom": headroom,
        "surface": surface,
        "measured": {"where": where, "when": when, "tool": f"aiperf {AIPERF_VERSION}", "scenario": sweep.scenario,
                     **({"notes": notes} if notes else {})},
    }


def _loaded_throughput(loaded, prefill_instances: int) -> dict[float, float]:
    """Prompt tokens/s one prefill instance computed under load, by the length its prompts had
    alone (a multi-turn scenario's prompts are shorter with one output token a turn: the pair
    says which runs are the same prompts)."""
    out: dict[float, float] = {}
    for alone, r in loaded:
        if math.isfinite(r.input_tokens_mean) and math.isfinite(r.requests_per_second) and not r.errors and \
                r.requests_per_second > 0 and math.isfinite(alone.input_tokens_mean):
            out[round(alone.input_tokens_mean, 1)] = r.input_tokens_mean * r.requests_per_second / prefill_instances
    return out
