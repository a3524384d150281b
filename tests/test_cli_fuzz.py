"""Every pdctl subcommand over a generated corpus of bad inputs, the way a fuzzer would: wrong
types, missing files, folders, binary, UTF-16 and Latin-1 files, truncated YAML and JSON,
extreme numbers, NaN and infinity, corrupt release stores and Prometheus servers on 127.0.0.1
that refuse, hang, answer 503 or junk.

Each case asserts what README.md documents for pdctl: no traceback (and no "unexpected
error", the boundary's last resort, which would mean an input nobody thought of), the exit
code (2 an input or option is wrong, 1 a check or a dependency failed, 3 refused), and no
file created or changed anywhere the command can write (its working folder, the corpus, the
stacks folder)."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from infra.cli import main
from infra.platform_stack.spec import PlatformSpec, is_ec2_tag_value
from infra.spec import REPO_ROOT, StackSpec
from tests.conftest import stack_data
from tests.servers import healthy_prometheus, misbehaving_prometheus

BAD, FAILED, REFUSED = 2, 1, 3

# --- files that are wrong in every way a file can be ------------------------------------------

BAD_FILES = {  # name -> bytes (None: the path does not exist; "dir": a folder)
    "missing.yaml": None,
    "folder.yaml": "dir",
    "empty.yaml": b"",
    "blank.yaml": b"   \n\n",
    "binary.yaml": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x01",
    "utf16.yaml": "environment: {name: dev}\n".encode("utf-16"),
    "latin1.yaml": "environment: {name: caf\xe9}\n".encode("latin-1"),
    "truncated.yaml": b"environment:\n  name: dev\n  namespace: [pdstack-dev,\n",
    "tabs.yaml": b"environment:\n\tname: dev\n",
    "list.yaml": b"- 1\n- 2\n",
    "scalar.yaml": b"42\n",
    "truncated.json": b'{"logical_count": [[1, 2], [3',
    "nan.json": b'{"logical_count": [[NaN, 1]]}',
    "huge.yaml": b"x: " + b"9" * 5000 + b"\n",
    "deep.yaml": b"a: " + b"[" * 200 + b"]" * 200 + b"\n",
    "duplicate-key.yaml": b"environment:\n  name: dev\n  name: prod\n",  # PyYAML would keep the last silently
    "duplicate-key.json": b'{"logical_count": [[1, 2]], "logical_count": [[3, 4]]}',
}

# Files that are right in every way but one: a key given twice in one mapping (each reader
# refuses it, naming the file, the line and the key; `plan --write` went through ruamel).
DUPLICATED = {  # file -> (the shipped file it copies, the line after which a duplicate of it goes)
    "dup-spec.yaml": ("stacks/prod.yaml", "    instances: "),
    "dup-workload.yaml": ("stacks/workloads/prod-chat.yaml", "arrival_rate_rps: "),
    "dup-inventory.yaml": ("stacks/inventory/dev.yaml", "timeout_seconds: "),
}

SPEC_COMMANDS = {  # each subcommand with the other options it needs, and what it does given a bad spec
    "validate": [],
    "preview": ["--offline"],
    "render": ["--out", "{W}/out"],
    "policy": [],
    "eplb": ["--loads", "{C}/loads.json", "--out", "{W}/p.json"],
    "plan": ["--workload", str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")],
    "releases": ["--releases", "{W}/releases"],
    "preflight": ["--inventory", "{C}/inventory.yaml"],
    "canary": ["--prometheus", "http://127.0.0.1:9", "--revision", "1"],
    "cost": ["--prometheus", "http://127.0.0.1:9"],
    "rollout": ["--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus", "http://127.0.0.1:9"],
    "rollback": ["--sim", "{W}/sim.json", "--releases", "{W}/releases"],
    "diff": ["--against", str(REPO_ROOT / "stacks/dev.yaml")],
    "validate-deployment": ["--url", "http://127.0.0.1:9", "--out", "{W}/v"],
    "images": ["--write", "{W}/pinned.yaml"],
}


def _cases():
    cases = []
    for name in BAD_FILES:
        for command, rest in SPEC_COMMANDS.items():
            cases.append((f"{command}-spec-{name}", [command, "--spec", f"{{C}}/{name}", *rest], BAD))
        cases.append((f"positional-spec-{name}", ["validate", f"{{C}}/{name}"], BAD))
        cases.append((f"eplb-loads-{name}", ["eplb", "--stack", "prod", "--loads", f"{{C}}/{name}",
                                             "--out", "{W}/p.json"], BAD))
        cases.append((f"plan-workload-{name}", ["plan", "--stack", "prod", "--workload", f"{{C}}/{name}"], BAD))
        cases.append((f"preflight-inventory-{name}", ["preflight", "--inventory", f"{{C}}/{name}"], BAD))
        cases.append((f"cost-inventory-{name}", ["cost", "--prometheus", "{PROM_OK}", "--inventory",
                                                 f"{{C}}/{name}"], BAD))
        if BAD_FILES[name] is not None:  # a missing --sim file is a new simulated cluster
            cases.append((f"rollback-sim-{name}", ["rollback", "--sim", f"{{C}}/{name}", "--releases",
                                                   "{W}/releases"], BAD))
    for name in LOAD_FILES:
        cases.append((f"eplb-{name}", ["eplb", "--stack", "prod", "--loads", f"{{C}}/{name}", "--out",
                                       "{W}/p.json"], BAD))
    for name in WORKLOAD_BREAKS:
        cases.append((f"plan-{name}", ["plan", "--stack", "prod", "--workload", f"{{C}}/workload-{name}.yaml"], BAD))
    for name in INVENTORY_BREAKS:
        cases.append((f"preflight-{name}", ["preflight", "--inventory", f"{{C}}/inventory-{name}.yaml"], BAD))
    workload = str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")
    cases += [
        ("duplicate-key-validate", ["validate", "{C}/dup-spec.yaml"], BAD),
        ("duplicate-key-plan-write", ["plan", "{C}/dup-spec.yaml", "--workload", workload, "--write", "{W}/p.yaml"],
         BAD),
        ("duplicate-key-diff-against", ["diff", "--stack", "prod", "--against", "{C}/dup-spec.yaml"], BAD),
        ("duplicate-key-workload", ["plan", "--stack", "prod", "--workload", "{C}/dup-workload.yaml"], BAD),
        ("duplicate-key-inventory", ["preflight", "--inventory", "{C}/dup-inventory.yaml"], BAD),
        ("duplicate-key-loads", ["eplb", "--stack", "prod", "--loads", "{C}/dup-loads.json", "--out", "{W}/p.json"],
         BAD),
    ]
    options = [
        ("stages-words", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                          "{PROM_OK}", "--stages", "one,two"], BAD),
        ("stages-down", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                         "{PROM_OK}", "--stages", "50,5,100"], BAD),
        ("stages-empty", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                          "{PROM_OK}", "--stages", ""], BAD),
        ("stages-huge", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                         "{PROM_OK}", "--stages", "1" + "0" * 400], BAD),
        *[(f"bake-{v}", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                         "{PROM_OK}", "--bake", v], BAD) for v in ("-1", "nan", "inf", "1e400", "soon")],
        ("rollout-no-prometheus", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases"], BAD),
        ("rollout-resume-abort", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--resume",
                                  "--abort"], BAD),
        ("rollout-force-alone", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                                 "{PROM_OK}", "--force"], BAD),
        ("rollout-resume-nothing", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                                    "{PROM_OK}", "--resume"], REFUSED),
        ("rollout-abort-nothing", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--abort"],
         REFUSED),
        ("rollout-two-places", ["rollout", "--sim", "{W}/sim.json", "--pulumi-stack", "dev"], BAD),
        ("rollout-project-with-sim", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases",
                                      "--pulumi-project", "{W}", "--abort"], BAD),
        ("rollback-project-not-a-project", ["rollback", "--pulumi-stack", "dev", "--releases", "{W}/releases",
                                            "--pulumi-project", "{W}"], BAD),
        ("rollback-nothing", ["rollback", "--sim", "{W}/sim.json", "--releases", "{W}/releases"], REFUSED),
        ("rollback-to-unknown", ["rollback", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--to", "7"],
         REFUSED),
        ("rollback-to-words", ["rollback", "--sim", "{W}/sim.json", "--releases", "{W}/releases", "--to", "seven"],
         BAD),
        ("canary-revision-words", ["canary", "--prometheus", "{PROM_OK}", "--revision", "latest"], BAD),
        ("cost-at-words", ["cost", "--prometheus", "{PROM_OK}", "--at", "yesterday"], BAD),
        ("cost-at-nan", ["cost", "--prometheus", "{PROM_OK}", "--at", "nan"], BAD),
        ("cost-at-negative", ["cost", "--prometheus", "{PROM_OK}", "--at", "-5"], BAD),
        ("cost-idle-below-nan", ["cost", "--prometheus", "{PROM_OK}", "--idle-below", "nan"], BAD),
        ("cost-idle-below-200", ["cost", "--prometheus", "{PROM_OK}", "--idle-below", "200"], BAD),
        ("cost-share-2", ["cost", "--prometheus", "{PROM_OK}", "--idle-instance-share", "2"], BAD),
        ("eplb-bad-role", ["eplb", "--stack", "prod", "--role", "encoder", "--loads", "{C}/loads.json",
                           "--out", "{W}/p.json"], BAD),
        ("eplb-bad-policy", ["eplb", "--stack", "prod", "--policy", "best", "--loads", "{C}/loads.json",
                             "--out", "{W}/p.json"], BAD),
        ("plan-colocated", ["plan", "--spec", "{C}/colocated.yaml", "--workload",
                            str(REPO_ROOT / "stacks/workloads/prod-chat.yaml")], BAD),
        ("plan-write-missing-folder", ["plan", "--stack", "prod", "--workload",
                                       str(REPO_ROOT / "stacks/workloads/prod-chat.yaml"), "--write",
                                       "{W}/no/such/spec.yaml"], BAD),
        ("plan-write-folder", ["plan", "--stack", "prod", "--workload",
                               str(REPO_ROOT / "stacks/workloads/prod-chat.yaml"), "--write", "{C}/folder.yaml"], BAD),
        # a full disk (/dev/full answers every write with ENOSPC) and a place nothing can be written
        ("eplb-out-disk-full", ["eplb", "--stack", "prod", "--loads", "{C}/loads.json", "--out", "/dev/full"], FAILED),
        ("render-out-unwritable", ["render", "--stack", "dev", "--out", "/proc/pdstack-render"], FAILED),
        ("plan-write-unwritable", ["plan", "--stack", "prod", "--workload",
                                   str(REPO_ROOT / "stacks/workloads/prod-chat.yaml"), "--write", "/proc/prod.yaml"],
         FAILED),
        ("preflight-hosts-not-ssh", ["preflight", "--inventory", "{C}/inventory-not-ssh.yaml"], FAILED),
        ("render-out-is-file", ["render", "--stack", "dev", "--out", "{C}/empty.yaml"], BAD),
        ("render-out-foreign", ["render", "--stack", "dev", "--out", "{C}/foreign"], BAD),
        ("render-engine-unknown", ["render", "--stack", "dev", "--engine", "trt", "--out", "{W}/out"], BAD),
        ("preview-not-offline", ["preview", "--stack", "dev"], BAD),
        ("unknown-stack", ["validate", "--stack", "staging"], BAD),
        ("stack-path-escape", ["validate", "--stack", "../../etc/passwd"], BAD),
        ("two-specs", ["validate", str(REPO_ROOT / "stacks/dev.yaml"), "--spec", str(REPO_ROOT / "stacks/prod.yaml")],
         BAD),
        ("diff-against-missing", ["diff", "--against", "{C}/missing.yaml"], BAD),
        ("diff-against-bad-spec", ["diff", "--against", "{C}/list.yaml"], BAD),
        ("diff-fail-on-unknown", ["diff", "--against", str(REPO_ROOT / "stacks/dev.yaml"), "--fail-on", "boom"], BAD),
        ("diff-output-yaml", ["diff", "--output", "yaml"], BAD),
        *[(f"validate-deployment-{name}", ["validate-deployment", "--url", "http://127.0.0.1:9", "--out", "{W}/v",
                                           *extra], BAD) for name, extra in (
            ("concurrency-words", ["--concurrency", "many"]), ("concurrency-zero", ["--concurrency", "0"]),
            ("scale-big", ["--scale", "5"]), ("requests-zero", ["--requests", "0"]),
            ("scenario-unknown", ["--scenario", "bursty"]), ("key-env-empty", ["--api-key-env", "PDSTACK_NO_SUCH_VAR"]),
            ("job-without-claim", ["--render-job", "{W}/jobs.yaml"]),
            ("plan-without-workload", ["--concurrency", "plan"]),
            ("plan-bad-workload", ["--concurrency", "plan", "--workload", "{C}/list.yaml"]),
            ("results-missing", ["--results", "{C}/folder.yaml", "--concurrency", "1"]))],
        ("validate-deployment-down", ["validate-deployment", "--url", "http://127.0.0.1:9", "--out", "{W}/v"], FAILED),
        ("unknown-command", ["deploy"], BAD),
        ("no-command", [], BAD),
        ("output-xml", ["validate", "--output", "xml"], BAD),
        *[(f"releases-{name}", ["releases", "--releases", where], code) for name, where, code in (
            ("s3-no-bucket", "s3://", BAD), ("s3-bad-bucket", "s3://Bad_Bucket/x", BAD),
            ("a-file", "{C}/empty.yaml", FAILED), ("corrupt-state", "{C}/store-corrupt-state", REFUSED),
            ("corrupt-revision", "{C}/store-corrupt-revision", REFUSED), ("stray-file", "{C}/store-stray", 0))],
        *[(f"rollout-on-{name}", ["rollout", "--sim", "{W}/sim.json", "--releases", where, "--prometheus", "{PROM_OK}",
                                  "--bake", "0"], code) for name, where, code in (
            ("corrupt-state", "{C}/store-corrupt-state", REFUSED),)],
    ]
    cases += options
    for mode, code in (("refused", FAILED), ("503", FAILED), ("junk", FAILED), ("hang", FAILED)):
        cases.append((f"canary-prometheus-{mode}", ["canary", "--prometheus", f"{{PROM_{mode}}}", "--revision", "1"],
                      code))
        cases.append((f"cost-prometheus-{mode}", ["cost", "--prometheus", f"{{PROM_{mode}}}"], code))
    for name, (_, codes) in CORRUPT_STORES.items():
        for kind, where in (("folder", "{C}/corrupt-" + name), ("s3", "s3://" + FUZZ_BUCKET + "/corrupt-" + name)):
            for (command, argv), code in zip(STORE_COMMANDS, codes):
                sim = [] if command == "releases" else ["--sim", "{C}/corrupt-cluster.json"]
                cases.append((f"{command}-on-{kind}-{name}", [*argv, *sim, "--releases", where], code))
    for url in ("s3:/pdstack-releases/x", "s3:pdstack-releases", "S3://pdstack-releases/x", "s3//pdstack-releases",
                "https://pdstack-releases.s3.amazonaws.com/x", "s3://pdstack-releases/a/../b", ""):
        cases.append((f"releases-url-{url}", ["releases", "--releases", url], BAD))
        cases.append((f"rollback-url-{url}", ["rollback", "--sim", "{W}/sim.json", "--releases", url], BAD))
    for url in ("prometheus:9090", "ftp://127.0.0.1:9", "http://", "http://[::1", "http://127.0.0.1:99999",
                "http://admin:hunter2@127.0.0.1:9", "http://127.0.0.1:9/?token=x", "http://127.0.0.1:9/#x",
                "http://127.0.0.1:9/ x"):
        cases.append((f"canary-url-{url}", ["canary", "--prometheus", url, "--revision", "1"], BAD))
        cases.append((f"rollout-url-{url}", ["rollout", "--sim", "{W}/sim.json", "--releases", "{W}/releases",
                                             "--prometheus", url], BAD))
        cases.append((f"cost-url-{url}", ["cost", "--prometheus", url], BAD))
        # every address validate-deployment will use is checked before its first request
        for option in ("--url", "--compare-url", "--prometheus"):
            given = ["--url", "http://127.0.0.1:9"] if option != "--url" else []
            cases.append((f"validate-deployment{option}-{url}", ["validate-deployment", *given, option, url,
                                                                 "--out", "{W}/v"], BAD))
    # A PromQL range Prometheus would refuse (a bare number, 0, a fraction, an upper-case unit, units out
    # of order, past 2^63 ns): refused by every command before it asks or changes anything.
    for window in ("5", "0", "0s", "1.5h", "5M", "-5m", "", "1m1h", "5m5m", "293y", "9" * 400 + "s", "5 m", "5m\n"):
        for command, rest in (("rollout", ["--sim", "{W}/sim.json", "--releases", "{W}/releases", "--prometheus",
                                           "{PROM_OK}"]),
                              ("canary", ["--prometheus", "{PROM_OK}", "--revision", "1"]),
                              ("cost", ["--prometheus", "{PROM_OK}"]),
                              ("validate-deployment", ["--url", "http://127.0.0.1:9", "--prometheus", "{PROM_OK}",
                                                       "--out", "{W}/v"])):
            cases.append((f"{command}-window-{window[:12]!r}", [command, *rest, "--window", window], BAD))
    for mode in ("refused", "503", "junk"):  # the gates cannot be read: said before the first change
        cases.append((f"rollout-prometheus-{mode}", ["rollout", "--sim", "{W}/sim.json", "--releases",
                                                     "{W}/releases", "--prometheus", f"{{PROM_{mode}}}", "--bake", "0"],
                      FAILED))
        cases.append((f"validate-deployment-prometheus-{mode}", ["validate-deployment", "--url", "http://127.0.0.1:9",
                                                                 "--prometheus", f"{{PROM_{mode}}}", "--out", "{W}/v"],
                      FAILED))
    return cases


LOAD_FILES = {  # load files that parse, but are not loads for this model (256 experts, 58 MoE layers)
    "loads-1d.json": json.dumps({"logical_count": [1, 2, 3]}),
    "loads-ragged.json": json.dumps({"logical_count": [[1, 2], [3]]}),
    "loads-negative.json": json.dumps({"logical_count": [[-1] * 256] * 58}),
    "loads-strings.json": json.dumps({"logical_count": [["a"] * 256] * 58}),
    "loads-empty.json": json.dumps({"logical_count": []}),
    "loads-wrong-experts.json": json.dumps({"logical_count": [[1] * 255] * 58}),
    "loads-wrong-layers.json": json.dumps({"logical_count": [[1] * 256] * 7}),
    "loads-not-object.json": json.dumps([[1] * 256] * 58),
    "loads-inf.json": '{"logical_count": [[Infinity, 1]]}',
    "loads-minus1.csv": "layer,expert,count\n0,-1,5\n",  # numpy would read -1 as the last expert
    "loads-too-high.csv": "layer,expert,count\n0,999,5\n",
    "loads-junk.csv": "layer,expert,count\nzero,one,two\n",
    "loads-header.csv": "a,b,c\n1,2,3\n",
    "loads-short.csv": "layer,expert,count\n0,1\n",
    "loads-nan.csv": "layer,expert,count\n0,1,nan\n",
}

WORKLOAD_BREAKS = {
    "rate-nan": lambda w: w.update(arrival_rate_rps=math.nan),
    "rate-inf": lambda w: w.update(arrival_rate_rps=math.inf),
    "rate-zero": lambda w: w.update(arrival_rate_rps=0),
    "rate-words": lambda w: w.update(arrival_rate_rps="lots"),
    "headroom-one": lambda w: w.update(headroom=1),
    "tokens-negative": lambda w: w["input_tokens"].update(mean=-3),
    "tokens-missing": lambda w: w.pop("output_tokens"),
    "capacity-empty": lambda w: w["capacity"]["decode"].clear(),
    "capacity-typo": lambda w: w["capacity"].update(prefil_tokens_per_second=1),
    "decode-negative": lambda w: w["capacity"]["decode"].append({"tpot_ms": 30, "concurrency": -5}),
    "decode-huge-number": lambda w: w["capacity"]["decode"][0].update(concurrency=10 ** 400),
}

INVENTORY_BREAKS = {
    "no-hosts": lambda i: i.update(hosts=[]),
    "port-words": lambda i: i.update(port="ssh"),
    "port-huge": lambda i: i.update(port=70000),
    "timeout-nan": lambda i: i.update(timeout_seconds=math.nan),
    "host-typo": lambda i: i["hosts"][0].update(adress="10.0.0.1"),
    "hosts-scalar": lambda i: i.update(hosts="h100-dev-0"),
}


def _lease(**change) -> str:
    """A live-looking lease of another host (so only its own content decides), changed."""
    lease = {"operation": "rollout", "actor": "ci@runner", "pid": 4242, "host": "elsewhere",
             "since": "2026-12-03T00:00:00+00:00", "expires": "2999-01-01T00:00:00+00:00", "token": "ab12", "fence": 3}
    return json.dumps({k: v for k, v in {**lease, **change}.items() if v is not ...})


def _with_state(**change):
    def apply(store: Path) -> None:
        state = json.loads((store / "state.json").read_text())
        (store / "state.json").write_text(json.dumps({**state, **change}))
    return apply


def _write(name: str, text: str):
    return lambda store: (store / name).write_text(text)


# Release stores broken the ways issue #24 found, and a few more; each one, on a folder and on
# S3 (moto), given to rollout, rollback, rollout --abort and releases: (break, exit codes).
# A broken state is refused by all; a broken lease or operation by all but `releases` (which
# reads neither), each naming the object and the fix; `--force` works around them
# (test_rollback_force_works_around_a_broken_lease_or_operation).
CORRUPT_STORES = {
    "lease-expires-no-zone": (_write("lease.json", _lease(expires="2999-01-01T00:00:00")), (REFUSED,) * 3 + (0,)),
    "lease-no-expires": (_write("lease.json", _lease(expires=...)), (REFUSED,) * 3 + (0,)),
    "lease-empty": (_write("lease.json", ""), (REFUSED,) * 3 + (0,)),
    "lease-a-list": (_write("lease.json", "[1, 2]"), (REFUSED,) * 3 + (0,)),
    "lease-fence-words": (_write("lease.json", _lease(fence="three")), (REFUSED,) * 3 + (0,)),
    "traffic-a-list": (_with_state(traffic=[2, 100]), (REFUSED,) * 4),
    "traffic-weight-200": (_with_state(traffic={"2": 200}), (REFUSED,) * 4),
    "status-unknown": (_with_state(status={"1": "good", "2": "great"}), (REFUSED,) * 4),
    "tracks-a-string": (_with_state(tracks="1,2"), (REFUSED,) * 4),
    "fence-negative": (_with_state(fence=-1), (REFUSED,) * 4),
    "state-unknown-key": (_with_state(trafic={}), (REFUSED,) * 4),
    "state-truncated": (_write("state.json", '{"traffic": {"2": 10'), (REFUSED,) * 4),
    "operation-half-written": (_with_state(operation={"kind": "rollout", "revision": 3}), (REFUSED,) * 3 + (0,)),
    "operation-a-string": (_with_state(operation="rollout"), (REFUSED,) * 3 + (0,)),
    "operation-started-no-zone": (_with_state(operation={
        "kind": "rollout", "revision": 3, "actor": "a", "started": "2026-12-03T00:00:00", "serving_before": {"2": 100},
        "stages": [100]}), (REFUSED,) * 3 + (0,)),
    "revisions-foreign": (lambda store: [_write(f"revisions/000{n}.json", f'{{"revision": {n}}}')(store)
                                         for n in (1, 2)], (REFUSED,) * 4),
}
STORE_COMMANDS = (("rollout", ["rollout", "--prometheus", "{PROM_OK}", "--stages", "100", "--bake", "0"]),
                  ("rollback", ["rollback"]), ("abort", ["rollout", "--abort"]), ("releases", ["releases"]))
FUZZ_BUCKET = "pdstack-fuzz"
FORCE_BUCKET = "pdstack-fuzz-force"  # the --force tests' own: they change what they find


def _tree(*roots: Path) -> dict[str, str]:
    """Every file and folder under `roots`: path -> content hash (or "dir")."""
    seen = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            if path.is_dir():
                seen[str(path)] = "dir"
            elif path.exists():
                seen[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return seen


def _two_good_revisions(store_root: Path, sim: Path) -> None:
    """r1 and r2 rolled out for real into a simulated cluster: r2 serves, r1 is warm."""
    import io

    from rich.console import Console

    from infra.rollout.canary import Observation
    from infra.rollout.cluster import load_simulated
    from infra.rollout.releases import ReleaseStore
    from infra.rollout.rollout import RolloutOptions, rollout
    from infra.spec_checks import parse_spec

    store, cluster = ReleaseStore("dev", store_root), load_simulated(sim)
    for threshold in (0.5, 0.6):
        data = stack_data("dev")
        data["deployment"]["load_balancer"]["weights"] = {"cache_threshold": threshold}
        rollout(parse_spec(data), store, cluster, lambda rev: Observation(0.3, 0.02, 0.0, 0),
                RolloutOptions(stages=(100,), bake_seconds=0, poll_seconds=0.001), console=Console(file=io.StringIO()))


def corrupt_stores(root: Path, s3_endpoint: str, names=CORRUPT_STORES, prefix: str = "corrupt-",
                   bucket: str = FUZZ_BUCKET) -> None:
    """Each of CORRUPT_STORES, broken after two good rollouts: `root/corrupt-<name>` (a
    folder store) and the same objects under s3://<bucket>/<prefix><name>/ (moto), with the
    simulated cluster they share at root/corrupt-cluster.json."""
    import boto3

    pristine = root / "corrupt-pristine"
    if not pristine.exists():
        _two_good_revisions(pristine, root / "corrupt-cluster.json")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=bucket)
    for name in names:
        import shutil

        where = root / f"corrupt-{name}"
        shutil.copytree(pristine, where, dirs_exist_ok=True)
        for path in where.rglob("*.json"):
            path.chmod(0o644)
        CORRUPT_STORES[name][0](where / "dev")
        for path in sorted(where.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                s3.put_object(Bucket=bucket, Key=f"{prefix}{name}/{path.relative_to(where)}", Body=path.read_bytes())


def _bucket(s3_endpoint: str, bucket: str = FUZZ_BUCKET) -> dict[str, tuple[str, str]]:
    """Every object of a bucket: key -> (ETag, LastModified). Listed after each of the 700-odd
    cases, so read as moto's server writes it (ListObjectsV2's XML, unsigned: moto 5.2.5 checks no
    signature unless INITIAL_NO_AUTH_ACTION_COUNT is set, moto/settings.py) with the standard
    library's parser: boto3's paginator parsed each of the ~550 objects' LastModified with
    dateutil, 0.09 to 0.11 s of CPU a listing (0.01 s now; moto's own, 0.10 to 0.17 s, is the same
    either way)."""
    import urllib.parse
    import urllib.request
    from xml.etree import ElementTree

    ns = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
    objects, token = {}, None
    while True:
        query = {"list-type": "2", **({"continuation-token": token} if token else {})}
        listing = f"{s3_endpoint}/{bucket}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(listing, timeout=60) as resp:
            page = ElementTree.fromstring(resp.read())
        for item in page.iterfind("s3:Contents", ns):
            objects[item.findtext("s3:Key", namespaces=ns)] = (item.findtext("s3:ETag", namespaces=ns),
                                                               item.findtext("s3:LastModified", namespaces=ns))
        token = page.findtext("s3:NextContinuationToken", namespaces=ns)
        if page.findtext("s3:IsTruncated", namespaces=ns) != "true":
            return objects


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, s3_endpoint):
    from infra.rollout.releases import ReleaseStore
    from infra.spec_checks import parse_spec

    root = tmp_path_factory.mktemp("corpus")
    corrupt_stores(root, s3_endpoint)
    for name, content in BAD_FILES.items():
        if content == "dir":
            (root / name).mkdir()
        elif content is not None:
            (root / name).write_bytes(content)
    (root / "loads.json").write_text(json.dumps({"logical_count": [[1] * 256] * 58}))
    for name, text in LOAD_FILES.items():
        (root / name).write_text(text)
    workload = yaml.safe_load((REPO_ROOT / "stacks/workloads/prod-chat.yaml").read_text())
    for name, change in WORKLOAD_BREAKS.items():
        broken = copy.deepcopy(workload)
        change(broken)
        (root / f"workload-{name}.yaml").write_text(yaml.safe_dump(broken))
    inventory = yaml.safe_load((REPO_ROOT / "stacks/inventory/dev.yaml").read_text())
    (root / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    for name, change in INVENTORY_BREAKS.items():
        broken = copy.deepcopy(inventory)
        change(broken)
        (root / f"inventory-{name}.yaml").write_text(yaml.safe_dump(broken))
    colocated = stack_data("dev")
    colocated["deployment"].update(mode="colocated", colocated={"instances": 1, "expert_parallel": 8,
                                                                "redundant_experts": 0})
    del colocated["deployment"]["prefill"], colocated["deployment"]["decode"]
    (root / "colocated.yaml").write_text(yaml.safe_dump(colocated))
    for name, (shipped, after) in DUPLICATED.items():
        lines = (REPO_ROOT / shipped).read_text().splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if line.startswith(after))
        (root / name).write_text("".join(lines[:at + 1] + [lines[at]] + lines[at + 1:]))
    (root / "dup-loads.json").write_text(json.dumps({"logical_count": [[1] * 256] * 58})[:-1]
                                         + ', "logical_count": ' + json.dumps([[2] * 256] * 58) + "}")
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("mine, not render's")
    for name in ("store-corrupt-state", "store-corrupt-revision", "store-stray"):  # one revision each, then broken
        store = ReleaseStore("dev", root / name)
        store.create(parse_spec(stack_data("dev")), message="fuzz")
        store.record(traffic={1: 100}, status={1: "good"})
    (root / "store-corrupt-state" / "dev" / "state.json").chmod(0o644)
    (root / "store-corrupt-state" / "dev" / "state.json").write_text("{not json")
    revision = root / "store-corrupt-revision" / "dev" / "revisions" / "0001.json"
    revision.chmod(0o644)
    revision.write_text('{"revision": 1}')
    (root / "store-stray" / "dev" / "revisions" / "0001.bak.json").write_text("a backup someone left")
    urls = {}
    with ExitStack() as servers:
        for mode in ("refused", "503", "junk", "hang"):
            urls[f"PROM_{mode}"] = servers.enter_context(misbehaving_prometheus(mode))
        urls["PROM_OK"] = servers.enter_context(healthy_prometheus())
        # hosts that are not SSH servers: an HTTP server's port (paramiko's banner error) and nothing
        (root / "known_hosts").write_text("")
        (root / "key").write_text("not a key")
        (root / "inventory-not-ssh.yaml").write_text(yaml.safe_dump({
            "key_file": "key", "known_hosts": "known_hosts", "timeout_seconds": 3, "hosts": [
                {"name": "http-not-ssh", "address": "127.0.0.1", "port": int(urls["PROM_OK"].rsplit(":", 1)[1])},
                {"name": "nothing-there", "address": "127.0.0.1", "port": 9}]}))
        urls["S3_ENDPOINT"] = s3_endpoint
        # The fuzz bucket as the corpus left it: every case must leave it so. Listed once, not
        # before each case (moto's server spends 0.10 to 0.17 s of CPU a listing): nothing else writes
        # to it (the --force tests have FORCE_BUCKET), so whatever order the cases run in, a
        # difference is the change of the case that sees it.
        yield root, urls, _bucket(s3_endpoint)


CASES = _cases()


@pytest.mark.parametrize("argv, expected", [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_a_bad_input_gets_a_message_and_its_exit_code_and_changes_nothing(corpus, argv, expected, tmp_path,
                                                                          monkeypatch, capsys):
    root, urls, stored = corpus
    work = tmp_path / "work"
    work.mkdir()
    argv = [a.format(C=root, W=work, **urls) for a in argv]
    monkeypatch.chdir(work)  # anything written relative to the caller lands here, and is seen
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", urls["S3_ENDPOINT"])
    before = _tree(root, work, REPO_ROOT / "stacks"), stored
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: a usage error, exit 2
        code = exc.code
    out = capsys.readouterr()
    said = out.out + out.err
    assert "Traceback" not in said and "unexpected error" not in said, said
    assert code == expected, said
    if code:
        assert out.err.strip(), "a failure must say why, on stderr"
    assert (_tree(root, work, REPO_ROOT / "stacks"), _bucket(urls["S3_ENDPOINT"])) == before, \
        "a refused or failed command changed a file or a stored object"
    if code and "corrupt-" in " ".join(argv) and "no unfinished rollout" not in said:  # the object is named, and the fix
        assert any(key in said for key in ("lease.json", "state.json", "revisions/000")), said
        assert "Fix:" in said, said


def _leaves(data, path=()):
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(data, list) and data:
        yield from _leaves(data[0], (*path, 0))
    else:
        yield path, data


def _bad_values(value):
    """Two values of the wrong kind for a leaf, chosen by the leaf's own type."""
    if isinstance(value, bool):
        return ["maybe", 2]
    if isinstance(value, (int, float)):
        return [math.nan, -(10 ** 30)] if isinstance(value, int) else [math.inf, "fast"]
    if isinstance(value, str):
        return [12345, "x" * 300]
    return [{"nested": True}, "scalar"]


