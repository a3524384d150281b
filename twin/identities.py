"""Who the twin's controllers are: each its own ServiceAccount, with the RBAC its own project
publishes at the pinned version, never the admin certificate.

`run_as(service_account, namespace, rbac_objects)` is the mechanism for every controller: it
applies the namespace, the ServiceAccount and the (Cluster)Roles and bindings, asks the
TokenRequest API for a token of that account (`kubectl create token`, the same call a kubelet's
projected token makes), and writes a kubeconfig of its own holding it (0600, under the run
folder). The controller started with that kubeconfig is that account and nothing more: a rule
its RBAC lacks is a Forbidden it meets, as in a cluster. The token lives as long as the twin's
certificates (TOKEN_LIFETIME; the API server sets no cap, --service-account-max-token-expiration
is unset); a twin is started afresh, never renewed.

Each controller's RBAC is read from its module zip at the pinned version (twin/crds.py's
`module()`), with where each object came from recorded in RUN_DIR/identities.json:
  kwok        sigs.k8s.io/kwok      kustomize/rbac/ (its kustomization's resources)
  LWS         sigs.k8s.io/lws       config/rbac/, as config/default/kustomization.yaml builds it
                                    (namespace lws-system, name prefix lws-, its common labels)
  Karpenter   sigs.k8s.io/karpenter kwok/charts/ (the chart its kwok provider ships), rendered by
                                    the Helm library the pinned Kubernetes provider embeds
                                    (twin/helm), release `karpenter` in the namespace it runs in
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import yaml

from twin import crds
from twin.api import TwinError, kubectl
from twin.paths import KUBECONFIG, RUN_DIR, private_folder

TOKEN_LIFETIME = "48h"  # the twin's certificates' life (twin/pki.py _VALID)
RECORD = RUN_DIR / "identities.json"
FIELD_MANAGER = "pdstack-twin"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "FlowSchema",
              "PriorityLevelConfiguration"}
# cluster-scoped: kustomize's namespace transformer gives them no namespace (it knows them from
# its built-in OpenAPI schema; these are the ones a controller's RBAC folder holds)
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "FlowSchema", "PriorityLevelConfiguration", "Namespace"}


class IdentityError(RuntimeError):
    pass


def _admin_kubectl(*args: str, kubeconfig_path: Path, input: str | None = None) -> str:
    try:
        return kubectl(*args, kubeconfig_path=kubeconfig_path, input=input).stdout
    except TwinError as exc:
        raise IdentityError(str(exc)) from None


def run_as(service_account: str, namespace: str, rbac_objects: list[dict], *, origins: tuple | list = (),
           admin_kubeconfig: Path = KUBECONFIG, server: str | None = None) -> Path:
    """A kubeconfig (0600, RUN_DIR/identities/<namespace>.<account>.kubeconfig) that
    authenticates as ServiceAccount `namespace/service_account` with a TokenRequest token, after
    applying the namespace, the account and `rbac_objects` with the admin's kubeconfig.
    `server` replaces the API server's address in it (a controller in a network namespace of
    its own reaches it elsewhere); `origins` (module, version, path of each RBAC file) go into
    RUN_DIR/identities.json beside the account, for the tests and the reader of a log."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": service_account, "namespace": namespace}}
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rbac_objects]
    if ("ServiceAccount", namespace, service_account) in names:
        account = None  # the project's own, labels and all
    namespace_object = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    grant([namespace_object, *([account] if account else []), *rbac_objects], admin_kubeconfig)
    answer = json.loads(_admin_kubectl("create", "token", service_account, "-n", namespace,
                                       f"--duration={TOKEN_LIFETIME}", "-o", "json",
                                       kubeconfig_path=admin_kubeconfig))
    config = yaml.safe_load(admin_kubeconfig.read_text())
    context = config["current-context"]
    if server:
        config["clusters"][0]["cluster"]["server"] = server
    config["users"] = [{"name": context, "user": {"token": answer["status"]["token"]}}]
    path = private_folder(RUN_DIR / "identities") / f"{namespace}.{service_account}.kubeconfig"
    write_private(path, yaml.safe_dump(config))
    _record(f"{namespace}/{service_account}", {
        "kubeconfig": str(path), "token_expires": answer["status"]["expirationTimestamp"],
        "rbac": [f"{kind} {f'{ns}/' if ns else ''}{name}" for kind, ns, name in names],
        "read_from": list(origins)})
    print(f"twin: {namespace}/{service_account} runs with its own RBAC, read from "
          + ", ".join(f"{o['module']}@{o['version']}/{o['path']}" for o in origins), flush=True)
    return path


def grant(objects: list[dict], admin_kubeconfig: Path = KUBECONFIG) -> None:
    """Apply RBAC objects as the admin (server-side: a role applied again with fewer rules has
    fewer, its `rules` being an atomic list)."""
    _admin_kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}", "-f", "-",
                   kubeconfig_path=admin_kubeconfig, input=yaml.safe_dump_all(objects))


