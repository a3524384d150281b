"""Derive what each component pdstack deploys asks of the Kubernetes API, from its source at the pinned version.

Why: a Role written by hand drifts from what the program does. The endpoint picker's caches
never sync when its ServiceAccount may not list a type its manager caches, and a router that
may read more than it uses is a standing risk. This reads the code that makes the calls and
writes infra/render/pinned/rbac-needs.json, from which infra/render/rbac.py renders every Role
(and against which tests/test_rbac.py and the policy pack check what is rendered):

- endpoint picker (llm-d-inference-scheduler v0.7.1, the version the image, the contract check and
  the spec pin, whose main runs the EPP runner of gateway-api-inference-extension v1.4.0, its go.mod's): the types its controller manager caches
  (pkg/epp/server/controller_manager.go, cache.ByObject: an informer lists and watches each),
  their API groups (api/v1, apix/v1alpha2 zz_generated.register.go) and plurals (config/crd/bases);
  leader election with --ha-enable-leader-election (a "leases" lock: client-go's leaselock.go
  gets, creates and updates it; controller-runtime's leader_election.go records events, which
  client-go's tools/record/event.go creates or patches); metrics authentication, on by default
  (pkg/epp/server/options.go), through controller-runtime's filters.go: TokenReviews and
  SubjectAccessReviews, which are cluster-scoped.
- routing sidecar (llm-d-inference-scheduler v0.7.1, pkg/sidecar/proxy): an InferencePool and pod
  informer only with --enable-ssrf-protection (allowlist.go; off by default in options.go).
- sglang-router 0.3.2 (the PyPI wheel): Kubernetes service discovery watches pods, in the
  namespace given by --service-discovery-namespace, or in every namespace without it
  (sglang_router/router.py; the Rust side, sgl-model-gateway src/service_discovery.rs, lists
  and watches `Api<Pod>` with kube-rs's watcher).

Go modules, llm-d-inference-scheduler's included, come from the Go module proxy at the versions
upstream/go.mod and go.sum fix (`go mod download` verifies them against the checksum database);
the wheel from PyPI (`pip download --no-deps`, once: scripts/pinned_wheels.py). (An earlier run
read llm-d v0.8.0 from a mirror of its repository, which the proxy does not serve, while
everything else pinned v0.7.1.)

    python scripts/derive_rbac.py            # rewrite infra/render/pinned/rbac-needs.json
    python scripts/derive_rbac.py --check    # exit 1 if the source now says otherwise
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from generated import write_or_check
from pinned_wheels import pinned_wheel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "infra" / "render" / "pinned" / "rbac-needs.json"
UPSTREAM = ROOT / "upstream"
GIE, CR, CLIENT_GO = ("sigs.k8s.io/gateway-api-inference-extension", "sigs.k8s.io/controller-runtime",
                      "k8s.io/client-go")
LLMD = "github.com/llm-d/llm-d-inference-scheduler"
ROUTER_WHEEL = ("sglang-router", "0.3.2")


def fail(message: str) -> None:
    raise SystemExit(f"derive_rbac: {message}")


class Module:
    """One Go module's source, downloaded (and checked against go.sum) by the go command."""

    def __init__(self, path: str):
        out = subprocess.run(["go", "mod", "download", "-json", path], cwd=UPSTREAM, capture_output=True, text=True,
                             env={**os.environ, "GOFLAGS": "-mod=mod"})
        info = json.loads(out.stdout or "{}")
        if out.returncode != 0 or "Dir" not in info:
            fail(f"go mod download {path}: {info.get('Error') or out.stderr.strip()}. Fix: the Go module proxy "
                 "must be reachable (GOPROXY)")
        self.path, self.version, self.dir = path, info["Version"], Path(info["Dir"])
        self.origin = {"module": path, "version": self.version, "sum": info["Sum"]}

    def read(self, relative: str) -> str:
        return (self.dir / relative).read_text()

    def cite(self, relative: str, what: str) -> str:
        return f"{self.path}@{self.version} {relative}: {what}"


def find(pattern: str, text: str, where: str, flags: int = 0) -> re.Match:
    m = re.search(pattern, text, flags)
    if m is None:
        fail(f"{where}: {pattern!r} not found; the source changed shape. Fix: read it again and update this script")
    return m


def group_and_plural(gie: Module, alias: str, kind: str, imports: dict[str, str]) -> tuple[str, str]:
    if alias == "corev1":
        return "", kind.lower() + "s"
    package = imports[alias].removeprefix(GIE + "/")
    register = f"{package}/zz_generated.register.go"
    group = find(r'const GroupName = "([^"]+)"', gie.read(register), register).group(1)
    crd = f"config/crd/bases/{group}_{kind.lower()}s.yaml"
    plural = find(r"^\s+plural: (\S+)$", gie.read(crd), crd, re.M).group(1)
    return group, plural


