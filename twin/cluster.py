"""Start and stop the cluster twin: a real control plane and real controllers on 127.0.0.1.

What runs (each built from the Go modules in twin/*/go.mod, see twin/build.py):
  etcd -> kube-apiserver -> kube-controller-manager, kube-scheduler -> kwok -> the CRDs ->
  LeaderWorkerSet's controller manager (its webhooks registered for the API server to call) ->
  Karpenter with its kwok cloud provider.

How it is supervised: `up()` starts one supervisor process (`python -m twin supervise`) in a
session of its own and waits until it says the twin is ready. The supervisor starts every
component as its child with the kernel's parent-death signal set, so if the supervisor dies,
even by SIGKILL, the components die with it; if any component exits, or a start step fails,
the supervisor stops all of them and records why. `down()` asks the supervisor to stop
(SIGTERM), and kills it if it does not. Nothing listens beyond 127.0.0.1; every port is picked
free at start, held until its component binds it (Ports), and written to .twin/run/state.json;
the kubeconfig is .twin/kubeconfig (context `pdstack-twin`).

One twin per state folder: `up()` takes the folder's lock (an flock on .twin/twin.lock) before
it touches anything, and hands its descriptor to the supervisor, which holds it for the twin's
life; a second `up` meanwhile is refused. The supervisor is known by its pid, its start time
and its holding that lock open (not by its command line, which any process may have), so a
state left behind by a dead twin never makes `status` report it or `down` signal another
process. etcd takes only clients with a certificate from its own CA, over TLS, as kubeadm
sets it up; every folder is 0700 and every private key 0600 from its creation (twin/pki.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from twin import build, crds, dataplane, egress, identities, kubelet, netns, pods
from twin.api import POD_CIDR, SERVICE_CIDR, TwinError, kubectl
from twin.paths import CONTEXT, KUBECONFIG, LOCK, ROOT, RUN_DIR, private_folder
from twin.pki import Authority, service_account_keys
from twin.process import dying_with_parent, has_open, identity

STATE = RUN_DIR / "state.json"
START_TIMEOUT = float(os.environ.get("PDSTACK_TWIN_START_TIMEOUT", 600))
ISSUER = "https://kubernetes.default.svc.cluster.local"


def _hold_port() -> socket.socket:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))  # and never listen(): see Ports
    return holder


@dataclass(frozen=True)
class Ports:
    """The twin's ports on 127.0.0.1.

    A port picked free and closed again may be picked again before its component binds it: by
    the next pick here (two components given one port) or by any other program. So each port is
    held from its pick until the supervisor exits, by a socket bound with SO_REUSEADDR that
    never listens (`held()`). While it is bound, the kernel gives that port to no other bind to
    port 0 and refuses it to any bind without SO_REUSEADDR, so the ports are distinct and no
    other program's pick lands on one; the component's listener may still bind it beside the
    holder, because it sets SO_REUSEADDR too (Go does on every TCP listener, net package,
    setDefaultListenerSockopts) and a socket that is not listening is no conflict between two
    that both set it (Linux inet_csk_bind_conflict; socket(7), SO_REUSEADDR). Holding closes the
    gap rather than recovering from it (a component restarted on another port would need every
    configuration naming the old one rewritten). What it cannot stop is a program that binds one
    of these ports by its number with SO_REUSEADDR set; no program picks one by chance."""
    etcd: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    lws_webhook: int
    lws_metrics: int
    lws_health: int
    prometheus_operator: int
    keda_metrics: int
    keda_health: int
    keda_metrics_service: int

    @classmethod
    def held(cls) -> tuple["Ports", list[socket.socket]]:
        """New ports and the sockets that hold them (keep them open until the components bind)."""
        holders = [_hold_port() for _ in fields(cls)]
        return cls(*(h.getsockname()[1] for h in holders)), holders


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, context: str = CONTEXT) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": context,
            "clusters": [{"name": context, "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": context, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context}}]}


class Supervisor:
    """Owns the components of one twin; runs in its own process (`python -m twin supervise`)."""

    def __init__(self, lock_fd: int, with_karpenter: bool = True):
        self.lock_fd = lock_fd  # the state folder's lock, held for the supervisor's life
        self.ports, self.port_holders = Ports.held()
        self.children: dict[str, subprocess.Popen] = {}
        self.with_karpenter = with_karpenter
        self.stopping = False
        self.pki = RUN_DIR / "pki"
        self.logs = RUN_DIR / "logs"

    # --- state, as the waiting `up()` and the tests read it ---------------------------------
    def record(self, phase: str, **extra) -> None:
        state = {"phase": phase, "supervisor_pid": os.getpid(), "supervisor_start": identity(os.getpid()),
                 "ports": asdict(self.ports),
                 "kubeconfig": str(KUBECONFIG), "context": CONTEXT,
                 "components": {name: p.pid for name, p in self.children.items()}, **extra}
        tmp = STATE.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(STATE)

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=RUN_DIR, env={**os.environ, **(env or {})})
        self.children[name] = proc
        self.record("starting", step=f"started {name}")
        return proc

    def wait_until(self, what: str, ready, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_children()
            try:
                if ready():
                    return
            except (OSError, ssl.SSLError, subprocess.SubprocessError, TwinError):
                pass
            time.sleep(0.5)
        raise TwinError(f"{what} was not ready within {timeout:.0f} s (logs: {self.logs})")

    def check_children(self) -> None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
                raise TwinError(f"{name} exited with {proc.returncode}; the end of its log "
                                f"({self.logs / (name + '.log')}):\n" + "\n".join(tail))

    def https_ok(self, port: int, path: str, client: tuple[Path, Path] | None = None,
                 ca: Path | None = None) -> bool:
        context = ssl.create_default_context(cafile=str(ca or self.pki / "ca.crt"))
        if client:
            context.load_cert_chain(str(client[0]), str(client[1]))
        context.check_hostname = False
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=context, timeout=5) as answer:
            return answer.status == 200

    # --- the start, step by step ----------------------------------------------------------
    def start(self) -> None:
        for folder in (self.pki, self.logs, RUN_DIR / "etcd"):
            private_folder(folder)
        self.record("starting", step="certificates")
        ca = Authority(self.pki)
        serving = ca.issue("apiserver", "kube-apiserver", server_names=(
            "127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local", "10.96.0.1"))
        admin = ca.issue("admin", "pdstack-twin-admin", groups=("system:masters",), client=True)
        kcm = ca.issue("controller-manager", "system:kube-controller-manager", client=True)
        sched = ca.issue("scheduler", "system:kube-scheduler", client=True)
        apiserver_client = ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                    groups=("kubeadm:cluster-admins",), client=True)
        webhook = ca.issue("lws-webhook", "lws-webhook", server_names=("127.0.0.1",))
        kcm_serving = ca.issue("controller-manager-serving", "kube-controller-manager", server_names=("127.0.0.1",))
        sched_serving = ca.issue("scheduler-serving", "kube-scheduler", server_names=("127.0.0.1",))
        sa = service_account_keys(self.pki)
        # the aggregator's identity towards extension API servers (KEDA's metrics API server), from
        # a CA of its own, as kubeadm makes it (pki/front-proxy-ca, front-proxy-client)
        front_proxy = Authority(self.pki / "front-proxy")
        front_proxy_client = front_proxy.issue("front-proxy-client", "front-proxy-client", client=True)
        # etcd's own CA and certificates, as kubeadm makes them (pki/etcd/)
        etcd_ca = Authority(self.pki / "etcd")
        # client use too, as kubeadm's: etcd's own JSON gateway (/v3/...) calls etcd with it
        etcd_server = etcd_ca.issue("server", "twin-etcd", server_names=("127.0.0.1", "localhost"), client=True)
        etcd_peer = etcd_ca.issue("peer", "twin-etcd", server_names=("127.0.0.1", "localhost"), client=True)
        etcd_probe = etcd_ca.issue("healthcheck-client", "twin-etcd-healthcheck-client", client=True)
        apiserver_etcd = etcd_ca.issue("apiserver-etcd-client", "kube-apiserver-etcd-client", client=True)
        server = f"https://127.0.0.1:{self.ports.apiserver}"

        def write_kubeconfig(path: Path, pair) -> Path:
            path.write_text(yaml.safe_dump(kubeconfig(server, ca.ca.cert, pair.cert, pair.key)))
            return path

        admin_kc = write_kubeconfig(KUBECONFIG, admin)
        kcm_kc = write_kubeconfig(RUN_DIR / "controller-manager.kubeconfig", kcm)
        sched_kc = write_kubeconfig(RUN_DIR / "scheduler.kubeconfig", sched)

        etcd_url, peer_url = f"https://127.0.0.1:{self.ports.etcd}", f"https://127.0.0.1:{self.ports.etcd_peer}"
        self.spawn("etcd", [str(build.program("etcd")), "--name=twin", f"--data-dir={RUN_DIR / 'etcd'}",
                            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                            f"--initial-cluster=twin={peer_url}",
                            # TLS both ways and a client certificate from etcd's CA, as kubeadm's etcd:
                            # anyone on the machine may connect to 127.0.0.1, and etcd holds the Secrets
                            f"--cert-file={etcd_server.cert}", f"--key-file={etcd_server.key}",
                            "--client-cert-auth=true", f"--trusted-ca-file={etcd_ca.ca.cert}",
                            f"--peer-cert-file={etcd_peer.cert}", f"--peer-key-file={etcd_peer.key}",
                            "--peer-client-cert-auth=true", f"--peer-trusted-ca-file={etcd_ca.ca.cert}",
                            # a throwaway store: no fsync, so a busy disk does not slow every write
                            "--unsafe-no-fsync", "--log-level=warn"])
        self.wait_until("etcd", lambda: self.https_ok(
            self.ports.etcd, "/health", (etcd_probe.cert, etcd_probe.key), ca=etcd_ca.ca.cert))

        # the API server reaches pod addresses through the twin's egress proxy (twin/egress.py)
        egress_flags, self.egress = egress.start(RUN_DIR)
        self.spawn("kube-apiserver", [
            str(build.program("kube-apiserver")),
            f"--etcd-servers={etcd_url}", f"--etcd-cafile={etcd_ca.ca.cert}",
            f"--etcd-certfile={apiserver_etcd.cert}", f"--etcd-keyfile={apiserver_etcd.key}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.ports.apiserver}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={ca.ca.cert}",
            f"--kubelet-client-certificate={apiserver_client.cert}", f"--kubelet-client-key={apiserver_client.key}",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            f"--service-account-key-file={sa.cert}", f"--service-account-signing-key-file={sa.key}",
            "--authorization-mode=Node,RBAC", f"--service-cluster-ip-range={SERVICE_CIDR}",
            # the defaults of the pinned kube-apiserver plus what kubeadm adds (README's admission
            # table); API priority and fairness is on, as by default
            "--enable-admission-plugins=NodeRestriction",
            # The `kubernetes` Service's endpoint would be 127.0.0.1, which Endpoints refuse.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false", *egress_flags,
            # the aggregation layer as kubeadm configures it
            f"--requestheader-client-ca-file={front_proxy.ca.cert}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={front_proxy_client.cert}", f"--proxy-client-key-file={front_proxy_client.key}"])
        self.wait_until("kube-apiserver", lambda: self.https_ok(
            self.ports.apiserver, "/readyz", (admin.cert, admin.key)))

        common = ["--bind-address=127.0.0.1", "--leader-elect=false", "--profiling=false"]
        self.spawn("kube-controller-manager", [
            str(build.program("kube-controller-manager")), f"--kubeconfig={kcm_kc}",
            f"--authentication-kubeconfig={kcm_kc}", f"--authorization-kubeconfig={kcm_kc}",
            f"--secure-port={self.ports.controller_manager}", *common,
            f"--tls-cert-file={kcm_serving.cert}", f"--tls-private-key-file={kcm_serving.key}",
            f"--service-account-private-key-file={sa.key}", f"--root-ca-file={ca.ca.cert}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={ca.ca.cert}", f"--cluster-signing-key-file={ca.ca.key}"])
        self.spawn("kube-scheduler", [
            str(build.program("kube-scheduler")), f"--kubeconfig={sched_kc}",
            f"--authentication-kubeconfig={sched_kc}", f"--authorization-kubeconfig={sched_kc}",
            f"--secure-port={self.ports.scheduler}", *common,
            f"--tls-cert-file={sched_serving.cert}", f"--tls-private-key-file={sched_serving.key}"])
        self.wait_until("kube-controller-manager", lambda: self.https_ok(self.ports.controller_manager, "/healthz"))
        self.wait_until("kube-scheduler", lambda: self.https_ok(self.ports.scheduler, "/healthz"))

        # the pod network (twin/pods.py), the twin's for its life: its controllers' pods run there (KEDA's
        # metrics API server), the tests' and `make up`'s pods join it, the egress proxy reaches into it
        self.pod_network = pods.PodNetwork(private_folder(pods.FOLDER), self.ports.apiserver)
        self.children["pod-network"] = self.pod_network.hub

        # each controller as its own ServiceAccount, with the RBAC its project publishes (twin/identities.py)
        kwok_kc = identities.start_as_own(identities.kwok_rbac(), admin_kc)
        self.spawn("kwok", [
            str(build.program("kwok")), f"--kubeconfig={kwok_kc}",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--server-address=127.0.0.1:{self.ports.kwok}", "--node-ip=127.0.0.1", f"--cidr={POD_CIDR}",
            *(f"--config={p}" for p in crds.kwok_stages())])
        # what a kubelet checks before it starts a pod, and its probes: kwok's pod-ready waits for it
        kubelet_kc = identities.run_as(kubelet.ACCOUNT, kubelet.ACCOUNT_NAMESPACE, kubelet.RBAC,
                                       origins=[kubelet.RBAC_ORIGIN], admin_kubeconfig=admin_kc)
        self.spawn("kubelet", [sys.executable, "-m", "twin.kubelet", str(kubelet_kc)], env={"PYTHONPATH": str(ROOT)})

        self.record("starting", step="CRDs")
        crds.apply_twin_crds(lambda *a, **k: kubectl(*a, kubeconfig_path=admin_kc, **k))

        lws_kc = identities.start_as_own(identities.lws_rbac(), admin_kc)
        self.spawn("lws-controller-manager", [
            str(build.program("lws-controller-manager")), f"--kubeconfig={lws_kc}",
            f"--config={self.lws_config(webhook)}"])
        self.wait_until("the LeaderWorkerSet webhook server", lambda: self.tls_listening(self.ports.lws_webhook))
        kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdstack-twin", "-f", "-",
                kubeconfig_path=admin_kc, input=yaml.safe_dump_all(
                    crds.lws_webhook_configurations(self.ports.lws_webhook, ca.pem)))

        dataplane.start(self, admin_kc)
        if self.with_karpenter:
            self.start_karpenter(admin_kc)
        self.record("ready")

    def tls_listening(self, port: int) -> bool:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1"):
                return True

    def lws_config(self, webhook) -> Path:
        """LWS's Configuration (config.lws.x-k8s.io/v1alpha1): its own certificate rotation off,
        serving the certificate made here on loopback, no leader election."""
        cert_dir = private_folder(self.pki / "lws-webhook")
        # links, not copies: a copy of the key would be made with the umask, then chmodded
        os.link(webhook.cert, cert_dir / "tls.crt")
        os.link(webhook.key, cert_dir / "tls.key")
        path = RUN_DIR / "lws-config.yaml"
        path.write_text(yaml.safe_dump({
            "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": self.ports.lws_webhook, "certDir": str(cert_dir)},
            "metrics": {"bindAddress": f"127.0.0.1:{self.ports.lws_metrics}"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.ports.lws_health}"}}))
        return path

    def start_karpenter(self, admin_kc: Path) -> None:
        """Karpenter binds its metrics and health ports on every interface, so it runs in a network
        namespace of its own (twin/netns.py) and reaches the API server through a Unix socket."""
        inside_port, namespace = 6443, "kube-system"
        kubeconfig_path = identities.start_as_own(identities.karpenter_rbac(namespace), admin_kc,
                                                  server=f"https://127.0.0.1:{inside_port}")
        tunnel = RUN_DIR / "karpenter-apiserver.sock"
        self.tunnel = netns.forward_unix_to_tcp(tunnel, self.ports.apiserver)
        self.spawn("karpenter", netns.argv(tunnel, inside_port, [
            str(build.program("karpenter-kwok"))]), env={
            "KUBECONFIG": str(kubeconfig_path), "SYSTEM_NAMESPACE": namespace, "DISABLE_LEADER_ELECTION": "true",
            "FEATURE_GATES": "StaticCapacity=true", "LOG_LEVEL": "info",
            "PYTHONPATH": str(ROOT),
            "INSTANCE_TYPES_FILE_PATH": str(self.karpenter_instance_types())})
        self.wait_until("karpenter", lambda: "Starting workers" in (self.logs / "karpenter.log").read_text(
            errors="replace"))

    def karpenter_instance_types(self) -> Path:
        from twin.karpenter import instance_types_file
        path = RUN_DIR / "karpenter-instance-types.json"
        path.write_text(json.dumps(instance_types_file(), indent=1) + "\n")
        return path

    # --- running and stopping ---------------------------------------------------------------
    def stop(self, *_):
        self.stopping = True

    def stop_children(self) -> None:
        for proc in reversed(list(self.children.values())):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.children.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def run(self) -> int:
        try:  # the lock `up` took for this supervisor: on its own descriptor, taking it again succeeds
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # then another twin owns this folder: write nothing in it
            print(f"twin: the supervisor does not hold the lock {LOCK} ({exc}); `python -m twin up` starts it",
                  file=sys.stderr)
            return 1
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            self.start()
            while not self.stopping:
                self.check_children()
                time.sleep(1)
            self.stop_children()
            self.record("stopped")
            return 0
        except BaseException as exc:  # every failure stops everything, and says why
            self.stop_children()
            self.record("failed", error="stopped while starting" if self.stopping else str(exc))
            return 1


# --- what `make twin-up`, `make twin-down` and the tests call -------------------------------

def read_state() -> dict | None:
    try:
        state = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def hold_lock() -> int:
    """The state folder's lock (an exclusive flock on LOCK), held while the returned descriptor, or a
    copy a child inherited, is open; the kernel drops it when the last holder dies."""
    private_folder(LOCK.parent)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        state = read_state() or {}
        raise TwinError(f"another twin holds {LOCK.parent} (a `twin up` still starting, or its supervisor: "
                        f"phase {state.get('phase', 'unknown')}, pid {state.get('supervisor_pid', 'unknown')}); "
                        "wait for it, or stop it with `python -m twin down`") from None
    return fd


def _is_supervisor(pid: int, state: dict) -> bool:
    """Whether `pid` is the process that wrote `state`: the same start on the same boot, and it
    holds this folder's lock open. A pid alone is any process's once the supervisor is gone."""
    return identity(pid) == state.get("supervisor_start") and has_open(pid, LOCK)


def _supervisor_pidfd(state: dict) -> int | None:
    """A pidfd for the state's supervisor, if that process still runs; None otherwise. A pidfd
    stands for one process, never for a later one given the same pid, so the process checked is
    the one signalled (pidfd_open(2))."""
    pid = state.get("supervisor_pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    if _is_supervisor(pid, state):
        return pidfd
    os.close(pidfd)
    return None


def running() -> dict | None:
    """The state of a twin that is up and ready, or None."""
    state = read_state()
    if state and state.get("phase") == "ready":
        pidfd = _supervisor_pidfd(state)
        if pidfd is not None:
            os.close(pidfd)
            return state
    return None


def not_running() -> str:
    """Why `running()` is None, for `python -m twin status`."""
    state = read_state()
    if not state:
        return "twin: not running (never started)"
    if state.get("phase") == "ready":
        return (f"twin: not running (its supervisor, pid {state.get('supervisor_pid')}, is gone; "
                f"{STATE} is what it left)")
    return f"twin: not running (last recorded: {state.get('phase')}" + (
        f": {state['error']})" if state.get("error") else ")")


def up(log=print, with_karpenter: bool = True) -> dict:
    """Build what is missing, start the twin and wait until it is ready; reuse one that is up.
    Refused (TwinError) while another `up` is starting a twin in the same state folder."""
    state = running()
    if not state:
        try:
            lock = hold_lock()
        except TwinError:
            state = running()  # the `up` that held it may have finished in between
            if not state:
                raise
    if state:
        log(f"twin: already up (kubeconfig {KUBECONFIG}, context {CONTEXT})")
        return state
    try:  # holding the lock: no supervisor of this folder is alive, and none will start meanwhile
        return _start(lock, log, with_karpenter)
    finally:
        os.close(lock)  # the supervisor keeps its own copy for the twin's life


def _start(lock: int, log, with_karpenter: bool) -> dict:
    build.build(log=log)
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    private_folder(RUN_DIR)
    started = time.monotonic()
    argv = [sys.executable, "-m", "twin", "supervise", f"--lock-fd={lock}"] + (
        [] if with_karpenter else ["--no-karpenter"])
    with open(RUN_DIR / "supervisor.log", "wb") as out:
        supervisor = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, pass_fds=(lock,),
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            state = read_state() or {}
            if state.get("phase") == "ready":
                log(f"twin: up in {time.monotonic() - started:.0f} s: kubectl --kubeconfig {KUBECONFIG} "
                    f"(context {CONTEXT}); logs in {RUN_DIR / 'logs'}")
                return state
            if state.get("phase") == "failed":
                raise TwinError(f"the twin did not start: {state.get('error')}")
            if supervisor.poll() is not None:
                raise TwinError(f"the twin's supervisor exited ({supervisor.returncode}); see {RUN_DIR}/supervisor.log")
            if time.monotonic() > deadline:
                raise TwinError(f"the twin was not ready within {START_TIMEOUT:.0f} s (last step: "
                                f"{state.get('step')}); logs in {RUN_DIR / 'logs'}")
            time.sleep(0.5)
    except BaseException:
        if supervisor.poll() is None:  # our child, not yet reaped: its pid is still its own
            _stop_supervisor(os.pidfd_open(supervisor.pid), supervisor.pid)
        raise


def _stop_supervisor(pidfd: int, pid: int) -> None:
    """SIGTERM, and SIGKILL if it has not exited 30 s later (its components die with it: parent-death
    signal). Signalled through its pidfd, which becomes readable when it exits (pidfd_open(2))."""
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                break
            if select.select([pidfd], [], [], 30)[0]:
                break
    finally:
        os.close(pidfd)
    try:  # reap it if it is our child
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def down(log=print) -> None:
    state = read_state() or {}
    pidfd = _supervisor_pidfd(state)
    if pidfd is None:
        log("twin: not running")
        return
    _stop_supervisor(pidfd, state["supervisor_pid"])
    log("twin: stopped")