def write_private(path: Path, text: str) -> None:
    """A new file, 0600 from its creation (it holds a bearer token), replacing any older one."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _record(account: str, entry: dict) -> None:
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    record[account] = entry
    tmp = RECORD.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(RECORD)


def recorded() -> dict:
    """RUN_DIR/identities.json: account -> its kubeconfig, its RBAC objects and where they came from."""
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {}


# --- each controller's RBAC, as its project publishes it -------------------------------------

def _documents(mod: crds.Module, relative: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(mod.file(relative).read_text()) if d]


def kustomize_rbac(twin_folder: str, module_path: str, folder: str, overlay: str | None = None,
                   ) -> tuple[list[dict], list[dict]]:
    """The RBAC objects a kustomization folder lists (`resources:` files), and their origins,
    built as `overlay` (a kustomization that lists `folder` among its resources) builds them:
    its `namespace` on every namespaced object, its `namePrefix` on every name, its
    `commonLabels` on every object, and the references the name transformer follows (a
    binding's roleRef, a ServiceAccount subject's name and namespace) renamed alike
    (kustomize api/filters: namespace, prefix, nameref; konfig/builtinpluginconsts). Anything
    else a kustomization may do (patches on these objects, components, replacements, nested
    folders) is refused rather than ignored."""
    mod = crds.module(twin_folder, module_path)
    base = yaml.safe_load(mod.file(f"{folder}/kustomization.yaml").read_text())
    _only_keys(mod, f"{folder}/kustomization.yaml", base, {"apiVersion", "kind", "resources"})
    docs, origins = [], []
    for resource in base["resources"]:
        relative = f"{folder}/{resource}"
        docs += _documents(mod, relative)
        origins.append(mod.origin(relative))
    others = [d["kind"] for d in docs if d["kind"] not in RBAC_KINDS]
    if others:
        raise IdentityError(f"{mod.path}@{mod.version}/{folder}: {others} are not RBAC; twin/identities.py "
                            "reads only ServiceAccounts, roles, bindings and flow schemas")
    if overlay is None:
        return docs, origins
    relative = f"{overlay}/kustomization.yaml"
    top = yaml.safe_load(mod.file(relative).read_text())
    _only_keys(mod, relative, top, {"namespace", "namePrefix", "commonLabels", "resources", "patches"})
    target = os.path.relpath(folder, overlay)
    if target not in top.get("resources", []):
        raise IdentityError(f"{mod.path}@{mod.version}/{relative} does not list {target}")
    for patch in top.get("patches", []):  # each names its object in the patch file itself
        patched = _documents(mod, f"{overlay}/{patch['path']}")
        if patch.get("target") or any(d.get("kind") in RBAC_KINDS for d in patched):
            raise IdentityError(f"{mod.path}@{mod.version}/{relative} patches RBAC ({patch}); "
                                "twin/identities.py does not apply patches")
    origins.append(mod.origin(relative))
    return [_transformed(d, top, docs) for d in docs], origins


def _only_keys(mod: crds.Module, relative: str, kustomization: dict, known: set[str]) -> None:
    unknown = set(kustomization) - known
    if unknown:
        raise IdentityError(f"{mod.path}@{mod.version}/{relative} uses {sorted(unknown)}, which "
                            "twin/identities.py does not build; build it with kustomize instead")


def _transformed(doc: dict, top: dict, docs: list[dict]) -> dict:
    prefix, namespace = top.get("namePrefix", ""), top.get("namespace")
    ours = {(d["kind"], d["metadata"]["name"]) for d in docs}
    out = json.loads(json.dumps(doc))
    meta = out["metadata"]
    meta["name"] = prefix + meta["name"]
    if namespace and out["kind"] not in CLUSTER_SCOPED:
        meta["namespace"] = namespace
    if top.get("commonLabels"):
        meta["labels"] = {**meta.get("labels", {}), **top["commonLabels"]}
    if "roleRef" in out and (out["roleRef"]["kind"], out["roleRef"]["name"]) in ours:
        out["roleRef"]["name"] = prefix + out["roleRef"]["name"]
    for subject in out.get("subjects", []):
        if subject["kind"] == "ServiceAccount" and ("ServiceAccount", subject["name"]) in ours:
            subject["name"] = prefix + subject["name"]
            if namespace:
                subject["namespace"] = namespace
    return out


def service_account_of(objects: list[dict]) -> tuple[str, str]:
    """(name, namespace) of the one ServiceAccount among `objects`."""
    accounts = [o["metadata"] for o in objects if o["kind"] == "ServiceAccount"]
    if len(accounts) != 1:
        raise IdentityError(f"expected one ServiceAccount among the RBAC objects, found {len(accounts)}")
    return accounts[0]["name"], accounts[0]["namespace"]


def kwok_rbac() -> tuple[list[dict], list[dict]]:
    """kwok's controller account, ClusterRole, binding and FlowSchema (kube-system/kwok-controller)."""
    return kustomize_rbac("controllers", "sigs.k8s.io/kwok", "kustomize/rbac")