def picker_needs(gie: Module, cr: Module, client_go: Module) -> tuple[list[dict], dict[str, bool]]:
    """The picker's calls, and the defaults of the flags that switch them on."""
    manager_path = "pkg/epp/server/controller_manager.go"
    manager = gie.read(manager_path)
    imports = {alias or path.rsplit("/", 1)[-1]: path
               for alias, path in re.findall(r'^\s+(?:(\w+) )?"([^"]+)"$', manager, re.M)}
    needs = []
    # Every type the manager's cache holds gets an informer: a LIST, then a WATCH.
    for m in re.finditer(r"(?:(if cfg\.(\w+) \{)\s*)?[^\n]*&(\w+)\.(\w+)\{\}(?:\]|:)", manager):
        alias, kind = m.group(3), m.group(4)
        if alias not in imports and alias != "corev1":
            continue
        condition = re.search(rf"if cfg\.(has{kind}s?) \{{", manager)
        # `switch gknn.Group { case <alias>.GroupName: ...ByObject[&<alias>.<Kind>{}]`: the pool's own
        # type is cached only in the API group --pool-group names.
        by_pool_group = re.search(rf"case {alias}\.GroupName:\s*\n\s*opt\.Cache\.ByObject\[&{alias}\.{kind}\{{\}}\]",
                                  manager)
        group, plural = group_and_plural(gie, alias, kind, imports)
        when, why = "always", ""
        if condition:
            when, why = f"crd:{kind}", f" when discovery finds the {kind} CRD ({condition.group(1)}, controller_config.go)"
        elif by_pool_group:
            when, why = f"pool-group:{group}", f" when --pool-group is {group} (switch gknn.Group)"
        needs.append({"scope": "namespace", "apiGroup": group, "resource": plural, "verbs": ["list", "watch"],
                      "when": when, "source": gie.cite(manager_path, f"cache.ByObject &{alias}.{kind}{{}}{why}")})
    if not needs:
        fail(f"{manager_path}: no cached types found")
    options_path = "pkg/epp/server/options.go"
    options = gie.read(options_path)
    find(r'fs\.BoolVar\(&opts\.EnableLeaderElection, "ha-enable-leader-election"', options, options_path)
    auth_default = find(r"MetricsEndpointAuth:\s+(true|false),", options, options_path).group(1)
    find(r'fs\.BoolVar\(&opts\.MetricsEndpointAuth, "metrics-endpoint-auth"', options, options_path)
    lock = find(r'LeaderElectionResourceLock = "(\w+)"', manager, manager_path).group(1)
    if lock != "leases":
        fail(f"{manager_path}: leader election lock {lock!r}, this script knows leases")
    lease_path = "tools/leaderelection/resourcelock/leaselock.go"
    lease_verbs = sorted({v.lower() for v in re.findall(r"\.Leases\([^)]*\)\.(Get|Create|Update|Patch|Delete)\(",
                                                        client_go.read(lease_path))})
    needs.append({"scope": "namespace", "apiGroup": "coordination.k8s.io", "resource": "leases", "verbs": lease_verbs,
                  "when": "flag:ha-enable-leader-election",
                  "source": client_go.cite(lease_path, f"LeaseLock calls Leases().{'/'.join(lease_verbs)}; lock "
                                           f"'leases' from {GIE}@{gie.version} {manager_path}")})
    elector_path = "pkg/leaderelection/leader_election.go"
    find(r"EventRecorder:\s+recorderProvider\.GetEventRecorderFor", cr.read(elector_path), elector_path)
    event_path = "tools/record/event.go"
    event_verbs = sorted({v.lower() for v in re.findall(r"sink\.(Create|Patch|Update)\(", client_go.read(event_path))})
    needs.append({"scope": "namespace", "apiGroup": "", "resource": "events", "verbs": event_verbs,
                  "when": "flag:ha-enable-leader-election",
                  "source": cr.cite(elector_path, "the lock records leader events") + "; "
                  + client_go.cite(event_path, f"the event sink {'/'.join(event_verbs)}s them")})
    runner_path, filters_path = "cmd/epp/runner/runner.go", "pkg/metrics/filters/filters.go"
    find(r"if opts\.MetricsEndpointAuth \{\s+return filters\.WithAuthenticationAndAuthorization",
         gie.read(runner_path), runner_path)
    filters = cr.read(filters_path)
    for client, group, resource in (("TokenAccessReviewClient", "authentication.k8s.io", "tokenreviews"),
                                    ("SubjectAccessReviewClient", "authorization.k8s.io", "subjectaccessreviews")):
        find(rf"{client}:\s+\w+", filters, filters_path)
        needs.append({"scope": "cluster", "apiGroup": group, "resource": resource, "verbs": ["create"],
                      "when": "flag:metrics-endpoint-auth",
                      "source": cr.cite(filters_path, f"WithAuthenticationAndAuthorization's {client}, set by "
                                        f"{GIE}@{gie.version} {runner_path}")})
    leader_default = find(r"EnableLeaderElection:\s+(true|false),", options, options_path).group(1) \
        if re.search(r"EnableLeaderElection:", options) else "false"
    find(r'fs\.StringVar\(&opts\.PoolGroup, "pool-group"', options, options_path)
    pool_group = find(r'PoolGroup:\s+"([^"]+)",', options, options_path).group(1)
    return needs, {"metrics-endpoint-auth": auth_default == "true", "ha-enable-leader-election": leader_default == "true",
                   "pool-group": pool_group}


