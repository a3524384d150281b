#!/usr/bin/env python3
"""Time the emergency rollback with the shared release store (S3, on moto's server started
here on 127.0.0.1) and a simulated cluster with realistic latencies.

Each run: two good revisions are rolled out (not timed), then the environment is rolled
back to the first (timed end to end: lease, checks, one route change, health checks,
state and audit writes). The cluster's own time (its route change and health checks,
at the latencies below) is measured apart, so the toolkit's share is the rest.

Latencies (defaults, per call; override with the flags):
  --apply-latency 12   one route change: `pulumi up --target` of the HTTPRoute (CLI start,
                       plugins, diff, one PATCH: 8-15 s) plus Envoy Gateway's push (1-3 s)
  --health-latency 2   one health check: `kubectl wait` on the target's router and engine groups

    .venv/bin/python scripts/bench_rollback.py [--runs 20] [--apply-latency 12] [--health-latency 2]

--twin: on the cluster twin instead, with nothing simulated but what twin/live.py says: dev's
two good revisions rolled out by `pdctl rollout --pulumi-stack dev` (the real Pulumi engine, the twin's
API server; not timed), their pods running as processes, a client sending requests throughout along
the live route; then `pdctl rollback --to` back and forth between them (r1, r2, r1, ...), each timed
from the command's start to the client's live share back at 100% on its target (twin/live.py
share_back). Prints min / median / max. Starts the twin if none runs (PDSTACK_TWIN_DIR), and stops it
if it started it.

    PDSTACK_TWIN_DIR=/tmp/twin .venv/bin/python scripts/bench_rollback.py --twin [--runs 5]
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402

from infra.rollout.canary import Observation  # noqa: E402
from infra.rollout.cluster import InMemoryCluster  # noqa: E402
from infra.rollout.objectstore import BucketStore  # noqa: E402
from infra.rollout.releases import ReleaseStore  # noqa: E402
from infra.rollout.rollback import rollback  # noqa: E402
from infra.rollout.rollout import RolloutOptions, rollout  # noqa: E402
from infra.spec import stack_spec_path  # noqa: E402
from infra.spec_checks import load_spec, parse_spec  # noqa: E402

BUCKET = "pdstack-bench-releases"


@contextmanager
def moto_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class TimedCluster:
    """Adds up the time spent inside the cluster's own calls."""

    def __init__(self, cluster: InMemoryCluster):
        self.cluster, self.seconds = cluster, 0.0

    def __getattr__(self, name):
        method = getattr(self.cluster, name)

        def timed(*args, **kwargs):
            started = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.monotonic() - started
        return timed


def one_run(endpoint: str, n: int, spec_a, spec_b, apply_latency: float, health_latency: float) -> tuple[float, float]:
    good = Observation(ttft_p99_s=0.3, tpot_p99_s=0.02, error_rate=0.0, kv_transfer_errors=0)
    quiet = Console(file=io.StringIO())
    store = ReleaseStore("bench", objects=BucketStore(BUCKET, f"run-{os.getpid()}-{n}/bench", endpoint))
    cluster = InMemoryCluster()
    options = RolloutOptions(stages=(100,), bake_seconds=0, poll_seconds=0.001)
    for spec in (spec_a, spec_b):
        rollout(spec, store, cluster, lambda rev: good, options, console=quiet)
    cluster.apply_latency, cluster.health_latency = apply_latency, health_latency
    timed = TimedCluster(cluster)
    started = time.monotonic()
    result = rollback(store, timed, console=quiet)
    total = time.monotonic() - started
    assert result.revision == 1 and cluster.traffic() == {1: 100} and store.traffic() == {1: 100}
    return total, total - timed.seconds


def twin_runs(runs: int) -> int:
    """--twin: see the module's docstring."""
    import tempfile

    from twin import cluster
    from twin.api import TwinError
    from twin.live import live_dev, retuned_router, timed_rollback

    already = cluster.running()
    cluster.up(log=lambda line: print(line, flush=True))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-rollback-twin-") as folder, \
                live_dev(Path(folder)) as env:
            for name, spec_file in (("r1", env.base_spec), ("r2", env.spec_file("r2", retuned_router))):
                done = env.rollout(spec_file, "100")
                if done.returncode:
                    print(f"rollout of {name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}", file=sys.stderr)
                    return 1
            figures = []
            for n in range(runs):
                to = 1 if n % 2 == 0 else 2  # named: the revision rolled back from is no longer "good"
                command, back, answers = timed_rollback(env, to, "--to", str(to))
                failed = sum(not a.ok for a in answers)
                figures.append(back)
                print(f"  run {n + 1}: rollback to r{to}: command {command:.1f} s, live share back at 100% after "
                      f"{back:.1f} s, {len(answers)} requests, {failed} failed", flush=True)
    except TwinError as exc:  # the twin or the scenario said why: no traceback
        print(f"bench_rollback --twin: {exc}", file=sys.stderr)
        return 1
    finally:
        if not already:
            cluster.down(log=lambda *_: None)
    print(f"rollback on the twin (dev, pdctl rollback --pulumi-stack dev, real engine; live share seen by the client), "
          f"{runs} runs: min {min(figures):.1f} s   median {statistics.median(figures):.1f} s   max {max(figures):.1f} s"
          f"   goal 60 s at the slowest: {'met' if max(figures) < 60 else 'MISSED'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, help="how many rollbacks (default 20; 5 with --twin)")
    parser.add_argument("--twin", action="store_true", help="on the cluster twin, live traffic (see above); "
                                                             "--runs defaults to 5 there")
    parser.add_argument("--apply-latency", type=float, default=12.0, help="seconds one cluster change takes")
    parser.add_argument("--health-latency", type=float, default=2.0, help="seconds one health check takes")
    parser.add_argument("--stack", default="prod")
    args = parser.parse_args()
    if args.twin:
        return twin_runs(args.runs or 5)
    args.runs = args.runs or 20
    spec_a = load_spec(stack_spec_path(args.stack))
    data = spec_a.model_dump(mode="json")
    data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = 0.6
    spec_b = parse_spec(data)
    with moto_server() as endpoint:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        runs = [one_run(endpoint, n, spec_a, spec_b, args.apply_latency, args.health_latency) for n in range(args.runs)]
    totals, own = [t for t, _ in runs], [o for _, o in runs]
    print(f"rollback, {args.stack}, S3 release store (moto on 127.0.0.1), simulated cluster: "
          f"{args.apply_latency:g}s per route change, {args.health_latency:g}s per health check, {args.runs} runs")
    print(f"  end to end   median {statistics.median(totals):.3f} s   slowest {max(totals):.3f} s   "
          f"budget 60 s: {'met' if max(totals) < 60 else 'MISSED'}")
    print(f"  pdstack's own share (all but the cluster's calls)   median {statistics.median(own):.3f} s   "
          f"slowest {max(own):.3f} s   budget 1 s: {'met' if max(own) < 1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
