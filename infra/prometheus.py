"""A small client of Prometheus's HTTP API (`/api/v1/query`): all the canary gates, the cost
report and the tests need. Instant queries only; ranges are PromQL subqueries."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from infra.inputs import InputError, http_url


class PrometheusError(RuntimeError):
    """Prometheus could not answer a query: unreachable, an HTTP error, or not a query result."""


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error") or body[:200])
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


class PrometheusURLError(PrometheusError, InputError):
    """The Prometheus URL itself is unusable: an input error, found before any query."""


# A PromQL range (`rate(x[5m])`, a subquery's `[24h:1m]`) as the Prometheus the tests run reads it
# (Debian bookworm's 2.42.0; its go.mod pins prometheus/common v0.39.0):
# - promql/parser/lex.go, lexDuration: a number without a unit is "missing unit character in duration";
# - prometheus/common model/time.go, ParseDuration (durationRE): whole numbers, each unit at most
#   once and in this order, y (365d) w d h m s ms; a total past 2^63-1 ns is "duration out of range";
# - promql/parser/parse.go, parseDuration: "duration must be greater than 0".
_DURATION_UNITS = (("y", 365 * 86400), ("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1),
                   ("ms", 0.001))
_DURATION = re.compile("".join(f"(?:([0-9]+){unit})?" for unit, _ in _DURATION_UNITS))
_MAX_DURATION_NS = 2 ** 63 - 1


def range_seconds(text: str) -> float:
    """The seconds of a PromQL range duration such as `5m` or `1h30m`; ValueError saying why
    Prometheus would refuse it (so a command refuses it before it changes anything)."""
    match = _DURATION.fullmatch(text)
    unitless = re.fullmatch("[0-9]+", text) is not None
    if unitless or match is None or not text:
        why = "has no unit" if unitless else "is not a PromQL duration"
        raise ValueError(f"{text!r} {why}: whole numbers with units y, w, d, h, m, s or ms, largest first, each "
                         "at most once (e.g. 5m, 1h30m, 24h)")
    numbers = [(n, scale) for n, (_, scale) in zip(match.groups(), _DURATION_UNITS) if n]
    ms = sum(int(n) * int(scale * 1000) for n, scale in numbers if len(n) <= 20)
    if ms * 1_000_000 > _MAX_DURATION_NS or any(len(n) > 20 for n, _ in numbers):
        raise ValueError(f"{text!r} is out of range (about 292 years at most)")
    if ms == 0:
        raise ValueError(f"{text!r} is empty: a range must be greater than 0 (e.g. 5m)")
    return ms / 1000


@dataclass(frozen=True)
class PrometheusAPI:
    url: str  # e.g. http://prometheus.monitoring.svc:9090
    timeout_seconds: float = 10.0

    def __post_init__(self):
        try:
            http_url(self.url, "Prometheus URL", "http://prometheus.monitoring.svc:9090")
        except InputError as exc:
            raise PrometheusURLError(str(exc)) from None

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
