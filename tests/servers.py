"""Real servers for tests, each on 127.0.0.1, started and stopped by the test session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout}s")
            time.sleep(0.2)


def require_binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if shutil.os.path.exists(f"/usr/sbin/{name}") else None)
    if not path:
        raise RuntimeError(f"{name} is not installed: run `make test` (scripts/install-system-deps installs it)")
    return path


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextmanager
def running(cmd: list[str], ready_url: str | None = None, **popen):
    # The server's log goes to a file: a pipe nobody reads fills up (64 KiB) and then blocks
    # the server mid-request (moto logs every request).
    import tempfile

    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, **popen)
        try:
            if ready_url:
                try:
                    wait_http(ready_url)
                except TimeoutError:
                    log.seek(0)
                    raise TimeoutError(f"{cmd[0]} did not start: {log.read()[-2000:].decode(errors='replace')}") from None
            yield proc
        finally:
            stop(proc)


@contextmanager
def moto_s3():
    """An S3 endpoint (moto's server mode) on loopback; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], ready_url=f"{url}/moto-api/"):
        yield url


@contextmanager
def sshd(workdir, path_dirs: list[str], authorized_key: str):
    """A real OpenSSH server on 127.0.0.1 with its own host key; yields (port, host_public_key).

    `path_dirs` go first on the PATH of every session (SetEnv), so stub commands there
    stand in for the GPU tools of a real node.
    """
    import os
    from pathlib import Path

    binary = require_binary("sshd")
    keygen = require_binary("ssh-keygen")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    host_key = workdir / "host_ed25519"
    if not host_key.exists():
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    (workdir / "authorized_keys").write_text(authorized_key + "\n")
    os.chmod(workdir / "authorized_keys", 0o600)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    port = free_port()
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {workdir}/sshd.pid",
        f"AuthorizedKeysFile {workdir}/authorized_keys", "StrictModes no", "UsePAM no",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
        f"SetEnv PATH={':'.join(path_dirs)}:/usr/local/bin:/usr/bin:/bin", "LogLevel ERROR", "",
    ]))
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError("sshd did not start")
            time.sleep(0.1)
        yield port, (workdir / "host_ed25519.pub").read_text().strip()
    finally:
        stop(proc)


@contextmanager
def prometheus(workdir, targets: list[tuple[int, dict[str, str]]], scrape_seconds: float = 1.0):
    """A real Prometheus server on 127.0.0.1 scraping `targets` (port, target labels); yields its URL.

    Target labels stand in for what the Prometheus operator adds from a PodMonitor
    (namespace, and pod labels named in podTargetLabels).
    """
    from pathlib import Path

    import yaml

    binary = require_binary("prometheus")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config = {"global": {"scrape_interval": f"{scrape_seconds:g}s", "evaluation_interval": f"{scrape_seconds:g}s"},
              "scrape_configs": [{"job_name": "engines", "static_configs": [
                  {"targets": [f"127.0.0.1:{port}"], "labels": labels} for port, labels in targets]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    with running(cmd, ready_url=f"{url}/-/ready"):
        yield url


@contextmanager
def cuttable_proxy(target_port: int, cut_flag):
    """A TCP proxy on 127.0.0.1 in front of `target_port` that drops every connection, new and
    open, while the file `cut_flag` exists: a dependency whose network went away. Yields its port."""
    import os
    import selectors
    import threading

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stopping = threading.Event()

    def pipe(client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", target_port))
        except OSError:
            client.close()
            return
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        try:
            while not stopping.is_set() and not os.path.exists(cut_flag):
                for key, _ in sel.select(timeout=0.1):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    def accept() -> None:
        while not stopping.is_set():
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            if os.path.exists(cut_flag):
                client.close()
                continue
            threading.Thread(target=pipe, args=(client,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stopping.set()
        thread.join(timeout=2)
        listener.close()
