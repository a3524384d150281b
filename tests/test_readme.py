"""Every command README.md shows, run: the lines of its shell blocks and the commands quoted in
its text. Each one is listed below with what it must do here (exit code and a phrase of its
output). A README command missing from the list, or a listed one README no longer shows,
fails the test, so the two cannot drift.

Most run exactly as written, from a folder of their own (the project's .venv, scripts and
stacks linked in; outputs land there). Where this machine lacks what the command talks to,
the table says what stands in: Prometheus at http://prometheus:9090 is a stand-in on
127.0.0.1, AWS S3 is moto's server (AWS_ENDPOINT_URL_S3), and the prod hosts and the Pulumi
CLI are absent, so those commands must fail the way README says they do, changing nothing.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
from dataclasses import dataclass

import pytest

from infra.spec import REPO_ROOT
from tests.servers import healthy_prometheus


@dataclass(frozen=True)
class Expect:
    exit: int
    says: str
    instead: str = ""  # what the test runs in place of the command, when it cannot run as written


# Commands this test does not run, and why; test_what_runs_the_commands_not_run_here checks
# that what runs them in its place is there.
RUN_ELSEWHERE = {
    "make test": "the command that runs this test (.ci/run calls it)",
    "make up": "tests/twin/test_platform_on_twin.py runs its function (scripts/up.py up) on the session's twin",
    "make down": "tests/twin/test_platform_on_twin.py runs its function (scripts/up.py down) after make up's",
    'make up UP_ARGS="--kubeconfig ~/.kube/config --context kind-kind --inventory my-inventory.yaml"':
        "it needs a kind or real cluster; tests/test_up.py runs the same options against the twin",
    'make down UP_ARGS="--kubeconfig ~/.kube/config --context kind-kind"': "likewise",
    "make twin-up": "tests/twin start the twin (or reuse one make twin-up started)",
    "make twin-down": "it would stop a twin the developer started; tests/twin stop theirs",
    "make twin-build": "make test runs it before the tests",
    "make registry-build": "make test runs it before the tests",
    ".venv/bin/python -m pytest -s tests/test_fault_matrix.py": "make test runs it",
}


PROM = "http://prometheus:9090"
GATEWAY = "https://api.pdstack.example.com"

EXPECTED = {
    "make preview": Expect(0, "plan by layer"),
    "make loadtest-tool": Expect(0, ""),  # make test has made it already: nothing to do
    "make engine": Expect(0, "cached"),  # likewise: the builds of this pin are there
    ".venv/bin/pdctl validate --stack prod": Expect(0, "ok prod: disaggregated"),
    ".venv/bin/pdctl validate stacks/prod.yaml --output json": Expect(0, '"kind": "pdstack/validate"'),
    ".venv/bin/pdctl preview --offline --stack prod": Expect(0, "plan by layer"),
    ".venv/bin/pdctl preview --offline --stack platform-prod": Expect(0, "plan by layer"),
    ".venv/bin/pdctl render --stack prod --out out/prod": Expect(0, "manifests to out/prod/"),
    ".venv/bin/pdctl render --stack prod --engine vllm --out out/prod-vllm": Expect(0, "manifests to out/prod-vllm/"),
    ".venv/bin/pdctl eplb --stack prod --role decode --loads stacks/examples/prod-decode-loads.json "
    "--out out/prod-decode-placement.json": Expect(0, "wrote out/prod-decode-placement.json"),
    ".venv/bin/pdctl plan --stack prod --workload stacks/workloads/prod-chat.yaml": Expect(0, "PD plan for prod"),
    ".venv/bin/pdctl plan --stack prod --workload stacks/workloads/prod-chat.yaml --write out/prod-planned.yaml":
        Expect(0, "wrote out/prod-planned.yaml"),
    # The stand-in is idle (0 req/s): the plan is one prefill instance, which the spec refuses (its host memory).
    f".venv/bin/pdctl plan --stack prod --workload stacks/workloads/prod-chat.yaml --watch --prometheus {PROM} "
    "--dry-run --iterations 1": Expect(0, "skipped: the spec refuses this plan, so it is not proposed: --dry-run: the "
                                      "planned spec would be invalid: deployment.prefill.host_cache_gib_per_rank",
                                      "Prometheus: the stand-in"),
    ".venv/bin/python scripts/bench_planner.py": Expect(0, "surface planner (one measured surface) 96/96",
                                                        "with --grid-only"),
    ".venv/bin/pdctl policy --stack prod": Expect(1, "images-pinned-by-digest",
                                                 "as written: prod's images are marked placeholders, refused"),
    "scripts/upload_weights --stack prod --source /data/DeepSeek-V3": Expect(2, "--source /data/DeepSeek-V3: not a folder"),
    ".venv/bin/python scripts/bench_eplb.py": Expect(0, "hierarchical"),
    ".venv/bin/python scripts/bench_preview.py": Expect(0, "ratio", "with --runs 1"),
    ".venv/bin/python scripts/bench_balancer_replicas.py": Expect(0, "hashed by API key", "with --requests 3000"),
    ".venv/bin/pdctl preflight --stack prod --inventory stacks/inventory/prod.yaml":
        Expect(1, "gb200-rack0-n00", "as written: the prod hosts are not reachable from here, each is named failing"),
    f".venv/bin/pdctl rollout --stack prod --pulumi-stack prod --prometheus {PROM} "
    '--inventory stacks/inventory/prod.yaml --message "why"':
        Expect(2, "names placeholder images", "as written: prod's images are marked placeholders, refused first"),
    f".venv/bin/pdctl canary --stack prod --prometheus {PROM} --revision 8 --baseline 7":
        Expect(0, "canary r8 vs r7", "Prometheus: the stand-in"),
    ".venv/bin/pdctl releases --stack prod": Expect(0, "releases of prod", "S3: moto"),
    f".venv/bin/pdctl rollout --stack prod --pulumi-stack prod --resume --prometheus {PROM}":
        Expect(3, "no unfinished rollout", "S3: moto; nothing to resume"),
    ".venv/bin/pdctl rollout --stack prod --pulumi-stack prod --abort": Expect(3, "no unfinished rollout to abort",
                                                                              "S3: moto; nothing to abort"),
    "scripts/rollback --stack prod --pulumi-stack prod": Expect(3, "no earlier good revision to roll back to",
                                                                "S3: moto; a store with no revision yet"),
    ".venv/bin/python scripts/bench_rollback.py": Expect(0, "budget 60 s: met",
                                                         "with --runs 1 --apply-latency 0.05 --health-latency 0.05"),
    f".venv/bin/pdctl cost --stack prod --prometheus {PROM} --window 24h": Expect(0, "GPU cost of prod",
                                                                                  "Prometheus: the stand-in"),
    ".venv/bin/python scripts/simulate_day.py": Expect(0, "GPU-hours"),
    ".venv/bin/pdctl diff --stack prod --against HEAD": Expect(0, "pdstack diff of prod against stacks/prod.yaml at"),
    f"PDSTACK_API_KEY=... .venv/bin/pdctl validate-deployment --stack prod --url {GATEWAY} --api-key-env PDSTACK_API_KEY "
    f"--prometheus {PROM} --profile-out out/prod-measured.yaml":
        Expect(1, "validation failed: authenticated request: HTTP 401",
               "the gateway: a streaming stand-in; the key as written (...) is refused, so it stops at the first gate"),
}

SHORTER = {  # what "instead" means for a command line
    ".venv/bin/python scripts/bench_planner.py": ".venv/bin/python scripts/bench_planner.py --grid-only",
    ".venv/bin/python scripts/bench_preview.py": ".venv/bin/python scripts/bench_preview.py --runs 1",
    ".venv/bin/python scripts/bench_balancer_replicas.py":
        ".venv/bin/python scripts/bench_balancer_replicas.py --requests 3000",
    ".venv/bin/python scripts/bench_rollback.py":
        ".venv/bin/python scripts/bench_rollback.py --runs 1 --apply-latency 0.05 --health-latency 0.05",
}


def readme_commands() -> list[str]:
    """Shell-block lines (continuations joined, comments dropped) and quoted commands in the text."""
    text = (REPO_ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(re.sub(r"\s+", " ", line))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [c for c in re.findall(r"`((?:\.venv/bin/|scripts/|make )[^`]*)`", prose) if " " in c]
    return list(dict.fromkeys(commands))


def test_every_readme_command_is_listed_here_and_every_listed_one_is_in_readme():
    shown = readme_commands()
    listed = set(EXPECTED) | set(RUN_ELSEWHERE)
    assert sorted(set(shown) - listed) == [], "README shows a command this test does not run"
    assert sorted(listed - set(shown)) == [], "this test runs a command README no longer shows"


def test_what_runs_the_commands_not_run_here():
    """Each command of RUN_ELSEWHERE is run by what its reason names: CI's script calls `make
    test`, the Makefile's twin targets call `python -m twin`, and `make test` runs pytest over
    the folder that holds the fault matrix (on every core, in groups: tests/file_order.py) but for
    the files of tests that mostly wait, which run beside it in a pytest of their own, and over
    tests/twin in groups, each with a twin of its own, that together hold every file of it
    (scripts/run_tests.py)."""
    import tomllib

    assert re.search(r"^make test$", (REPO_ROOT / ".ci/run").read_text(), re.M)
    makefile = (REPO_ROOT / "Makefile").read_text()
    for verb in ("up", "down", "build"):
        assert re.search(rf"^twin-{verb}:.*\n\t\$\(PY\) -m twin {verb}$", makefile, re.M), verb
    assert re.search(r"^test:.*\btwin-build\b.*\n\t\$\(PY\) scripts/run_tests.py$", makefile, re.M)
    for verb in ("up", "down"):
        assert re.search(rf"^{verb}:.*\n\t\$\(PY\) -m scripts.up {verb} \$\(UP_ARGS\)$", makefile, re.M), verb
    assert re.search(r"^test:.*\bregistry-build\b", makefile, re.M)
    runner = runpy.run_path(str(REPO_ROOT / "scripts/run_tests.py"))
    groups = runner["TWIN_GROUPS"]
    control_plane = groups.pop("control-plane")[0]
    elsewhere = [f for args, _ in groups.values() for f in args]  # the other groups name their files
    assert control_plane[0] == "tests/twin" and control_plane[1:] == [f"--ignore={f}" for f in elsewhere]
    assert all((REPO_ROOT / f).is_file() for f in elsewhere) and len(set(elsewhere)) == len(elsewhere), elsewhere
    assert len({state for _, state in groups.values()}) == len(groups)  # a twin each
    waiting = runner["WAITING_FILES"]
    assert runner["OTHER_TESTS"][-7 - len(waiting):] == ["-m", "pytest", "-n", "auto", "--dist", "loadfile",
                                                         *[f"--ignore={f}" for f in waiting], "--ignore=tests/twin"]
    assert runner["WAITING_TESTS"][-len(waiting):] == waiting and all((REPO_ROOT / f).is_file() for f in waiting)
    testpaths = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    assert testpaths == ["tests"]
    assert (REPO_ROOT / "tests/twin").is_dir() and (REPO_ROOT / "tests/test_fault_matrix.py").is_file()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, s3_endpoint):
    import boto3

    work = tmp_path_factory.mktemp("readme")
    for name in (".venv", "scripts", "stacks"):
        (work / name).symlink_to(REPO_ROOT / name)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="pdstack-prod-releases")
    from tests.openai_stub import Behaviour, openai_stub

    with healthy_prometheus() as prom, openai_stub(Behaviour()) as gateway:
        yield work, {**os.environ, "AWS_ENDPOINT_URL_S3": s3_endpoint, "COLUMNS": "200"}, prom, gateway, s3


@pytest.mark.parametrize("command", list(EXPECTED))
def test_a_readme_command_does_what_readme_says(sandbox, command):
    expect = EXPECTED[command]
    work, env, prom, gateway, s3 = sandbox
    line = SHORTER.get(command, command).replace(PROM, prom).replace(GATEWAY, gateway)
    cwd = REPO_ROOT if command.startswith("make ") else work
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert "Traceback" not in said, said
    assert done.returncode == expect.exit, said
    assert expect.says in re.sub(r"\s+", " ", said), said
    # The refused and failed rollouts changed nothing: prod's store holds no revision.
    assert s3.list_objects_v2(Bucket="pdstack-prod-releases", Prefix="pdstack/prod/revisions/").get("KeyCount", 0) == 0
