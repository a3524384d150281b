"""The Mooncake master as rendered, run with the real `mooncake_master` of the pinned Mooncake
(issue #37 item 10).

The binary comes from the `mooncake-transfer-engine` wheel on PyPI (mooncake/mooncake_master, with
its bundled libraries in mooncake_transfer_engine.libs/), at the version the spec's master image is
tagged with (`kvcacheai/mooncake:v<version>`), checked against its sha256, and downloaded once
into the machine's upstream cache (scripts/pinned_wheels.py). It links the system's libibverbs
(scripts/install-system-deps installs it). Its flags are gflags: an unknown flag exits 1 before
anything starts, and `--helpfull` describes each one.

It runs inside a network namespace of its own (`unshare --net`, loopback only): the master binds
its RPC and metrics servers on 0.0.0.0 (it has no flag for the metrics address), so nothing it
opens is reachable from outside the test, and the rendered ports are used as they are.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra.render.kvcache_config import MOONCAKE_METRICS_PORT, MOONCAKE_RPC_PORT, kv_cache_plan
from infra.render.engine_check import variant_spec
from tests.servers import require_binary


def pinned_version() -> str:
    """The Mooncake version of the committed specs' master image (every stack runs the same)."""
    tags = {variant_spec(stack, "sglang").images.mooncake_master.split("@")[0].rsplit(":", 1)[1] for stack in ("dev", "prod")}
    (tag,) = tags
    return tag.removeprefix("v")


@pytest.fixture(scope="module")
def master_binary(tmp_path_factory) -> tuple[Path, dict]:
    """mooncake_master from the pinned wheel (sha256 checked), and the environment it runs in: the
    twin runs the Mooncake master's pod with the same (twin/pods.py mooncake_master)."""
    from twin.pods import mooncake_master

    binary, env = mooncake_master(pinned_version(), tmp_path_factory.mktemp("mooncake"))
    env = {"PATH": "/usr/bin:/bin", **env}
    missing = [line for line in subprocess.run(["ldd", str(binary)], env=env, capture_output=True, text=True).stdout
               .splitlines() if "not found" in line]
    assert not missing, f"mooncake_master lacks {missing}: run scripts/install-system-deps (libibverbs1)"
    return binary, env


def flags(binary: Path, env: dict) -> dict[str, str]:
    """Each flag of the binary and its help text, from `--helpfull`."""
    text = subprocess.run([str(binary), "--helpfull"], env=env, capture_output=True, text=True, timeout=30).stdout
    blocks = re.split(r"^ {4}-(?=\w+ \()", text, flags=re.M)[1:]  # each: "name (help) type: ... default: ..."
    return {b.split(" ", 1)[0]: " ".join(b.split(" ", 1)[1].split()).rsplit(") type:", 1)[0][1:] for b in blocks}


def rendered_command() -> list[str]:
    plan = kv_cache_plan(variant_spec("prod", "sglang"))
    assert plan.store == "mooncake" and plan.command[0] == "mooncake_master"
    return plan.command


def test_every_rendered_flag_is_a_current_flag_of_the_pinned_master(master_binary):
    """Each flag the master is started with exists and is not deprecated (`--port` is "deprecated,
    use rpc_port" since 0.3.8.post1); and HA, which the master runs without, needs a backend (etcd...)."""
    known = flags(*master_binary)
    assert "rpc_port" in known and "metrics_port" in known
    for arg in rendered_command()[1:]:
        name = arg.removeprefix("--").split("=", 1)[0]
        assert name in known, f"{arg}: not a flag of mooncake_master"
        assert "deprecated" not in known[name].lower(), f"{arg}: {known[name]}"
    # HA needs a leader-election backend pdstack does not run (0.3.13.post1: --ha_backend_type, etcd by default)
    assert "ha_backend_type" in known and "etcd" in known["ha_backend_type"] and "etcd_endpoints" in known


def test_the_rendered_master_starts_and_serves_its_ports(master_binary, tmp_path):
    """The rendered command, run as it is in a namespace of its own: the master says it listens on
    the rendered RPC port, and answers /metrics on the rendered metrics port."""
    unshare = require_binary("unshare")
    binary, env = master_binary
    command = [str(binary), *rendered_command()[1:]]
    # Runs inside the namespace: loopback up, the master started, its metrics read, the master stopped.
    inside = f"""
import subprocess, sys, time, urllib.request
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
log = open({str(tmp_path / "master.log")!r}, "wb")
master = subprocess.Popen({command!r}, stdout=log, stderr=log)
deadline = time.monotonic() + 60
try:
    while True:
        try:
            body = urllib.request.urlopen("http://127.0.0.1:{MOONCAKE_METRICS_PORT}/metrics", timeout=2).read()
            break
        except OSError:
            if master.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"master exited with {{master.poll()}}, or did not serve metrics")
            time.sleep(0.2)
    with open({str(tmp_path / "metrics.txt")!r}, "wb") as out:
        out.write(body)
finally:
    master.terminate()
    master.wait(timeout=20)
"""
    done = subprocess.run([unshare, "--net", sys.executable, "-c", inside], env=env, capture_output=True, text=True,
                          timeout=120)
    log = (tmp_path / "master.log").read_text(errors="replace") if (tmp_path / "master.log").exists() else ""
    assert done.returncode == 0, f"{done.stderr[-2000:]}\n{log[-3000:]}"
    assert re.search(rf"Master service started on port {MOONCAKE_RPC_PORT}\b.*\brpc_port={MOONCAKE_RPC_PORT}\b", log)
    assert "enable_ha=0" in log
    assert "master_total_capacity_bytes" in (tmp_path / "metrics.txt").read_text()
