"""After the load: what the engines' own metrics say about the fleet (Prometheus). Per role, the
spread of running requests over instances (a persistent hot spot means the balancer is not
balancing), expert balancedness (EPLB), KV transfers that failed and requests that failed or
were aborted during the test. Pure: query text in, gates out."""

from __future__ import annotations

import math

from infra.render.metrics import ENGINE_METRICS, GROUP_SERIES_LABEL, ROLE_SERIES_LABEL, summary_mean, with_selector
from infra.tracks import namespaces_matcher
from infra.rollout.canary import Gate

MAX_LOAD_SPREAD = 1.5  # busiest instance's running requests over the mean, averaged over the window
MIN_EXPERT_BALANCEDNESS = 0.8  # SGLang's eplb_balancedness: mean over max GPU load of experts, 1 is even


def fleet_queries(engine: str, namespace: str, window: str, roles: list[str],
                  balancedness_roles: list[str] = ()) -> dict[str, str]:
    """`balancedness_roles`: pools whose engines export expert balancedness
    (infra.render.metrics.balancedness_roles); SGLang registers it only when told to."""
    m = ENGINE_METRICS[engine]
    queries = {}
    for role in roles:
        sel = f'{{{namespaces_matcher(namespace)},{ROLE_SERIES_LABEL}="{role}"}}'
        # An instance's load is its group's: every node of an SGLang group exports its own
        # schedulers' running requests.
        running = f"sum by (namespace, {GROUP_SERIES_LABEL}) (avg_over_time({with_selector(m.running, sel)}[{window}]))"
        queries[f"{role} load spread"] = f"max({running}) / avg({running})"
        if m.expert_balancedness and role in balancedness_roles:
            queries[f"{role} expert balancedness"] = \
                f"min({summary_mean(m.expert_balancedness, sel, window, over='increase')})"
    sel = f"{{{namespaces_matcher(namespace)}}}"
    queries["KV transfer failures"] = f"sum(increase({with_selector(m.kv_transfer_failures, sel)}[{window}])) or vector(0)"
    queries["failed or aborted requests"] = f"sum(increase({with_selector(m.requests_failed, sel)}[{window}])) or vector(0)"
    return queries


def fleet_gates(values: dict[str, float]) -> list[Gate]:
    """No data for a spread is a failed gate (the engines were not seen); a missing balancedness
    is skipped only if the engine exports none (vLLM)."""
    gates = []
    for name, value in values.items():
        seen = math.isfinite(value)
        if name.endswith("load spread"):
            gates.append(Gate(name, seen and value <= MAX_LOAD_SPREAD,
                              f"{value:.2f}x the mean (at most {MAX_LOAD_SPREAD:g}x)" if seen else "no samples"))
        elif name.endswith("expert balancedness"):
            gates.append(Gate(name, seen and value >= MIN_EXPERT_BALANCEDNESS,
                              f"{value:.2f} (at least {MIN_EXPERT_BALANCEDNESS:g})" if seen else "no samples"))
        else:
            gates.append(Gate(name, seen and value == 0, f"{value:g} during the test" if seen else "no samples"))
    return gates
