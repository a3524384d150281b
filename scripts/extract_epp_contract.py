"""Extract what the pinned endpoint picker and its routing sidecar accept, from their Go source.

Why: the endpoint picker (llm-d-inference-scheduler, built on the Gateway API Inference
Extension's EPP framework) is a Go binary, so no flag table can be built by importing it the
way extract_engine_flags.py does for the engines. Its config loader decodes the top level of
EndpointPickerConfig strictly and hands each plugin its raw `parameters`, which the plugin
json-unmarshals without complaint about unknown keys, so a misspelt or renamed parameter is
silently dropped. This reads, at the pinned tags, the config types, every registered plugin
type (and which are kept only for backward compatibility), the parameter structs of the
plugins pdstack renders (deprecated fields marked), and the sidecar's flags and KV
connectors, into infra/render/pinned/llm-d-inference-scheduler-<version>.json, which
infra/render/router_config.py checks the rendered config against.

    python scripts/extract_epp_contract.py            # needs the two repositories mirrored:
    # /work/.mirror/llm-d+llm-d-inference-scheduler/repo, .../kubernetes-sigs+gateway-api-inference-extension/repo
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "infra" / "render" / "pinned"
MIRRORS = Path("/work/.mirror")
LLMD = ("llm-d/llm-d-inference-scheduler", "v0.8.0")

# Plugins pdstack renders whose parameters are a struct: type -> (repo key, path, struct).
# The prefix-cache-scorer ignores its own parameters; the loader passes them to the
# approx-prefix-cache-producer it adds (gateway-api-inference-extension, configloader.go).
PARAMETER_STRUCTS = {
    "disagg-profile-handler": ("llmd", "pkg/epp/framework/plugins/scheduling/profilehandler/disagg/"
                               "disagg_profile_handler.go", "disaggProfileHandlerParameters"),
    "prefix-based-pd-decider": ("llmd", "pkg/epp/framework/plugins/scheduling/profilehandler/disagg/"
                                "prefix_based_pd_decider.go", "PrefixBasedPDDeciderConfig"),
    "prefix-cache-scorer": ("gie", "pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go",
                            "config"),
}
REGISTRIES = [("llmd", "pkg/epp/framework/plugins/register.go"), ("gie", "cmd/epp/runner/runner.go")]
CONFIG_TYPES = ("gie", "apix/config/v1alpha1/endpointpickerconfig_types.go")
SIDECAR_OPTIONS = ("llmd", "pkg/sidecar/proxy/options.go")
EPP_OPTIONS = ("gie", "pkg/epp/server/options.go")


class Repo:
    def __init__(self, name: str, tag: str):
        self.name, self.tag = name, tag
        self.git = MIRRORS / name.replace("/", "+") / "repo"
        if not self.git.is_dir():
            sys.exit(f"{self.git}: no mirror of github:{name}. Fix: fetch it first (the library's fetch tool)")
        self.commit = self._run("rev-parse", f"{tag}^{{commit}}").strip()

    def _run(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.git), *args], capture_output=True, text=True, check=True).stdout

    def show(self, path: str) -> str:
        return self._run("show", f"{self.tag}:{path}")

    def grep(self, pattern: str) -> str:
        out = subprocess.run(["git", "-C", str(self.git), "grep", "-h", "-E", pattern, self.tag, "--", "*.go"],
                             capture_output=True, text=True)
        return out.stdout

    def origin(self) -> dict:
        return {"repository": f"github:{self.name}", "tag": self.tag, "commit": self.commit}


def struct_fields(source: str, name: str) -> dict[str, dict]:
    """json field name -> {deprecated, nested} of one Go struct, nested structs of the same file followed."""
    body = re.search(rf"type {re.escape(name)} struct \{{(.*?)\n\}}", source, re.S)
    if body is None:
        raise SystemExit(f"struct {name} not found")
    fields, comment = {}, []
    for line in body.group(1).splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped)
            continue
        m = re.match(r"(\w+)\s+([\w\.\*\[\]]+)\s+`json:\"([\w-]+)", stripped)
        if m:
            go_type = m.group(2).lstrip("*[]")
            defined = re.search(rf"type {re.escape(go_type)} struct", source)
            nested = struct_fields(source, go_type) if defined and go_type != name else None
            fields[m.group(3)] = {"deprecated": any("Deprecated" in c for c in comment), "nested": nested}
        comment = []
    return fields


def registered_plugins(repos: dict[str, Repo]) -> dict[str, dict]:
    plugins = {}
    for key, path in REGISTRIES:
        repo = repos[key]
        for line in repo.show(path).splitlines():
            m = re.search(r"Register\((\w+)\.(\w+),\s*(\w+)\.(\w+)\)", line)
            if not m:
                continue
            const = re.search(rf"\b{m.group(2)}\s*=\s*\"([^\"]+)\"", repo.grep(rf"\b{m.group(2)}\s*=\s*\""))
            if const is None:
                raise SystemExit(f"{repo.name}: constant {m.group(2)} not found")
            factory = repo.grep(rf"func {m.group(4)}\(")
            plugins[const.group(1)] = {
                "deprecated": "backward compatibility" in line or "SA1019" in line,
                "ignores_parameters": bool(re.search(r"func \w+\(\w+ string, _ json\.RawMessage", factory)),
            }
    return plugins


def go_flags(source: str) -> dict:
    """pflag flags a Go options file defines, and those it marks deprecated."""
    flags = re.findall(r'fs\.\w+Var(?:P)?\(&[\w\.]+,\s*"([\w-]+)"', source)
    deprecated = re.findall(r'MarkDeprecated\("([\w-]+)"', source)
    return {"flags": sorted(set(flags)), "deprecated_flags": sorted(deprecated)}


def sidecar(repo: Repo) -> dict:
    source = repo.show(SIDECAR_OPTIONS[1])
    connectors = re.search(r"supportedKVConnectors = map\[string\]struct\{\}\{(.*?)\}\n", source, re.S)
    names = re.findall(r"(\w+):\s*\{\}", connectors.group(1)) if connectors else []
    values = [re.search(rf"\b{n}\s*=\s*\"([^\"]+)\"", repo.grep(rf"\b{n}\s*=\s*\"")).group(1) for n in names]
    return {**go_flags(source), "kv_connectors": values}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args(argv)
    llmd = Repo(*LLMD)
    gie_tag = re.search(r"sigs\.k8s\.io/gateway-api-inference-extension (v[\d.]+)", llmd.show("go.mod")).group(1)
    repos = {"llmd": llmd, "gie": Repo("kubernetes-sigs/gateway-api-inference-extension", gie_tag)}
    types_source = repos["gie"].show(CONFIG_TYPES[1])
    group = re.search(r'GroupName = "([^"]+)"', repos["gie"].show("apix/config/v1alpha1/zz_generated.register.go"))
    plugins = registered_plugins(repos)
    for plugin_type, (key, path, struct) in PARAMETER_STRUCTS.items():
        plugins[plugin_type]["parameters"] = struct_fields(repos[key].show(path), struct)
    contract = {
        "about": "What the pinned endpoint picker and routing sidecar accept (scripts/extract_epp_contract.py).",
        "epp": llmd.origin(), "inference_extension": repos["gie"].origin(),
        "config": {"apiVersion": f"{group.group(1)}/v1alpha1", "kind": "EndpointPickerConfig",
                   "fields": struct_fields(types_source, "EndpointPickerConfig"),
                   "plugin_spec": struct_fields(types_source, "PluginSpec"),
                   "profile": struct_fields(types_source, "SchedulingProfile"),
                   "profile_plugin": struct_fields(types_source, "SchedulingPlugin")},
        "plugins": dict(sorted(plugins.items())),
        "epp_flags": go_flags(repos["gie"].show(EPP_OPTIONS[1])),
        "sidecar": sidecar(llmd),
    }
    out = OUT_DIR / f"llm-d-inference-scheduler-{LLMD[1].lstrip('v')}.json"
    out.write_text(json.dumps(contract, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}: {len(plugins)} plugin types, {len(contract['sidecar']['flags'])} sidecar flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
