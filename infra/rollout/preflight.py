"""Preflight: check every GPU node over SSH before a rollout touches the cluster.

For each host in an inventory: driver and CUDA versions match the spec's pins, all GPUs
are visible, the NVIDIA Container Toolkit is installed (what lets a container see the GPUs), the
RDMA devices the engines use are up, the clock is synchronised, and the weights cache has room.
Where the platform's GPU operator installs the driver and the toolkit itself (its
controllers.gpu_driver_preinstalled: false), those are not on the host: their rows say so.
Hosts run in parallel; every command has a timeout, so one hung `nvidia-smi` fails its host
instead of stalling the rollout.

Host keys must already be in the inventory's known_hosts file: an unknown or changed key
fails the host (paramiko's RejectPolicy), because auto-adding keys would let anyone on the
path answer for a GPU node.

The parsers (`parse_*`) and `judge_*` functions are pure and tested on their own; only
`run_host` talks to the network.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Annotated, Callable

from pydantic import Field

from infra.inputs import Strict, load_model
from infra.spec import StackSpec

if TYPE_CHECKING:
    import paramiko

# paramiko's transport thread logs a failed handshake with its traceback; with no handler
# configured, Python would print that to stderr. The failure is reported in the table instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# --- inventory ----------------------------------------------------------------------------


class HostEntry(Strict):
    name: str = Field(description="The node's Kubernetes name (static node mode labels and taints it by that name).")
    address: str
    port: Annotated[int, Field(gt=0, lt=65536)] | None = None
    user: str | None = None
    role: Literal["prefill", "decode", "colocated"] | None = Field(
        None, description="Static node mode (on-prem): the pool this node serves; the platform stack labels and "
                          "taints it so, and the capacity check counts it.")
    clique: str | None = Field(None, description="Static node mode: its NVLink domain (the clique label's value), "
                                                 "where GPU feature discovery does not publish one.")


class Inventory(Strict):
    """GPU nodes to check, and how to reach them. Lives next to the stack (per cluster)."""

    user: str = "root"
    port: Annotated[int, Field(gt=0, lt=65536)] = 22
    key_file: str = Field(description="Private key for the preflight user.")
    known_hosts: str = Field(description="known_hosts file holding every host's key (never auto-added).")
    timeout_seconds: Annotated[float, Field(gt=0)] = 10.0
    min_free_disk_gib: Annotated[float, Field(ge=0)] = 500.0
    max_clock_offset_ms: Annotated[float, Field(gt=0)] = 500.0
    hosts: list[HostEntry] = Field(min_length=1)


def load_inventory(path: str | Path) -> Inventory:
    path = Path(path)
    inventory = load_model(path, Inventory, "inventory")
    base = path.parent
    resolve = lambda p: str((base / Path(p).expanduser()).resolve())  # noqa: E731  relative to the inventory
    return inventory.model_copy(update={"key_file": resolve(inventory.key_file), "known_hosts": resolve(inventory.known_hosts)})


# --- what is expected, from the spec --------------------------------------------------------


@dataclass(frozen=True)
class Expectations:
    driver_version: str
    cuda_version: str
    gpus_per_node: int
    rdma_devices: tuple[str, ...]
    cache_path: str
    min_free_disk_gib: float
    max_clock_offset_ms: float
    # The host carries the NVIDIA driver and container toolkit (the platform's
    # controllers.gpu_driver_preinstalled); false: the GPU operator installs both in containers.
    host_driver: bool = True

    @classmethod
    def of(cls, spec: StackSpec, inventory: Inventory) -> Expectations:
        from infra.platform_stack.spec import load_platform_spec
        from infra.spec import REPO_ROOT

        platform = load_platform_spec(REPO_ROOT / spec.platform.spec) if spec.platform else None
        return cls(
            driver_version=spec.hardware.driver_version,
            cuda_version=spec.hardware.cuda_version,
            gpus_per_node=spec.hardware.gpus_per_node,
            rdma_devices=tuple(spec.hardware.fabric.devices if spec.hardware.fabric else ()),
            cache_path=spec.model.weights.node_cache_path,
            min_free_disk_gib=inventory.min_free_disk_gib,
            max_clock_offset_ms=inventory.max_clock_offset_ms,
            host_driver=platform.controllers.gpu_driver_preinstalled if platform else True,
        )


@dataclass(frozen=True)
class CheckResult:
    host: str
    check: str
    ok: bool
    detail: str
    seconds: float = 0.0


# --- pure parsers and verdicts ------------------------------------------------------------------


def parse_gpu_query(text: str) -> list[tuple[str, str]]:
    """`nvidia-smi --query-gpu=driver_version,name --format=csv,noheader` -> [(driver, name)]."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0]:
            rows.append((parts[0], parts[1]))
    return rows


