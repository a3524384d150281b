"""The twin's supervision and files, checked without starting a twin (so they are cheap): one
twin per state folder, a supervisor known by more than its pid, ports held until bound, private
keys private from their first byte, and children that die with their parent."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from twin.cluster import Ports
from twin.paths import ROOT
from twin.pki import Authority
from twin.process import identity

# What `up` and then the supervisor do with a state folder, as far as others can see: hold its
# lock and record the phase, its pid and its start (argv[1] is the phase).
FIRST_TWIN = """
import json, os, sys, time
from twin import cluster
from twin.paths import private_folder
from twin.process import identity
lock = cluster.hold_lock()
private_folder(cluster.RUN_DIR)
cluster.STATE.write_text(json.dumps({"phase": sys.argv[1], "supervisor_pid": os.getpid(),
                                     "supervisor_start": identity(os.getpid())}))
print("holding", flush=True)
time.sleep(600)
"""


def _env(state_dir: Path) -> dict[str, str]:
    # no `go` on PATH: a command that got as far as building would fail at once
    return {**os.environ, "PDSTACK_TWIN_DIR": str(state_dir), "PYTHONPATH": str(ROOT),
            "PATH": str(state_dir.parent / "no-go")}


def _twin(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twin", *args], cwd=ROOT, env=_env(state_dir),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def first_twin(tmp_path):
    """Start a stand-in for a twin in tmp_path/twin, in the given phase; stopped afterwards."""
    procs = []

    def start(phase: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", FIRST_TWIN, phase], cwd=ROOT, env=_env(tmp_path / "twin"),
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "holding"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_second_up_on_one_state_folder_is_refused_while_the_first_holds_it(tmp_path, first_twin):
    """Before, a second `twin up` stopped nothing, then rebuilt, removed the first's run folder and
    remade the certificates under it. Now the first holds the folder's flock (flock(2)) from its
    start to the end of its supervisor; the second is refused before it builds or removes anything."""
    state_dir = tmp_path / "twin"
    first = first_twin("starting")
    state = (state_dir / "run" / "state.json").read_text()

    second = _twin(state_dir, "up")

    assert second.returncode == 1
    assert f"another twin holds {state_dir}" in second.stderr and f"pid {first.pid}" in second.stderr
    assert "Traceback" not in second.stderr
    assert (state_dir / "run" / "state.json").read_text() == state, "the first twin's run folder was touched"
    assert first.poll() is None


def test_the_state_folder_is_private(tmp_path, first_twin):
    """The folder holds the kubeconfig and, in run/, the keys and etcd's data: 0700, even if it was
    made before with the umask's mode."""
    state_dir = tmp_path / "twin"
    state_dir.mkdir(mode=0o755)
    state_dir.chmod(0o755)
    first_twin("starting")
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((state_dir / "run").stat().st_mode) == 0o700


def test_a_stale_state_is_neither_reported_nor_stopped(tmp_path):
    """A supervisor is the process with the recorded start on this boot (proc(5): /proc/<pid>/stat
    field 22) holding this folder's lock open, not any process whose command line says
    `twin supervise`. Here the recorded supervisor is gone and its pid belongs to another process
    whose command line looks like one: before, `status` said it was up and `down` killed it."""
    state_dir, run = tmp_path / "twin", tmp_path / "twin" / "run"
    run.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone_start = identity(gone.pid)
    gone.kill()
    gone.wait()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "twin", "supervise"])
    try:
        for recorded_start in (gone_start, identity(other.pid)):  # the second: the right process, wrong folder
            (run / "state.json").write_text(json.dumps({
                "phase": "ready", "supervisor_pid": other.pid, "supervisor_start": recorded_start}))
            status, down = _twin(state_dir, "status"), _twin(state_dir, "down")
            assert status.returncode == 1 and "twin: not running" in status.stdout, status.stdout
            assert down.stdout.strip() == "twin: not running", down.stdout + down.stderr
            assert other.poll() is None, "`twin down` killed a process that is not the twin's supervisor"
    finally:
        other.kill()
        other.wait()