def _spec_mutations():
    data = stack_data("prod")
    for path, value in _leaves(data):
        for i, bad in enumerate(_bad_values(value)):
            yield pytest.param(path, bad, id=f"{'.'.join(map(str, path))}-{i}")


# Free-form text the spec cannot check further (any folder name could be right); every other
# wrong value must be refused (names, keys, paths and ids are held to their systems' rules).
FREE_FORM = {"environment.release_store.url"}


@pytest.mark.parametrize("path, bad", list(_spec_mutations()))
def test_every_spec_field_given_a_wrong_value_is_refused_with_its_field(path, bad, tmp_path, capsys):
    data = stack_data("prod")
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    code = main(["validate", str(spec_file)])
    out = capsys.readouterr()
    said = out.out + out.err
    assert "Traceback" not in said and "unexpected error" not in said, said
    field = ".".join(map(str, path))
    if field in FREE_FORM and isinstance(bad, str):
        assert code == 0, said
    else:
        assert code == BAD, f"{field} = {bad!r} was accepted"
        # named: the field itself, or (a cross-field rule) the mapping it belongs to
        named = [".".join(map(str, path[:n])) for n in range(len(path), 0, -1)]
        assert any(f"- {prefix}" in out.err for prefix in named), out.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def _hostile_mutations():
    """Every string field of the spec model (walked, not listed) given each hostile string of
    tests/test_script_injection.py: shell syntax, quotes, newlines, globs, a leading '-'."""
    from tests.test_script_injection import HOSTILE, string_fields

    data = stack_data("prod")
    for path in string_fields(StackSpec):
        parent = data
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else (parent[key] if parent else None)
        if parent is None:
            continue  # a section prod does not have (colocated): the same model is reached elsewhere
        for i, hostile in enumerate(HOSTILE):
            yield pytest.param(path, hostile, id=f"{'.'.join(map(str, path))}-hostile{i}")