def parse_cuda_version(text: str) -> str | None:
    """The 'CUDA Version: 12.8' in nvidia-smi's banner (the driver's CUDA runtime)."""
    m = re.search(r"CUDA Version:\s*([0-9.]+)", text)
    return m.group(1) if m else None


def parse_ibv_devinfo(text: str) -> dict[str, bool]:
    """`ibv_devinfo` -> {hca_id: any port PORT_ACTIVE}."""
    devices: dict[str, bool] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*hca_id:\s*(\S+)", line)
        if m:
            current = m.group(1)
            devices[current] = False
            continue
        if current and re.match(r"\s*state:\s*PORT_ACTIVE", line):
            devices[current] = True
    return devices


def parse_df_available_bytes(text: str) -> int | None:
    """`df -P -B1 <path>` -> available bytes on that filesystem."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return None
    fields = lines[-1].split()
    try:
        return int(fields[3])
    except (IndexError, ValueError):
        return None


def judge_driver(out: str, exp: Expectations) -> tuple[bool, str]:
    rows = parse_gpu_query(out)
    if not rows:
        return False, "nvidia-smi listed no GPUs"
    drivers = sorted({d for d, _ in rows})
    if drivers != [exp.driver_version]:
        return False, f"driver {', '.join(drivers)}, pinned {exp.driver_version}"
    return True, f"driver {exp.driver_version}"


def judge_gpus(out: str, exp: Expectations) -> tuple[bool, str]:
    rows = parse_gpu_query(out)
    if len(rows) != exp.gpus_per_node:
        return False, f"{len(rows)} GPUs visible, expected {exp.gpus_per_node}"
    return True, f"{len(rows)} x {rows[0][1]}"


def judge_cuda(out: str, exp: Expectations) -> tuple[bool, str]:
    found = parse_cuda_version(out)
    if found != exp.cuda_version:
        return False, f"CUDA {found or 'not reported'}, pinned {exp.cuda_version}"
    return True, f"CUDA {found}"


# `nvidia-ctk --version` (NVIDIA Container Toolkit, cmd/nvidia-ctk): "NVIDIA Container Toolkit CLI version 1.17.8".
_TOOLKIT_VERSION = re.compile(r"NVIDIA Container Toolkit CLI version (\S+)")
TOOLKIT_MISSING = ("no NVIDIA Container Toolkit (nvidia-ctk): no container would see a GPU. Fix: install it and "
                   "`nvidia-ctk runtime configure --runtime=containerd` (README, \"An existing on-prem cluster\"), or "
                   "let the GPU operator install it (platform controllers.gpu_driver_preinstalled: false)")


def judge_toolkit(out: str, exp: Expectations) -> tuple[bool, str]:
    found = _TOOLKIT_VERSION.search(out)
    if not found:
        return False, TOOLKIT_MISSING
    return True, f"NVIDIA Container Toolkit {found.group(1)}"


def judge_rdma(out: str, exp: Expectations) -> tuple[bool, str]:
    devices = parse_ibv_devinfo(out)
    wanted = exp.rdma_devices or tuple(devices)
    if not wanted:
        return False, "no RDMA devices listed"
    missing = [d for d in wanted if d not in devices]
    down = [d for d in wanted if d in devices and not devices[d]]
    if missing or down:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"down {', '.join(down)}"] if down else [])
        return False, "; ".join(parts)
    return True, f"{len(wanted)} active ({', '.join(wanted)})"


def judge_clock(out: str, exp: Expectations, local_time: float) -> tuple[bool, str]:
    """Output of `timedatectl show -p NTPSynchronized --value; date +%s.%N`."""
    lines = out.strip().splitlines()
    if len(lines) < 2:
        return False, f"unexpected output {out.strip()!r}"
    synced, remote = lines[0].strip(), lines[1].strip()
    try:
        offset_ms = abs(float(remote) - local_time) * 1000
    except ValueError:
        return False, f"unreadable time {remote!r}"
    if synced != "yes":
        return False, f"NTP not synchronised (NTPSynchronized={synced})"
    if offset_ms > exp.max_clock_offset_ms:
        return False, f"clock {offset_ms:.0f} ms off, limit {exp.max_clock_offset_ms:g} ms"
    return True, f"synchronised, {offset_ms:.0f} ms off"


def judge_disk(out: str, exp: Expectations) -> tuple[bool, str]:
    free = parse_df_available_bytes(out)
    if free is None:
        return False, f"cannot read free space of {exp.cache_path}"
    free_gib = free / 2**30
    if free_gib < exp.min_free_disk_gib:
        return False, f"{free_gib:.0f} GiB free at {exp.cache_path}, need {exp.min_free_disk_gib:g}"
    return True, f"{free_gib:.0f} GiB free"


@dataclass(frozen=True)
class Check:
    name: str
    command: Callable[[Expectations], str]
    judge: Callable[..., tuple[bool, str]]
    on_host: Callable[[Expectations], bool] = lambda exp: True  # false: nothing on the host to check


def _host_driver(exp: Expectations) -> bool:
    return exp.host_driver


NOT_ON_HOST = "not checked: the GPU operator installs it in a container (controllers.gpu_driver_preinstalled: false)"


# The weights cache may not exist yet on a fresh node: check the nearest existing parent.
_DF = "p={path}; while [ ! -e \"$p\" ]; do p=$(dirname \"$p\"); done; df -P -B1 \"$p\""

CHECKS: tuple[Check, ...] = (
    Check("driver", lambda e: "nvidia-smi --query-gpu=driver_version,name --format=csv,noheader", judge_driver,
          _host_driver),
    Check("gpus", lambda e: "nvidia-smi --query-gpu=driver_version,name --format=csv,noheader", judge_gpus,
          _host_driver),
    Check("cuda", lambda e: "nvidia-smi", judge_cuda, _host_driver),
    # Absent, the shell's own "not found" goes to /dev/null and the verdict names the fix.
    Check("toolkit", lambda e: "nvidia-ctk --version 2>/dev/null || true", judge_toolkit, _host_driver),
    Check("rdma", lambda e: "ibv_devinfo", judge_rdma),
    Check("clock", lambda e: "timedatectl show -p NTPSynchronized --value; date +%s.%N", judge_clock),
    Check("disk", lambda e: _DF.format(path=e.cache_path), judge_disk),
)


# --- running over SSH -----------------------------------------------------------------------


class CommandTimeout(Exception):
    pass


def run_command(client: paramiko.SSHClient, command: str, timeout: float) -> tuple[int, str]:
    transport = client.get_transport()
    chan = transport.open_session(timeout=timeout)
    try:
        chan.settimeout(timeout)
        chan.exec_command(command)
        if not chan.status_event.wait(timeout):
            raise CommandTimeout(f"no answer within {timeout:g}s")
        chunks = []  # outputs here are a few lines, well inside the channel window
        while chunk := chan.recv(65536):
            chunks.append(chunk)
        out = b"".join(chunks)
        return chan.recv_exit_status(), out.decode(errors="replace")
    finally:
        chan.close()


def connect(inv: Inventory, host: HostEntry) -> paramiko.SSHClient:
    # paramiko (with cryptography) is imported where a host is reached, not with the module:
    # every program that reads an inventory (the platform stack, cost) imports this one.
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(inv.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    t = inv.timeout_seconds
    client.connect(
        host.address, port=host.port or inv.port, username=host.user or inv.user,
        key_filename=inv.key_file, look_for_keys=False, allow_agent=False,
        timeout=t, banner_timeout=t, auth_timeout=t,
    )
    return client


def connect_error(exc: Exception) -> str:
    import paramiko

    if isinstance(exc, paramiko.BadHostKeyException):
        return "host key does not match known_hosts (possible impostor; fix known_hosts only after checking the node)"
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return "host key not in known_hosts (add it after checking the node; keys are never auto-added)"
    if isinstance(exc, paramiko.AuthenticationException):
        return "authentication failed for the preflight key"
    if isinstance(exc, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "connection timed out"
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc):
        return "no SSH server answered on that port (no SSH banner). Fix: check the host's address and port"
    if isinstance(exc, OSError) and exc.strerror:
        return f"cannot connect: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def run_host(inv: Inventory, host: HostEntry, exp: Expectations,
             clock: Callable[[], float] = time.time) -> list[CheckResult]:
    """Every check on one host; a host that cannot be reached gets one failed 'ssh' row."""
    started = time.monotonic()
    try:
        client = connect(inv, host)
    except Exception as exc:  # noqa: BLE001  every failure here is a reason to stop, reported by name
        return [CheckResult(host.name, "ssh", False, connect_error(exc), time.monotonic() - started)]
    results = []
    outcomes: dict[str, tuple[int, str] | Exception] = {}  # driver and gpus read the same query: run it once
    try:
        for check in CHECKS:
            t0 = time.monotonic()
            if not check.on_host(exp):
                results.append(CheckResult(host.name, check.name, True, NOT_ON_HOST, 0.0))
                continue
            command = check.command(exp)
            if command not in outcomes:
                try:
                    outcomes[command] = run_command(client, command, inv.timeout_seconds)
                except (CommandTimeout, socket.timeout) as exc:
                    outcomes[command] = exc
            outcome = outcomes[command]
            if isinstance(outcome, Exception):
                results.append(CheckResult(host.name, check.name, False, f"timed out: {outcome}", time.monotonic() - t0))
                continue
            status, out = outcome
            if status != 0:
                first = out.strip().splitlines()[-1] if out.strip() else ""
                results.append(CheckResult(host.name, check.name, False, f"exit {status} {first}".strip(), time.monotonic() - t0))
                continue
            ok, detail = check.judge(out, exp, clock()) if check.name == "clock" else check.judge(out, exp)
            results.append(CheckResult(host.name, check.name, ok, detail, time.monotonic() - t0))
    finally:
        client.close()
    return results


@dataclass(frozen=True)
class PreflightReport:
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        if self.ok:
            hosts = len({r.host for r in self.results})
            return f"preflight passed on {hosts} host(s)"
        return "preflight failed: " + "; ".join(f"{r.host} {r.check}: {r.detail}" for r in self.failures())


def run_preflight(inventory: Inventory, expectations: Expectations, parallel: int = 16) -> PreflightReport:
    with ThreadPoolExecutor(max_workers=min(parallel, len(inventory.hosts))) as pool:
        per_host = list(pool.map(lambda h: run_host(inventory, h, expectations), inventory.hosts))
    return PreflightReport([r for rows in per_host for r in rows])


def report_table(report: PreflightReport):
    from rich.table import Table

    table = Table(title="preflight")
    for col in ("host", "check", "result", "detail", "s"):
        table.add_column(col)
    for r in report.results:
        table.add_row(r.host, r.check, "[green]ok[/green]" if r.ok else "[red]FAIL[/red]", r.detail, f"{r.seconds:.2f}")
    return table