def test_the_supervisor_that_holds_the_folder_is_reported_and_stopped(tmp_path, first_twin):
    """The other side of the stale state: the recorded process, holding the lock, is the twin."""
    state_dir = tmp_path / "twin"
    first = first_twin("ready")
    status = _twin(state_dir, "status")
    assert status.returncode == 0 and json.loads(status.stdout)["supervisor_pid"] == first.pid
    assert _twin(state_dir, "down").stdout.strip() == "twin: stopped"
    assert first.wait(timeout=60) == -15  # SIGTERM, the supervisor's signal to stop its components


def test_the_twins_ports_are_held_until_their_components_bind_them():
    """Before, each port was picked by binding port 0 and closing the socket, so the next pick, or
    any other program's, could get it again before its component bound it. Now each stays bound,
    with SO_REUSEADDR and never listening, until the supervisor exits. socket(7), SO_REUSEADDR,
    and Linux's inet_csk_bind_conflict: a bind to port 0 never gets a bound port, a bind without
    SO_REUSEADDR is refused it, and a listener with SO_REUSEADDR (Go's net package sets it on every
    TCP listener) binds and listens beside the holder."""
    ports, holders = Ports.held()
    numbers = list(asdict(ports).values())
    others = []
    try:
        assert len(set(numbers)) == len(numbers) == len(holders)
        for port in numbers:
            with socket.socket() as plain, pytest.raises(OSError) as refused:
                plain.bind(("127.0.0.1", port))
            assert refused.value.errno == errno.EADDRINUSE
        for _ in range(256):  # other programs picking ports meanwhile
            pick = socket.socket()
            others.append(pick)
            pick.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            pick.bind(("127.0.0.1", 0))
            assert pick.getsockname()[1] not in numbers
        with socket.socket() as component:  # as a Go component listens
            component.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            component.bind(("127.0.0.1", ports.etcd))
            component.listen()
            with socket.create_connection(("127.0.0.1", ports.etcd), timeout=10):
                accepted, _ = component.accept()
                accepted.close()
    finally:
        for s in holders + others:
            s.close()


def test_a_private_key_is_a_new_file_private_from_its_creation(tmp_path, monkeypatch):
    """Before, a key was written with the umask's mode, then chmodded to 0600: meanwhile any user
    could open it and keep reading through that descriptor. Now it is created 0600 (open(2) with
    O_CREAT|O_EXCL and mode 0600): with a umask that takes nothing away and no chmod after the
    creation allowed, every key is still 0600, in a folder of 0700."""
    real_chmod = Path.chmod

    def chmod_folders_only(path, mode, **kw):
        assert path.is_dir(), f"{path} was chmodded after its creation"
        return real_chmod(path, mode, **kw)

    monkeypatch.setattr(Path, "chmod", chmod_folders_only)
    folder = tmp_path / "pki"
    folder.mkdir(mode=0o755)
    old_umask = os.umask(0)
    try:
        ca = Authority(folder)
        pair = ca.issue("admin", "pdstack-twin-admin", groups=("system:masters",), client=True)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for key in (ca.ca.key, pair.key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_a_key_is_never_written_into_a_file_or_link_already_there(tmp_path):
    """O_EXCL (open(2)): a file at the key's path is refused, not reused with whatever mode and
    readers it had, and a symlink there is not followed."""
    folder = tmp_path / "pki"
    ca = Authority(folder)
    planted = folder / "admin.key"
    planted.write_text("someone else's file\n")
    elsewhere = tmp_path / "elsewhere.key"
    (folder / "scheduler.key").symlink_to(elsewhere)
    with pytest.raises(FileExistsError):
        ca.issue("admin", "pdstack-twin-admin", client=True)
    with pytest.raises(FileExistsError):
        ca.issue("scheduler", "system:kube-scheduler", client=True)
    assert planted.read_text() == "someone else's file\n"
    assert not elsewhere.exists()


@pytest.mark.parametrize("parent, survives", [("os.getppid()", True), ("1", False)])
def test_a_child_whose_parent_is_already_gone_dies_at_once(parent, survives):
    """prctl(2): the parent-death signal is sent only for a death after PR_SET_PDEATHSIG, so the
    man page advises comparing getppid() with the parent's pid right after it. A process whose
    parent is not the one named (here pid 1: as if it had died and the process been reparented)
    is killed there and then."""
    child = subprocess.run([sys.executable, "-c", "import os\nfrom twin.process import die_with_parent\n"
                            f"die_with_parent({parent})\nprint('alive')"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (child.returncode, child.stdout.strip()) == ((0, "alive") if survives else (-9, ""))
