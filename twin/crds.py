"""Upstream files the twin and the render checks read, straight from the pinned Go modules.

Every CRD (and kwok's stages, LWS's webhook manifests) is read from the module zip that
`go mod download` verifies against the go.sum of the twin folder that pins it; each file is
named by module, version and path, so what the twin applies and what `infra/render/crds/` holds
(scripts/derive_crds.py) is exactly what the project published at that version.

The one exception: NVIDIA's ComputeDomain (k8s-dra-driver-gpu). The Go module proxy serves no
version of github.com/NVIDIA/k8s-dra-driver-gpu (its v25.x tags have no /v25 module path, and the
proxy refuses the module), so its schema stays the copy infra/render/crds/sources/ records the
origin of (repository, tag, commit, path), and the twin applies that.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jsonpatch
import yaml

from twin.build import go_env
from twin.kubelet import ready_stages
from twin.paths import ROOT, RUN_DIR, TWIN_SRC


@dataclass(frozen=True)
class Module:
    """A Go module as go.sum pins it, unpacked in the module cache."""

    path: str
    version: str
    folder: Path  # the unpacked zip (read-only)
    go_sum: str  # its h1: hash, as go.sum records it

    def file(self, relative: str) -> Path:
        found = self.folder / relative
        if not found.is_file():
            raise FileNotFoundError(f"{self.path}@{self.version} has no {relative}")
        return found

    def origin(self, relative: str) -> dict:
        return {"module": self.path, "version": self.version, "path": relative, "go_sum": self.go_sum}


@functools.cache
def module(twin_folder: str, path: str) -> Module:
    """The module at the version twin/<twin_folder>/go.mod selects, downloaded and verified."""
    answer = subprocess.run(["go", "mod", "download", "-json", path], cwd=TWIN_SRC / twin_folder,
                            capture_output=True, text=True, env=go_env())
    info = json.loads(answer.stdout or "{}")
    if answer.returncode or info.get("Error") or not info.get("Dir"):
        raise RuntimeError(f"go mod download {path} (twin/{twin_folder}): "
                           f"{info.get('Error') or answer.stderr.strip()}")
    return Module(info["Path"], info["Version"], Path(info["Dir"]), info["Sum"])


@dataclass(frozen=True)
class CRDFile:
    twin_folder: str  # the twin/ folder whose go.mod/go.sum pins the module
    module: str
    path: str  # inside the module
    rendered: bool = True  # pdstack renders objects of its kinds: its schema goes to infra/render/crds/


# The CRDs the twin installs; the `rendered` ones are also what `pdctl render` checks against.
# Karpenter's NodePool and NodeClaim come from the AWS provider's module (the CRDs a production
# cluster installs): the same Go types as the core's, plus the AWS provider's CEL rules on labels.
CRD_FILES = (
    CRDFile("controllers", "sigs.k8s.io/lws", "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"),
    CRDFile("controllers", "sigs.k8s.io/lws", "config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
            rendered=False),
    CRDFile("crds", "github.com/aws/karpenter-provider-aws", "pkg/apis/crds/karpenter.sh_nodepools.yaml"),
    CRDFile("crds", "github.com/aws/karpenter-provider-aws", "pkg/apis/crds/karpenter.sh_nodeclaims.yaml",
            rendered=False),
    CRDFile("karpenter", "sigs.k8s.io/karpenter", "pkg/apis/crds/karpenter.sh_nodeoverlays.yaml", rendered=False),
    CRDFile("karpenter", "sigs.k8s.io/karpenter", "kwok/apis/crds/karpenter.kwok.sh_kwoknodeclasses.yaml",
            rendered=False),
    CRDFile("crds", "github.com/aws/karpenter-provider-aws", "pkg/apis/crds/karpenter.k8s.aws_ec2nodeclasses.yaml"),
    CRDFile("crds", "sigs.k8s.io/gateway-api", "config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml",
            rendered=False),
    CRDFile("crds", "sigs.k8s.io/gateway-api", "config/crd/standard/gateway.networking.k8s.io_gateways.yaml"),
    CRDFile("crds", "sigs.k8s.io/gateway-api", "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"),
    CRDFile("crds", "sigs.k8s.io/gateway-api", "config/crd/standard/gateway.networking.k8s.io_referencegrants.yaml"),
    CRDFile("crds", "sigs.k8s.io/gateway-api-inference-extension",
            "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"),
    *(CRDFile("crds", "github.com/envoyproxy/gateway",
              f"charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_{name}.yaml")
      for name in ("backendtrafficpolicies", "envoyproxies", "securitypolicies")),
    CRDFile("crds", "github.com/kedacore/keda/v2", "config/crd/bases/keda.sh_scaledobjects.yaml"),
    CRDFile("crds", "github.com/kedacore/keda/v2", "config/crd/bases/keda.sh_triggerauthentications.yaml",
            rendered=False),
    *(CRDFile("crds", "github.com/prometheus-operator/prometheus-operator",
              f"example/prometheus-operator-crd/monitoring.coreos.com_{name}.yaml")
      for name in ("podmonitors", "servicemonitors", "prometheusrules")),
    # the platform stack's Prometheus, which the twin's prometheus-operator reconciles (twin/dataplane.py),
    # and the Probes its Prometheus controller lists before it syncs (cmd/operator/main.go: not optional)
    *(CRDFile("crds", "github.com/prometheus-operator/prometheus-operator",
              f"example/prometheus-operator-crd/monitoring.coreos.com_{name}.yaml", rendered=False)
      for name in ("prometheuses", "probes")),
    # every kind KEDA's operator runs a controller for (cmd/operator/main.go): without one it exits
    *(CRDFile("crds", "github.com/kedacore/keda/v2", f"config/crd/bases/{name}.yaml", rendered=False)
      for name in ("keda.sh_scaledjobs", "keda.sh_clustertriggerauthentications", "eventing.keda.sh_cloudeventsources",
                   "eventing.keda.sh_clustercloudeventsources")),
)
# Not served by the Go module proxy (see the module docstring): the recorded copy.
UNSERVED_CRD_FILES = (ROOT / "infra" / "render" / "crds" / "sources" / "nvidia_computedomains.yaml",)


def crd_documents(entry: CRDFile) -> tuple[list[dict], dict]:
    """The CustomResourceDefinitions in one file, and the file's origin."""
    mod = module(entry.twin_folder, entry.module)
    docs = [d for d in yaml.safe_load_all(mod.file(entry.path).read_text())
            if d and d.get("kind") == "CustomResourceDefinition"]
    return docs, mod.origin(entry.path)


