"""dev's release tracks on the twin under live traffic, for tests/twin/test_live_rollout_on_twin.py
and scripts/bench_rollback.py --twin: `pdctl rollout --pulumi-stack dev` and `pdctl rollback` run by
the real Pulumi engine against the twin, every track's router and engine pods running as processes
(twin/live.py TrackProcesses), a real Prometheus in the pod network scraping them (the gate's
`--prometheus`), and a client sending requests throughout along the live route (LiveClient).

What stands in, as in tests/twin/test_rollout_kill_on_twin.py: tests/twin/standins.py writes the
status Envoy Gateway and Karpenter's AWS provider would; the platform stack is tests/engine.py's.

The fleet model per engine build (PodProcesses.token_timing): the revision's engine image decides its
stand-ins' token timing. The stack's pinned build answers with TTFT GOOD_TTFT_MS and ITL GOOD_ITL_MS,
each in the middle of a wide bucket of SGLang 0.5.23's histograms (TTFT (1, 2] s, ITL (0.4, 0.6] s),
so that a busy two-core machine's delays (a first run saw ITL p99 136 ms for 16 ms asked) stay in
it: the gate's p99 of two healthy tracks is then the same bucket's edge, and "vs serving" compares
like with like. dev's TPOT SLO (50 ms) is raised to TWIN_TPOT_SLO_MS for that (and its tokens per
second per user to what that allows); its TTFT SLO (2 s) stays. `slow_build` names another digest of the same image, whose stand-ins take SLOW_TTFT_MS to
the first token, above that SLO.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra.rollout.releases import ReleaseStore
from infra.spec import REPO_ROOT, stack_spec_path
from infra.spec_checks import load_spec
from infra.tracks import track_namespace
from tests.engine import engine_project, program_stack, serving_program
from tests.oci_registry import stand_in_pins
from tests.twin.placement import delete_namespaces, users_objects
from tests.twin.standins import controllers_status
from twin import fleet, live
from twin.api import kubectl
from twin.build import program
from twin.nodes import TWIN_LABEL, stack_nodes
from twin.paths import KUBECONFIG

# SGLang 0.5.23's buckets (twin/engine_standin.py BUCKETS): TTFT 1.2 s in (1, 2], ITL 0.5 s in (0.4, 0.6],
# the slow build's TTFT 3 s in (2, 4]
GOOD_TTFT_MS, GOOD_ITL_MS, SLOW_TTFT_MS, TWIN_TPOT_SLO_MS = 1200, 500, 3000, 1000
# A stage's window holds only that stage's traffic, and enough of it that one slow KV transfer on a busy
# machine is not the p99 of the canary's few (a window of 25 s with 4 clients failed r2 on it once).
GATES = ["--bake", "45", "--window", "40s"]


def pdctl(args: list[str], tracks: live.TrackProcesses) -> subprocess.CompletedProcess:
    """`pdctl <args>`, ended (and the failure raised) if one of the tracks' processes exits meanwhile."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = subprocess.Popen([sys.executable, "-m", "infra.cli", *args], cwd=REPO_ROOT, stdout=out, stderr=err,
                                   text=True)
        try:
            while command.poll() is None:
                tracks.check()
                time.sleep(1)
        finally:
            if command.poll() is None:
                command.kill()
                command.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command.args, command.returncode, out.read(), err.read())


@dataclass
class LiveDev:
    spec_data: dict  # dev's deployable spec (placeholder images pinned to stand-in digests)
    folder: Path
    base_spec: Path  # the Pulumi project's spec file
    target: list[str]  # --pulumi-stack, --pulumi-project, --releases
    prometheus: str
    store: ReleaseStore
    tracks: live.TrackProcesses
    client: live.LiveClient

    def spec_file(self, name: str, change=lambda data: None) -> Path:
        """dev's spec as a revision to roll out: `change(data)` edits a copy of it."""
        data = yaml.safe_load(yaml.safe_dump(self.spec_data))
        change(data)
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def rollout(self, spec_file: Path, stages: str) -> subprocess.CompletedProcess:
        return pdctl(["rollout", "--spec", str(spec_file), *self.target, "--prometheus", self.prometheus,
                      "--stages", stages, *GATES], self.tracks)

    def rollback(self, *to: str) -> subprocess.CompletedProcess:
        return pdctl(["rollback", "--spec", str(self.base_spec), *self.target, *to], self.tracks)


