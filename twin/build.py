"""Build the twin's programs from the Go modules pinned in twin/*/go.mod and go.sum.

Each module folder lists its programs as `tool` lines in go.mod; `go install tool` builds them
all. The binaries land in the machine's cache (`~/.cache/pdstack/twin-bin/<module>-<key>/`,
twin/paths.py BIN_DIR), where the key hashes go.mod, go.sum, the build flags and the module's own Go files, so a warm run
(same pins, any clone) finds them and builds nothing, and a changed pin builds into a new folder
(other pins' folders stay: another clone may be on them). Go's own caches (GOCACHE, GOMODCACHE) stay where the machine keeps
them, so a fresh clone on a machine that built the twin before only links.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.machine_cache import building
from twin import paths
from twin.paths import TWIN_SRC

KUBERNETES_VERSION = "v1.34.4"
PROMETHEUS_VERSION = "3.13.1"  # twin/prometheus/go.mod's github.com/prometheus/prometheus v0.313.1 (its Makefile sets it by ldflags)
# k8s.io/kubernetes reads its version from ldflags (hack/lib/version.sh does the same); without
# them it reports v0.0.0-master, which controllers that check the server's version refuse.
_KUBE_LDFLAGS = " ".join([
    "-s", "-w",
    f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}",
    "-X k8s.io/component-base/version.gitMajor=1",
    f"-X k8s.io/component-base/version.gitMinor={KUBERNETES_VERSION.split('.')[1]}",
    "-X k8s.io/component-base/version.gitTreeState=clean",
])


@dataclass(frozen=True)
class GoModule:
    """One folder under twin/ with a go.mod whose `tool` lines are the programs to build."""

    name: str
    ldflags: str = "-s -w"
    tags: str = ""  # go build tags, e.g. the one service discovery of Prometheus the twin needs

    @property
    def folder(self) -> Path:
        return TWIN_SRC / self.name

    def tools(self) -> list[str]:
        return _tool_lines((self.folder / "go.mod").read_text())

    def key(self) -> str:
        """go.mod, go.sum, the flags, and the module's own Go source (twin/helm's main.go): a
        changed program of ours builds anew, as a changed pin does."""
        digest = hashlib.sha256()
        for name in ("go.mod", "go.sum"):
            digest.update((self.folder / name).read_bytes())
        for source in sorted(self.folder.rglob("*.go")):  # a program's own packages too (ext-proc-client)
            digest.update(str(source.relative_to(self.folder)).encode() + b"\0" + source.read_bytes())
        digest.update((self.ldflags + self.tags).encode())
        return digest.hexdigest()[:16]

    @property
    def bin_dir(self) -> Path:
        return paths.BIN_DIR / f"{self.name}-{self.key()}"


def _tool_lines(go_mod: str) -> list[str]:
    tools, in_block = [], False
    for raw in go_mod.splitlines():
        line = raw.split("//")[0].strip()
        if line == "tool (":
            in_block = True
        elif in_block and line == ")":
            in_block = False
        elif in_block and line:
            tools.append(line)
        elif line.startswith("tool "):
            tools.append(line.split()[1])
    return tools


MODULES = {
    "kube": GoModule("kube", _KUBE_LDFLAGS),
    "controllers": GoModule("controllers"),
    "karpenter": GoModule("karpenter"),
    "helm": GoModule("helm"),  # renders Karpenter's chart for its RBAC (twin/identities.py)
    "prometheus-operator": GoModule("prometheus-operator"),
    "envoy-gateway": GoModule("envoy-gateway"),
    "keda": GoModule("keda"),
    # the endpoint picker (gateway_epp) and the gateway's ext_proc side for the tests (twin/endpoint-picker/main.go)
    "endpoint-picker": GoModule("endpoint-picker"),
}
# Go programs the tests use beside the twin: built by `make test` (`python -m twin.build registry`),
# not by `twin up`, which needs none of them.
TEST_MODULES = {
    "registry": GoModule("registry"),  # distribution's OCI registry (tests/test_images.py)
    # Prometheus at the operator's default version (twin/monitoring.py), with the Kubernetes
    # discovery its generated configs use and no other (its plugins/ build tags)
    "prometheus": GoModule("prometheus", f"-s -w -X github.com/prometheus/common/version.Version={PROMETHEUS_VERSION}",
                           tags="remove_all_sd,enable_kubernetes_sd"),
}

# The program each tool path installs as (`go install` names it after the last path element,
# or the one before a trailing major-version element: server/v3 installs as `server`).
PROGRAMS = {
    "etcd": ("kube", "server"),  # go.etcd.io/etcd/server/v3
    "kube-apiserver": ("kube", "kube-apiserver"),
    "kube-controller-manager": ("kube", "kube-controller-manager"),
    "kube-scheduler": ("kube", "kube-scheduler"),
    "kubectl": ("kube", "kubectl"),
    "kwok": ("controllers", "kwok"),
    "lws-controller-manager": ("controllers", "cmd"),  # sigs.k8s.io/lws/cmd
    "karpenter-kwok": ("karpenter", "kwok"),  # sigs.k8s.io/karpenter/kwok
    "helm-template": ("helm", "helm"),  # pdstack.dev/twin/helm, on helm.sh/helm/v3's library
    "prometheus-operator": ("prometheus-operator", "operator"),  # .../prometheus-operator/cmd/operator
    "envoy-gateway": ("envoy-gateway", "envoy-gateway"),  # github.com/envoyproxy/gateway/cmd/envoy-gateway
    "keda-operator": ("keda", "operator"),  # github.com/kedacore/keda/v2/cmd/operator
    "keda-adapter": ("keda", "adapter"),  # github.com/kedacore/keda/v2/cmd/adapter: its metrics API server
    "epp": ("endpoint-picker", "endpoint-picker"),  # GIE v1.4.0's EPP runner with llm-d v0.7.1's plugins
    "ext-proc-client": ("endpoint-picker", "ext-proc-client"),  # Envoy's ext_proc call to the picker
    "registry": ("registry", "registry"),  # github.com/distribution/distribution/v3/cmd/registry
    "prometheus": ("prometheus", "prometheus"),  # github.com/prometheus/prometheus/cmd/prometheus
}


def program(name: str) -> Path:
    """Path of one built program (build() first)."""
    module, installed_as = PROGRAMS[name]
    return {**MODULES, **TEST_MODULES}[module].bin_dir / installed_as


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-buildvcs=false")
    env["GOTOOLCHAIN"] = env.get("GOTOOLCHAIN", "local")
    return env


def build_module(module: GoModule, log=print) -> float | None:
    """Install the module's tools into its keyed folder; None when they are there already."""
    with building(module.bin_dir):
        if (module.bin_dir / ".complete").is_file():
            return None
        return _install(module, log)


