"""Keep a program that listens on every interface off the machine's network: run it in a network
namespace of its own, which has only a loopback, and carry its API-server connections out over
a Unix socket.

Why: Karpenter formats its metrics and health addresses as ":<port>" (sigs.k8s.io/karpenter
v1.14.1, pkg/operator/operator.go), so it cannot be told to bind 127.0.0.1 only. Inside the
namespace those ports exist on its private loopback alone.

    outside: supervisor thread   unix socket  <->  127.0.0.1:<apiserver port>
    inside:  `unshare --net python -m twin.netns ...`  127.0.0.1:<port>  <->  unix socket,
             then the program, as its child (parent-death signal set)
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from twin.process import die_with_parent


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(listener: socket.socket, connect) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def forward_unix_to_tcp(path: Path, port: int) -> socket.socket:
    """Outside the namespace: connections to the Unix socket go to 127.0.0.1:port (a daemon thread)."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o600)
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, lambda: socket.create_connection(("127.0.0.1", port))),
                     daemon=True).start()
    return listener


def argv(unix_socket: Path, port: int, program: list[str]) -> list[str]:
    """The command line that runs `program` in a new network namespace, reaching the API server
    at 127.0.0.1:port through unix_socket."""
    return ["unshare", "--net", "--", sys.executable, "-m", "twin.netns", "--unix-socket", str(unix_socket),
            "--port", str(port), "--", *program]


def main() -> int:  # inside the namespace
    parser = argparse.ArgumentParser()
    parser.add_argument("--unix-socket", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.create_server(("127.0.0.1", args.port))
    threading.Thread(target=_serve, args=(listener, lambda: _unix(args.unix_socket)), daemon=True).start()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    child = subprocess.Popen(program, preexec_fn=functools.partial(die_with_parent, os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    return child.wait()


def _unix(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    return s


if __name__ == "__main__":
    sys.exit(main())
