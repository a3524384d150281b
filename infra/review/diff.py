"""What a change does to an environment: two offline runs of the same program (the spec before
and after), compared resource by resource, and each change classified by how the controller
that owns the resource acts on it. Pure: no files, no clock, no cluster.

Impact classes (what `pdctl diff --fail-on` takes):
- `restart`: pods are replaced. A LeaderWorkerSet rolls every group when its template hash
  changes, and that hash covers leaderTemplate, workerTemplate and the subdomain policy only
  (kubernetes-sigs/lws pkg/utils/utils.go LeaderWorkerTemplateHash); `replicas` scales without
  one. A Deployment rolls its pods when spec.template changes (kubernetes.io/docs/concepts/
  workloads/controllers/deployment/#updating-a-deployment).
- `roll`: CPU-only pods roll (routers, cache servers, the collector): they restart one at a
  time to read a new config; no GPU capacity is lost and no model reloads.
- `track`: the change restarts engines, so it must ship as a new release track with a canary
  (`pdctl rollout`), not an in-place `pulumi up`, which would restart serving groups unjudged.
- `node-replacement`: Karpenter marks every node of a NodePool drifted when the NodePool's
  spec.template changes and replaces them; its behavioural fields (weight, limits, disruption)
  are not considered for drift (karpenter.sh/docs/concepts/disruption/#drift; aws/karpenter-
  provider-aws website/content/en/docs/concepts/disruption.md).
- `scale`: instance counts change; no pod is restarted, capacity is added or removed.
- `traffic`: the route's weights change; nothing restarts.
- `config`: an object is updated in place (a Service, a policy, a config no pod restarts for).
- `create`, `delete`: resources appear or go.
- `policy`: a mandatory policy rule that passed before fails now.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from infra import naming
from infra.recording import OfflineRun, RegisteredResource, SECRET_PLACEHOLDER, is_secret
from infra.render.engine_args import EngineLaunch

IMPACT_CLASSES = ("restart", "track", "node-replacement", "roll", "scale", "traffic", "config", "create", "delete",
                  "policy")

# Assumptions of the capacity estimate, stated once. A node Karpenter launches needs this long
# to join, pass its GPU checks and pull images before an engine starts loading.
NODE_READY_MINUTES = 10.0


@dataclass(frozen=True)
class FieldChange:
    path: str
    before: Any
    after: Any


@dataclass(frozen=True)
class ResourceChange:
    action: str  # create | update | delete
    layer: str
    type: str
    name: str  # the object's name in the cluster (metadata.name), else Pulumi's
    fields: tuple[FieldChange, ...] = ()
    key: tuple[str, str] = ("", "")  # (type, Pulumi name): how the two runs are matched

    @property
    def kind(self) -> str:
        return self.type.split(":")[-1]


@dataclass(frozen=True)
class Impact:
    klass: str
    resource: str  # kind/name
    detail: str
    gpu_minutes: float = 0.0  # capacity out of service while it happens (estimate)


@dataclass(frozen=True)
class FlagChange:
    role: str
    flag: str
    before: str | None  # None: not set before (added)
    after: str | None  # None: not set after (removed)


@dataclass
class FleetDiff:
    environment: str
    changes: list[ResourceChange] = field(default_factory=list)
    impacts: list[Impact] = field(default_factory=list)
    flags: list[FlagChange] = field(default_factory=list)
    images: list[FieldChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # changes `pulumi up` will not apply (ignoreChanges)
    policy_new: list[str] = field(default_factory=list)
    policy_fixed: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.changes or self.flags or self.images or self.policy_new or self.policy_fixed)

    def classes(self) -> set[str]:
        return {i.klass for i in self.impacts}

    def gpu_minutes(self) -> float:
        return sum(i.gpu_minutes for i in self.impacts)


# --- resources -----------------------------------------------------------------------------------


def _key(r: RegisteredResource) -> tuple[str, str]:
    return r.type, r.name


def _comparable(value: Any) -> Any:
    """Secrets compared by a digest of their value, shown as a placeholder: a diff never prints one."""
    if is_secret(value):
        inner = value.get("value")
        return f"{SECRET_PLACEHOLDER}#{hashlib.sha256(json.dumps(inner, sort_keys=True).encode()).hexdigest()[:8]}"
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if not k.startswith("__")}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def _shown(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(f"{SECRET_PLACEHOLDER}#"):
        return SECRET_PLACEHOLDER
    return value


def _named(items: list) -> dict | None:
    """A list of objects each with a distinct `name` (containers, env, ports, volumes) as a map."""
    if items and all(isinstance(i, dict) and "name" in i for i in items):
        names = [i["name"] for i in items]
        if len(set(names)) == len(names):
            return {str(n): i for n, i in zip(names, items)}
    return None


def field_changes(before: Any, after: Any, path: str = "") -> Iterator[FieldChange]:
    """Leaf changes between two values; lists of named objects are matched by name."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in before:
                yield FieldChange(sub, None, _shown(after[key]))
            elif key not in after:
                yield FieldChange(sub, _shown(before[key]), None)
            else:
                yield from field_changes(before[key], after[key], sub)
        return
    if isinstance(before, list) and isinstance(after, list):
        a, b = _named(before), _named(after)
        if a is not None and b is not None:
            for name in sorted(set(a) | set(b)):
                sub = f"{path}[{name}]"
                if name not in a:
                    yield FieldChange(sub, None, b[name])
                elif name not in b:
                    yield FieldChange(sub, a[name], None)
                else:
                    yield from field_changes(a[name], b[name], sub)
            return
        if any(isinstance(v, (dict, list)) for v in before + after):  # rules, ports: item by item
            for i in range(max(len(before), len(after))):
                sub = f"{path}[{i}]"
                if i >= len(before):
                    yield FieldChange(sub, None, _shown(after[i]))
                elif i >= len(after):
                    yield FieldChange(sub, _shown(before[i]), None)
                else:
                    yield from field_changes(before[i], after[i], sub)
            return
    if before != after:
        yield FieldChange(path, _shown(before), _shown(after))


