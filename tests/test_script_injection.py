"""No spec string can become a command in a pod (issue #24: a weights prefix of
`x; touch INJECTED #` passed validate and the rendered fetch script ran it).

Two layers, each tested on its own:
- validate refuses hostile strings in every string field of the spec (tests/test_cli_fuzz.py
  walks them through `pdctl validate`);
- rendering quotes whatever it is given. Here the checks are bypassed: every string field the
  spec model has (found by walking the pydantic model, so a field added later is fuzzed too) is
  set to a hostile string, the whole program is rendered offline, and every script the manifests
  hold (ConfigMap launch scripts, `sh -c` commands, lifecycle hooks) is EXECUTED by /bin/sh with
  stand-ins on PATH that only record their arguments (aws, python3, vllm, sleep). Nothing may run:
  no marker file appears, and each hostile string reaches the stand-ins whole, as (part of) one
  argument or environment value.
"""

from __future__ import annotations

import subprocess
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from infra.offline import run_spec
from infra.render.engine_check import variant_spec
from infra.render.manifests import manifests, unwrap
from infra.spec import StackSpec

# Shell metacharacters of every kind the issue lists; {mark} is a file the command would create.
HOSTILE = [
    "x; touch {mark} #",
    "$(touch {mark})",
    "`touch {mark}`",
    "x\ntouch {mark}\n",
    "x' ; touch {mark} ; '",
    'x" ; touch {mark} ; "',
    "x && touch {mark}",
    "x || touch {mark} || x",
    "x | touch {mark}",
    "${{IFS}}$(touch${{IFS}}{mark})",
    "-x; touch {mark}",
    "--help",
    "*",
]


# Strings the program reads as something else before any script sees them (validate checks their
# form): a file it reads, the flag tables' key, numbers and ratios it computes with.
NOT_TEXT = {"deployment.prefill.expert_placement", "deployment.decode.expert_placement",
            "deployment.colocated.expert_placement", "engine.version", "deployment.pd_ratio",
            "deployment.autoscaling.pd_ratio_bounds.min",
            "deployment.autoscaling.pd_ratio_bounds.max", "environment.kubernetes_version",
            "platform.spec"}  # the platform spec file the program reads


def string_fields(model: type[BaseModel], path: tuple = ()) -> list[tuple]:
    """Every free-text field of the spec model (str, str | None, list[str]); Literal choices are
    not text a user can shape. Nested models are walked; a list of models by its first item, a dict
    keyed by a Literal by each key."""
    found = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        optional = typing.get_origin(ann) in (typing.Union, types.UnionType)
        inner = [a for a in typing.get_args(ann) if a is not type(None)][0] if optional else ann
        if typing.get_origin(inner) is typing.Annotated:
            inner = typing.get_args(inner)[0]
        if typing.get_origin(inner) is list:
            item = typing.get_args(inner)[0]
            if isinstance(item, type) and issubclass(item, BaseModel):
                found += string_fields(item, (*path, name, 0))
            elif item is str:
                found.append((*path, name, 0))
        elif typing.get_origin(inner) is dict:  # keyed by a Literal choice (images.engines): every key
            key_type, item = typing.get_args(inner)
            for key in typing.get_args(key_type):
                found += (string_fields(item, (*path, name, key)) if isinstance(item, type) and issubclass(item, BaseModel)
                          else [(*path, name, key, 0)] if item == list[str] else [])
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            found += string_fields(inner, (*path, name))
        elif inner is str:
            found.append((*path, name))
    return found