def llmd_facts(llmd: Module) -> dict:
    """What only llm-d's own module says: its main runs the GIE runner; the sidecar's informers."""
    main = llmd.read("cmd/epp/main.go")
    find(r'"sigs\.k8s\.io/gateway-api-inference-extension/cmd/epp/runner"', main, "cmd/epp/main.go")
    find(r"runner\.NewRunner\(\)", main, "cmd/epp/main.go")
    allowlist = llmd.read("pkg/sidecar/proxy/allowlist.go")
    options = llmd.read("pkg/sidecar/proxy/options.go")
    find(r'fs\.BoolVar\(&opts\.EnableSSRFProtection, "enable-ssrf-protection"', options, "options.go")
    if re.search(r"EnableSSRFProtection:\s+true", options):
        fail("pkg/sidecar/proxy/options.go: SSRF protection is on by default now")
    resources = sorted(set(re.findall(r'Resource:\s+"(\w+)"', allowlist)) | {"inferencepools"})
    gie_require = find(rf"{re.escape(GIE)} (v[\d.]+)", llmd.read("go.mod"), "go.mod").group(1)
    return {
        "origin": llmd.origin,
        "gie_required": gie_require,
        "main_runs_gie_runner": llmd.cite("cmd/epp/main.go", f"runner.NewRunner() of {GIE}/cmd/epp/runner"),
        "sidecar_needs": [{"scope": "namespace", "apiGroup": "inference.networking.k8s.io" if r == "inferencepools"
                           else "", "resource": r, "verbs": ["list", "watch"], "when": "flag:enable-ssrf-protection",
                           "source": llmd.cite("pkg/sidecar/proxy/allowlist.go",
                                               f"an informer (List, Watch) of {r}, started only with "
                                               "--enable-ssrf-protection (off in options.go)")}
                          for r in resources],
    }


def router_needs(wheel: Path | None, previous: dict) -> dict:
    wheel = wheel or pinned_wheel(*ROUTER_WHEEL)
    data = wheel.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        router = z.read("sglang_router/router.py").decode()
        binary = next(z.read(n) for n in z.namelist() if n.endswith(".so"))
    doc = find(r"service_discovery_namespace: Kubernetes namespace to watch for pods\. If not provided,\s+"
               r"watches pods across all namespaces", router, "sglang_router/router.py")
    for marker in (b"K8s service discovery initialized", b"Pod deletion event", b"Error in Kubernetes watcher"):
        if marker not in binary:
            fail(f"the router binary no longer logs {marker!r}; read its discovery again")
    source = (f"{ROUTER_WHEEL[0]}=={ROUTER_WHEEL[1]} wheel sglang_router/router.py: "
              f"'{' '.join(doc.group(0).split())}'; the binary's kube-rs watcher lists and watches pods "
              "(sgl-model-gateway src/service_discovery.rs, Api<Pod> + watcher)")
    return {"origin": {"package": ROUTER_WHEEL[0], "version": ROUTER_WHEEL[1], "wheel": wheel.name,
                       "sha256": hashlib.sha256(data).hexdigest()},
            "needs": [{"scope": "namespace", "apiGroup": "", "resource": "pods", "verbs": ["list", "watch"],
                       "when": "flag:service-discovery", "source": source,
                       "cluster_wide_without": "service-discovery-namespace"}]}


def derive(args: argparse.Namespace) -> dict:
    previous = json.loads(OUT.read_text()) if OUT.exists() else {}
    gie, cr, client_go = Module(GIE), Module(CR), Module(CLIENT_GO)
    llmd_module = Module(LLMD)
    llmd = llmd_facts(llmd_module)
    picker, picker_flags = picker_needs(gie, cr, client_go)
    if llmd["gie_required"] != gie.version:
        fail(f"llm-d {llmd_module.version} requires {GIE} {llmd['gie_required']}, upstream/go.mod pins {gie.version}")
    return {
        "about": "What each component asks of the Kubernetes API, derived from its source by scripts/derive_rbac.py",
        "modules": [gie.origin, cr.origin, client_go.origin],
        "llm_d": llmd,
        "components": {
            "endpoint_picker": {"needs": picker, "flags": picker_flags, "runs": llmd["main_runs_gie_runner"]},
            "routing_sidecar": {"needs": llmd["sidecar_needs"], "flags": {"enable-ssrf-protection": False}},
            "sglang_router": {**router_needs(args.router_wheel, previous.get("components", {}).get("sglang_router", {})),
                              "flags": {"service-discovery": False}},
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    p.add_argument("--router-wheel", type=Path, help="the sglang-router wheel (default: the upstream cache's wheels/, downloaded once)")
    args = p.parse_args(argv)
    derived = json.dumps(derive(args), indent=1, sort_keys=True) + "\n"
    return write_or_check({OUT: derived}, args.check, "the source", "python scripts/derive_rbac.py")


if __name__ == "__main__":
    sys.exit(main())
