"""Chart values pdstack sets, checked against each chart's own values at the pinned version.

Helm merges user values over the chart's values.yaml and, where the chart ships one, checks the
result against its values.schema.json (helm.sh/helm/v3 pkg/chartutil/jsonschema.go
ValidateAgainstSchema). A key the chart does not know is silently ignored by Helm, which is how
a misspelt toleration path leaves a DaemonSet off the GPU nodes: here it is an error. A key is
known when the chart's values.yaml has it, or sits under a map the chart leaves empty ({}: a
free-form map such as annotations or nodeSelector).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema

PINNED = Path(__file__).resolve().parent / "pinned"


@cache
def pinned_chart(name: str) -> dict:
    """The extracted values of a catalog row's chart (scripts/platform_sources.py)."""
    return json.loads((PINNED / f"{name}.json").read_text())


def unknown_keys(values: dict, defaults: dict, path: str = "") -> list[str]:
    problems = []
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key not in defaults:
            problems.append(f"{where}: the chart has no such value")
            continue
        known = defaults[key]
        if isinstance(value, dict) and isinstance(known, dict) and known:
            problems += unknown_keys(value, known, where)
    return problems


def _merged(defaults: dict, values: dict) -> dict:
    out = dict(defaults)
    for k, v in values.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def values_problems(name: str, values: dict) -> list[str]:
    """What the pinned chart of catalog row `name` says about `values` (empty: accepted)."""
    pinned = pinned_chart(name)
    origin = pinned["origin"]
    where = f"{name} ({origin['module']}@{origin['version']} {origin['path']})"
    problems = [f"{where}: {p}" for p in unknown_keys(values, pinned["defaults"])]
    if pinned.get("schema"):
        validator = jsonschema.Draft7Validator(pinned["schema"])
        for err in sorted(validator.iter_errors(_merged(pinned["defaults"], values)), key=str):
            at = ".".join(str(p) for p in err.absolute_path) or "(top)"
            problems.append(f"{where}: values.schema.json: {at}: {err.message}")
    return problems


def dig(values: dict, dotted: str):
    """The value at a dotted path of chart values ('a.b.c'), or None."""
    node = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
