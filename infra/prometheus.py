"""A small client of Prometheus's HTTP API (`/api/v1/query`): all the canary gates, the cost
report and the tests need. Instant queries only; ranges are PromQL subqueries."""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass


class PrometheusError(RuntimeError):
    pass


@dataclass(frozen=True)
class PrometheusAPI:
    url: str  # e.g. http://prometheus.monitoring.svc:9090
    timeout_seconds: float = 10.0

    def vector(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) for every series it yields, at `at` (unix seconds) or now."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        endpoint = f"{self.url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(endpoint, timeout=self.timeout_seconds) as resp:
                body = json.load(resp)
        except OSError as exc:
            raise PrometheusError(f"Prometheus at {self.url} did not answer: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"query failed: {body.get('error')} ({promql})")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query(self, promql: str, at: float | None = None) -> float:
        """An instant query that yields one number (NaN when it yields no series)."""
        result = self.vector(promql, at)
        if not result:
            return math.nan
        if len(result) > 1:
            raise PrometheusError(f"query returned {len(result)} series, expected one: {promql}")
        return result[0][1]
