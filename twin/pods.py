"""Processes at the pods' addresses: what a kubelet and a CNI would do for the pods the twin can
run on a CPU (the router, each engine pod with the engine replaced by twin/engine_standin.py, and
the Mooncake master with the pinned wheel's `mooncake_master`). Which pod runs, and why another
does not (a container with no command), is `not_runnable`. The endpoint picker's pod runs the
twin's build of it (twin/endpoint-picker, `build.program("epp")`) in its image's /app/epp's place.

Network: a pod network of its own, never the machine's. A hub network namespace (`unshare --net`)
holds a bridge; each started pod gets a network namespace of its own with a veth on that bridge and
its pod IP (the address kwok wrote into its status, from twin/api.py POD_CIDR) on it, so two pods may
both bind 0.0.0.0:30000 as they do on a cluster, and nothing they bind is on the machine's
interfaces. The hub carries the `kubernetes` Service's address (the first of twin/api.py SERVICE_CIDR),
forwarded to the API server through a Unix socket (twin/netns.py), so in-cluster clients reach the
twin's API server as in a pod; and a Unix socket (`pod-network.sock`) through which a caller on
the machine opens a TCP connection to any pod address (send_request).

Files: a mount namespace per pod (`unshare --mount --propagation private`): each volume is made
in the pod's folder (ConfigMap and Secret keys, the projected service-account token from the
TokenRequest API with kube-root-ca.crt and the namespace, emptyDir, hostPath under the node's
folder) and bind-mounted at its mountPath, read-only where the pod says; a mount point the machine
lacks is made in an overlay (its upper layer on a tmpfs of the pod's), so nothing is written to
the machine's folders. Env: the container's env and envFrom, valueFrom read from the twin's API,
plus what the kubelet adds (KUBERNETES_SERVICE_HOST/PORT, HOSTNAME). Command: the container's
command and args as rendered (an image's own entrypoint is not known here: such a pod is not run).
PATH: the engines' CPU virtualenv (sglang-router and its Python) behind a `python3` that runs the
engine stand-in for `-m sglang.launch_server` and the virtualenv's python3 for anything else.

A started pod is annotated `twin.pdstack.dev/process: running` (its probes can then be run
against it). A process that exits is reported with the end of its log (PodProcesses.check).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from twin import build, kv_libraries, netns
from infra import naming
from twin.api import POD_CIDR, SERVICE_CIDR, TwinError, kubectl
from twin.kubelet import CONNECTED
from twin.paths import KUBECONFIG, ROOT, RUN_DIR, private_folder, script_module
from twin.process import dying_with_parent

PROCESS_ANNOTATION = "twin.pdstack.dev/process"
NAME_LABEL = "app.kubernetes.io/name"
POD_NETWORK = ipaddress.ip_network(POD_CIDR, strict=False)
KUBERNETES_SERVICE_IP = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))
KUBERNETES_SERVICE_PORT = 443
SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
STANDIN = ROOT / "twin" / "engine_standin.py"
PATH_TAIL = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLIENT_SOCKET = "pod-network.sock"
FOLDER = RUN_DIR / "pods"  # the pods' folders, the sockets and the logs of `python -m twin.pods run`
MOONCAKE_MASTER = "mooncake_master"  # the program the Mooncake master's pod runs (its rendered command)
MOONCAKE_WHEEL = "mooncake-transfer-engine"  # PyPI's wheel carries mooncake/mooncake_master and its libraries
# PyPI's sha256 of the wheel pip picks here (cp311, manylinux x86_64) at each version the specs have pinned.
MOONCAKE_WHEEL_SHA256 = {"0.3.8.post1": "49eba9348de1acebec104e77ec65ae5f02e94ead50890839dddf351cd8dc6278",
                         "0.3.13.post1": "81e6d425a097b4915bdc9efbe2fe89d779dc2bd70e48a5a69c248cc9b250bafe"}
PICKER_PROGRAM = "/app/epp"  # the endpoint picker's entry point in its image (llm-d-inference-scheduler)
PICKER_BUILT = "epp"  # its name in twin/build.py PROGRAMS


def _netns_inode(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _await_netns_of_its_own(proc: subprocess.Popen, what: str) -> None:
    """Until `proc` (started by `unshare --net`) is in a network namespace other than ours: a
    command aimed at its namespace before then would change the machine's network."""
    ours = _netns_inode("self")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TwinError(f"{what} exited ({proc.returncode}) before its network namespace was made")
        try:
            if _netns_inode(proc.pid) != ours:
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise TwinError(f"{what} was not in a network namespace of its own within 60 s")


def _inside(pid: int, *command: str) -> None:
    """Run `command` in the network namespace of `pid`, which must not be ours (the machine's)."""
    if _netns_inode(pid) == _netns_inode("self"):
        raise TwinError(f"refused: process {pid} is in the machine's network namespace ({' '.join(command)})")
    done = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", *command], capture_output=True, text=True)
    if done.returncode:
        raise TwinError(f"{' '.join(command)} (in {pid}'s network namespace): {done.stderr.strip()}")