def with_value(node, path: tuple, value):
    """`node` with the leaf at `path` replaced, every check bypassed (model_copy does not validate)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(node, list):
        return [with_value(node[0], rest, value), *node[1:]] if node else node
    if isinstance(node, dict):
        return {**node, key: with_value(node[key], rest, value)} if key in node else node
    child = getattr(node, key)
    if child is None and rest:
        return node  # an optional section this spec does not have
    return node.model_copy(update={key: with_value(child, rest, value)})


def variants() -> dict[str, StackSpec]:
    """The shapes that render different scripts: SGLang with its router and the aws-cli fetcher;
    vLLM behind the endpoint picker (its prelude sets per-rank flags) with the Python fetcher and
    a dedicated encoder pool."""
    vllm = variant_spec("prod", "vllm")
    vllm = with_value(vllm, ("images", "weights_fetcher_tool"), "python-boto3")
    sglang_mm = with_value(variant_spec("dev", "sglang"), ("model", "multimodal"), True)
    sglang_mm = with_value(sglang_mm, ("deployment", "load_balancer", "encoder", "mode"), "dedicated")
    return {"prod-sglang": variant_spec("prod", "sglang"), "prod-vllm": vllm, "dev-encoder": sglang_mm}


def scripts_of(items: list[dict]) -> list[tuple[str, str, dict[str, str]]]:
    """(where, script, environment) of every shell script a pod would run."""
    configmaps = {m["metadata"]["name"]: m.get("data") or {} for m in items if m["kind"] == "ConfigMap"}
    found = []
    for m in items:
        for template in _pod_templates(m["spec"] if "spec" in m else {}):
            pod = template.get("spec") or {}
            volumes = {v["name"]: v for v in pod.get("volumes") or []}
            for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
                env = {e["name"]: e["value"] for e in c.get("env") or [] if "value" in e}
                where = f"{m['kind']}/{m['metadata']['name']}/{c['name']}"
                commands = [c.get("command") or []]
                hook = ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}
                commands.append(hook.get("command") or [])
                for command in commands:
                    if command[:2] == ["/bin/sh", "-c"]:
                        found.append((where, command[2], env))
                    elif command[:1] == ["/bin/sh"] and len(command) == 2:
                        mount = next(vm for vm in c["volumeMounts"] if command[1].startswith(vm["mountPath"] + "/"))
                        data = configmaps[volumes[mount["name"]]["configMap"]["name"]]
                        found.append((where, data[command[1].rsplit("/", 1)[1]], env))
    return found


def _pod_templates(spec: dict) -> list[dict]:
    group = spec.get("leaderWorkerTemplate") or {}
    candidates = [spec.get("template"), (spec.get("jobTemplate") or {}).get("spec", {}).get("template"),
                  group.get("leaderTemplate"), group.get("workerTemplate")]
    return [t for t in candidates if isinstance(t, dict)]


RECORDER = """#!/bin/sh
# records its name and arguments, one per line with a NUL after each; runs nothing
{{ printf '%s\\0' "$(basename "$0")"; for a in "$@"; do printf '%s\\0' "$a"; done; printf '\\n'; }} >> {log}
case "$(basename "$0") $1 $2" in
  "aws s3 cp") printf '%064d  config.json\\n' 0 > "$5" 2>/dev/null || true ;;
esac
exit 0
"""


def execute(script: str, env: dict[str, str], work: Path) -> subprocess.CompletedProcess:
    """/bin/sh runs the script as the pod would, in `work`, with every program it may call a
    recorder; the weights cache it names is moved under `work`."""
    bin_dir = work / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir(parents=True)
        for tool in ("aws", "python3", "python", "vllm", "sleep", "sglang"):
            (bin_dir / tool).write_text(RECORDER.format(log=work / "calls.log"))
            (bin_dir / tool).chmod(0o755)
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(work), "LWS_LEADER_ADDRESS": "127.0.0.1",
               "LWS_GROUP_SIZE": "2", **env}
    if "PDSTACK_WEIGHTS_DEST" in env:
        run_env["PDSTACK_WEIGHTS_DEST"] = str(work / "cache") + env["PDSTACK_WEIGHTS_DEST"]
    results = []
    for rank in ("0", "1"):
        results.append(subprocess.run(["/bin/sh", "-c", script], env={**run_env, "LWS_WORKER_INDEX": rank},
                                      cwd=work, capture_output=True, text=True, timeout=120))
    return results[-1]


def test_every_string_field_of_the_spec_model_is_found():
    fields = {".".join(map(str, p)) for p in string_fields(StackSpec)}
    for expected in ("model.weights.prefix", "model.name", "model.weights.node_cache_path", "images.engines.sglang.image",
                     "hardware.fabric.devices.0", "deployment.prefill.expert_placement", "access.api_keys.0.name"):
        assert expected in fields
    assert "engine.kind" not in fields  # a Literal choice


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("variant", ["prod-sglang", "prod-vllm", "dev-encoder"])
def test_no_hostile_spec_string_runs_in_any_rendered_script(variant, hostile, tmp_path):
    spec = variants()[variant]
    marks, values = {}, {}
    for i, path in enumerate(string_fields(StackSpec)):
        if ".".join(map(str, path)) in NOT_TEXT:
            continue
        mark = tmp_path / f"INJECTED-{i}"
        value = hostile.format(mark=mark)
        spec = with_value(spec, path, value)
        marks[mark], values[".".join(map(str, path))] = ".".join(map(str, path)), value
    try:
        items = [unwrap(m) for m in manifests(run_spec(spec))]
    except AssertionError as exc:  # the engine's flag check read a value as an option: refused, nothing rendered
        assert hostile.startswith("-") and "do not match" in str(exc), exc
        return
    scripts = scripts_of(items)
    assert len(scripts) >= 4, [w for w, _, _ in scripts]
    reached = set()
    for n, (where, script, env) in enumerate(scripts):
        work = tmp_path / f"run-{n}"
        work.mkdir()
        execute(script, env, work)
        ran = [marks[m] for m in marks if m.exists()]
        assert not ran, f"{where}: {ran} ran a command"
        calls = (work / "calls.log").read_text() if (work / "calls.log").exists() else ""
        seen = calls + "\0".join(env.values())
        reached |= {field for field, value in values.items() if value in seen}
    assert not list(tmp_path.glob("INJECTED-*"))
    # Whole: the fields that reach a script arrive verbatim (a quoting that split or ate a
    # character would lose them here). The weights prefix and the model name reach a script in every
    # variant (the node's cache path is only a hostPath now: pods see it at one fixed mount).
    assert {"model.weights.prefix", "model.name"} <= reached, sorted(reached)
