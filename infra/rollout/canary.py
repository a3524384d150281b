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


@dataclass(frozen=True)
class GatePolicy:
    """How much worse than the serving revision a canary may be before it is rolled back."""

    latency_regression: float = 1.2  # canary p99 may be at most 20% above the baseline's
    error_rate_slack: float = 0.005  # and its error rate at most 0.5 points above
    allowed_kv_transfer_errors: float = 0.0


@dataclass(frozen=True)
class Observation:
    ttft_p99_s: float  # the slowest role's, each where its engine times TTFT
    tpot_p99_s: float
    error_rate: float
    kv_transfer_errors: float
    kv_transfer_p99_s: float = math.nan  # NaN: no transfer timed


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
    }


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
            limit = base * policy.latency_regression
            gates.append(Gate(f"{name} vs serving", value <= limit,
                              f"{value * 1000:.0f} ms, serving {base * 1000:.0f} ms (limit x{policy.latency_regression:g})"))
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
        limit = base * policy.latency_regression
        gates.append(Gate("KV transfer p99 vs serving", slow <= limit,
                          f"{slow * 1000:.1f} ms, serving {base * 1000:.1f} ms (limit x{policy.latency_regression:g})"))
    return Verdict(tuple(gates))


def observe(api: PrometheusAPI, spec: StackSpec, revision: int, window: str) -> Observation:
    """One revision of one environment, as the gates read it from Prometheus."""
    return Observation(**{k: api.query(q) for k, q in gate_queries(spec, revision, window).items()})