def _spawn(argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(dying_with_parent(argv), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd)


class PodNetwork:
    """The hub namespace and one namespace per pod, wired by veths to the hub's bridge. One per
    folder: where a hub already serves the folder (the twin's own, which its supervisor starts for
    the pods of its controllers, twin/cluster.py), it is joined, and left running by stop()."""

    def __init__(self, folder: Path, apiserver_port: int):
        self.folder = folder
        self.client_socket = folder / CLIENT_SOCKET
        self.hub_pid_file = folder / "hub.pid"
        self.joined = _connects(self.client_socket) and self.hub_pid_file.is_file()
        if self.joined:
            self.hub_pid = int(self.hub_pid_file.read_text())
            return
        self.tunnel = netns.forward_unix_to_tcp(folder / "apiserver.sock", apiserver_port)
        self.client_socket.unlink(missing_ok=True)
        self.hub = _spawn(["unshare", "--net", "--", sys.executable, "-m", "twin.pods", "hub",
                           "--apiserver-socket", str(folder / "apiserver.sock"),
                           "--machine-netns", str(_netns_inode("self")),
                           "--client-socket", str(self.client_socket)],
                          folder / "hub.log", env={**os.environ, "PYTHONPATH": str(ROOT)})
        _await_netns_of_its_own(self.hub, "the pod network's hub")
        deadline = time.monotonic() + 60
        while not _connects(self.client_socket):
            if self.hub.poll() is not None or time.monotonic() > deadline:
                raise TwinError(f"the pod network's hub did not start: {_tail(folder / 'hub.log')}")
            time.sleep(0.05)
        self.hub_pid = self.hub.pid
        self.hub_pid_file.write_text(f"{self.hub_pid}\n")

    def attach(self, ip: str, log: Path) -> subprocess.Popen:
        """A network namespace holding `ip`, on the hub's bridge; its holder process is returned."""
        if ipaddress.ip_address(ip) not in POD_NETWORK:
            raise TwinError(f"pod IP {ip} is outside the twin's pod network {POD_NETWORK}")
        holder = _spawn(["unshare", "--net", "--", "sleep", "infinity"], log)
        _await_netns_of_its_own(holder, f"the network namespace of {ip}")
        veth = _veth(ip)
        self.detach(ip)  # an earlier pod's at this address (the cluster gave it out again)
        _inside(self.hub_pid, "ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(holder.pid))
        _inside(self.hub_pid, "ip", "link", "set", veth, "master", "br0", "up")
        for command in (("ip", "link", "set", "lo", "up"),
                        ("ip", "addr", "add", f"{ip}/{POD_NETWORK.prefixlen}", "dev", "eth0"),
                        ("ip", "link", "set", "eth0", "up"),
                        ("ip", "route", "add", SERVICE_CIDR, "dev", "eth0")):
            _inside(holder.pid, *command)
        return holder

    def detach(self, ip: str) -> None:
        """Remove the hub's end of the veth of `ip`, if there is one (its pair goes with it). Ending a
        pod's processes is not enough: the kernel frees a network namespace, and the veth with it,
        in a work queue of its own after the last process left (net/core/net_namespace.c
        cleanup_net), which on a loaded machine lagged behind the next pod given the same address
        ("RTNETLINK answers: File exists")."""
        if not Path(f"/proc/{self.hub_pid}").exists():  # the hub is gone, and its bridge and veths with it
            return
        done = subprocess.run(["nsenter", f"--net=/proc/{self.hub_pid}/ns/net", "--", "ip", "link", "del", _veth(ip)],
                              capture_output=True, text=True)
        if done.returncode and "Cannot find device" not in done.stderr:
            raise TwinError(f"ip link del {_veth(ip)} (in the hub's network namespace): {done.stderr.strip()}")

    def stop(self) -> None:
        if self.joined:  # its owner stops it
            return
        _stop(self.hub)
        self.tunnel.close()
        self.client_socket.unlink(missing_ok=True)  # no hub answers there now (twin/kubelet.py dials it)
        self.hub_pid_file.unlink(missing_ok=True)


def _veth(ip: str) -> str:
    """The hub's end of a pod address's veth: "v" and the address in hex (at most 15 characters)."""
    return "v" + ipaddress.ip_address(ip).packed.hex()


def hub_main(apiserver_socket: Path, client_socket: Path, machine_netns: int) -> int:
    """Inside the hub's namespace: the bridge, the `kubernetes` Service's address, and the two sockets."""
    if _netns_inode("self") == machine_netns:
        print("twin.pods hub: refused, not in a network namespace of its own", file=sys.stderr)
        return 1
    for command in (("ip", "link", "set", "lo", "up"), ("ip", "link", "add", "br0", "type", "bridge"),
                    ("ip", "link", "set", "br0", "up"),
                    ("ip", "addr", "add", f"{KUBERNETES_SERVICE_IP}/32", "dev", "br0"),
                    ("ip", "route", "add", str(POD_NETWORK), "dev", "br0")):
        subprocess.run(command, check=True)
    service = socket.create_server((KUBERNETES_SERVICE_IP, KUBERNETES_SERVICE_PORT))
    threading.Thread(target=netns._serve, args=(service, lambda: netns._unix(apiserver_socket)), daemon=True).start()
    clients = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    clients.bind(str(client_socket))
    client_socket.chmod(0o600)
    clients.listen(64)
    threading.Thread(target=_serve_clients, args=(clients,), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def _serve_clients(listener: socket.socket) -> None:
    """Each connection names its pod address on its first line ("10.244.0.3:8000\\n"), then is piped there."""
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_connect_client, args=(client,), daemon=True).start()


def _connect_client(client: socket.socket) -> None:
    line = b""
    while not line.endswith(b"\n") and len(line) < 64:
        got = client.recv(1)
        if not got:
            client.close()
            return
        line += got
    # "?<ip>:<port>": the caller (twin/kubelet.py dial, a TCP probe) is told the connection opened
    asked, confirm = line.decode().strip(), line.startswith(b"?")
    host, _, port = asked.removeprefix("?").rpartition(":")
    try:
        if ipaddress.ip_address(host) not in POD_NETWORK:
            raise ValueError(host)
        upstream = socket.create_connection((host, int(port)), timeout=10)
        upstream.settimeout(None)
    except (OSError, ValueError):
        client.close()
        return
    if confirm:
        client.sendall(CONNECTED)
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=netns._pipe, args=(a, b), daemon=True).start()


def _connects(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
        return True
    except OSError:
        return False


class PodConnection(http.client.HTTPConnection):
    """HTTP to a pod address, through the hub's client socket."""

    def __init__(self, client_socket: Path, ip: str, port: int, timeout: float = 60):
        super().__init__(ip, port, timeout=timeout)
        self.client_socket = client_socket

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.client_socket))
        self.sock.sendall(f"{self.host}:{self.port}\n".encode())


