"""Extract what the pinned endpoint picker and its routing sidecar accept, from their Go source.

Why: the endpoint picker (llm-d-inference-scheduler, built on the Gateway API Inference
Extension's EPP framework) is a Go binary, so no flag table can be built by importing it the
way extract_engine_flags.py does for the engines. Its config loader decodes the top level of
EndpointPickerConfig strictly and hands each plugin its raw `parameters`, which the plugin
json-unmarshals without complaint about unknown keys, so a misspelt or renamed parameter is
silently dropped. This reads the config types, every registered plugin type (and which are
kept only for backward compatibility), the parameter structs of the plugins pdstack renders
(deprecated fields marked), and the sidecar's flags and KV connectors, into
infra/render/pinned/llm-d-inference-scheduler-<version>.json, which
infra/render/epp_contract.py checks the rendered config against.

The source is the Go modules contracts/go.mod pins (go.sum checks them), as the module cache
holds them (`go mod download -json` gives each one's folder): llm-d-inference-scheduler, and
gateway-api-inference-extension at the version llm-d's own go.mod requires. The output records
each module's path, version and go.sum hash and every file of it that was read.

    python scripts/extract_epp_contract.py      # needs `go` and the module proxy (or a filled cache)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "infra" / "render" / "pinned"
PINS = ROOT / "contracts"  # go.mod, go.sum
LLMD = "github.com/llm-d/llm-d-inference-scheduler"
GIE = "sigs.k8s.io/gateway-api-inference-extension"

# Paths are those of the pinned versions (llm-d v0.7.1, GIE v1.4.0); they move between releases.
# Plugins pdstack renders whose parameters are a struct: type -> (module key, path, struct).
PARAMETER_STRUCTS = {
    "disagg-profile-handler": ("llmd", "pkg/plugins/profile/disagg_profile_handler.go", "disaggProfileHandlerParameters"),
    "prefix-based-pd-decider": ("llmd", "pkg/plugins/profile/prefix_based_pd_decider.go", "PrefixBasedPDDeciderConfig"),
    "prefix-cache-scorer": ("gie", "pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go", "Config"),
}
REGISTRIES = [("llmd", "pkg/plugins/register.go"), ("gie", "cmd/epp/runner/runner.go")]
CONFIG_TYPES = ("gie", "apix/config/v1alpha1/endpointpickerconfig_types.go")
CONFIG_GROUP = ("gie", "apix/config/v1alpha1/zz_generated.register.go")
SIDECAR_OPTIONS = ("llmd", "pkg/sidecar/proxy/options.go")
EPP_OPTIONS = ("gie", "pkg/epp/server/options.go")


def go(*args: str) -> str:
    done = subprocess.run(["go", *args], cwd=PINS, capture_output=True, text=True,
                          env={**os.environ, "GOFLAGS": "-mod=readonly"})
    if done.returncode != 0:
        sys.exit(f"go {' '.join(args)} (in contracts/) failed: {done.stderr.strip()}. Fix: check contracts/go.mod "
                 "and that the Go module proxy is reachable")
    return done.stdout


class ModuleSource:
    """One pinned module's source in the module cache; remembers every file read from it."""

    def __init__(self, path: str):
        info = json.loads(go("mod", "download", "-json", path))  # the version go.mod pins, checked against go.sum
        if info.get("Error"):
            sys.exit(f"{path}: {info['Error']}")
        self.path, self.version, self.sum = info["Path"], info["Version"], info["Sum"]
        self.dir = Path(info["Dir"])
        self.read: set[str] = set()

    def show(self, path: str) -> str:
        self.read.add(path)
        return (self.dir / path).read_text()

    def grep(self, pattern: str) -> str:
        """Lines of the module's .go files that match, as `git grep -h` printed them."""
        regex, lines = re.compile(pattern), []
        for file in sorted(self.dir.rglob("*.go")):
            found = [line for line in file.read_text(errors="replace").splitlines() if regex.search(line)]
            if found:
                self.read.add(file.relative_to(self.dir).as_posix())
                lines += found
        return "\n".join(lines)

    def origin(self) -> dict:
        return {"module": self.path, "version": self.version, "go.sum": self.sum, "files_read": sorted(self.read)}


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
            fields[m.group(3)] = {"deprecated": any(re.search(r"Deprecated|Depricated", c) for c in comment), "nested": nested}
        comment = []
    return fields