def lws_rbac() -> tuple[list[dict], list[dict]]:
    """LWS's manager account and roles as its default install makes them (lws-system/lws-controller-manager)."""
    return kustomize_rbac("controllers", "sigs.k8s.io/lws", "config/rbac", overlay="config/default")


def start_as_own(objects_and_origins: tuple[list[dict], list[dict]], admin_kubeconfig: Path,
                 server: str | None = None) -> Path:
    """run_as() for a controller whose RBAC objects name its one ServiceAccount."""
    objects, origins = objects_and_origins
    name, namespace = service_account_of(objects)
    return run_as(name, namespace, objects, origins=origins, admin_kubeconfig=admin_kubeconfig, server=server)


def without(objects: list[dict], kind: str, name: str, resource: str, verb: str) -> list[dict]:
    """`objects` with role `kind`/`name` no longer granting `verb` on `resource` (a deliberate
    break, for the tests that show a controller lives by its own RBAC)."""
    out = json.loads(json.dumps(objects))
    role = next(o for o in out if (o["kind"], o["metadata"]["name"]) == (kind, name))
    rules = []
    for rule in role["rules"]:
        if resource not in rule.get("resources", []) or verb not in rule["verbs"] and "*" not in rule["verbs"]:
            rules.append(rule)
            continue
        others = [r for r in rule["resources"] if r != resource]
        verbs = [v for v in rule["verbs"] if v not in (verb, "*")]
        rules += [r for r in ({**rule, "resources": others} if others else None,
                              {**rule, "resources": [resource], "verbs": verbs} if verbs else None) if r]
    role["rules"] = json.loads(json.dumps(rules))  # no shared lists: YAML would alias them
    return out


# Karpenter's chart templates that hold its RBAC (kwok/charts/templates/ of sigs.k8s.io/karpenter)
KARPENTER_CHART = "kwok/charts"
KARPENTER_RBAC_TEMPLATES = ("serviceaccount.yaml", "clusterrole.yaml", "clusterrole-kwok.yaml",
                            "aggregate-clusterrole.yaml", "role.yaml", "rolebinding.yaml")


def rendered_chart(chart: Path, release: str, namespace: str, named: str,
                   values: dict | None = None, kube_version: str | None = None) -> dict[str, list[dict]]:
    """Each template of a chart (its path under templates/) -> the objects it renders for release
    `release` in `namespace`, with the chart's default values and `values` over them (as
    `helm template -f` merges them), for a cluster at `kube_version` (Helm's default otherwise), by
    the Helm library the pinned Kubernetes provider embeds (twin/helm). `named` names the chart in
    an error."""
    from twin.build import program
    with tempfile.NamedTemporaryFile("w", suffix=".json") as given:
        json.dump(values or {}, given)
        given.flush()
        done = subprocess.run([str(program("helm-template")), f"-values={given.name}",
                               *([f"-kube-version={kube_version}"] if kube_version else []), str(chart), release,
                               namespace], capture_output=True, text=True)
    if done.returncode:
        raise IdentityError(f"rendering {named}: {done.stderr.strip()}")
    templates: dict[str, list[dict]] = {}
    for part in done.stdout.split("---\n# Source: ")[1:]:
        source, text = part.split("\n", 1)
        templates.setdefault(source.split("/templates/", 1)[-1], []).extend(
            d for document in _MANIFEST_SEPARATOR.split(text) if document.strip()
            for d in [yaml.safe_load(document)] if d)
    return templates


# How Helm splits a template's text into manifests (helm.sh/helm/v3 v3.18.6 pkg/releaseutil/manifest.go
# SplitManifests): a `---` after trimmed whitespace, so `{{- ... }}`'s `---# comment` is a separator too.
_MANIFEST_SEPARATOR = re.compile(r"(?:^|\s*\n)---\s*")


def chart_rbac(chart: Path, release: str, namespace: str, wanted: tuple[str, ...], mod: crds.Module,
               relative: str) -> tuple[list[dict], list[dict]]:
    """The objects of the `wanted` templates of the chart at `relative` in `mod` (rendered_chart),
    and each template's origin; a wanted template that renders nothing is an error."""
    named = f"{mod.path}@{mod.version}/{relative}"
    templates = rendered_chart(chart, release, namespace, named)
    missing = [t for t in wanted if not templates.get(t)]
    if missing:
        raise IdentityError(f"{named} rendered no {sorted(missing)}")
    return ([d for t in wanted for d in templates[t]],
            [mod.origin(f"{relative}/templates/{t}") for t in wanted])


def karpenter_rbac(namespace: str) -> tuple[list[dict], list[dict]]:
    """Karpenter's account, roles and bindings as its kwok chart renders them for release
    `karpenter` in `namespace` (the release its Makefile installs), with the chart's default
    values, by the Helm library the pinned Kubernetes provider embeds (twin/helm)."""
    mod = crds.module("karpenter", "sigs.k8s.io/karpenter")
    return chart_rbac(mod.folder / KARPENTER_CHART, "karpenter", namespace, KARPENTER_RBAC_TEMPLATES, mod,
                      KARPENTER_CHART)
