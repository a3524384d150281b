"""Canary gates: is the new revision as good as the SLO and as the revision serving now?

`gate_queries` (PromQL per revision, from the engine's real metric names) and `judge`
(observations -> verdict) are pure. `observe` reads one revision from Prometheus.

A revision's series carry the label `pdstack_io_release` (the pod label
`pdstack.io/release`, copied onto every series by the PodMonitor's podTargetLabels).

TTFT is judged per role, read from the pools where the engine times it (`ttft_pools`, the table
the alerts and scalers read): vLLM times it on prefill and on decode, each its own part, and a
histogram summed over both hides one role's slow tail in the other's samples; an SGLang PD
prefill times none. The gate reads the slowest role's p99: any role's above the SLO fails it.

KV hand-offs: a failed one (each engine's own counter, ENGINE_METRICS kv_transfer_failures) fails
the canary; a slow one, its p99 transfer time above the serving revision's by more than the latency
regression allows (ENGINE_METRICS kv_transfer_time_bucket, timed where each engine times it). The
spec sets no SLO for a transfer's time, so a first release is not judged on it, nor a revision
whose engines report no transfer (no PD pair, or no traffic yet).

"vs serving" latency gates judge at the histograms' resolution. Each p99 is histogram_quantile over
a classic histogram with the engine's own buckets (SGLang's KV transfer: 1, 2, 5 ... 500, 1000 ms),
so it is known only to its bucket: Prometheus v3.13.1 (promql/quantile.go BucketQuantile) picks the
first bucket whose count reaches the rank and interpolates linearly inside it, and the quantile past
the last finite edge reads as that edge. A canary fails only when its p99's bucket lies wholly above
the serving p99's bucket's upper edge times the latency regression (`slower_beyond_resolution`):
then every p99 the samples allow is slower than the regression allows. Two 2x-wide buckets apart
and more than the regression is evidence; 660 ms against 350 ms across the 500 ms edge is not.
`observe` reads each compared histogram's edges (its `le` values) beside its p99.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra import naming
from infra.prometheus import PrometheusAPI
from infra.render.metrics import ENGINE_METRICS, ROLE_SERIES_LABEL, increase_from_zero, p99, ttft_pools, with_selector
from infra.tracks import namespaces_matcher
from infra.spec import SLOSpec, StackSpec

RELEASE_SERIES_LABEL = naming.RELEASE_LABEL.replace(".", "_").replace("/", "_")

DEFAULT_STAGES = (1, 5, 25, 50, 100)
BUCKET_EDGES = "bucket_edges"  # gate_queries' key of the histograms' edges, not an Observation field


@dataclass(frozen=True)
class GatePolicy:
    """How much worse than the serving revision a canary may be before it is rolled back."""

    latency_regression: float = 1.2  # canary p99 may be at most 20% above the baseline's
    error_rate_slack: float = 0.005  # and its error rate at most 0.5 points above
    allowed_kv_transfer_errors: float = 0.0
    # A p99 of fewer than 100 samples is their largest (histogram_quantile's rank is 0.99 x count):
    # one outlier, such as a new instance's first KV transfer over a connection not yet made,
    # would decide it. Below this many samples in the canary's window a "vs serving" gate does not
    # judge (and says so); the SLO gates still do.
    min_samples_vs_serving: int = 100


@dataclass(frozen=True)
class Observation:
    ttft_p99_s: float  # the slowest role's, each where its engine times TTFT
    tpot_p99_s: float
    error_rate: float
    kv_transfer_errors: float
    kv_transfer_p99_s: float = math.nan  # NaN: no transfer timed
    # The bucket edges (le, in s, +Inf last) of the histograms each p99 above was read from; empty:
    # not known, and the p99 is taken as exact.
    ttft_buckets_s: tuple[float, ...] = ()
    tpot_buckets_s: tuple[float, ...] = ()
    kv_transfer_buckets_s: tuple[float, ...] = ()
    # How many samples each p99 above was read from in the window (TTFT: the fewest of a role's);
    # NaN: not known, and the p99 is judged whatever their number.
    ttft_samples: float = math.nan
    tpot_samples: float = math.nan
    kv_transfer_samples: float = math.nan


@dataclass(frozen=True)
class Gate:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Verdict:
    gates: tuple[Gate, ...]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def reasons(self) -> str:
        return "; ".join(f"{g.name}: {g.detail}" for g in self.gates if not g.passed) or "all gates passed"


def gate_queries(spec: StackSpec, revision: int, window: str) -> dict[str, str]:
    """One environment's revision: a Prometheus often scrapes several environments."""
    m = ENGINE_METRICS[spec.engine.kind]
    sel = f'{{{namespaces_matcher(spec.environment.namespace, revision)},{RELEASE_SERIES_LABEL}="{revision}"}}'
    timing_first_tokens = with_selector(sel, f'{{{ROLE_SERIES_LABEL}=~"{"|".join(ttft_pools(spec))}"}}')
    return {
        "ttft_p99_s": f"max({p99(m.ttft_bucket, timing_first_tokens, window, by=(ROLE_SERIES_LABEL,))})",
        "tpot_p99_s": p99(m.tpot_bucket, sel, window),
        # No traffic gives 0/0 = NaN, which fails the gate: a canary must be seen to work. No failure
        # counted is 0: SGLang exports its aborted-requests counter only from the first abort.
        "error_rate": f"(sum(rate({with_selector(m.requests_failed, sel)}[{window}])) or vector(0)) / "
                      f"sum(rate({with_selector(m.requests_started, sel)}[{window}]))",
        "kv_transfer_errors": increase_from_zero(with_selector(m.kv_transfer_failures, sel), window),
        "kv_transfer_p99_s": f"{p99(m.kv_transfer_time_bucket, sel, window)} * {m.kv_transfer_time_unit_s:g}",
        "ttft_samples": f"min({samples(m.ttft_bucket, timing_first_tokens, window, by=(ROLE_SERIES_LABEL,))})",
        "tpot_samples": samples(m.tpot_bucket, sel, window),
        "kv_transfer_samples": samples(m.kv_transfer_time_bucket, sel, window),
        # The `le` edges of the series each p99 reads, one series per (gate, le): `observe` reads them.
        BUCKET_EDGES: " or ".join(
            f'label_replace(group by (le) (rate({with_selector(bucket, selector)}[{window}])), "gate", "{field}", "", "")'
            for field, bucket, selector in (("ttft_buckets_s", m.ttft_bucket, timing_first_tokens),
                                            ("tpot_buckets_s", m.tpot_bucket, sel),
                                            ("kv_transfer_buckets_s", m.kv_transfer_time_bucket, sel))),
    }


