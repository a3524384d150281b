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


@contextmanager
def running(cmd: list[str], ready_url: str | None = None, **popen):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)
    try:
        if ready_url:
            wait_http(ready_url)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def moto_s3():
    """An S3 endpoint (moto's server mode) on loopback; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], ready_url=f"{url}/moto-api/"):
        yield url
