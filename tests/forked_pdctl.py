"""pdctl processes forked from one that has already imported pdctl, for tests that start
hundreds of them (the fault matrix: one rollout and one recovery per fault point).

Each pdctl process spends about a second of CPU importing Pulumi, the Kubernetes SDK, pydantic
and boto3 before it does anything; on two cores, hundreds of them were minutes of `make test`.
A fork of a process that has done those imports starts at once and is still a real process of
its own: it runs `infra.cli.main` with its own arguments, environment, working directory and
standard streams, is killed (SIGKILL) or stopped (SIGSTOP) at its fault points like any other,
and exits with its own status. What it skips is the interpreter's start and the imports, which
tests/test_cli.py checks on the console script itself.

The server (`python -m tests.forked_pdctl SOCKET PARENT_PID`) imports, then serves requests on
a Unix socket: a JSON line {argv, env, cwd} with the request's stdin/stdout/stderr passed along
(SCM_RIGHTS). For each it forks a monitor, which forks the pdctl process, sends its pid, waits
for it and sends its exit status (Popen's convention: -N for signal N), so the server itself
never waits and never runs a thread (a fork from a threaded process may copy a held lock).

Each of them dies with its parent (the kernel's parent-death signal, twin/process.py): the
server with the test process that started it, even a test run killed by SIGKILL, which runs no
cleanup; a monitor with the server; a pdctl process with its monitor.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twin.process import die_with_parent


# What pdctl's commands import before they do anything: imported once, by the server.
PRELOADED = ("infra.cli", "infra.cli.run", "infra.offline", "infra.program", "infra.rollout.objectstore",
             "infra.rollout.rollout", "boto3")


def serve(path: str, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    for module in PRELOADED:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    server_pid = os.getpid()
    while True:
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if os.fork() == 0:
            die_with_parent(server_pid)
            server.close()
            _monitor(conn, json.loads(message), fds)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)


def _monitor(conn: socket.socket, request: dict, fds: list[int]) -> None:
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # so waitpid sees the pdctl process end
        monitor_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            die_with_parent(monitor_pid)
            conn.close()
            _run_pdctl(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def _run_pdctl(request: dict, fds: list[int]) -> None:
    code = 70
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from infra.cli import main

        code = main(request["argv"])
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


class ForkedPdctl:
    """One pdctl process from the server: `pid`, `poll()`, `wait()` and `communicate()` as
    subprocess.Popen has them, its output read from pipes of its own."""

    def __init__(self, socket_path: str, argv: list[str], env: dict[str, str], cwd: str | Path):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(socket_path)
            request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
            socket.send_fds(self._conn, [request], [stdin, out_w, err_w])
        finally:
            for fd in (stdin, out_w, err_w):
                os.close(fd)
        self._answers = b""  # the monitor's lines: the pid, then the exit status
        self.pid = int(self._line(None))
        self.returncode: int | None = None
        self.stdout, self.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")

    def _line(self, timeout: float | None) -> str | None:
        """The monitor's next line; None if none came within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._answers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            data = self._conn.recv(4096)
            if not data:
                raise RuntimeError("the forked pdctl's monitor ended without saying its status")
            self._answers += data
        line, self._answers = self._answers.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            self.returncode = None if line is None else int(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired("pdctl", timeout)
            self.returncode = int(line)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams read to their end, then the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[int, list[bytes]] = {self.stdout.fileno(): [], self.stderr.fileno(): []}
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = selector.select(left)
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired("pdctl", timeout)
                for key, _ in ready:
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out, err = (b"".join(chunks[s.fileno()]).decode(errors="replace") for s in (self.stdout, self.stderr))
        self.close()
        return out, err

    def close(self) -> None:
        for stream in (self.stdout, self.stderr, self._conn):
            stream.close()


class PdctlServer:
    """The server process, started and stopped by a test (a context manager)."""

    def __enter__(self) -> "PdctlServer":
        self._dir = tempfile.TemporaryDirectory(prefix="pdctl-fork-")
        self.path = str(Path(self._dir.name) / "socket")
        # The server dies with the thread that starts it (prctl(2)): the test's own, here.
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.forked_pdctl", self.path, str(os.getpid())],
                                      cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            self._proc.kill()
            raise RuntimeError(f"the pdctl fork server did not start (it said {ready!r})")
        return self

    def start(self, argv: list[str], env: dict[str, str], cwd: str | Path) -> ForkedPdctl:
        return ForkedPdctl(self.path, argv, env, cwd)

    def run(self, argv: list[str], env: dict[str, str], cwd: str | Path, timeout: float) -> subprocess.CompletedProcess:
        proc = self.start(argv, env, cwd)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(["pdctl", *argv], proc.returncode, out, err)

    def __exit__(self, *exc) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc.stdout.close()
        self._dir.cleanup()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