def resource_changes(before: OfflineRun, after: OfflineRun, notes: list[str] | None = None) -> list[ResourceChange]:
    """Created, deleted and changed resources. A changed field the program tells Pulumi to ignore
    (ignoreChanges: e.g. spec.replicas, which the autoscaler owns) is left out: `pulumi up` will
    not apply it; `notes` gets a line saying so."""
    old = {_key(r): r for r in before.custom()}
    new = {_key(r): r for r in after.custom()}
    changes = []
    for key in sorted(set(old) | set(new)):
        r = new.get(key) or old[key]
        meta = r.inputs.get("metadata") if isinstance(r.inputs.get("metadata"), dict) else {}
        name = meta.get("name") or r.name
        if key not in old:
            changes.append(ResourceChange("create", r.layer, r.type, name, key=key))
        elif key not in new:
            changes.append(ResourceChange("delete", r.layer, r.type, name, key=key))
        else:
            fields = tuple(field_changes(_comparable(old[key].inputs), _comparable(new[key].inputs)))
            ignored = [f for f in fields if any(f.path == p or f.path.startswith(f"{p}.") for p in r.ignore_changes)]
            for f in ignored:
                if notes is not None:
                    notes.append(f"{r.type.split(':')[-1]}/{name} {f.path}: {_shown(f.before)} -> {_shown(f.after)} is "
                                 "not applied by pulumi up (ignoreChanges: the autoscaler owns it after the first apply)")
            fields = tuple(f for f in fields if f not in ignored)
            if fields:
                changes.append(ResourceChange("update", r.layer, r.type, name, fields, key=key))
    return changes


# --- engine command lines ------------------------------------------------------------------------


def parse_flags(args: list[str]) -> dict[str, str]:
    """`--flag value`, `--flag=value` and bare `--flag` (value "") as a map."""
    flags, i = {}, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            flags[name] = value
        i += 1
    return flags


def flag_changes(before: dict[str, EngineLaunch], after: dict[str, EngineLaunch]) -> list[FlagChange]:
    out = []
    for role in sorted(set(before) | set(after)):
        a = parse_flags(before[role].args) if role in before else {}
        b = parse_flags(after[role].args) if role in after else {}
        a.update({f"env {k}": v for k, v in (before[role].env if role in before else {}).items()})
        b.update({f"env {k}": v for k, v in (after[role].env if role in after else {}).items()})
        for flag in sorted(set(a) | set(b)):
            if a.get(flag) != b.get(flag):
                out.append(FlagChange(role, flag, a.get(flag), b.get(flag)))
    return out


# --- impact --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityModel:
    """What the estimate needs from the spec, per role: GPUs of one instance, instances, and
    minutes an instance is out of service when restarted (load the weights, then start)."""

    gpus_per_instance: dict[str, int]
    instances: dict[str, int]
    restart_minutes: float
    gpus_per_node: int


