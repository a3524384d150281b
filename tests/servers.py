"""Real servers for tests, each on 127.0.0.1, started and stopped by the test session."""

from __future__ import annotations

import http.server
import json
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send_json(handler: http.server.BaseHTTPRequestHandler, status: int, payload) -> None:
    """A stub server's JSON answer, with its length (the client reads exactly that much)."""
    body = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def http_answer(request: urllib.request.Request | str, timeout: float = 30) -> tuple[int, str]:
    """A server's status and body, an error status included; 0 and the error when none answered."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


# How long a server the tests start may take to answer while its process lives. Generous: `make
# test` starts these at nice 10 beside four twins starting, and moto's server took over 30 s to
# import there (its session fixture failed, and with it every test of two workers that used S3).
# A server that exits is reported at once.
SERVER_START_SECONDS = 600


def wait_http(url: str, proc: subprocess.Popen, timeout: float = SERVER_START_SECONDS) -> None:
    """Until `url` answers with success, while `proc`, the server, runs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except Exception:
            if proc.poll() is not None:
                raise TimeoutError(f"{url}: the server exited with {proc.returncode} before it answered")
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
                    wait_http(ready_url, proc)
                except TimeoutError as exc:
                    log.seek(0)
                    raise TimeoutError(f"{cmd[0]} did not start ({exc}): "
                                       f"{log.read()[-2000:].decode(errors='replace')}") from None
            yield proc
        finally:
            stop(proc)


@contextmanager
def moto_s3(custom_endpoints: tuple[str, ...] = ()):
    """An S3 endpoint (moto's server mode) on loopback; yields its URL. `custom_endpoints`: the URLs
    by which clients also reach it (a Service's name: moto 5.2.5 takes a host such as
    minio.storage.svc for a virtual-hosted bucket, but not one of MOTO_S3_CUSTOM_ENDPOINTS,
    moto/s3/responses.py subdomain_based_buckets)."""
    import os

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **({"MOTO_S3_CUSTOM_ENDPOINTS": ",".join(custom_endpoints)} if custom_endpoints else {})}
    with running([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], ready_url=f"{url}/moto-api/",
                 env=env):
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
    log = open(workdir / "sshd.log", "wb")  # a file, not a pipe nobody reads (see running())
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(workdir / 'sshd.log').read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("sshd did not start")
            time.sleep(0.1)
        yield port, (workdir / "host_ed25519.pub").read_text().strip()
    finally:
        stop(proc)
        log.close()


@contextmanager
def prometheus(workdir, targets: list[tuple[int, dict[str, str]]], scrape_seconds: float = 1.0):
    """A real Prometheus server on 127.0.0.1 scraping `targets` (port, target labels); yields its URL.

    Target labels stand in for what the Prometheus operator adds from a PodMonitor
    (namespace, and pod labels named in podTargetLabels).
    """
    jobs = [{"job_name": "engines", "static_configs": [
        {"targets": [f"127.0.0.1:{port}"], "labels": labels} for port, labels in targets]}]
    with prometheus_server(workdir, jobs, scrape_seconds) as url:
        yield url


@contextmanager
def prometheus_server(workdir, scrape_configs: list[dict], scrape_seconds: float = 1.0):
    """A real Prometheus server on 127.0.0.1 with these scrape configs; yields its URL."""
    from pathlib import Path

    import yaml

    binary = require_binary("prometheus")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    every = f"{round(scrape_seconds * 1000)}ms"  # Prometheus durations are whole numbers of a unit: 0.25s is refused
    config = {"global": {"scrape_interval": every, "evaluation_interval": every},
              "scrape_configs": scrape_configs}
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


# --- Prometheus stand-ins: an HTTP server on 127.0.0.1 answering each query as told ---------------


