"""Reading a spec whole: its own rules (infra/spec/, the data) and the rules that need the
planner (infra/planning/), checked together so an operator sees every problem at once.

This module sits above both, so that the spec stays data and never imports the planner, and
the planner builds on the spec's types without a cycle. Every reader of a spec file or mapping
goes through `load_spec` or `parse_spec` here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from infra.inputs import InputError, load_yaml_mapping, validation_problems
from infra.planning.capacity import capacity_problems as reserved_capacity_problems
from infra.render.router_config import router_policy_problems
from infra.spec import PINNED_ENGINE_VERSIONS, SpecError, StackSpec, cross_field_problems


def planning_problems(spec: StackSpec) -> list[str]:
    """The spec's rules that need the planner: what the pools reserve (scaling maximums and the
    rollout surge) against the GPU quota, the NVLink domains and the node size."""
    return reserved_capacity_problems(spec)


def _ratio_hint(err: dict) -> str | None:
    path = ".".join(str(p) for p in err["loc"])
    if err["type"] == "string_type" and isinstance(err.get("input"), int) and path.endswith(
            ("pd_ratio", "pd_ratio_bounds.min", "pd_ratio_bounds.max")):
        return (f"is the number {err['input']}: YAML reads an unquoted ratio such as 1:1 as a base-60 number. "
                "Fix: quote it, e.g. '1:1'")
    return None


def parse_spec(data: object) -> StackSpec:
    """Validate a spec mapping, raising SpecError with one line per problem."""
    try:
        spec = StackSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(validation_problems(exc, StackSpec, _ratio_hint)) from None
    problems = cross_field_problems(spec) + planning_problems(spec) + router_policy_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path) -> StackSpec:
    try:
        data = load_yaml_mapping(path, "spec")
    except InputError as exc:
        raise SpecError([str(exc)]) from None
    if data.get("kind") == "platform":  # else every field of a serving spec would be "missing"
        raise SpecError([f"{path} is a platform stack's spec (kind: platform); this command takes a serving "
                         "stack's. Fix: name a serving stack (e.g. --stack dev), or preview the platform with "
                         f"`pdctl preview --offline --spec {path}`"])
    return parse_spec(data)


def switch_engine(spec: StackSpec, kind: str) -> tuple[StackSpec, list[str]]:
    """The same spec for the other engine (`render --engine`): the engine's pinned version, and
    each setting the other engine cannot use replaced by the nearest one it can, each said."""
    if kind == spec.engine.kind:
        return spec, []
    data = spec.model_dump(mode="json")
    data["engine"].update(kind=kind, version=PINNED_ENGINE_VERSIONS[kind])
    dep, notes = data["deployment"], []

    def change(where: dict, key: str, value, field: str, why: str) -> None:
        notes.append(f"{field}: {where[key]} -> {value} ({why})")
        where[key] = value

    if kind != "sglang" and dep["load_balancer"]["implementation"] == "sglang_router":
        change(dep["load_balancer"], "implementation", "gateway_epp", "deployment.load_balancer.implementation",
               f"sglang_router cannot route {kind}")
    if kind == "vllm" and dep["load_balancer"]["implementation"] == "gateway_epp" and data["engine"]["kv_transfer"] != "nixl":
        change(data["engine"], "kv_transfer", "nixl", "engine.kv_transfer", "llm-d's sidecar runs vLLM's P->D hop over NIXL")
    if kind == "sglang" and dep["cache"]["store"] == "lmcache":
        change(dep["cache"], "store", "mooncake", "deployment.cache.store", "sglang has no LMCache backend")
    for role in ("prefill", "decode", "colocated"):
        if kind == "vllm" and (dep.get(role) or {}).get("expert_placement"):
            change(dep[role], "expert_placement", None, f"deployment.{role}.expert_placement",
                   "vllm rebalances experts at runtime")
    try:
        return parse_spec(data), notes
    except SpecError as exc:
        raise SpecError([f"--engine {kind}: after {'; '.join(notes) or 'the engine switch'}: {p}"
                         for p in exc.problems]) from None