def samples(bucket: str, selector: str, window: str, by: tuple[str, ...] = ()) -> str:
    """How many samples a histogram (named by its `_bucket` series) took in `window`."""
    count = bucket.removesuffix("_bucket") + "_count"
    grouping = f" by ({', '.join(by)})" if by else ""
    return f"sum{grouping} (increase({with_selector(count, selector)}[{window}]))"


def bucket_edges(series: list[tuple[dict[str, str], float]], kv_transfer_unit_s: float) -> dict[str, tuple[float, ...]]:
    """The BUCKET_EDGES query's answer as Observation's *_buckets_s fields: each gate's sorted `le`
    edges in seconds (SGLang's KV transfer histogram counts ms)."""
    edges: dict[str, set[float]] = {}
    for labels, _ in series:
        unit = kv_transfer_unit_s if labels["gate"] == "kv_transfer_buckets_s" else 1.0
        edges.setdefault(labels["gate"], set()).add(float(labels["le"]) * unit)
    return {field: tuple(sorted(values)) for field, values in edges.items()}


def p99_bucket(p99_s: float, edges: tuple[float, ...]) -> tuple[float, float]:
    """(lower, upper]: where the samples put a quantile that histogram_quantile read as `p99_s` from
    a classic histogram with these `le` edges. Prometheus v3.13.1 promql/quantile.go BucketQuantile
    interpolates inside the first bucket whose count reaches the rank (from 0 in the lowest bucket),
    and reads a quantile in the +Inf bucket as the last finite edge. No edges known: (p99_s, p99_s)."""
    finite = sorted(e for e in edges if math.isfinite(e))
    for i, upper in enumerate(finite):
        if p99_s <= upper or math.isclose(p99_s, upper, rel_tol=1e-9):  # the interpolation's rounding
            lower = finite[i - 1] if i else (0.0 if upper > 0 else -math.inf)
            past_the_last = i == len(finite) - 1 and math.isclose(p99_s, upper, rel_tol=1e-9)
            return lower, math.inf if past_the_last else upper
    return (finite[-1], math.inf) if finite else (p99_s, p99_s)