def twin_crds() -> list[dict]:
    """Every CRD the twin installs, each annotated with where it came from."""
    out = []
    for entry in CRD_FILES:
        docs, origin = crd_documents(entry)
        for doc in docs:
            doc = copy.deepcopy(doc)
            doc["metadata"].setdefault("annotations", {})["twin.pdstack.io/origin"] = (
                f"{origin['module']}@{origin['version']}/{origin['path']}")
            out.append(doc)
    for path in UNSERVED_CRD_FILES:
        out += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "CustomResourceDefinition"]
    return out


def apply_twin_crds(kubectl) -> None:
    """Install the CRDs (server-side apply: large schemas exceed client-side apply's annotation)
    and wait until the API server serves each."""
    docs = twin_crds()
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdstack-twin", "-f", "-",
            input=yaml.safe_dump_all(docs))
    kubectl("wait", "--for=condition=Established", "--timeout=120s",
            *(f"crd/{d['metadata']['name']}" for d in docs))


def kwok_stages() -> list[Path]:
    """kwok's own stages at its pinned version: nodes initialise (capacity becomes allocatable,
    Ready) and keep a heartbeat; pods go Running and Ready once the twin's kubelet's start checks
    pass (twin/kubelet.py), and complete. A pod being deleted is
    first taken to a terminal phase, as a kubelet does (twin/stages/pod-terminate-on-delete.yaml,
    the twin's own), and then deleted by kwok's pod-delete stage, narrowed to terminal pods so
    the two never race for the same pod."""
    mod = module("controllers", "sigs.k8s.io/kwok")
    stages = [mod.file(f"kustomize/stage/{p}") for p in (
        "node/fast/node-initialize.yaml", "node/heartbeat/node-heartbeat.yaml", "pod/fast/pod-complete.yaml")]
    return [*stages, _gated_pod_ready(mod), TWIN_SRC / "stages" / "pod-terminate-on-delete.yaml",
            _terminal_pod_delete(mod)]


def _gated_pod_ready(mod: Module) -> Path:
    """kwok's pod/fast/pod-ready.yaml narrowed to pods that passed the twin's kubelet's start
    checks, with a variant for pods a process serves, whose readiness its probes set (twin/kubelet.py)."""
    relative = "kustomize/stage/pod/fast/pod-ready.yaml"
    origin = mod.origin(relative)
    out = RUN_DIR / "kwok-pod-ready-gated.yaml"
    out.write_text(f"# {origin['module']}@{origin['version']}/{relative}, gated on twin/kubelet.py's start checks\n"
                   + yaml.safe_dump_all(ready_stages(yaml.safe_load(mod.file(relative).read_text())), sort_keys=False))
    return out


def _terminal_pod_delete(mod: Module) -> Path:
    """kwok's pod/fast/pod-delete.yaml with one condition added: the pod is in a terminal phase."""
    relative = "kustomize/stage/pod/fast/pod-delete.yaml"
    stage = yaml.safe_load(mod.file(relative).read_text())
    stage["spec"]["selector"]["matchExpressions"].append(
        {"key": ".status.phase", "operator": "In", "values": ["Succeeded", "Failed"]})
    origin = mod.origin(relative)
    out = RUN_DIR / "kwok-pod-delete-terminal.yaml"
    out.write_text(f"# {origin['module']}@{origin['version']}/{relative}, narrowed to terminal pods (twin/crds.py)\n"
                   + yaml.safe_dump(stage, sort_keys=False))
    return out


def lws_webhook_configurations(port: int, ca_pem: bytes) -> list[dict]:
    """LWS's admission webhooks as its module publishes them (config/webhook/manifests.yaml with
    the patches its kustomization applies, and its `lws-` name prefix), pointed at the
    controller on 127.0.0.1 and trusting the twin's CA."""
    mod = module("controllers", "sigs.k8s.io/lws")
    kustomization = yaml.safe_load(mod.file("config/webhook/kustomization.yaml").read_text())
    docs = [d for d in yaml.safe_load_all(mod.file("config/webhook/manifests.yaml").read_text()) if d]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        ops = yaml.safe_load(mod.file(f"config/webhook/{patch['path']}").read_text())
        docs = [jsonpatch.apply_patch(d, ops) if (d["kind"], d["metadata"]["name"]) ==
                (target["kind"], target["name"]) else d for d in docs]
    prefix = yaml.safe_load(mod.file("config/default/kustomization.yaml").read_text())["namePrefix"]
    bundle = base64.b64encode(ca_pem).decode()
    for doc in docs:
        doc["metadata"]["name"] = prefix + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
    return docs