# A folder of the project's release history: read and written by pdctl in Python (no shell), any
# folder name a filesystem takes is its own.
HOSTILE_ACCEPTED = {"environment.release_store.url"}


@pytest.mark.parametrize("path, hostile", list(_hostile_mutations()))
def test_every_spec_string_field_refuses_shell_syntax_with_its_field(path, hostile, tmp_path, capsys):
    """validate holds each field to what its system accepts (S3 keys, paths, Hugging Face ids, OCI
    references, Kubernetes names...), so `x; touch INJECTED #` in a weights prefix (issue #24) or
    anywhere else is refused, exit 2, naming the field. The rendering side quotes anyway:
    tests/test_script_injection.py."""
    data = stack_data("prod")
    node = data
    for key in path[:-1]:
        node = node[key]
    value = hostile.format(mark=tmp_path / "INJECTED")
    node[path[-1]] = value
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    code = main(["validate", str(spec_file)])
    out = capsys.readouterr()
    field = ".".join(map(str, path))
    assert "Traceback" not in out.out + out.err and "unexpected error" not in out.out + out.err
    if field in HOSTILE_ACCEPTED:
        assert code in (0, BAD)
    else:
        assert code == BAD, f"{field} = {value!r} was accepted"
        named = [".".join(map(str, path[:n])) for n in range(len(path), 0, -1)]
        assert any(f"- {prefix}" in out.err for prefix in named), out.err
    assert not (tmp_path / "INJECTED").exists()