def classify(change: ResourceChange, labels: dict[str, str], capacity: CapacityModel, gpu_pods: int = 0) -> list[Impact]:
    """The impacts of one resource change, from how its controller acts on it. `gpu_pods`: the
    GPUs a workload's pods hold (0 for CPU-only ones)."""
    ref = f"{change.kind}/{change.name}"
    role = labels.get(naming.ROLE_LABEL)
    if change.action in ("create", "delete"):
        return [Impact(change.action, ref, f"{change.kind} {change.action}d")]
    paths = [f.path for f in change.fields]
    impacts = []
    if change.kind == "LeaderWorkerSet":
        template = [p for p in paths if p.startswith(("spec.leaderWorkerTemplate.leaderTemplate",
                                                      "spec.leaderWorkerTemplate.workerTemplate",
                                                      "spec.networkConfig.subdomainPolicy"))]
        if template:
            n = capacity.instances.get(role, 1)
            gpus = capacity.gpus_per_instance.get(role, 0)
            minutes = n * gpus * capacity.restart_minutes
            impacts.append(Impact("restart", ref, f"every {role} group restarts ({n} x {gpus} GPUs, one at a time; "
                                                  f"{_few(template)})", minutes))
            impacts.append(Impact("track", ref, f"{role} engines change: ship it as a new revision with a canary "
                                                "(pdctl rollout), not an in-place pulumi up"))
        if "spec.replicas" in paths:
            before, after = _values(change, "spec.replicas")
            impacts.append(Impact("scale", ref, f"{role} instances {before} -> {after} (no restart; "
                                                f"{'new capacity' if (after or 0) > (before or 0) else 'capacity removed'})"))
        impacts += _in_place(ref, [p for p in paths if p not in template and p != "spec.replicas"],
                             "updated in place")
        return impacts
    if change.kind in ("Deployment", "StatefulSet", "DaemonSet"):
        template = [p for p in paths if p.startswith("spec.template")]
        if template and gpu_pods:
            impacts.append(Impact("restart", ref, f"its GPU pods restart and reload the model ({_few(template)})",
                                  capacity.restart_minutes * gpu_pods))
        elif template:
            impacts.append(Impact("roll", ref, f"its pods roll, one at a time ({_few(template)})"))
        if "spec.replicas" in paths:
            before, after = _values(change, "spec.replicas")
            impacts.append(Impact("scale", ref, f"replicas {before} -> {after} (no restart)"))
        impacts += _in_place(ref, [p for p in paths if not p.startswith("spec.template") and p != "spec.replicas"],
                             "updated in place")
        return impacts
    if change.kind == "NodePool":
        drift = [p for p in paths if p.startswith("spec.template")]
        if drift:
            nodes = _pool_nodes(role, capacity)
            minutes = nodes * capacity.gpus_per_node * (NODE_READY_MINUTES + capacity.restart_minutes)
            impacts.append(Impact("node-replacement", ref, f"Karpenter replaces every node of the pool (drift: "
                                                           f"{_few(drift)}); up to {nodes} node"
                                                           f"{'s' if nodes != 1 else ''}", minutes))
        impacts += _in_place(ref, [p for p in paths if not p.startswith("spec.template")], "behavioural fields, no drift")
        return impacts
    if change.kind in ("ScaledObject", "HorizontalPodAutoscaler"):
        bounds = [f for f in change.fields if f.path.split(".")[-1] in
                  ("minReplicaCount", "maxReplicaCount", "minReplicas", "maxReplicas")]
        if bounds:
            impacts.append(Impact("scale", ref, "instance bounds " + ", ".join(
                f"{f.path.split('.')[-1]} {f.before} -> {f.after}" for f in bounds) + " (no restart)"))
        impacts += _in_place(ref, [f.path for f in change.fields if f not in bounds], "scaling rules updated in place")
        return impacts
    if change.kind == "HTTPRoute":
        weights = [p for p in paths if p.endswith(".weight")]
        if weights:
            impacts.append(Impact("traffic", ref, "route weights change: " + ", ".join(
                f"{f.path.split('.backendRefs')[0].removeprefix('spec.')} {f.before} -> {f.after}"
                for f in change.fields if f.path.endswith(".weight"))))
        impacts += _in_place(ref, [p for p in paths if p not in weights], "updated in place")
        return impacts
    return _in_place(ref, paths, "updated in place")


def _in_place(ref: str, paths: list[str], what: str) -> list[Impact]:
    """The fields no controller restarts anything for, as one `config` impact (none if empty)."""
    return [Impact("config", ref, f"{what}: {_few(paths)}")] if paths else []


def _values(change: ResourceChange, path: str) -> tuple[Any, Any]:
    for f in change.fields:
        if f.path == path:
            return f.before, f.after
    return None, None


def _pool_nodes(role: str | None, capacity: CapacityModel) -> int:
    roles = [role] if role in capacity.instances else list(capacity.instances)
    return sum(math.ceil(capacity.instances[r] * capacity.gpus_per_instance[r] / capacity.gpus_per_node) for r in roles)


def _few(paths: list[str], most: int = 3) -> str:
    shown = ", ".join(paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def gpus_of(inputs: dict) -> int:
    """GPUs the pods of a Deployment-like workload request, all replicas together."""
    spec = inputs.get("spec") if isinstance(inputs.get("spec"), dict) else {}
    pod = (spec.get("template") or {}).get("spec") or {}
    per_pod = sum(int(float(str((c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0))))
                  for c in pod.get("containers") or [])
    return per_pod * int(spec.get("replicas") or 1)


def labels_of(run: OfflineRun) -> dict[tuple[str, str], dict[str, str]]:
    out = {}
    for r in run.custom():
        meta = r.inputs.get("metadata") if isinstance(r.inputs.get("metadata"), dict) else {}
        out[_key(r)] = dict(meta.get("labels") or {})
    return out