def _install(module: GoModule, log) -> float:
    go = shutil.which("go")
    if go is None:
        raise SystemExit("twin: the `go` command is not on PATH. Fix: install Go 1.26 (the README's set-up)")
    staging = module.bin_dir.with_name(module.bin_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.monotonic()
    log(f"twin: building {', '.join(module.tools())} (twin/{module.name})")
    tags = [f"-tags={module.tags}"] if module.tags else []
    subprocess.run([go, "install", f"-ldflags={module.ldflags}", *tags, "tool"], cwd=module.folder,
                   env={**go_env(), "GOBIN": str(staging)}, check=True)
    took = time.monotonic() - started
    (staging / ".complete").write_text(json.dumps({"seconds": round(took, 1), "tools": module.tools()}) + "\n")
    shutil.rmtree(module.bin_dir, ignore_errors=True)
    staging.rename(module.bin_dir)
    log(f"twin: built twin/{module.name} in {took:.0f} s")
    return took


def build(names: list[str] | None = None, log=print) -> dict[str, float | None]:
    return {name: build_module({**MODULES, **TEST_MODULES}[name], log) for name in (names or list(MODULES))}


if __name__ == "__main__":
    try:
        build(sys.argv[1:] or None)
    except subprocess.CalledProcessError as exc:
        sys.exit(f"twin: go install failed ({exc.returncode}); the output above names the package")
