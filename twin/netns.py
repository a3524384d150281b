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
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from twin.process import dying_with_parent


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


def argv(unix_socket: Path, port: int, program: list[str], folders: dict[str, Path] | None = None) -> list[str]:
    """The command line that runs `program` in a new network namespace, reaching the API server
    at 127.0.0.1:port through unix_socket. `folders` (path the program reads -> folder here) are
    mounted where the program expects them, in a mount namespace of its own (see `_root_with`)."""
    return ["unshare", "--net", *(["--mount"] if folders else []), "--", *inside_argv(unix_socket, port, program, folders)]


def inside_argv(unix_socket: Path, port: int, program: list[str], folders: dict[str, Path] | None = None) -> list[str]:
    """argv's command for a namespace made otherwise (a pod's, entered with nsenter): 127.0.0.1:port
    inside it carried to unix_socket, `folders` mounted (its mount namespace must be private), then
    `program`."""
    mounts = [f"--folder={inside}={outside}" for inside, outside in (folders or {}).items()]
    return [sys.executable, "-m", "twin.netns", "--unix-socket", str(unix_socket), "--port", str(port), *mounts,
            "--", *program]


def _root_with(folders: dict[str, Path], scratch: Path) -> Path:
    """A root for the program: every top-level entry of / mounted (or linked) into a tmpfs at
    `scratch`, plus each of `folders` at its path, all in this process's private mount namespace.
    For a program that reads a fixed path such as /certs, where a pod mounts a Secret: the
    machine's own / gets no new folder, and nothing outside this namespace sees the mounts."""
    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True)

    mount("--make-rprivate", "/")
    scratch.mkdir(mode=0o700, exist_ok=True)
    mount("-t", "tmpfs", "-o", "mode=0755", "twin-root", str(scratch))
    for entry in sorted(os.listdir("/")):
        source, target = Path("/") / entry, scratch / entry
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif source.is_dir():
            target.mkdir()
            mount("--rbind", str(source), str(target))
    for inside, outside in folders.items():
        target = scratch / inside.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        mount("--bind", "-o", "ro", str(outside), str(target))
    return scratch


def main() -> int:  # inside the namespace
    parser = argparse.ArgumentParser()
    parser.add_argument("--unix-socket", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--folder", action="append", default=[], help="inside=outside (see argv)")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.create_server(("127.0.0.1", args.port))
    threading.Thread(target=_serve, args=(listener, lambda: _unix(args.unix_socket)), daemon=True).start()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if args.folder:
        folders = dict(f.split("=", 1) for f in args.folder)
        root = _root_with({k: Path(v) for k, v in folders.items()}, args.unix_socket.with_suffix(".root"))
        program = ["chroot", str(root), *program]  # chroot(8): that root, and its / as the working folder
    child = subprocess.Popen(dying_with_parent(program))
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    return child.wait()


def _unix(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    return s


if __name__ == "__main__":
    sys.exit(main())