def forward(client_socket: Path, ip: str, port: int) -> tuple[socket.socket, int]:
    """A listener on a free loopback port of the machine whose connections go to ip:port in the pod
    network (through the hub's client socket, as PodConnection); the listener and its port."""
    def connect() -> socket.socket:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(str(client_socket))
        upstream.sendall(f"{ip}:{port}\n".encode())
        return upstream
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=netns._serve, args=(listener, connect), daemon=True).start()
    return listener, listener.getsockname()[1]


# --- a pod's files, env and command, as a kubelet makes them ---------------------------------

def get_object(kind: str, name: str, namespace: str, kubeconfig: Path) -> dict | None:
    """The object, or None where the API has none."""
    got = kubectl("get", kind, name, "-n", namespace, "-o", "json", kubeconfig_path=kubeconfig, check=False)
    return json.loads(got.stdout) if got.returncode == 0 else None


def _keys(obj: dict) -> dict[str, bytes]:
    """A ConfigMap's or Secret's keys and their bytes."""
    keys = {k: v.encode() for k, v in (obj.get("data") or {}).items()} if obj["kind"] == "ConfigMap" else {}
    encoded = obj.get("binaryData") if obj["kind"] == "ConfigMap" else obj.get("data")
    keys.update({k: base64.b64decode(v) for k, v in (encoded or {}).items()})
    return keys


