"""`pdctl validate-deployment`: the checks the design ends a rollout with, against a running
endpoint. Connectivity and the auth chain first (a request with the key is served, one without
is refused), then a load-test sweep with aiperf judged against the spec's SLOs. Each check is a
gate with its figures; the first failing class stops what would only measure noise."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from infra.inputs import write_output
from infra.validation.loadtest import (AIPERF_API_KEY_ENV, RESULT_FILE, Gate, LoadTestError, Scenario, Sweep,
                                       aiperf_command, aiperf_config, judge, read_result)


@dataclass
class Validation:
    url: str
    gates: list[tuple[str, Gate]] = field(default_factory=list)  # (stage, gate)
    sweep: Sweep | None = None

    @property
    def passed(self) -> bool:
        return bool(self.gates) and all(g.passed for _, g in self.gates)

    def add(self, stage: str, gates: list[Gate]) -> bool:
        self.gates += [(stage, g) for g in gates]
        return all(g.passed for g in gates)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow a redirect. urllib's handler re-sends every header but the body's, the API
    key's Authorization included, to whatever host and scheme a Location names (CPython 3.11
    Lib/urllib/request.py, HTTPRedirectHandler.redirect_request); unfollowed, the 3xx arrives
    as an HTTPError and is the check's answer."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _chat(url: str, model: str, api_key: str | None, timeout: float) -> tuple[int, str]:
    """(status, start of the body); for a redirect, where it points; status 0: nothing answered."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", data=body, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as resp:
            return resp.status, resp.read(200).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:  # the server's text, shown: no terminal control characters
            location = exc.headers.get("Location") or "no Location"
            return exc.code, "".join(c if c.isprintable() else "?" for c in location[:200])
        return exc.code, exc.read(200).decode(errors="replace")
    except (OSError, ValueError) as exc:
        return 0, str(getattr(exc, "reason", exc))


def _redirect(code: int, location: str) -> str:
    return (f"HTTP {code}: redirected to {location}; a redirect is never followed (the key would go with it). "
            "Fix: the URL of the address that serves the API itself")


def endpoint_gates(url: str, model: str, api_key: str | None, timeout: float = 10.0) -> list[Gate]:
    """Served with the key; refused (401/403) without one. Status 0: nothing answered; a
    redirect fails either check, unfollowed."""
    code, text = _chat(url, model, api_key, timeout)
    served = Gate("authenticated request", 200 <= code < 300,
                  _redirect(code, text) if 300 <= code < 400 else f"HTTP {code}" if code else
                  f"no answer from {url} ({text})")
    if not served.passed:
        return [served]
    code, text = _chat(url, model, None, timeout)
    refused = Gate("request without a key is refused", code in (401, 403),
                   _redirect(code, text) if 300 <= code < 400 else
                   f"HTTP {code}" + ("" if code in (401, 403) else ": the gateway serves without an API key"))
    return [served, refused]


def run_sweep(aiperf: str, url: str, model: str, scenario: Scenario, concurrencies: list[int], requests: int,
              out_dir: Path, tokenizer: str, api_key: str | None, slo, env: dict[str, str],
              timeout_seconds: float = 900) -> Sweep:
    """aiperf once per concurrency, each run's own result file read and judged."""
    sweep = Sweep(scenario.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    for concurrency in concurrencies:
        run_dir = out_dir / f"{scenario.name}-c{concurrency}"
        (run_dir / RESULT_FILE).unlink(missing_ok=True)  # a result left from an earlier run is never judged
        config = out_dir / f"{scenario.name}-c{concurrency}.aiperf.yaml"  # holds no secret: `${VAR}` at most
        write_output(config, yaml.safe_dump(aiperf_config(url, model, scenario, concurrency, requests, run_dir,
                                                          tokenizer, with_api_key=api_key is not None),
                                            sort_keys=False))
        started = time.monotonic()
        try:
            done = subprocess.run(aiperf_command(aiperf, config), capture_output=True, text=True,
                                  env={**env, **({AIPERF_API_KEY_ENV: api_key} if api_key else {})},
                                  timeout=timeout_seconds)
        except FileNotFoundError:
            raise LoadTestError(f"{aiperf}: not installed. Fix: `make loadtest-tool` (aiperf, pinned)") from None
        except subprocess.TimeoutExpired:
            raise LoadTestError(f"aiperf at concurrency {concurrency} ran past {timeout_seconds:g}s") from None
        (out_dir / f"{scenario.name}-c{concurrency}.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            tail = " ".join((done.stdout + done.stderr).split()[-40:])
            raise LoadTestError(f"aiperf at concurrency {concurrency} exited {done.returncode} after "
                                f"{time.monotonic() - started:.0f}s: ...{tail}")
        sweep.runs.append(judged_run(run_dir, scenario.name, concurrency, slo))
    return sweep


def judged_run(run_dir: Path, scenario: str, concurrency: int, slo) -> tuple:
    """One run's result file (aiperf's own), read and judged against the SLO."""
    result = read_result(run_dir / RESULT_FILE, scenario, concurrency)
    return result, judge(result, slo.ttft_p99_ms, slo.tpot_p99_ms, slo.tokens_per_second_per_user)


def read_sweep(results: Path, scenario: str, concurrencies: list[int], slo) -> Sweep:
    """A sweep that ran elsewhere (the in-cluster Jobs), from its result folders <scenario>-c<N>."""
    return Sweep(scenario, [judged_run(results / f"{scenario}-c{c}", scenario, c, slo) for c in concurrencies])
