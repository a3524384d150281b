"""The pinned endpoint picker's and routing sidecar's rules, and a check of what pdstack renders.

`pinned/llm-d-inference-scheduler-0.7.1.json` was read by `scripts/extract_epp_contract.py`
from the Go modules contracts/go.mod pins, as the module cache holds them:
llm-d-inference-scheduler v0.7.1 (the proxy serves no v0.8.0) and the version of
gateway-api-inference-extension it is built with, v1.4.0; the file names the module, version,
go.sum hash and every source file read. The EPP decodes the top level of
its config strictly but lets each plugin json-unmarshal its own parameters, dropping unknown
keys silently; this check is stricter there on purpose: an unknown or deprecated parameter,
a plugin type kept only for backward compatibility, or a reference to an undefined plugin is
an error here, so the config says what the pinned picker will actually do.
"""

from __future__ import annotations

import functools
import json

from infra.render.flagsets import PINNED_DIR

CONTRACT_FILE = "llm-d-inference-scheduler-0.7.1.json"


@functools.cache
def contract() -> dict:
    return json.loads((PINNED_DIR / CONTRACT_FILE).read_text())


def _fields_problems(where: str, given: dict, fields: dict) -> list[str]:
    problems = []
    for key, value in given.items():
        field = fields.get(key)
        if field is None:
            problems.append(f"{where}.{key}: not a field (known: {', '.join(fields)})")
        elif field["deprecated"]:
            problems.append(f"{where}.{key}: deprecated in the pinned picker")
        elif field["nested"] is not None and isinstance(value, dict):
            problems += _fields_problems(f"{where}.{key}", value, field["nested"])
    return problems


def config_problems(config: dict) -> list[str]:
    """What the pinned endpoint picker would refuse, or silently ignore, in one config."""
    c = contract()
    spec = c["config"]
    problems = []
    if config.get("apiVersion") != spec["apiVersion"] or config.get("kind") != spec["kind"]:
        problems.append(f"apiVersion/kind: {config.get('apiVersion')}/{config.get('kind')}, the pinned picker "
                        f"decodes {spec['apiVersion']}/{spec['kind']}")
    problems += _fields_problems("config", {k: v for k, v in config.items() if k not in ("apiVersion", "kind")},
                                 spec["fields"])
    names = {}
    for i, plugin in enumerate(config.get("plugins", [])):
        where = f"plugins[{i}]"
        problems += _fields_problems(where, plugin, spec["plugin_spec"])
        kind = c["plugins"].get(plugin.get("type"))
        name = plugin.get("name") or plugin.get("type")
        if name in names:
            problems.append(f"{where}: duplicate plugin name {name!r}")
        names[name] = plugin.get("type")
        if kind is None:
            problems.append(f"{where}.type: {plugin.get('type')!r} is not a registered plugin type")
            continue
        if kind["deprecated"]:
            problems.append(f"{where}.type: {plugin['type']} is kept for backward compatibility only")
        params = plugin.get("parameters")
        if params is not None:
            if kind.get("parameters") is not None:
                problems += _fields_problems(f"{where}.parameters", params, kind["parameters"])
            elif kind["ignores_parameters"]:
                problems.append(f"{where}.parameters: {plugin['type']} takes no parameters")
    for i, profile in enumerate(config.get("schedulingProfiles", [])):
        problems += _fields_problems(f"schedulingProfiles[{i}]", profile, spec["profile"])
        for j, ref in enumerate(profile.get("plugins", [])):
            problems += _fields_problems(f"schedulingProfiles[{i}].plugins[{j}]", ref, spec["profile_plugin"])
            if ref.get("pluginRef") not in names:
                problems.append(f"schedulingProfiles[{i}].plugins[{j}]: {ref.get('pluginRef')!r} is not defined")
    for plugin in config.get("plugins", []):
        deciders = (plugin.get("parameters") or {}).get("deciders", {})
        for phase, decider in deciders.items():
            if decider not in names:
                problems.append(f"{plugin['type']}: decider for {phase} {decider!r} is not defined")
        # llm-d-inference-scheduler v0.7.1 pkg/plugins/profile/prefix_based_pd_decider.go disaggregate:
        # "A value of 0 disables disaggregation", so no request would reach the prefill pool
        if plugin.get("type") == "prefix-based-pd-decider" and \
                (plugin.get("parameters") or {}).get("nonCachedTokens", 0) <= 0:
            problems.append("prefix-based-pd-decider: nonCachedTokens 0 (or unset) sends no request through prefill; "
                            "for every request use always-disagg-pd-decider")
    return problems


def flag_problems(args: list[str], binary: str) -> list[str]:
    """Flags of `--name=value` arguments the pinned picker ("epp") or sidecar does not take."""
    table = contract()["epp_flags" if binary == "epp" else "sidecar"]
    problems = []
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg[2:].partition("=")[0]
        if name not in table["flags"]:
            problems.append(f"--{name}: not a flag of the pinned {binary}")
        elif name in table["deprecated_flags"]:
            problems.append(f"--{name}: deprecated in the pinned {binary}")
    return problems


def require(problems: list[str], what: str) -> None:
    if problems:
        raise AssertionError(f"rendered {what} does not match llm-d-inference-scheduler "
                             f"{contract()['epp']['version']}: {problems}")
