"""A small client of Prometheus's HTTP API (`/api/v1/query`): all the canary gates, the cost
report and the tests need. Instant queries only; ranges are PromQL subqueries."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from infra.inputs import InputError


class PrometheusError(RuntimeError):
    """Prometheus could not answer a query: unreachable, an HTTP error, or not a query result."""


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error") or body[:200])
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


class PrometheusURLError(PrometheusError, InputError):
    """The Prometheus URL itself is unusable: an input error, found before any query."""


@dataclass(frozen=True)
class PrometheusAPI:
    url: str  # e.g. http://prometheus.monitoring.svc:9090
    timeout_seconds: float = 10.0

    def __post_init__(self):
        fix = "Fix: e.g. http://prometheus.monitoring.svc:9090"
        try:
            parsed = urllib.parse.urlsplit(self.url)
            parsed.port  # noqa: B018 - raises for a port out of range
        except ValueError as exc:
            raise PrometheusURLError(f"Prometheus URL {self.url!r} is not a URL ({exc}). {fix}") from None
        if parsed.scheme not in ("http", "https"):
            raise PrometheusURLError(f"Prometheus URL {self.url!r} has no http:// or https:// scheme. {fix}")
        if not parsed.hostname:
            raise PrometheusURLError(f"Prometheus URL {self.url!r} names no host. {fix}")

    def vector(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) for every series it yields, at `at` (unix seconds) or now."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        endpoint = f"{self.url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(endpoint, timeout=self.timeout_seconds) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            # Prometheus puts the PromQL error in the body of its 4xx/5xx answers.
            raise PrometheusError(f"Prometheus at {self.url} answered HTTP {exc.code}: "
                                  f"{_error_text(exc.read())} ({promql})") from None
        except (OSError, ValueError) as exc:  # refused, reset, timed out, unreadable URL
            raise PrometheusError(f"Prometheus at {self.url} did not answer: {exc}") from None
        try:
            body = json.loads(raw)
            if body.get("status") != "success":
                raise PrometheusError(f"query failed: {body.get('error')} ({promql})")
            data = body["data"]
            if data["resultType"] == "scalar":
                return [({}, float(data["result"][1]))]
            return [(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]
        except PrometheusError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise PrometheusError(f"Prometheus at {self.url} answered something that is not a query result: "
                                  f"{raw[:120]!r}") from None

    def query(self, promql: str, at: float | None = None) -> float:
        """An instant query that yields one number (NaN when it yields no series)."""
        result = self.vector(promql, at)
        if not result:
            return math.nan
        if len(result) > 1:
            raise PrometheusError(f"query returned {len(result)} series, expected one: {promql}")
        return result[0][1]
