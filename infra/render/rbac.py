"""What a component's ServiceAccount may do: exactly what its source asks of the API server. Pure.

`pinned/rbac-needs.json` lists, per component, each call its pinned source makes (resource,
verbs, namespace or cluster scope), the condition under which it makes it (always, a flag, a
CRD being installed, the picker's --pool-group) and where the source says so; `scripts/derive_rbac.py` reads it from the
Go modules and the wheel. The balancers render their Roles from it with the command line they
run, the policy pack refuses a grant no component needs, and the cluster twin can ask the API
server (SubjectAccessReview) for each need of `needs_for(component, args)`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from infra.render.flagsets import PINNED_DIR

NEEDS_FILE = "rbac-needs.json"


@dataclass(frozen=True)
class Need:
    scope: str  # "namespace" or "cluster"
    api_group: str
    resource: str
    verbs: tuple[str, ...]
    source: str


@functools.cache
def table() -> dict:
    return json.loads((PINNED_DIR / NEEDS_FILE).read_text())


def flag_on(args: list[str], name: str, default: bool) -> bool:
    """A pflag/argparse boolean as the program reads it: bare `--x`, `--x=true|false`, or absent."""
    value = None
    for arg in args:
        if arg == f"--{name}":
            value = "true"
        elif arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
    return default if value is None else value.lower() in ("true", "1")


def flag_value(args: list[str], name: str, default: str) -> str:
    """A string flag as the program reads it: `--x=v` or `--x v` (the last one wins), or its default."""
    value = default
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
        elif arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
    return value


def _has_flag(args: list[str], name: str) -> bool:
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in args)


def needs_for(component: str, args: list[str]) -> list[Need]:
    """The calls `component` makes when started with `args`.

    A CRD-gated informer (the picker watches InferenceObjective and InferenceModelRewrite when
    discovery finds their CRDs at start) counts as needed: the CRDs can be installed at any time,
    and a picker that then cannot list them never syncs its caches.
    """
    entry = table()["components"][component]
    defaults = entry.get("flags", {})
    out = []
    for need in entry["needs"]:
        when = need["when"]
        if when.startswith("flag:"):
            flag = when.removeprefix("flag:")
            if not flag_on(args, flag, defaults.get(flag, False)):
                continue
        if when.startswith("pool-group:") and when.removeprefix("pool-group:") != flag_value(
                args, "pool-group", defaults.get("pool-group", "")):
            continue  # the picker caches only its own pool's type
        scope = need["scope"]
        wide = need.get("cluster_wide_without")
        if wide and not _has_flag(args, wide):
            scope = "cluster"
        out.append(Need(scope, need["apiGroup"], need["resource"], tuple(need["verbs"]), need["source"]))
    return out


def rules(needs: list[Need], scope: str) -> list[dict]:
    """RBAC rules granting exactly these needs of one scope, one rule per resource."""
    merged: dict[tuple[str, str], set[str]] = {}
    for n in needs:
        if n.scope == scope:
            merged.setdefault((n.api_group, n.resource), set()).update(n.verbs)
    return [{"apiGroups": [group], "resources": [resource], "verbs": sorted(verbs)}
            for (group, resource), verbs in sorted(merged.items())]


def granted(rule_list: list[dict]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) triples a list of RBAC rules grants (no wildcards expected)."""
    return {(g, r, v) for rule in rule_list for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
            for v in rule.get("verbs", [])}


@functools.cache
def permitted(scope: str) -> frozenset[tuple[str, str, str]]:
    """Everything any pinned component may need in `scope`, whatever its flags."""
    return frozenset((n["apiGroup"], n["resource"], v) for entry in table()["components"].values()
                     for n in entry["needs"] for v in n["verbs"]
                     if n["scope"] == scope or (scope == "cluster" and n.get("cluster_wide_without")))