def _platform_data() -> dict:
    """platform-prod with every optional string field set, so each one the fuzz changes is there."""
    data = yaml.safe_load((REPO_ROOT / "stacks/platform-prod.yaml").read_text())
    digest = data["images"]["grafana"]
    data["environments"][0].update(stack="prod", inventory="stacks/inventory/prod.yaml")
    data["cloud"]["cluster"].update(system_nodes={"instance_types": ["m7i.2xlarge"]}, discovery_tag="pdstack-prod")
    data["cloud"]["node_classes"][0]["capacity_reservations"]["by_role"]["colocated"] = ["cr-0a1b2c3d4e5f60705"]
    data["nodes"] = {"mode": "node-groups", "node_groups": [{"role": role, "environment": "prod", "node_class": "gb200"}
                                                            for role in ("prefill", "decode")]}
    data["images"].update(prometheus_adapter=digest, efa_device_plugin=digest)
    data["controllers"] = {"user_installed": ["lws"]}
    data["monitoring_namespace"] = "monitoring"
    return data


# A GitHub deployment environment's name: GitHub documents no character rule, and the name reaches
# only IAM's StringEquals on the OIDC token's sub (JSON-encoded): no wildcard, no script.
PLATFORM_HOSTILE_ACCEPTED = {"cloud.ci.environments.0"}


