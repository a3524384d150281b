"""The data path's controllers on the twin: each the upstream program built from its pinned Go
module (twin/build.py), run as its own ServiceAccount with the RBAC its project publishes at that
version (twin/identities.py), listening on 127.0.0.1 only.

  prometheus-operator  v0.93.0  cmd/operator, with the container args of the Deployment in its
                                bundle.yaml (what the platform stack installs), its web server
                                moved to 127.0.0.1; its ServiceAccount, ClusterRole and binding
                                from the same bundle.yaml
  Envoy Gateway        v1.9.0   cmd/envoy-gateway `server`, with the EnvoyGateway configuration its
                                chart renders (charts/gateway-helm, the platform's values merged as
                                Helm merges them) and the certificates its chart's certgen hook makes,
                                made by the same `envoy-gateway certgen` as the ServiceAccount and Role
                                the platform stack gives that hook; its own account, roles and
                                bindings as the chart renders them (twin/identities.py chart_rbac).
                                It listens on every interface (xDS on 0.0.0.0:18000) and reads its
                                certificates from /certs, where its pod mounts the `envoy-gateway`
                                Secret: so it runs in a network and mount namespace of its own
                                (twin/netns.py), /certs holding that Secret's files. No Envoy proxy
                                runs: its verdict is the status it writes.
  KEDA's operator      v2.20.2  cmd/operator, with the args and environment of its config/manager
                                Deployment, its listeners moved to 127.0.0.1 and its certificate
                                folder to the twin's; its ServiceAccount and RBAC from its
                                config/service_account and config/rbac.
  KEDA's metrics   v2.20.2  cmd/adapter, with the args and environment of its config/metrics-server
  API server                Deployment, at an address of the twin's pod network (METRICS_SERVER_IP),
                            as the operator's account (the Deployment's serviceAccountName) with the
                            roles and bindings of config/metrics-server; its Service and APIService
                            from there too. The API server reaches it through the egress proxy
                            (twin/egress.py), the way the aggregator reaches any APIService.

Each controller's RBAC objects are the platform stack's own (infra/platform_stack/components/
controllers.py moves them into the catalog row's namespace), renamed with TWIN_PREFIX and put in
a namespace of the twin's: tests/twin/test_platform_on_twin.py applies and destroys the platform
stack's copy, and its destroy must not take away a running controller's permissions.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import json
import subprocess
import urllib.request
from pathlib import Path

import yaml

from twin import build, identities, netns
from twin.api import POD_CIDR, kubectl
from twin.paths import ROOT, RUN_DIR, private_folder

TWIN_PREFIX = "twin-"
NAMESPACE = "twin-dataplane"  # the controllers' ServiceAccounts (no pod of theirs runs anywhere)
_CLUSTER_SCOPED_RBAC = {"ClusterRole", "ClusterRoleBinding"}
# The cluster's own namespace: a binding there to one of its Roles (extension-apiserver-authentication-
# reader), and a subject there (the HPA controller's account), stay there; only the name is the twin's.
_CLUSTERS_OWN = "kube-system"


def twin_copy(objects: list[dict], namespace: str = NAMESPACE) -> list[dict]:
    """The platform stack's RBAC objects for one controller as the twin's own: namespaced ones in
    `namespace`, cluster-wide ones renamed with TWIN_PREFIX, and the bindings' role references
    and ServiceAccount subjects following them. Objects and subjects in kube-system stay there
    (renamed with TWIN_PREFIX): they bind the cluster's own roles and accounts. An APIService keeps
    its name (the API group and version it serves); its Service follows the namespace."""
    ours = {o["metadata"]["name"] for o in objects if o["kind"] == "ClusterRole"}
    out = []
    for obj in objects:
        obj = {**obj, "metadata": {**obj["metadata"]}}
        if obj["kind"] == "APIService":
            obj["spec"] = {**obj["spec"], "service": {**obj["spec"]["service"], "namespace": namespace}}
        elif obj["kind"] in _CLUSTER_SCOPED_RBAC or obj["metadata"].get("namespace") == _CLUSTERS_OWN:
            obj["metadata"]["name"] = TWIN_PREFIX + obj["metadata"]["name"]
        else:
            obj["metadata"]["namespace"] = namespace
        if obj.get("roleRef", {}).get("kind") == "ClusterRole" and obj["roleRef"]["name"] in ours:
            obj["roleRef"] = {**obj["roleRef"], "name": TWIN_PREFIX + obj["roleRef"]["name"]}
        if "subjects" in obj:
            obj["subjects"] = [{**s, "namespace": namespace}
                               if s.get("kind") == "ServiceAccount" and s.get("namespace") != _CLUSTERS_OWN else s
                               for s in obj["subjects"]]
        out.append(obj)
    return out


# --- prometheus-operator ---------------------------------------------------------------------

def _bundle() -> tuple[list[dict], dict]:
    """prometheus-operator's bundle.yaml as the platform stack installs it, and where it came from."""
    from infra.platform_stack.catalog import controller
    from infra.platform_stack.components.controllers import manifest_documents
    from infra.platform_stack.modules import pin

    row = controller("prometheus-operator")
    origin = pin(row.manifests.module).origin(row.manifests.path)
    return manifest_documents(row.manifests, row.namespace), origin


