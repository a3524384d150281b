"""A small client of Prometheus's HTTP API (`/api/v1/query`): all the canary gates, the cost
report and the tests need. Instant queries only; ranges are PromQL subqueries."""

from __future__ import annotations

import functools
import http.client
import io
import json
import math
import re
import socket
import time
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


# --- one deadline over a whole answer ----------------------------------------------------------
# urllib's timeout is each socket operation's: a server that sends its headers and then a byte
# every few seconds is never timed out. Every connect, send and read below is given only what
# is left of one deadline (time.monotonic()), so the whole answer ends by it. urllib still
# does the rest (proxies from the environment, redirects, HTTP errors).


@dataclass(frozen=True)
class _Deadline:
    seconds: float
    ends: float  # time.monotonic()

    def left(self) -> float:
        """The seconds left; TimeoutError once there are none."""
        left = self.ends - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {self.seconds:g}s")
        return left


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read waiting at most for what is left of the deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)  # counted by the socket: it closes after its readers

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        self._sock.settimeout(self._deadline.left())
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """The connected socket as http.client uses it (sendall, makefile, close), under the deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        self._sock.close()


class _DeadlineConnection:
    """An http.client connection whose connect, request and answer share one deadline."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = self.deadline.left()  # the TCP connect; a TLS handshake waits this long per step
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _HTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHandler:
    """urllib's handler for a scheme, opening its connections under one deadline."""

    connection: type

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(functools.partial(self.connection, deadline=self.deadline), req, **kwargs)


class _HTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    connection = _HTTPConnection


class _HTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
    connection = _HTTPSConnection


@dataclass(frozen=True)
class PrometheusAPI:
    url: str  # e.g. http://prometheus.monitoring.svc:9090
    # The whole answer (connect, request, headers, body) of one query. Well under half the
    # release store's lease, which a rollout renews between a stage's tries.
    timeout_seconds: float = 10.0

    def __post_init__(self):
        try:
            http_url(self.url, "Prometheus URL", "http://prometheus.monitoring.svc:9090")
        except InputError as exc:
            raise PrometheusURLError(str(exc)) from None

    def vector(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) for every series it yields, at `at` (unix seconds) or now."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        status, raw = self._get(f"{self.url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode(params))
        if not 200 <= status < 300:  # Prometheus puts the PromQL error in the body of its 4xx/5xx answers
            raise PrometheusError(f"Prometheus at {self.url} answered HTTP {status}: {_error_text(raw)} ({promql})")
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

    def _get(self, endpoint: str) -> tuple[int, bytes]:
        """The status and body of one GET, whole within timeout_seconds; PrometheusError for any
        failure to read it (http.client's own errors are neither OSError nor ValueError)."""
        deadline = _Deadline(self.timeout_seconds, time.monotonic() + self.timeout_seconds)
        opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
        try:
            try:
                with opener.open(endpoint) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as exc:
                with exc:
                    return exc.code, exc.read()
        except http.client.HTTPException as exc:  # a short body, not HTTP, a header line too long
            raise PrometheusError(f"Prometheus at {self.url} sent a broken HTTP answer ({type(exc).__name__}: "
                                  f"{str(exc)[:120]!r})") from None
        except (OSError, ValueError) as exc:  # refused, reset, past the deadline, unreadable URL
            timed_out = isinstance(getattr(exc, "reason", exc), TimeoutError)
            raise PrometheusError(f"Prometheus at {self.url} did not answer"
                                  + (f" within {self.timeout_seconds:g}s" if timed_out else f": {exc}")) from None

    def query(self, promql: str, at: float | None = None) -> float:
        """An instant query that yields one number (NaN when it yields no series)."""
        result = self.vector(promql, at)
        if not result:
            return math.nan
        if len(result) > 1:
            raise PrometheusError(f"query returned {len(result)} series, expected one: {promql}")
        return result[0][1]