def retuned_router(data: dict) -> None:
    """A good revision: only the router's cache-aware threshold changes."""
    data["deployment"]["load_balancer"]["weights"]["cache_threshold"] = 0.6


def slow_build(data: dict) -> None:
    """The engine image rebuilt: another digest of the same reference (the fleet model makes it slow)."""
    image = data["images"]["engines"][data["engine"]["kind"]]
    ref = image["image"].split("@")[0]
    digest = "sha256:" + hashlib.sha256(f"{ref} slow build".encode()).hexdigest()
    old = image["image"].split("@")[1]
    image["image"] = f"{ref}@{digest}"
    data["images"]["platforms"][digest] = data["images"]["platforms"][old]


def engine_image(data: dict) -> str:
    return data["images"]["engines"][data["engine"]["kind"]]["image"]


@contextmanager
def live_dev(tmp_path: Path, monkeypatch, workers: int = 6):
    """dev's nodes, user objects and Pulumi project on the twin (the twin must be up), with its tracks'
    pods kept running, a real Prometheus scraping them and the client sending requests; everything
    removed afterwards."""
    spec = stand_in_pins(load_spec(stack_spec_path("dev")))  # deployable: the policy pack refuses placeholders
    env_ns = spec.environment.namespace
    namespaces = [env_ns, *[track_namespace(env_ns, r) for r in range(1, 12)]]
    delete_namespaces(namespaces)  # what an earlier test of dev left, so that this one starts from nothing
    assert fleet.apply_each_pass(stack_nodes(spec)).rejected == {}
    users_objects(spec)
    project = engine_project(tmp_path, monkeypatch, twin=KUBECONFIG)
    program_stack(project, serving_program(tmp_path))  # `pulumi stack init dev`: the rollout selects it
    monkeypatch.setenv("PATH", str(program("kubectl").parent) + os.pathsep + os.environ["PATH"])
    data = yaml.safe_load(project.spec_file.read_text())
    data["slo"].update(tpot_p99_ms=TWIN_TPOT_SLO_MS, tokens_per_second_per_user=1000 // TWIN_TPOT_SLO_MS)
    project.spec_file.write_text(yaml.safe_dump(data))
    slow = yaml.safe_load(yaml.safe_dump(data))
    slow_build(slow)
    timing = {engine_image(data): {"TWIN_STANDIN_TTFT_MS": str(GOOD_TTFT_MS), "TWIN_STANDIN_ITL_MS": str(GOOD_ITL_MS)},
              engine_image(slow): {"TWIN_STANDIN_TTFT_MS": str(SLOW_TTFT_MS), "TWIN_STANDIN_ITL_MS": str(GOOD_ITL_MS)}}
    releases = tmp_path / "releases"
    target = ["--pulumi-stack", "dev", "--pulumi-project", str(project.work_dir), "--releases", str(releases)]
    try:
        with controllers_status(env_ns, spec.environment.name), \
                live.TrackProcesses(env_ns, timing) as tracks, \
                live.pod_prometheus(tracks, tmp_path / "prometheus") as prometheus, \
                live.LiveClient(tracks, spec.model.name, workers) as client:
            yield LiveDev(data, tmp_path, project.spec_file, target, prometheus, ReleaseStore("dev", releases), tracks, client)
    finally:
        delete_namespaces(namespaces)
        kubectl("delete", "nodepools.karpenter.sh", "-l", f"pdstack.io/environment={spec.environment.name}",
                "--ignore-not-found", "--wait=false")
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


def timed_rollback(env: LiveDev, to: int, *args: str, after: int = 20) -> tuple[float, float, list]:
    """`pdctl rollback` (with `args`) to revision `to`, timed from the command's start to the client's
    share on `to` back at 100% (live.share_back), with `after` answers more once the command returned
    to show it stays there. (command seconds, share-back seconds, the answers since the command)."""
    started = time.monotonic()
    done = env.rollback(*args)
    command = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    returned = time.monotonic()
    env.client.wait_for(f"{after} answers after the rollback to r{to}",
                        lambda answers: sum(a.started > returned for a in answers) >= after)
    answers = env.client.since(started)
    back = live.share_back(answers, to, started)
    assert back is not None, f"the client's share is not back on r{to}: {live.shares(answers)}"
    return command, back, answers
