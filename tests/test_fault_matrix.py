"""The crash-safety figure: a real rollout, run as its own process against the simulated
cluster, is stopped or broken at every point where it changes something (each store write,
each cluster change: infra/rollout/faultpoints.py numbers them), on both kinds of release
store; then the recovery an operator would run, and a check that nothing disagrees.

Faults, each real, none simulated inside pdstack:
- SIGKILL of the rollout process (folder store and S3 store);
- the store's disk filling up (a tmpfs of its own, filled by `dd`: the kernel's ENOSPC);
- the store's disk going read-only (`mount -o remount,ro`: the kernel's EROFS);
- the S3 endpoint's network going away (a proxy in front of moto's server drops every
  connection: botocore's own connection errors after its retries);
- the process stopped (SIGSTOP, a paused VM or a long GC) while another operator takes its
  lease over (`rollout --abort --force`), then continued (SIGCONT): whatever it was about to
  change, its stale change must be refused (the fence on the state and on the cluster), and
  nothing it does afterwards may leave the cluster and the store disagreeing.
The tmpfs rows need mount(2) (root); where it is not allowed they are skipped and say so.

Recovery rotates over what an operator would run after a crash: `rollout --abort`,
`rollout --resume` (falling back to --abort when nothing was recorded to resume), and
`rollback`, each after repairing the fault. In the stop/takeover row the takeover is the
recovery, and it runs while the stopped process still lives.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from infra.rollout.cluster import load_simulated
from infra.rollout.objectstore import BucketStore
from infra.rollout.releases import ReleaseStore
from infra.spec import REPO_ROOT
from tests.forked_pdctl import ForkedPdctl, PdctlServer
from tests.servers import cuttable_proxy, healthy_prometheus

BUCKET = "pdstack-fault-matrix"
RECOVERIES = ("abort", "resume", "rollback")


def _can_mount(tmp: Path) -> str:
    """'' if this process may mount a tmpfs, else why not."""
    probe = tmp / "probe"
    probe.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"mount(2) not allowed here ({done.stderr.strip()})"
    subprocess.run(["umount", str(probe)], check=True)
    return ""


class Site:
    """One case's release store and simulated cluster, and how to break and repair them."""

    def __init__(self, root: Path, kind: str, fault: str, s3: dict | None = None):
        self.root, self.kind, self.fault, self.s3 = root, kind, fault, s3
        self.cluster_file = root / "cluster.json"  # another system: never on the broken disk
        self.mount = root / "disk"
        self.prefix = f"case-{uuid.uuid4().hex[:8]}"

    # where the store is, for pdctl --releases and for the checks
    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}" if self.kind == "s3" else str(self.mount / "releases")

    def store(self) -> ReleaseStore:
        if self.kind == "s3":
            return ReleaseStore("dev", objects=BucketStore(BUCKET, f"{self.prefix}/dev", self.s3["endpoint"]))
        return ReleaseStore("dev", self.mount / "releases")

    def env(self) -> dict[str, str]:
        extra = {"AWS_ENDPOINT_URL_S3": self.s3["endpoint"]} if self.kind == "s3" else {}
        return {**os.environ, **extra}

    def prepare(self, base: "Site") -> None:
        self.root.mkdir(parents=True)
        self.mount.mkdir()
        if self.fault in ("disk full", "read-only"):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(self.mount)], check=True)
        shutil.copy(base.cluster_file, self.cluster_file)
        if self.kind == "s3":
            s3 = base.store().objects.s3
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=base.prefix + "/"):
                for obj in page.get("Contents", []):
                    s3.copy_object(Bucket=BUCKET, Key=self.prefix + obj["Key"][len(base.prefix):],
                                   CopySource={"Bucket": BUCKET, "Key": obj["Key"]})
        else:
            shutil.copytree(base.mount / "releases", self.mount / "releases")

    def break_command(self) -> str | None:
        """The shell command that breaks the dependency at the fault point (None: SIGKILL)."""
        return {"sigkill": None, "stop+takeover": None,
                "disk full": f"dd if=/dev/zero of={self.mount}/filler bs=4k 2>/dev/null || true",
                "read-only": f"mount -o remount,ro {self.mount}",
                "endpoint cut": f"touch {self.s3 and self.s3['cut']}"}[self.fault]

    def repair(self) -> None:
        if self.fault == "disk full":
            (self.mount / "filler").unlink(missing_ok=True)
        elif self.fault == "read-only":
            subprocess.run(["mount", "-o", "remount,rw", str(self.mount)], check=True)
        elif self.fault == "endpoint cut":
            Path(self.s3["cut"]).unlink(missing_ok=True)

    def cleanup(self) -> None:
        if self.fault in ("disk full", "read-only"):
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)