def registered_plugins(repos: dict[str, ModuleSource]) -> dict[str, dict]:
    plugins = {}
    for key, path in REGISTRIES:
        repo = repos[key]
        for line in repo.show(path).splitlines():
            m = re.search(r"Register\((\w+)\.(\w+),\s*(\w+)\.(\w+)\)", line)
            if not m:
                continue
            const = re.search(rf"\b{m.group(2)}\s*=\s*\"([^\"]+)\"", repo.grep(rf"\b{m.group(2)}\s*=\s*\""))
            if const is None:
                raise SystemExit(f"{repo.path}: constant {m.group(2)} not found")
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


def sidecar(repo: ModuleSource) -> dict:
    source = repo.show(SIDECAR_OPTIONS[1])
    connectors = re.search(r"supportedKVConnectors = map\[string\]struct\{\}\{(.*?)\}\n", source, re.S)
    names = re.findall(r"(\w+):\s*\{\}", connectors.group(1)) if connectors else []
    values = [re.search(rf"\b{n}\s*=\s*\"([^\"]+)\"", repo.grep(rf"\b{n}\s*=\s*\"")).group(1) for n in names]
    return {**go_flags(source), "kv_connectors": values}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write to (default: %(default)s)")
    args = p.parse_args(argv)
    llmd = ModuleSource(LLMD)
    gie = ModuleSource(GIE)
    required = re.search(rf"{re.escape(GIE)} (v[\w.-]+)", llmd.show("go.mod")).group(1)
    if required != gie.version:
        sys.exit(f"contracts/go.mod pins {GIE} {gie.version}, but {LLMD} {llmd.version} is built with {required}. "
                 f"Fix: go get {GIE}@{required} in contracts/")
    repos = {"llmd": llmd, "gie": gie}
    types_source = gie.show(CONFIG_TYPES[1])
    group = re.search(r'GroupName = "([^"]+)"', gie.show(CONFIG_GROUP[1]))
    plugins = registered_plugins(repos)
    for plugin_type, (key, path, struct) in PARAMETER_STRUCTS.items():
        plugins[plugin_type]["parameters"] = struct_fields(repos[key].show(path), struct)
    contract = {
        "about": "What the pinned endpoint picker and routing sidecar accept (scripts/extract_epp_contract.py).",
        "config": {"apiVersion": f"{group.group(1)}/v1alpha1", "kind": "EndpointPickerConfig",
                   "fields": struct_fields(types_source, "EndpointPickerConfig"),
                   "plugin_spec": struct_fields(types_source, "PluginSpec"),
                   "profile": struct_fields(types_source, "SchedulingProfile"),
                   "profile_plugin": struct_fields(types_source, "SchedulingPlugin")},
        "plugins": dict(sorted(plugins.items())),
        "epp_flags": go_flags(gie.show(EPP_OPTIONS[1])),
        "sidecar": sidecar(llmd),
    }
    contract = {"about": contract.pop("about"), "epp": llmd.origin(), "inference_extension": gie.origin(), **contract}
    out = args.out / f"llm-d-inference-scheduler-{llmd.version.lstrip('v')}.json"
    out.write_text(json.dumps(contract, indent=1) + "\n")
    print(f"wrote {out}: {len(plugins)} plugin types, {len(contract['sidecar']['flags'])} sidecar flags, "
          f"from {llmd.path} {llmd.version} and {gie.path} {gie.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
