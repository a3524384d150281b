"""`pdctl cost` against a real Prometheus holding recorded samples (written into its TSDB by
`promtool tsdb create-blocks-from openmetrics`), checked against numbers worked out by hand;
and the cache hygiene scan over a real sshd."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from infra.prometheus import PrometheusAPI
from infra.reports.cost import CacheEntry, cost_report, scan_caches, stale_entries
from infra.rollout.preflight import load_inventory
from infra.spec_checks import parse_spec
from tests.conftest import stack_data, vllm_with_epp
from tests.servers import free_port, require_binary, running
from tests.ssh_hosts import inventory

NS = "pdstack-prod"
WINDOW_MIN = 240  # a 4 h window, one sample a minute
END = (int(time.time()) // 60 - 1) * 60  # the last recorded minute

# The recorded fleet (2 GPUs per pod), minute m = 0 .. 239 of the window:
#   engine-prefill-0          util 60 the whole window
#   engine-prefill-1          util 0 for minutes 0-179, then 70           (idle 3 h of 4)
#   engine-prefill-0 of release track r8 (its own namespace, same pod name): only the
#                             last 2 h (minutes 120-239), util 80           (a canary)
#   engine-decode-0, -0-1     leader and worker of one 2-node group, util 50
#   other environments' engine-prefill-0 (pdstack-dev, pdstack-production), util 0: not counted
# Worked out by hand:
#   prefill GPU-hours = 2x4 + 2x4 + 2x2 = 20;  idle = 2 GPUs x 3 h = 6;  idle share 30%
#   decode  GPU-hours = 4 GPUs x 4 h = 16;      idle 0
#   prefill instances: 2 for 2 h, then 3 for 2 h -> average 2.5, max 3; decode 1
#   idle instances (idle more than half their time): engine-prefill-1, 180/240 = 75%
FLEET = [
    (NS, "engine-prefill-0", lambda m: 60, range(WINDOW_MIN)),
    (NS, "engine-prefill-1", lambda m: 0 if m < 180 else 70, range(WINDOW_MIN)),
    (f"{NS}-r8", "engine-prefill-0", lambda m: 80, range(120, WINDOW_MIN)),
    (NS, "engine-decode-0", lambda m: 50, range(WINDOW_MIN)),
    (NS, "engine-decode-0-1", lambda m: 50, range(WINDOW_MIN)),
    ("pdstack-dev", "engine-prefill-0", lambda m: 0, range(WINDOW_MIN)),
    ("pdstack-production", "engine-prefill-0", lambda m: 0, range(WINDOW_MIN)),
]


def openmetrics() -> str:
    lines = ["# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for ns, pod, util, minutes in FLEET:
        for gpu in ("0", "1"):
            labels = f'namespace="{ns}",pod="{pod}",gpu="{gpu}",Hostname="node-{pod}"'
            for m in minutes:
                ts = END - (WINDOW_MIN - 1 - m) * 60
                lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} {util(m)} {ts}")
    return "\n".join(lines) + "\n# EOF\n"


@pytest.fixture(scope="module")
def recorded_prometheus(tmp_path_factory):
    work = tmp_path_factory.mktemp("cost-prom")
    (work / "samples.om").write_text(openmetrics())
    data = work / "data"
    subprocess.run([require_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                    str(work / "samples.om"), str(data)], check=True, capture_output=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [require_binary("prometheus"), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={data}",
           "--storage.tsdb.retention.time=30d", f"--web.listen-address=127.0.0.1:{port}"]
    with running(cmd, ready_url=f"{url}/-/ready"):
        yield url


def test_report_matches_the_numbers_worked_out_by_hand(recorded_prometheus):
    report = cost_report(PrometheusAPI(recorded_prometheus), NS, window="4h", at=END)
    roles = {r.role: r for r in report.roles}
    assert set(roles) == {"prefill", "decode"}
    assert roles["prefill"].gpu_hours == pytest.approx(20)
    assert roles["prefill"].idle_gpu_hours == pytest.approx(6)
    assert roles["prefill"].idle_share == pytest.approx(0.30)
    assert roles["prefill"].avg_instances == pytest.approx(2.5)
    assert roles["prefill"].max_instances == 3
    assert roles["decode"].gpu_hours == pytest.approx(16)
    assert roles["decode"].idle_gpu_hours == 0
    assert roles["decode"].avg_instances == pytest.approx(1)
    assert [(i.namespace, i.role, i.group) for i in report.idle_instances] == [(NS, "prefill", "engine-prefill-1")]
    assert report.idle_instances[0].idle_share == pytest.approx(0.75)


def test_pdctl_cost_prints_the_report(recorded_prometheus):
    result = subprocess.run([sys.executable, "-m", "infra.cli", "cost", "--stack", "prod", "--prometheus",
                             recorded_prometheus, "--window", "4h", "--at", str(END)],
                            capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "total 36.0 GPU-hours, 6.0 idle (16.7%)" in result.stdout
    assert "engine-prefill-1" in result.stdout and "75.0%" in result.stdout


# --- cache hygiene ------------------------------------------------------------------------------


def test_stale_entries_keep_what_is_in_use():
    now = 1_000_000.0
    entries = [CacheEntry("h", "/mnt/weights/old-model", now - 200 * 3600),
               CacheEntry("h", "/mnt/weights/current-model", now - 500 * 3600),
               CacheEntry("h", "/mnt/weights/recent", now - 10 * 3600)]
    stale = stale_entries(entries, now, 168, "weights cache", keep=("current-model/",))
    assert [(s.path, round(s.age_hours)) for s in stale] == [("/mnt/weights/old-model", 200)]


def test_scan_finds_stale_cache_folders_over_ssh(tmp_path, client_key, hosts):
    weights, prefix = tmp_path / "weights", tmp_path / "kvdisk"
    now = time.time()
    for folder, name, age_h in ((weights, "qwen3-30b-a3b", 400), (weights, "old-model", 400),
                                (weights, "fresh-model", 2), (prefix, "chunk-a", 30), (prefix, "chunk-b", 1)):
        (folder / name).mkdir(parents=True)
        os.utime(folder / name, (now - age_h * 3600, now - age_h * 3600))
    data = stack_data("dev")
    # The hosts scanned here are the on-prem kind: the cache is a folder on a mounted disk.
    data["model"]["weights"].update(node_cache_path=str(weights), cache={"medium": "host-path"})
    vllm_with_epp(data)
    data["deployment"]["cache"].update(store="lmcache", disk_path=str(prefix), retention_hours=24)
    spec = parse_spec(data)
    port, key = hosts["good"]
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-0": port, "gpu-9": free_port()}, {port: key}))
    stale, unreachable = scan_caches(inv, spec, now)
    assert sorted((s.host, s.what, os.path.basename(s.path)) for s in stale) == [
        ("gpu-0", "prefix cache", "chunk-a"), ("gpu-0", "weights cache", "old-model")]
    assert unreachable == ["gpu-9: connection refused"]