def prometheus_operator_rbac() -> tuple[list[dict], list[dict]]:
    """The bundle's ServiceAccount, ClusterRole and ClusterRoleBinding (the twin's copy), and their origin."""
    docs, origin = _bundle()
    return twin_copy([d for d in docs if d["kind"] in identities.RBAC_KINDS]), [origin]


def prometheus_operator_args() -> list[str]:
    """The container args of the bundle's Deployment at the pinned version."""
    docs, _ = _bundle()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def start_prometheus_operator(supervisor, admin_kubeconfig: Path) -> None:
    kubeconfig = identities.start_as_own(prometheus_operator_rbac(), admin_kubeconfig)
    port = supervisor.ports.prometheus_operator
    # No --kubeconfig flag: the operator reads KUBECONFIG (pkg/k8s/k8s.go NewClusterConfig).
    supervisor.spawn("prometheus-operator", [
        str(build.program("prometheus-operator")), *prometheus_operator_args(),
        f"--web.listen-address=127.0.0.1:{port}"], env={"KUBECONFIG": str(kubeconfig)})
    supervisor.wait_until("prometheus-operator", lambda: _http_ok(port, "/healthz"))


def _http_ok(port: int, path: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return answer.status == 200


# --- Envoy Gateway -----------------------------------------------------------------------------

EG_RELEASE = "envoy-gateway"  # the platform stack's release name (its catalog row)
EG_RBAC_TEMPLATES = ("envoy-gateway-serviceaccount.yaml", "envoy-gateway-rbac.yaml", "infra-manager-rbac.yaml",
                     "leader-election-rbac.yaml")
EG_INSIDE_PORT = 6443  # the API server, inside its network namespace


@functools.cache
def _platform_context():
    """The platform context of platform-dev (the platform the twin's tests apply), for the values
    the platform stack gives Envoy Gateway's chart and its certgen hook."""
    from infra.platform_stack.program import hosted_environments, platform_context
    from infra.platform_stack.spec import load_platform_spec
    from twin.paths import ROOT

    spec = load_platform_spec(ROOT / "stacks" / "platform-dev.yaml")
    return platform_context(spec, [h.spec for h in hosted_environments(spec)])


def _eg_chart() -> tuple[Path, dict]:
    from infra.platform_stack.catalog import controller
    from infra.platform_stack.charts import prepared_chart

    row = controller("envoy-gateway")
    return prepared_chart(row), row


def envoy_gateway_rbac() -> tuple[list[dict], list[dict]]:
    """The chart's ServiceAccount, roles and bindings for release envoy-gateway (the twin's copy)."""
    from twin import crds
    chart, row = _eg_chart()
    mod = crds.module("crds", row.values_source.module)
    docs, origins = identities.chart_rbac(chart, EG_RELEASE, NAMESPACE, EG_RBAC_TEMPLATES, mod, row.values_source.path)
    return twin_copy(docs), origins


def _merged(base: dict, over: dict) -> dict:
    """`over` merged into `base` as Helm's merge of values does (maps key by key, the rest replaced)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def envoy_gateway_config() -> dict:
    """The EnvoyGateway configuration the chart renders into its envoy-gateway-config ConfigMap,
    with the platform's values (infra/platform_stack/catalog.py envoy_gateway_values)."""
    from infra.platform_stack.catalog import envoy_gateway_values
    chart, _ = _eg_chart()
    (configmap,) = identities.rendered_chart(chart, EG_RELEASE, NAMESPACE, "envoy-gateway's chart")[
        "envoy-gateway-config.yaml"]
    config = yaml.safe_load(configmap["data"]["envoy-gateway.yaml"])
    return _merged(config, envoy_gateway_values(_platform_context())["config"]["envoyGateway"])


def make_envoy_gateway_certificates(admin_kubeconfig: Path) -> Path:
    """What the chart's certgen hook makes, made as the platform stack makes it: the hook's
    ServiceAccount and Role (infra/platform_stack/catalog.py envoy_gateway_certgen) and its Job's
    command, run here; then the `envoy-gateway` Secret's keys written where the controller's pod
    mounts it (a private folder here, mounted at /certs in its namespace)."""
    from infra.platform_stack.catalog import envoy_gateway_certgen
    _, row = _eg_chart()
    hook = twin_copy(envoy_gateway_certgen(row, _platform_context()))
    job = next(o for o in hook if o["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    from twin import crds
    origins = [crds.module("crds", row.values_source.module).origin(f"{row.values_source.path}/templates/{t}")
               for t in ("certgen-rbac.yaml", "certgen.yaml")]
    kubeconfig = identities.start_as_own(([o for o in hook if o["kind"] != "Job"], origins), admin_kubeconfig)
    env = {e["name"]: e.get("value", NAMESPACE) for e in container["env"]}  # the namespace's fieldRef: ours
    done = subprocess.run([str(build.program("envoy-gateway")), *container["command"][1:], *container["args"]],
                          env={**build.go_env(), **env, "KUBECONFIG": str(kubeconfig)}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"envoy-gateway certgen failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return mount_secret("envoy-gateway", private_folder(RUN_DIR / "pki" / "envoy-gateway-certs"), admin_kubeconfig)


def mount_secret(name: str, folder: Path, admin_kubeconfig: Path) -> Path:
    """What the kubelet does for a pod's secret volume: the Secret's keys as files in the folder
    (0600 here: only the twin's own processes read them)."""
    secret = json.loads(kubectl("get", "secret", name, "-n", NAMESPACE, "-o", "json",
                                kubeconfig_path=admin_kubeconfig).stdout)
    for key, value in secret["data"].items():
        identities.write_private(folder / key, base64.b64decode(value).decode())
    return folder


_TUNNELS = []  # the Unix sockets controllers in network namespaces reach the API server through


def start_envoy_gateway(supervisor, admin_kubeconfig: Path) -> None:
    certs = make_envoy_gateway_certificates(admin_kubeconfig)
    kubeconfig = identities.start_as_own(envoy_gateway_rbac(), admin_kubeconfig,
                                         server=f"https://127.0.0.1:{EG_INSIDE_PORT}")
    config = RUN_DIR / "envoy-gateway.yaml"
    config.write_text(yaml.safe_dump(envoy_gateway_config()))
    tunnel = RUN_DIR / "envoy-gateway-apiserver.sock"
    _TUNNELS.append(netns.forward_unix_to_tcp(tunnel, supervisor.ports.apiserver))
    log = supervisor.logs / "envoy-gateway.log"
    supervisor.spawn("envoy-gateway", netns.argv(tunnel, EG_INSIDE_PORT, [
        str(build.program("envoy-gateway")), "server", f"--config-path={config}"], {"/certs": certs}), env={
        "KUBECONFIG": str(kubeconfig), "ENVOY_GATEWAY_NAMESPACE": NAMESPACE, "KUBERNETES_CLUSTER_DOMAIN": "cluster.local"})
    supervisor.wait_until("envoy-gateway", lambda: "Starting workers" in log.read_text(errors="replace"))


# --- KEDA ------------------------------------------------------------------------------------

KEDA = "github.com/kedacore/keda/v2"
KEDA_RBAC_FILES = ("config/service_account/service_account.yaml", "config/rbac/role.yaml",
                   "config/rbac/role_binding.yaml")


def _keda_documents(relative: str) -> list[dict]:
    from twin import crds
    return [d for d in yaml.safe_load_all(crds.module("crds", KEDA).file(relative).read_text()) if d]


def keda_rbac() -> tuple[list[dict], list[dict]]:
    """KEDA's operator account, roles and bindings as its config/ declares them (the twin's copy)."""
    from twin import crds
    mod = crds.module("crds", KEDA)
    return twin_copy([d for f in KEDA_RBAC_FILES for d in _keda_documents(f)]), [mod.origin(f) for f in KEDA_RBAC_FILES]


def keda_operator_container() -> dict:
    (deployment,) = [d for d in _keda_documents("config/manager/manager.yaml") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def start_keda_operator(supervisor, admin_kubeconfig: Path) -> None:
    kubeconfig = identities.start_as_own(keda_rbac(), admin_kubeconfig)
    apply_keda_metrics_server(admin_kubeconfig)
    container, ports = keda_operator_container(), supervisor.ports
    env = {e["name"]: e.get("value", NAMESPACE) for e in container["env"]}  # the namespace's fieldRef: ours
    cert_dir = private_folder(RUN_DIR / "pki" / "keda-certs")
    argv = [str(build.program("keda-operator")), *container["args"],
            f"--cert-dir={cert_dir}",
            f"--metrics-bind-address=127.0.0.1:{ports.keda_metrics}",
            f"--health-probe-bind-address=127.0.0.1:{ports.keda_health}",
            f"--metrics-service-bind-address=127.0.0.1:{ports.keda_metrics_service}"]
    # what the pod's projected token volume says (/var/run/secrets/kubernetes.io/serviceaccount/
    # namespace), which it reads unless told (pkg/util/env_resolver.go GetClusterObjectNamespace)
    env = {**env, "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE, "KUBECONFIG": str(kubeconfig)}
    # Its certificate rotator makes the kedaorg-certs Secret, then exits 0 "so pod can be restarted"
    # (github.com/open-policy-agent/cert-controller, RestartOnSecretRefresh, which cmd/operator sets);
    # the kubelet restarts it (restartPolicy Always), and so does the twin, once.
    first = supervisor.spawn("keda-operator-first-start", argv, env=env)
    supervisor.children.pop("keda-operator-first-start")  # its exit is expected: not a failure
    try:
        first.wait(timeout=180)
    except subprocess.TimeoutExpired:
        first.kill()
        raise RuntimeError(f"keda-operator did not restart itself after making its certificates "
                           f"({supervisor.logs / 'keda-operator-first-start.log'})") from None
    refreshed = "exiting so pod can be restarted" in (supervisor.logs / "keda-operator-first-start.log").read_text(
        errors="replace")
    if first.returncode or not refreshed:
        raise RuntimeError(f"keda-operator exited with {first.returncode} before it served "
                           f"({supervisor.logs / 'keda-operator-first-start.log'})")
    # The pod mounts that Secret at --cert-dir (config/manager/manager.yaml, volume `certificates`),
    # and the restarted rotator waits for its files there: without them it gives up after its
    # backoff (cert-controller rotator.go ensureCertsMounted, about 12 minutes) and the operator
    # exits with "could not mount certs".
    mount_secret("kedaorg-certs", cert_dir, admin_kubeconfig)
    supervisor.spawn("keda-operator", argv, env=env)
    supervisor.wait_until("keda-operator", lambda: _http_ok(ports.keda_health, "/readyz"))
    start_keda_metrics_server(supervisor, admin_kubeconfig, kubeconfig, cert_dir)


# --- KEDA's metrics API server ----------------------------------------------------------------

KEDA_METRICS_SERVER = "config/metrics-server"
KEDA_METRICS_SERVER_RBAC = ("role.yaml", "role_binding.yaml")
METRICS_SERVER_IP = str(ipaddress.ip_network(POD_CIDR, strict=False)[-2])  # the pod network's last: kwok's pool starts at its first
METRICS_SERVICE_PORT = 9666  # the operator's gRPC port in the adapter's default address (cmd/adapter generateDefaultMetricsServiceAddr)


def keda_metrics_server_rbac() -> tuple[list[dict], list[dict]]:
    """config/metrics-server's roles and bindings (the twin's copy): the HPA controller may read
    external.metrics.k8s.io; the server's account may delegate authentication and authorisation
    (system:auth-delegator) and read kube-system's extension-apiserver-authentication."""
    from twin import crds
    mod = crds.module("crds", KEDA)
    files = [f"{KEDA_METRICS_SERVER}/{f}" for f in KEDA_METRICS_SERVER_RBAC]
    return twin_copy([d for f in files for d in _keda_documents(f)]), [mod.origin(f) for f in files]


def keda_metrics_server_objects() -> list[dict]:
    """config/metrics-server's Service and APIService (the twin's copy), the Service with no selector
    and an EndpointSlice the twin writes for it, as for any Service without one: its endpoint is the
    address the server runs at (no Pod object stands for it, as none does for the operator)."""
    service, api_service = (twin_copy(_keda_documents(f"{KEDA_METRICS_SERVER}/{f}"))[0]
                            for f in ("service.yaml", "api_service.yaml"))
    service["spec"] = {k: v for k, v in service["spec"].items() if k != "selector"}
    name = service["metadata"]["name"]
    slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": f"{TWIN_PREFIX}{name}", "namespace": NAMESPACE, "labels": {
                  "kubernetes.io/service-name": name, "endpointslice.kubernetes.io/managed-by": "pdstack-twin"}},
              "addressType": "IPv4",
              "endpoints": [{"addresses": [METRICS_SERVER_IP], "conditions": {"ready": True}}],
              "ports": [{"name": p["name"], "port": p["targetPort"], "protocol": "TCP"} for p in service["spec"]["ports"]]}
    return [service, slice_, api_service]


def keda_metrics_server_container() -> dict:
    (deployment,) = _keda_documents(f"{KEDA_METRICS_SERVER}/deployment.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def apply_keda_metrics_server(admin_kubeconfig: Path) -> None:
    """Its roles and bindings, Service, EndpointSlice and APIService; before the operator starts,
    whose certificate rotator writes the APIService's caBundle (cmd/operator: CertManager
    APIServiceName v1beta1.external.metrics.k8s.io, EnableAPIServicePatching)."""
    identities.grant(keda_metrics_server_rbac()[0], admin_kubeconfig)
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdstack-twin", "-f", "-",
            kubeconfig_path=admin_kubeconfig, input=yaml.safe_dump_all(keda_metrics_server_objects()))


def start_keda_metrics_server(supervisor, admin_kubeconfig: Path, operator_kubeconfig: Path, cert_dir: Path) -> None:
    """cmd/adapter with its Deployment's args, at METRICS_SERVER_IP in the twin's pod network
    (twin/pods.py; the API server's egress proxy reaches it there), its /certs the kedaorg-certs
    Secret's files (mounted as its pod mounts them), reaching the API server at the `kubernetes`
    Service's address as a pod does, and the operator's gRPC server at 127.0.0.1:9666 inside its
    namespace (forwarded to the operator on the machine's loopback: the twin has no cluster DNS
    for its default keda-operator.<namespace>.svc.cluster.local:9666), with the TLS authority that
    name would give."""
    from twin import pods
    config = yaml.safe_load(operator_kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://{pods.KUBERNETES_SERVICE_IP}:{pods.KUBERNETES_SERVICE_PORT}"
    kubeconfig = operator_kubeconfig.with_name(operator_kubeconfig.stem + ".pod-network.kubeconfig")
    identities.write_private(kubeconfig, yaml.safe_dump(config))
    container = keda_metrics_server_container()
    env = {e["name"]: e.get("value", NAMESPACE) for e in container["env"]}  # the namespace's fieldRef: ours
    # the pod's network namespace, held by a process that dies with the supervisor (as the server does)
    holder = supervisor.pod_network.attach(METRICS_SERVER_IP, supervisor.logs / "keda-metrics-apiserver-netns.log")
    grpc = RUN_DIR / "keda-operator-grpc.sock"
    _TUNNELS.append(netns.forward_unix_to_tcp(grpc, supervisor.ports.keda_metrics_service))
    operator_service = f"keda-operator.{NAMESPACE}.svc.cluster.local"
    supervisor.spawn("keda-metrics-apiserver", [
        "nsenter", f"--net=/proc/{holder.pid}/ns/net", "--", "unshare", "--mount", "--",
        *netns.inside_argv(grpc, METRICS_SERVICE_PORT, [
            str(build.program("keda-adapter")), *container["args"],
            f"--metrics-service-address=127.0.0.1:{METRICS_SERVICE_PORT}",
            f"--metrics-service-grpc-authority={operator_service}",
            *(f"--{flag}={kubeconfig}" for flag in ("authentication-kubeconfig", "authorization-kubeconfig",
                                                     "lister-kubeconfig"))], {"/certs": cert_dir})],
        env={**env, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(ROOT)})


def start(supervisor, admin_kubeconfig: Path) -> None:
    """Every data-path controller, after the CRDs (called by twin/cluster.py's Supervisor)."""
    start_prometheus_operator(supervisor, admin_kubeconfig)
    start_envoy_gateway(supervisor, admin_kubeconfig)
    start_keda_operator(supervisor, admin_kubeconfig)