@pytest.fixture(scope="module", autouse=True)
def forks():
    """Every pdctl process of this module is forked from one that has imported pdctl already
    (tests/forked_pdctl.py): a real process of its own, killed and stopped at its fault points
    like any other, without a second of imports each, hundreds of times over."""
    global _forks
    with PdctlServer() as _forks:
        yield _forks
    _forks = None


_forks: PdctlServer | None = None


def pdctl_argv(site: Site, *args: str) -> list[str]:
    return [*args, "--stack", "dev", "--sim", str(site.cluster_file), "--releases", site.url]


def pdctl(site: Site, *args: str, fault_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _forks.run(pdctl_argv(site, *args), env={**site.env(), **(fault_env or {})}, cwd=REPO_ROOT, timeout=300)


def _stopped_or_gone(proc: ForkedPdctl) -> None:
    """Wait until `proc` has stopped itself (state T in /proc) or exited."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.05)


def stopped_then_taken_over(site: Site, prometheus: str, n: int) -> list[str]:
    """A rollout stops itself (SIGSTOP) just before its n-th change; another operator runs
    `rollout --abort --force`; the rollout is continued (SIGCONT) and runs to its end. Returns
    what went wrong with the two commands (their disagreements are inconsistencies()')."""
    env = {**site.env(), "PDSTACK_FAULT_AT": str(n), "PDSTACK_FAULT_STOP": "1"}
    paused = _forks.start(pdctl_argv(site, *rollout_args(prometheus, "50,100")), env=env, cwd=REPO_ROOT)
    try:
        _stopped_or_gone(paused)
        takeover = pdctl(site, "rollout", "--abort", "--force")
    finally:
        if paused.poll() is None:
            os.kill(paused.pid, signal.SIGCONT)
        _, paused_err = paused.communicate(timeout=300)
    problems = []
    nothing_to_take = takeover.returncode == 3 and "no unfinished rollout to abort" in takeover.stderr
    if takeover.returncode != 0 and not nothing_to_take or "Traceback" in takeover.stderr:
        problems.append(f"takeover exit {takeover.returncode}: {takeover.stderr[-400:]}")
    if paused.returncode not in (0, 1) or "Traceback" in paused_err or "unexpected error" in paused_err:
        problems.append(f"continued rollout exit {paused.returncode}: {paused_err[-400:]}")
    return problems


def rollout_args(prometheus: str, stages: str) -> list[str]:
    return ["rollout", "--prometheus", prometheus, "--stages", stages, "--bake", "0"]


def recover(site: Site, prometheus: str, how: str) -> list[str]:
    """What an operator runs after the crash, once the fault is repaired; '' problems if it went well."""
    store = site.store()
    if store.operation() is None and store.lease() is None:
        return []
    runs = []
    if how == "resume" and store.operation() is not None:
        runs.append(pdctl(site, "rollout", "--resume", "--prometheus", prometheus, "--bake", "0"))
        if runs[-1].returncode == 3 and "nothing to resume" in runs[-1].stderr:  # as it tells the operator
            runs = [pdctl(site, "rollout", "--abort")]
    elif how == "rollback" and store.operation() is not None:
        runs.append(pdctl(site, "rollback"))
    else:
        runs.append(pdctl(site, "rollout", "--abort"))
    return [f"{how}: exit {r.returncode}: {r.stderr[-400:]}" for r in runs if r.returncode != 0 or "Traceback" in r.stderr]


def inconsistencies(site: Site) -> list[str]:
    """What disagrees after recovery: cluster vs store (traffic and the tracks the program would
    deploy), the serving revision, orphans, temp files, lease, operation, audit outcomes."""
    store, cluster = site.store(), load_simulated(site.cluster_file)
    found = []
    traffic = store.traffic()
    if cluster.traffic() != traffic:
        found.append(f"cluster serves {cluster.traffic()}, store says {traffic}")
    tracks = store.tracks() or {}
    if {r: w for r, w in tracks.items() if w} != cluster.traffic():
        found.append(f"store's tracks {tracks} do not route as the cluster does ({cluster.traffic()})")
    deployed = {r for r in cluster.applied if r != "shared" and cluster.deployed(r)}
    if not deployed <= set(tracks):
        found.append(f"revisions {sorted(deployed - set(tracks))} run but the program would delete them")
    if list(traffic.values()) != [100] or store.status(next(iter(traffic), 0)) != "good":
        found.append(f"not one good revision at 100%: {traffic}, {store.state()['status']}")
    found += [f"revision {r} has no status" for r in store.revisions() if store.status(r) is None]
    found += [f"temp file {p}" for p in site.root.rglob("*.tmp")]
    if store.lease() is not None or store.operation() is not None:
        found.append(f"left: lease {store.lease()}, operation {store.operation()}")
    entries = store.audit_entries()
    started = {e["revision"] for e in entries if e["action"] == "rollout" and e["outcome"] == "started"}
    ended = {e["revision"] for e in entries if e["outcome"] in ("succeeded", "failed", "aborted", "rolled back")}
    found += [f"rollout of r{r} has no outcome in the audit log" for r in started - ended]
    return found


def points_to_fault(count: int, fault: str, row: int) -> list[int]:
    """SIGKILL and stop/takeover at every point. The faults that break a dependency at every
    third point, each row offset from the others (CI's 20-minute budget: the whole matrix took
    134 s here with forked processes, each row at every point would add about 55 s);
    PDSTACK_FULL_MATRIX=1 runs every row at every point."""
    if fault in ("sigkill", "stop+takeover") or os.environ.get("PDSTACK_FULL_MATRIX") == "1":
        return list(range(1, count + 1))
    return list(range(1 + row % 3, count + 1, 3))


ROWS = [("folder", "sigkill"), ("folder", "disk full"), ("folder", "read-only"), ("folder", "stop+takeover"),
        ("s3", "sigkill"), ("s3", "endpoint cut"), ("s3", "stop+takeover")]


@contextmanager
def s3_behind_proxy(s3_endpoint: str, tmp: Path):
    tmp.mkdir(exist_ok=True)
    cut = tmp / "cut"
    port = int(s3_endpoint.rsplit(":", 1)[1])
    with cuttable_proxy(port, cut) as proxy_port:
        yield {"endpoint": f"http://127.0.0.1:{proxy_port}", "cut": str(cut)}


def ensure_bucket(s3_endpoint: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=BUCKET)


def test_every_change_point_under_every_fault_then_recovery_leaves_nothing_disagreeing(tmp_path, s3_endpoint):
    """The figure issue #14 asks for: fault points x faults tried, inconsistencies found (0)."""
    mount_refused = _can_mount(tmp_path)
    rows = [r for r in ROWS if not (mount_refused and r[1] in ("disk full", "read-only"))]
    only = os.environ.get("PDSTACK_MATRIX_ROWS")  # e.g. "s3/sigkill", to rerun one row while fixing it
    rows = [r for r in rows if not only or "/".join(r) in only.split(",")]
    figures, bad = [], {}
    with ExitStack() as stack:
        prometheus = stack.enter_context(healthy_prometheus())
        direct = {"endpoint": s3_endpoint, "cut": None}
        ensure_bucket(s3_endpoint)
        s3 = direct
        for kind in sorted({k for k, _ in rows}):
            # A first good revision (r1), then a traced second rollout: the change points.
            base = Site(tmp_path / f"{kind}-base", kind, "sigkill", s3)
            base.root.mkdir()
            base.mount.mkdir()
            first = pdctl(base, *rollout_args(prometheus, "100"))
            assert first.returncode == 0, first.stderr
            traced = Site(tmp_path / f"{kind}-traced", kind, "sigkill", s3)
            traced.prepare(base)
            trace = tmp_path / f"{kind}-trace.txt"
            run = pdctl(traced, *rollout_args(prometheus, "50,100"), fault_env={"PDSTACK_FAULT_TRACE": str(trace)})
            assert run.returncode == 0, run.stderr
            points = trace.read_text().splitlines()
            assert len(points) >= 20, points
            for row_kind, fault in rows:
                if row_kind != kind:
                    continue

                def one(n: int, fault=fault) -> tuple[str, list[str]]:
                    with ExitStack() as own:
                        # A cut of its own: cases run two at a time and must not cut each other off.
                        endpoint = own.enter_context(s3_behind_proxy(s3_endpoint, tmp_path / f"cut-{n}")) \
                            if fault == "endpoint cut" else direct
                        return case(n, fault, endpoint)

                def case(n: int, fault: str, endpoint: dict | None) -> tuple[str, list[str]]:
                    site = Site(tmp_path / f"{kind}-{fault.replace(' ', '-')}-{n}", kind, fault, endpoint)
                    site.prepare(base)
                    try:
                        if fault == "stop+takeover":
                            return points[n - 1], stopped_then_taken_over(site, prometheus, n) + inconsistencies(site)
                        env = {"PDSTACK_FAULT_AT": str(n)}
                        if site.break_command():
                            env["PDSTACK_FAULT_RUN"] = site.break_command()
                        run = pdctl(site, *rollout_args(prometheus, "50,100"), fault_env=env)
                        problems = []
                        expected = (-9,) if fault == "sigkill" else (0, 1)
                        if run.returncode not in expected or "Traceback" in run.stderr:
                            problems.append(f"rollout exit {run.returncode}: {run.stderr[-400:]}")
                        site.repair()
                        problems += recover(site, prometheus, RECOVERIES[n % len(RECOVERIES)])
                        problems += inconsistencies(site)
                        return points[n - 1], problems
                    finally:
                        site.cleanup()

                started = time.monotonic()
                at = points_to_fault(len(points), fault, rows.index((row_kind, fault)))
                with ThreadPoolExecutor(max_workers=2) as pool:
                    results = list(pool.map(one, at))
                print(f"{kind}/{fault}: {len(at)} of {len(points)} points in {time.monotonic() - started:.0f}s", flush=True)
                found = {f"{kind}/{fault} at {p}": r for p, r in results if r}
                bad.update(found)
                figures.append((kind, fault, len(at), len(points), sum(len(r) for r in found.values())))
    print("\ncrash-safety matrix (change points x faults, inconsistencies after recovery):")
    for kind, fault, tried, points, count in figures:
        print(f"  {kind:6} store  {fault:13}  {tried} of {points} points  {count} inconsistencies")
    total = sum(f[2] for f in figures)
    print(f"  total: {total} faulted runs, {sum(f[4] for f in figures)} inconsistencies"
          + (f"; tmpfs rows skipped: {mount_refused}" if mount_refused else ""))
    assert bad == {}


def test_a_rollout_paused_at_its_traffic_change_and_taken_over_cannot_put_its_traffic_back(tmp_path):
    """Issue #24's case: stopped just before it routes 50% to the new revision, taken over by
    `rollout --abort --force`, continued: before fencing covered the cluster, it routed
    {2: 50, 1: 50} while the store said {1: 100}. Its change is refused now, and says why."""
    with healthy_prometheus() as prometheus:
        base = Site(tmp_path / "base", "folder", "sigkill")
        base.root.mkdir()
        base.mount.mkdir()
        assert pdctl(base, *rollout_args(prometheus, "100")).returncode == 0
        traced = Site(tmp_path / "traced", "folder", "sigkill")
        traced.prepare(base)
        trace = tmp_path / "trace.txt"
        assert pdctl(traced, *rollout_args(prometheus, "50,100"), fault_env={"PDSTACK_FAULT_TRACE": str(trace)}
                     ).returncode == 0
        points = [line.split(" ", 1)[1] for line in trace.read_text().splitlines()]
        at = points.index("traffic {2: 50, 1: 50}") + 1
        site = Site(tmp_path / "case", "folder", "stop+takeover")
        site.prepare(base)
        assert stopped_then_taken_over(site, prometheus, at) == []
    assert inconsistencies(site) == []
    assert load_simulated(site.cluster_file).traffic_log[-1] == {1: 100}  # the takeover's, and nothing after