def _platform_hostile_mutations():
    """Every string field of the platform spec model (walked as the serving spec's are), and a key
    and a value of the Prometheus selector, given each hostile string (a field that takes any
    text, the first only: each accepted one costs a whole preview)."""
    from tests.test_script_injection import HOSTILE, string_fields

    for path in [*string_fields(PlatformSpec), ("prometheus_selector", "{key}"), ("prometheus_selector", "pdstack.io/x")]:
        field = ".".join(map(str, path))
        for i, hostile in enumerate(HOSTILE[:1] if field in PLATFORM_HOSTILE_ACCEPTED else HOSTILE):
            yield pytest.param(path, hostile, id=f"{field}-hostile{i}")
# A hostile string the field's own system takes: an EC2 tag value may start with '-' (`--help`);
# it reaches AWS's API and Karpenter's selector, never a command line.
PLATFORM_VALID = {"cloud.cluster.discovery_tag": is_ec2_tag_value}
# Files of the project the platform reads (a hosted spec, its inventory): a name that is none is
# refused as the file it names, missing.
PLATFORM_FILES = {"environments.0.spec", "environments.0.inventory"}


@pytest.mark.parametrize("path, hostile", list(_platform_hostile_mutations()))
def test_every_platform_spec_string_field_refuses_shell_syntax_with_its_field(path, hostile, tmp_path, capsys):
    """The platform spec's strings are held to their systems' rules as the serving spec's are:
    `Monitoring"; $(id) #` was a namespace and part of the Prometheus URL every serving stack
    reads (issue #36). `preview --offline --spec` refuses each, exit 2, naming the field, before
    anything is previewed."""
    data = _platform_data()
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    value = hostile.format(mark=tmp_path / "INJECTED")
    if path[-1] == "{key}":
        node[value] = "pdstack"
    else:
        node[path[-1]] = value
    spec_file = tmp_path / "platform.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    code = main(["preview", "--offline", "--spec", str(spec_file)])
    out = capsys.readouterr()
    field = ".".join(map(str, path))
    assert "Traceback" not in out.out + out.err and "unexpected error" not in out.out + out.err
    if field in PLATFORM_HOSTILE_ACCEPTED:
        assert code in (0, BAD)
    elif field in PLATFORM_VALID and PLATFORM_VALID[field](value):
        assert code == 0, out.err
    elif field in PLATFORM_FILES:
        assert code == BAD and f"{value}: no such" in out.err, out.err
    else:
        assert code == BAD, f"{field} = {value!r} was accepted"
        # named: the field or (a cross-field rule) the list or mapping it is in; pydantic puts the
        # cloud's provider in the path (cloud.aws.cluster...)
        named = [".".join(map(str, path[:n])) for n in range(len(path), 0, -1)]
        said = out.err.replace("- cloud.aws.", "- cloud.")
        assert any(f"- {prefix}" in said for prefix in named), out.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["platform.yaml"]


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_rollback_force_works_around_a_broken_lease_or_operation(tmp_path, s3_endpoint, kind, monkeypatch, capsys):
    """The emergency path must run whatever else the store holds: `rollback --force` takes
    over a lease it cannot read and clears an operation it cannot read (saying so, audited),
    and leaves the cluster and the store agreeing; `rollout --abort --force` clears a broken
    lease. Without --force the same commands are refused (the corpus above)."""
    import shutil
    import uuid

    from infra.rollout.cluster import load_simulated
    from infra.rollout.objectstore import BucketStore
    from infra.rollout.releases import ReleaseStore

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    prefix = f"force-{uuid.uuid4().hex[:8]}-"
    names = ["lease-expires-no-zone", "lease-empty", "lease-no-expires", "operation-half-written", "operation-a-string"]
    corrupt_stores(tmp_path, s3_endpoint, names, prefix, bucket=FORCE_BUCKET)
    for name in names:
        for argv, target in ((["rollback", "--force"], 2 if name.startswith("operation") else 1),
                             (["rollout", "--abort", "--force"], None)):
            if name.startswith("operation") and target is None:
                continue  # the abort of a broken operation is the rollback above
            if kind == "s3":
                case = f"{prefix}{name}-{argv[0]}"
                for key in _bucket(s3_endpoint, FORCE_BUCKET):
                    if key.startswith(f"{prefix}{name}/"):
                        BucketStore(FORCE_BUCKET, "", s3_endpoint).s3.copy_object(
                            Bucket=FORCE_BUCKET, Key=case + key[len(prefix + name):],
                            CopySource={"Bucket": FORCE_BUCKET, "Key": key})
                where, store = (f"s3://{FORCE_BUCKET}/{case}",
                                ReleaseStore("dev", objects=BucketStore(FORCE_BUCKET, f"{case}/dev", s3_endpoint)))
            else:
                where = tmp_path / f"{name}-{argv[0]}"
                shutil.copytree(tmp_path / f"corrupt-{name}", where)
                store = ReleaseStore("dev", where)
            sim = tmp_path / f"{name}-{argv[0]}-{kind}.json"
            shutil.copy(tmp_path / "corrupt-cluster.json", sim)
            code = main([*argv, "--stack", "dev", "--sim", str(sim), "--releases", str(where)])
            said = capsys.readouterr()
            assert code == 0, said.err
            assert store.lease() is None and store.operation() is None
            assert store.traffic() == load_simulated(sim).traffic() == ({target: 100} if target else {2: 100})
            entries = store.audit_entries()
            if name.startswith("lease"):
                taken = [e for e in entries if e["action"] == "lease"][-1]
                assert taken["previous"]["why"].startswith("its lease record is unreadable"), taken
            else:
                assert "state.json operation cannot be read" in said.out
                assert any("cleared_unreadable_operation" in e for e in entries)


def test_the_corpus_is_the_size_the_issue_asks_for():
    mutations = len(list(_spec_mutations())) + len(list(_hostile_mutations()))
    assert len(CASES) + mutations >= 300, (len(CASES), mutations)


def test_a_host_that_is_not_an_ssh_server_is_a_row_not_a_traceback(corpus):
    """paramiko logs a failed handshake with its traceback from its transport thread; in a
    whole process (not under pytest, whose log capture would swallow it) nothing may reach
    stderr but our report."""
    import subprocess
    import sys

    root, _, _ = corpus
    done = subprocess.run([sys.executable, "-m", "infra.cli", "preflight", "--inventory",
                           str(root / "inventory-not-ssh.yaml")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == FAILED
    assert "Traceback" not in done.stderr and "Exception (client)" not in done.stderr, done.stderr
    assert "http-not-ssh ssh: no SSH server answered on that port" in done.stderr