class QuietServer(http.server.ThreadingHTTPServer):
    """A threaded HTTP server for stand-ins that keeps quiet about clients that went away."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that gave up (a "hang" mode outlasts its timeout) makes the late answer
        # fail with a broken pipe; socketserver would print that traceback into whichever
        # test runs next.
        pass


@contextmanager
def http_server(answer):
    """A server on 127.0.0.1 whose every GET is answered by `answer(query)`: (status, body), or a
    generator of raw bytes (status line and headers included: an answer no HTTP server should
    give) sent as it yields them, until it ends or the client hangs up (then it is closed)."""
    from urllib.parse import parse_qs, urlparse

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            given = answer(parse_qs(urlparse(self.path).query).get("query", [""])[0])
            if isinstance(given, tuple):
                status, body = given
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.close_connection = True
            try:
                for chunk in given:
                    self.wfile.write(chunk)
            except OSError:  # the client hung up (a write after it did fails)
                given.close()

        def log_message(self, *args):
            pass

    with serving(Handler) as url:
        yield url


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]):
    """`handler` on a free port of 127.0.0.1, in threads, until the block ends; yields its URL."""
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# Answers no HTTP client can read, each one of http.client's own failures (CPython 3.11
# Lib/http/client.py): a body shorter than its Content-Length, then the connection closed
# (IncompleteRead); a first line that is not an HTTP status line (BadStatusLine); a header line
# longer than _MAXLINE, 65536 bytes (LineTooLong).
BROKEN_ANSWERS = {
    "short-body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                  b'{"status":"success","data":{"resultType":"vec',
    "not-http": b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n",
    "long-header": b"HTTP/1.1 200 OK\r\nX-Filler: " + b"x" * 70_000 + b"\r\n\r\n{}",
}
# "trickle": the status line and headers at once, then one byte of the body this often: no
# single read waits long, so only a deadline over the whole answer ends it. The server gives
# up on its own after TRICKLE_BYTES (a client without that deadline then fails on a short body).
TRICKLE_SECONDS, TRICKLE_BYTES = 0.1, 200


def passing_answer(query: str) -> tuple[int, bytes]:
    """A gate query's passing value: latency quantiles 10 ms, failures 0; the histograms' edges
    (canary.py BUCKET_EDGES, one series per gate and le) none, so quantiles compare as exact values."""
    value = "0.01" if "histogram_quantile" in query else "0"
    result = [] if "group by (le)" in query else [{"metric": {}, "value": [time.time(), value]}]
    return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


@contextmanager
def misbehaving_prometheus(mode: str, breaks=lambda query: True, hung_up: queue.Queue[int] | None = None):
    """Prometheus answering the queries `breaks(query)` picks the way `mode` says, the others
    with a passing value: 503 with its error body, hang (2 s a query), junk (HTML), refused
    (nothing listening), one of BROKEN_ANSWERS, or trickle. A trickle's client that hangs up
    before its end is recorded in `hung_up` (the body bytes it had been sent)."""
    if mode == "refused":
        yield f"http://127.0.0.1:{free_port()}"
        return

    def trickle():
        yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
        for sent in range(TRICKLE_BYTES):
            time.sleep(TRICKLE_SECONDS)
            try:
                yield b" "
            except GeneratorExit:
                if hung_up is not None:
                    hung_up.put(sent)
                raise

    def answer(query: str):
        if not breaks(query):
            return passing_answer(query)
        if mode in BROKEN_ANSWERS:
            return (chunk for chunk in (BROKEN_ANSWERS[mode],))
        if mode == "trickle":
            return trickle()
        if mode == "hang":
            time.sleep(2)
        if mode == "503":
            return 503, b'{"status":"error","errorType":"unavailable","error":"tsdb is closing"}'
        return 200, b"<html>maintenance</html>"

    with http_server(answer) as url:
        yield url


@contextmanager
def healthy_prometheus():
    """Answers every gate query with a passing value (latency quantiles 10 ms, failures 0)."""
    with http_server(passing_answer) as url:
        yield url