def _write_keys(folder: Path, keys: dict[str, bytes], items: list | None, mode: int) -> None:
    wanted = [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else [(k, k, mode) for k in keys]
    for key, path, file_mode in wanted:
        if key not in keys:
            raise TwinError(f"key {key} is not there")
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(keys[key])
        target.chmod(file_mode)


def _field(pod: dict, path: str) -> str:
    """A downward-API fieldRef (metadata.name, status.podIP, metadata.labels['x'], ...)."""
    for prefix in ("metadata.labels", "metadata.annotations"):
        if path.startswith(prefix + "["):
            return pod["metadata"].get(prefix.split(".")[1], {}).get(path[len(prefix) + 2:-2], "")
    where: object = pod
    for part in path.split("."):
        where = where.get(part, "") if isinstance(where, dict) else ""
    return str(where)


def _make_volumes(pod: dict, folder: Path, kubeconfig: Path) -> dict[str, Path]:
    namespace, volumes = pod["metadata"]["namespace"], {}
    for volume in pod["spec"].get("volumes", []):
        name = volume["name"]
        where = private_folder(folder / "volumes" / name)
        if "configMap" in volume or "secret" in volume:
            ref = volume.get("configMap") or volume["secret"]
            kind, ref_name = ("configmap", ref["name"]) if "configMap" in volume else ("secret", ref["secretName"])
            obj = get_object(kind, ref_name, namespace, kubeconfig)
            if obj is None:
                if ref.get("optional"):
                    continue
                raise TwinError(f"volume {name}: {kind} {namespace}/{ref_name} does not exist")
            _write_keys(where, _keys(obj), ref.get("items"), ref.get("defaultMode", 0o644))
        elif "projected" in volume:
            for source in volume["projected"]["sources"]:
                mode = volume["projected"].get("defaultMode", 0o644)
                if "serviceAccountToken" in source:
                    token = source["serviceAccountToken"]
                    made = kubectl("create", "token", pod["spec"].get("serviceAccountName", "default"), "-n", namespace,
                                   "--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
                                   f"--bound-object-uid={pod['metadata']['uid']}",
                                   f"--duration={token.get('expirationSeconds', 3607)}s",
                                   *([f"--audience={token['audience']}"] if token.get("audience") else []),
                                   kubeconfig_path=kubeconfig)
                    _write_keys(where, {"token": made.stdout.strip().encode()}, None, mode)
                elif "configMap" in source or "secret" in source:
                    ref = source.get("configMap") or source["secret"]
                    obj = get_object("configmap" if "configMap" in source else "secret", ref["name"], namespace, kubeconfig)
                    if obj is None:
                        if ref.get("optional"):
                            continue
                        raise TwinError(f"volume {name}: {ref['name']} in {namespace} does not exist")
                    _write_keys(where, _keys(obj), ref.get("items"), mode)
                elif "downwardAPI" in source:
                    _write_keys(where, {i["path"]: _field(pod, i["fieldRef"]["fieldPath"]).encode()
                                        for i in source["downwardAPI"]["items"]}, None, mode)
        elif "emptyDir" in volume or "persistentVolumeClaim" in volume:
            pass  # the folder itself (a claim's volume is local to its pod here: the kubelet checked it is bound)
        elif "hostPath" in volume:
            node_path = folder.parent / "nodes" / pod["spec"]["nodeName"] / volume["hostPath"]["path"].lstrip("/")
            node_path.mkdir(parents=True, exist_ok=True)
            where.rmdir()
            where = node_path
        else:
            raise TwinError(f"volume {name}: kind {sorted(set(volume) - {'name'})} is not made by the twin")
        volumes[name] = where
    return volumes


def _env(pod: dict, container: dict, kubeconfig: Path, path: str) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env = {"PATH": path, "HOSTNAME": pod["metadata"]["name"], "HOME": "/root",
           "KUBERNETES_SERVICE_HOST": KUBERNETES_SERVICE_IP, "KUBERNETES_SERVICE_PORT": str(KUBERNETES_SERVICE_PORT),
           "KUBERNETES_SERVICE_PORT_HTTPS": str(KUBERNETES_SERVICE_PORT),
           "KUBERNETES_PORT": f"tcp://{KUBERNETES_SERVICE_IP}:{KUBERNETES_SERVICE_PORT}"}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        obj = get_object("configmap" if "configMapRef" in source else "secret", ref["name"], namespace, kubeconfig)
        if obj is None:
            if ref.get("optional"):
                continue
            raise TwinError(f"envFrom: {ref['name']} in {namespace} does not exist")
        env.update({source.get("prefix", "") + k: v.decode() for k, v in _keys(obj).items()})
    for var in container.get("env", []):
        if "valueFrom" not in var:
            env[var["name"]] = var.get("value", "")
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            ref = source.get("configMapKeyRef") or source["secretKeyRef"]
            obj = get_object("configmap" if "configMapKeyRef" in source else "secret", ref["name"], namespace, kubeconfig)
            keys = _keys(obj) if obj else {}
            if ref["key"] in keys:
                env[var["name"]] = keys[ref["key"]].decode()
            elif not ref.get("optional"):
                raise TwinError(f"env {var['name']}: key {ref['key']} of {ref['name']} in {namespace} does not exist")
        elif "resourceFieldRef" in source:
            resource = source["resourceFieldRef"]["resource"]
            kind, _, what = resource.partition(".")
            env[var["name"]] = str(container.get("resources", {}).get(kind, {}).get(what, "0"))
    return env


def _mounts(container: dict, volumes: dict[str, Path]) -> list[dict]:
    mounts = []
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volumes:
            continue  # an optional source that does not exist
        source = volumes[mount["name"]] / mount.get("subPath", "")
        if not source.exists():
            source.mkdir(parents=True)  # a subPath the volume lacks: the kubelet makes it a folder
        mounts.append({"source": str(source), "target": mount["mountPath"], "read_only": bool(mount.get("readOnly"))})
    return mounts


def enter_main(spec_file: Path) -> int:
    """Inside the pod's new mount namespace: mount its volumes, then become its program."""
    spec = json.loads(spec_file.read_text())
    scratch = Path(spec["scratch"])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(scratch)], check=True)
    # A mount point in a top-level folder the machine lacks (Prometheus's /prometheus) is made in a
    # root of the pod's own, entered before the program starts: the machine's top-level entries,
    # each mount below made first, bound into a tmpfs beside the new folder (twin/netns.py
    # _root_with). The machine's / gets nothing.
    lacking = {Path(m["target"]).parts[1] for m in spec["mounts"]
               if not os.path.lexists(Path("/", Path(m["target"]).parts[1]))}
    in_root = [m for m in spec["mounts"] if Path(m["target"]).parts[1] in lacking]
    mounts = [m for m in spec["mounts"] if m not in in_root]
    # every mount point first, then the binds: an overlay made after a bind beneath it would hide it
    overlays: list[str] = []
    for mount in mounts:
        target = Path(mount["target"])
        if os.path.lexists(target):
            continue
        ancestor = os.path.realpath(next(p for p in target.parents if p.exists()))
        if not any(ancestor == o or ancestor.startswith(o + "/") for o in overlays):
            upper, work = scratch / f"upper{len(overlays)}", scratch / f"work{len(overlays)}"
            upper.mkdir()
            work.mkdir()
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={ancestor},upperdir={upper},workdir={work}", ancestor], check=True)
            overlays.append(ancestor)
        _mount_point(target, Path(mount["source"]))
    for mount in mounts:
        _bind(mount["source"], mount["target"], mount["read_only"])
    if in_root:
        root = netns._root_with({}, scratch / "root")
        for mount in in_root:
            target = root / mount["target"].lstrip("/")
            _mount_point(target, Path(mount["source"]))
            _bind(mount["source"], str(target), mount["read_only"])
        os.chroot(root)
    os.chdir(spec["workdir"])
    argv = spec["argv"]
    program = spec.get("program") or shutil.which(argv[0], path=spec["env"].get("PATH")) or argv[0]
    os.execve(program, argv, spec["env"])