def slower_beyond_resolution(canary_s: float, canary_edges: tuple[float, ...], serving_s: float,
                             serving_edges: tuple[float, ...], regression: float) -> bool:
    """Every p99 the canary's samples allow is above every p99 the serving revision's allow times
    `regression`: its bucket's lower edge (exclusive) is at or above the serving bucket's upper
    edge times it. Exact values (no edges) compare as values: at most `regression` x passes."""
    lower, _ = p99_bucket(canary_s, canary_edges)
    limit = p99_bucket(serving_s, serving_edges)[1] * regression
    return lower > limit or (lower == limit and lower < canary_s)


def _vs_serving(name: str, value: float, edges: tuple[float, ...], base: float, base_edges: tuple[float, ...],
                policy: GatePolicy, digits: int, samples: float = math.nan) -> Gate:
    """A latency gate against the serving revision, at the resolution of both histograms, judged
    only on enough of the canary's samples for a p99 (GatePolicy.min_samples_vs_serving)."""
    detail = f"{value * 1000:.{digits}f} ms, serving {base * 1000:.{digits}f} ms (limit x{policy.latency_regression:g})"
    if math.isfinite(samples) and samples < policy.min_samples_vs_serving:
        return Gate(f"{name} vs serving", True, f"not judged: {samples:.0f} samples in the window, fewer than the "
                                                f"{policy.min_samples_vs_serving} a p99 needs ({detail})")
    slower = slower_beyond_resolution(value, edges, base, base_edges, policy.latency_regression)
    if edges or base_edges:
        buckets = "; p99 buckets: canary {}, serving {}".format(
            *("{:g}-{:g} ms".format(*(edge * 1000 for edge in p99_bucket(v, e))) for v, e in ((value, edges), (base, base_edges))))
        within = not slower and value > base * policy.latency_regression
        detail += (", within the histograms' resolution" if within else "") + buckets
    return Gate(f"{name} vs serving", not slower, detail)


def judge(canary: Observation, baseline: Observation | None, slo: SLOSpec, policy: GatePolicy = GatePolicy()) -> Verdict:
    """Each metric against the SLO and, when a revision serves already, against it."""
    gates = []
    for name, field, limit_s in (("TTFT p99", "ttft_p99_s", slo.ttft_p99_ms / 1000),
                                 ("TPOT p99", "tpot_p99_s", slo.tpot_p99_ms / 1000)):
        value = getattr(canary, field)
        base = getattr(baseline, field) if baseline else math.nan
        if not math.isfinite(value):
            gates.append(Gate(name, False, "no samples for the canary (did it get traffic?)"))
            continue
        gates.append(Gate(f"{name} vs SLO", value <= limit_s, f"{value * 1000:.0f} ms, SLO {limit_s * 1000:g} ms"))
        if math.isfinite(base) and base > 0:
            edges = field.replace("_p99_s", "_buckets_s")
            gates.append(_vs_serving(name, value, getattr(canary, edges), base, getattr(baseline, edges), policy, 0,
                                     getattr(canary, field.replace("_p99_s", "_samples"))))
    err = canary.error_rate
    if not math.isfinite(err):
        gates.append(Gate("error rate", False, "no finished requests for the canary"))
    else:
        gates.append(Gate("error rate vs SLO", err <= slo.max_error_rate, f"{err:.2%}, SLO {slo.max_error_rate:.2%}"))
        if baseline and math.isfinite(baseline.error_rate):
            limit = baseline.error_rate + policy.error_rate_slack
            gates.append(Gate("error rate vs serving", err <= limit, f"{err:.2%}, serving {baseline.error_rate:.2%}"))
    kv = canary.kv_transfer_errors if math.isfinite(canary.kv_transfer_errors) else 0.0
    gates.append(Gate("KV transfer errors", kv <= policy.allowed_kv_transfer_errors, f"{kv:g} in the window"))
    slow, base = canary.kv_transfer_p99_s, baseline.kv_transfer_p99_s if baseline else math.nan
    if math.isfinite(slow) and math.isfinite(base) and base > 0:
        gates.append(_vs_serving("KV transfer p99", slow, canary.kv_transfer_buckets_s, base,
                                 baseline.kv_transfer_buckets_s, policy, 1, canary.kv_transfer_samples))
    return Verdict(tuple(gates))


def observe(api: PrometheusAPI, spec: StackSpec, revision: int, window: str) -> Observation:
    """One revision of one environment, as the gates read it from Prometheus."""
    queries = gate_queries(spec, revision, window)
    edges = bucket_edges(api.vector(queries.pop(BUCKET_EDGES)), ENGINE_METRICS[spec.engine.kind].kv_transfer_time_unit_s)
    return Observation(**{k: api.query(q) for k, q in queries.items()}, **edges)