def _mount_point(target: Path, source: Path) -> None:
    if source.is_dir():
        target.mkdir(parents=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()


def _bind(source: str, target: str, read_only: bool) -> None:
    subprocess.run(["mount", "--bind", source, target], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def runs_as(pod: dict) -> str | None:
    """What the twin runs for a pod: its role for an engine pod (the stand-in), "router" for the
    router's (sglang-router, or the picker when built), "mooncake-master" for the KV cache's master
    (the pinned wheel's binary); None for a pod it does not run (see not_runnable)."""
    return None if not_runnable(pod) else _kind(pod)


def _kind(pod: dict) -> str | None:
    labels = pod["metadata"].get("labels", {})
    if naming.ROLE_LABEL in labels:
        return labels[naming.ROLE_LABEL]
    return labels.get(NAME_LABEL) if labels.get(NAME_LABEL) in (naming.ROUTER, naming.MOONCAKE_MASTER) else None


def not_runnable(pod: dict) -> str | None:
    """Why the twin starts no process for this pod, or None when it does. Pure: the pod's own
    labels and first container's command decide (twin/build.py's PROGRAMS for the picker)."""
    container = pod["spec"]["containers"][0]
    command = container.get("command") or []
    kind = _kind(pod)
    if not command:
        return f"no command (the entry point of {container.get('image', 'its image')} is not known to the twin)"
    if command[0] == PICKER_PROGRAM and PICKER_BUILT not in build.PROGRAMS:
        return f"the endpoint picker ({PICKER_PROGRAM}): twin/build.py builds no {PICKER_BUILT} program"
    if kind == naming.MOONCAKE_MASTER and command[0] != MOONCAKE_MASTER:
        return f"the Mooncake master runs {command[0]}, not the pinned wheel's {MOONCAKE_MASTER}"
    if kind is None:
        return f"{command[0]}: no program of the twin's stands for it (router, engine stand-in, Mooncake master)"
    return None


def _engines_venv() -> Path:
    """The engines' CPU virtualenv (sglang-router 0.3.2 and sglang 0.5.23 from their pinned wheels),
    built once into the machine's cache by scripts/extract_engine_flags.py."""
    return script_module("extract_engine_flags").engine_venv()


def mooncake_master(version: str, folder: Path) -> tuple[Path, dict[str, str]]:
    """`mooncake_master` of the pinned Mooncake: the `mooncake-transfer-engine` wheel at `version`
    (PyPI, checked against its sha256, cached by scripts/pinned_wheels.py) unpacked into `folder`
    (mooncake/mooncake_master and its bundled mooncake_transfer_engine.libs/), and the environment
    it runs in (LD_LIBRARY_PATH to those libraries; it links the system's libibverbs, which
    scripts/install-system-deps installs)."""
    if version not in MOONCAKE_WHEEL_SHA256:
        raise TwinError(f"Mooncake {version}: no sha256 of its wheel is pinned (twin/pods.py MOONCAKE_WHEEL_SHA256)")
    wheel = script_module("pinned_wheels").pinned_wheel(MOONCAKE_WHEEL, version)
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != MOONCAKE_WHEEL_SHA256[version]:
        raise TwinError(f"{wheel} is not the pinned wheel of {MOONCAKE_WHEEL} {version} (its sha256 differs)")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(folder, [n for n in z.namelist() if n == f"mooncake/{MOONCAKE_MASTER}"
                              or n.startswith("mooncake_transfer_engine.libs/")])
    binary = folder / "mooncake" / MOONCAKE_MASTER
    binary.chmod(0o755)
    return binary, {"LD_LIBRARY_PATH": str(folder / "mooncake_transfer_engine.libs")}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Started:
    namespace: str
    name: str
    ip: str
    role: str  # runs_as(pod): prefill, decode, ... or router
    holder: subprocess.Popen
    process: subprocess.Popen
    log: Path


class PodProcesses:
    """The pods of some namespaces, started as processes at their addresses (see the module's docstring).
    Every process dies with the one that made this (parent-death signal); stop() ends them."""

    def __init__(self, kubeconfig: Path = KUBECONFIG, folder: Path | None = None):
        self.kubeconfig = kubeconfig
        self.folder = private_folder(folder or FOLDER)
        server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        self.network = PodNetwork(self.folder, int(server.rsplit(":", 1)[1]))
        self.venv = _engines_venv()
        self.bin = private_folder(self.folder / "bin")
        self.bin.chmod(0o755)
        checker = self.folder / "engine-checker.sock"
        self.checker: subprocess.Popen | None = None  # started with the first engine pod (engine_standin.py)
        self.start_checker = lambda: _spawn([str(self.venv / "bin" / "python"), str(STANDIN), "--serve-checks",
                                             str(checker)], self.folder / "engine-checker.log")
        # the stand-in runs with the KV transfer libraries (written with the checker: twin/kv_libraries.py)
        self.kv_env = self.folder / "kv-libraries.env"
        standin = f"{self.venv}/bin/python {STANDIN} --checker {checker}"
        shim = (f"#!/bin/sh\n# the engine's entry point runs the twin's stand-in; any other python3 is the engines' "
                f"virtualenv's (sglang-router's)\nif [ \"${{1:-}}\" = -m ] && [ \"${{2:-}}\" = sglang.launch_server ]; "
                f"then shift 2; . {self.kv_env}; exec {standin} sglang \"$@\"; fi\n"
                f"exec {self.venv}/bin/python3 \"$@\"\n")
        vllm = (f"#!/bin/sh\n# `vllm serve` runs the twin's stand-in\nif [ \"${{1:-}}\" = serve ]; then shift; "
                f". {self.kv_env}; exec {standin} vllm \"$@\"; fi\nexec {self.venv}/bin/vllm \"$@\"\n")
        for name, text in (("python3", shim), ("python", shim), ("vllm", vllm)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.started: list[Started] = []
        self.not_runnable: dict[str, str] = {}  # "namespace/name" -> why no process was started (not_runnable)
        # The fleet model per engine build: image -> the token timing its stand-ins start with
        # ({"TWIN_STANDIN_TTFT_MS": "2500"}, engine_standin.py reads it), so a revision whose render
        # names another image (a slow build) is slow by what its pods carry.
        self.token_timing: dict[str, dict[str, str]] = {}
        # What runs a pod's init containers before its main container (twin/init_containers.py
        # InitContainers, which a caller sets with the object store their fetch reaches); None: not run.
        self.init_containers = None

    def start(self, namespace: str, select=lambda pod: True, timeout: float = 300) -> list[Started]:
        """Start every pod of `namespace` the twin runs (runs_as) that `select(pod)` also picks, once
        each has its IP; the others `select` picks are kept in `not_runnable` with the reason."""
        deadline = time.monotonic() + timeout
        while True:
            listed = [p for p in json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json",
                                                    kubeconfig_path=self.kubeconfig).stdout)["items"]
                      if select(p) and "deletionTimestamp" not in p["metadata"]]
            pods = [p for p in listed if runs_as(p)]
            self.not_runnable.update({f"{namespace}/{p['metadata']['name']}": not_runnable(p)
                                      for p in listed if not runs_as(p)})
            if pods and all(p.get("status", {}).get("podIP") for p in pods):
                break
            if time.monotonic() > deadline:
                if not pods:
                    raise TwinError(f"no router or engine pod in {namespace} after {timeout:.0f} s")
                raise TwinError(f"pods in {namespace} without an IP after {timeout:.0f} s: "
                                + ", ".join(p["metadata"]["name"] for p in pods if not p.get("status", {}).get("podIP")))
            time.sleep(0.5)
        return [self.start_pod(p) for p in pods]

    def start_pod(self, pod: dict, container_name: str | None = None, entrypoint: list[str] | None = None,
                  init=None) -> Started:
        """Start one container of the pod (`container_name`, default its first) at the pod's address.
        `entrypoint`: the command its image runs where the pod names none (the caller knows the
        image); `init(volumes)`: what its init containers do to its volumes (name -> folder),
        called before it starts."""
        meta = pod["metadata"]
        folder = self.folder / f"{meta['namespace']}_{meta['name']}"
        shutil.rmtree(folder, ignore_errors=True)  # an earlier start's keys, token and logs
        private_folder(folder)
        container = next(c for c in pod["spec"]["containers"] if c["name"] == (container_name or c["name"]))
        command = container.get("command") or entrypoint
        if not command:
            raise TwinError(f"{meta['namespace']}/{meta['name']}: no command in the pod (the image's entrypoint is "
                            "not known to the twin)")
        volumes = _make_volumes(pod, folder, self.kubeconfig)
        if init:
            init(volumes)
        path = f"{self.bin}:{self.venv}/bin:{PATH_TAIL}"
        if runs_as(pod) == naming.MOONCAKE_MASTER:
            path = f"{self.mooncake_bin(container['image'])}:{path}"
        elif runs_as(pod) not in (naming.ROUTER, None) and self.checker is None:
            self.checker = self.start_checker()
            kv_libraries.write_env(self.kv_env)
        ip = pod["status"]["podIP"]
        log = folder / f"{container['name']}.log"
        holder = self.network.attach(ip, folder / "netns.log")
        if self.init_containers:  # they run first, in order, and the main container only after all exit 0
            try:
                self.init_containers.run(self, pod, folder, volumes, holder)
            except BaseException:
                _stop(holder)
                self.network.detach(ip)
                raise
        process = self.spawn_container(pod, container, command, volumes, folder, holder, path, log)
        started = Started(meta["namespace"], meta["name"], ip, runs_as(pod) or container["name"], holder, process, log)
        self.started.append(started)
        kubectl("annotate", "pod", meta["name"], "-n", meta["namespace"], "--overwrite",
                f"{PROCESS_ANNOTATION}=running", kubeconfig_path=self.kubeconfig)
        return started

    def spawn_container(self, pod: dict, container: dict, command: list[str], volumes: dict[str, Path], folder: Path,
                        holder: subprocess.Popen, path: str, log: Path, mounts: tuple[dict, ...] = ()) -> subprocess.Popen:
        """One container of the pod as a process in the network namespace of `holder` and a mount
        namespace of its own: its command and args, its env (PATH `path`) and its volumes mounted
        (`mounts`: more, as `_mounts` gives them); its output into `log`."""
        spec_file = folder / f"enter-{container['name']}.json"
        spec_file.write_text(json.dumps({
            "scratch": str(private_folder(folder / f"scratch-{container['name']}")),
            "mounts": [*_mounts(container, volumes), *mounts],
            "workdir": container.get("workingDir", "/"), "argv": [*command, *container.get("args", [])],
            # the picker's image entry point (/app/epp) runs the twin's build of it, argv unchanged
            "program": str(build.program(PICKER_BUILT)) if command[0] == PICKER_PROGRAM else None,
            "env": {**_env(pod, container, self.kubeconfig, path), **self.token_timing.get(container["image"], {})}}))
        spec_file.chmod(0o600)
        return _spawn(["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--", "unshare", "--mount",
                       "--propagation", "private", "--", sys.executable, "-m", "twin.pods", "enter", str(spec_file)],
                      log, env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", PATH_TAIL)})

    def mooncake_bin(self, image: str) -> Path:
        """A folder whose `mooncake_master` runs the pinned wheel's binary at the version the pod's
        image is tagged with (kvcacheai/mooncake:v<version>), with the libraries it needs."""
        version = image.split("@")[0].rsplit(":", 1)[-1].removeprefix("v")
        folder = self.folder / f"mooncake-{version}"
        wrapper = folder / "bin" / MOONCAKE_MASTER
        if not wrapper.exists():
            binary, env = mooncake_master(version, private_folder(folder))
            private_folder(folder / "bin").chmod(0o755)
            wrapper.write_text(f"#!/bin/sh\nLD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} exec {binary} \"$@\"\n")
            wrapper.chmod(0o755)
        return wrapper.parent

    def check(self) -> None:
        """Raise if a started process has exited, with its reason (the end of its log)."""
        for pod in self.started:
            if pod.process.poll() is not None:
                raise TwinError(f"pod {pod.namespace}/{pod.name} ({pod.role}): its process exited with "
                                f"{pod.process.returncode}; the end of its log ({pod.log}):\n{_tail(pod.log)}")

    def request(self, ip: str, port: int, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
        return request(self.network.client_socket, ip, port, path, body, timeout)

    def stop_pod(self, pod: Started) -> None:
        """End one started pod's process (its pod deleted, say)."""
        _stop(pod.process)
        _stop(pod.holder)
        self.network.detach(pod.ip)
        kubectl("annotate", "pod", pod.name, "-n", pod.namespace, f"{PROCESS_ANNOTATION}-",
                kubeconfig_path=self.kubeconfig, check=False)  # nothing serves it now
        self.started.remove(pod)

    def stop_pods(self) -> None:
        """End the started pods' processes; the pod network and the engine checker stay for the next."""
        for pod in reversed(list(self.started)):
            self.stop_pod(pod)
        self.not_runnable.clear()

    def stop(self) -> None:
        self.stop_pods()
        if self.init_containers:
            self.init_containers.stop()
        if self.checker:
            _stop(self.checker)
        self.network.stop()


def start_processes(namespace: str, kubeconfig: Path = KUBECONFIG, folder: Path | None = None) -> PodProcesses:
    """The router and engine pods of `namespace`, started at their addresses (see PodProcesses)."""
    processes = PodProcesses(kubeconfig, folder)
    try:
        processes.start(namespace)
    except BaseException:
        processes.stop()
        raise
    return processes


def request(client_socket: Path, ip: str, port: int, path: str, body: dict | None = None,
            timeout: float = 60) -> tuple[int, str]:
    """One HTTP request to a pod address (GET, or POST of `body` as JSON): its status and text."""
    connection = PodConnection(client_socket, ip, port, timeout)
    try:
        connection.request("POST" if body is not None else "GET", path,
                           body=json.dumps(body) if body is not None else None,
                           headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read().decode(errors="replace")
    finally:
        connection.close()


CHAT = {"messages": [{"role": "user", "content": "Say hello from the twin."}], "max_tokens": 8}


def send_request(namespace: str, kubeconfig: Path = KUBECONFIG, folder: Path = FOLDER, timeout: float = 300,
                 check=lambda: None) -> dict:
    """One chat request to a running router pod of `namespace` (started by PodProcesses, whose
    folder is `folder`), at its pod address and `http` port, for the model the router lists; retried
    until the router has found its workers (service discovery, health checks). The answer, as JSON.
    `check()` is called between tries (PodProcesses.check: a process that exited ends the wait)."""
    deadline = time.monotonic() + timeout
    while not (routers := [p for p in json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json",
                                                         kubeconfig_path=kubeconfig).stdout)["items"]
                           if runs_as(p) == naming.ROUTER
                           and p["metadata"].get("annotations", {}).get(PROCESS_ANNOTATION) == "running"]):
        check()
        if time.monotonic() > deadline:
            raise TwinError(f"no router pod runs in {namespace} after {timeout:.0f} s: start them (python -m "
                            f"twin.pods run --namespace {namespace})")
        time.sleep(1)
    ip = routers[0]["status"]["podIP"]
    if (routers[0]["spec"]["containers"][0].get("command") or [""])[0] == PICKER_PROGRAM:
        raise TwinError(f"the router {namespace}/{routers[0]['metadata']['name']} is the endpoint picker (gateway_epp), "
                        "which a gateway asks over ext_proc (twin/endpoint_picker.py, as tests/twin/"
                        "test_requests_on_twin.py does); `request` sends to sglang-router only")
    port = next(p["containerPort"] for c in routers[0]["spec"]["containers"] for p in c.get("ports", [])
                if p.get("name") == "http")
    said = ""
    while time.monotonic() < deadline:
        check()
        try:
            status, said = request(folder / CLIENT_SOCKET, ip, port, "/v1/models")
            if status == 200 and json.loads(said).get("data"):
                model = json.loads(said)["data"][0]["id"]
                status, said = request(folder / CLIENT_SOCKET, ip, port, "/v1/chat/completions", {**CHAT, "model": model})
                if status == 200:
                    return json.loads(said)
        except (OSError, ValueError) as exc:
            said = str(exc)
        time.sleep(1)
    raise TwinError(f"the router {namespace}/{routers[0]['metadata']['name']} at {ip}:{port} did not answer within "
                    f"{timeout:.0f} s; last: {said[:300]}")


def run(namespace: str) -> int:
    """`python -m twin.pods run`: start the pods of `namespace` and keep them until SIGTERM or Ctrl-C;
    exit 1, saying why, if one of their processes exits."""
    processes = start_processes(namespace)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"twin.pods: {len(processes.started)} pods of {namespace} running: " + ", ".join(
        f"{p.name} ({p.role}) at {p.ip}" for p in processes.started), flush=True)
    for name, why in sorted(processes.not_runnable.items()):
        print(f"twin.pods: {name} not run: {why}", flush=True)
    try:
        while not stopping.wait(1):
            processes.check()
        return 0
    except TwinError as exc:
        print(f"twin.pods: {exc}", file=sys.stderr)
        return 1
    finally:
        processes.stop()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m twin.pods")
    sub = parser.add_subparsers(dest="command", required=True)
    hub = sub.add_parser("hub", help=argparse.SUPPRESS)
    hub.add_argument("--apiserver-socket", type=Path, required=True)
    hub.add_argument("--client-socket", type=Path, required=True)
    hub.add_argument("--machine-netns", type=int, required=True)  # its inode: the hub must be elsewhere
    enter = sub.add_parser("enter", help=argparse.SUPPRESS)
    enter.add_argument("spec", type=Path)
    for name, what in (("run", "start the router and engine pods of a namespace as processes; keep them running"),
                       ("request", "send one chat request to the running router of a namespace; print the answer")):
        command = sub.add_parser(name, help=what)
        command.add_argument("--namespace", required=True)
    args = parser.parse_args()
    try:
        if args.command == "hub":
            return hub_main(args.apiserver_socket, args.client_socket, args.machine_netns)
        if args.command == "enter":
            return enter_main(args.spec)
        if args.command == "run":
            return run(args.namespace)
        print(json.dumps(send_request(args.namespace), indent=1))
        return 0
    except TwinError as exc:
        print(f"twin.pods: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
