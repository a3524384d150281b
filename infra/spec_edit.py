"""Changing a spec file the way an operator would by hand: `pdctl plan --write` changes the
counts and keeps everything else, comments and layout included (ruamel.yaml's round trip),
so the result reads as a small diff in review."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.scalarstring import DoubleQuotedScalarString, SingleQuotedScalarString

from infra.inputs import InputError, parse_yaml, read_text, write_output
from infra.spec import SpecError, ratio_value
from infra.spec_checks import load_spec, parse_spec


def _quoted(ratio: str, like) -> str:
    """Quoted as the operator quoted the value it replaces: unquoted, PyYAML (YAML 1.1, what
    the spec is read with) would read 1:2 as the base-60 number 62."""
    return (DoubleQuotedScalarString if isinstance(like, DoubleQuotedScalarString) else SingleQuotedScalarString)(ratio)


def editable(source: str | Path):
    """(ruamel's round-trip YAML, the document) of a spec file to edit: comments, key order, quotes
    and flow style are kept when it is dumped again (`dumped`)."""
    yaml = YAML()  # round trip: comments, key order and flow style kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-fold a long line the operator wrote
    yaml.indent(mapping=2, sequence=4, offset=2)  # the shipped specs' layout: "  key:\n    - item"
    text = read_text(source, "spec")
    parse_yaml(text, source, "spec")  # what every reader refuses (a duplicate key, bad syntax), said the same way
    try:
        return yaml, yaml.load(text)
    except YAMLError as exc:  # what ruamel (YAML 1.2) refuses beyond that
        mark = getattr(exc, "problem_mark", None)
        raise InputError(f"{source}: ruamel.yaml cannot edit it{f' at line {mark.line + 1}' if mark else ''} "
                         f"({getattr(exc, 'problem', None) or exc}). Nothing was written. Fix: correct it") from None


def dumped(yaml, doc) -> str:
    buffer = io.StringIO()
    yaml.dump(doc, buffer)
    return buffer.getvalue()


def write_counts(source: str | Path, target: str | Path, result) -> list[str]:
    """Write `source` with the plan's instance counts and card ratio to `target`; scaling
    bounds and pd_ratio_bounds widened where the new counts fall outside them; the
    autoscalers' per-instance targets set to the plan's (so the fleet scales on the model
    the plan printed). Returns what was widened or set. The written spec is validated
    first; nothing is written otherwise."""
    target = Path(target)
    if not target.parent.is_dir():
        raise InputError(f"--write {target}: the folder {target.parent} does not exist. Nothing was written. "
                         "Fix: create it, or write elsewhere")
    if target.is_dir():
        raise InputError(f"--write {target}: is a folder. Fix: name a file")
    text, notes = planned_spec(source, result, target, f"--write {target}")
    write_output(target, text)  # whole or not at all
    load_spec(target)
    return notes


def planned_spec(source: str | Path, result, target: str | Path, label: str) -> tuple[str, list[str]]:
    """The text `write_counts` would write for `target`, and its notes, validated by the spec's
    own reader (a SpecError, each problem under `label`, if the spec refuses the plan); writes
    nothing, so a dry run can ask whether the spec takes a plan."""
    yaml, doc = editable(source)
    dep = doc["deployment"]
    notes = []
    for role in ("prefill", "decode"):
        n = getattr(result, f"{role}_instances")
        dep[role]["instances"] = n
        scaling = dep[role].get("scaling")
        if scaling is not None:
            for bound, keep in (("max_instances", max), ("min_instances", min)):
                if bound in scaling and keep(scaling[bound], n) != scaling[bound]:
                    notes.append(f"widened deployment.{role}.scaling.{bound} from {scaling[bound]} to {n}")
                    scaling[bound] = n
    dep["pd_ratio"] = _quoted(result.pd_ratio, dep.get("pd_ratio"))
    bounds = (dep.get("autoscaling") or {}).get("pd_ratio_bounds")
    if bounds is not None:
        recommended = Fraction(result.prefill_gpus, result.decode_gpus)
        for side, outside in (("min", lambda b: recommended < b), ("max", lambda b: recommended > b)):
            if side in bounds and outside(ratio_value(str(bounds[side]))):
                notes.append(f"widened pd_ratio_bounds.{side} from {bounds[side]} to {result.pd_ratio}")
                bounds[side] = _quoted(result.pd_ratio, bounds[side])
    auto = dep.get("autoscaling")
    if auto is not None and getattr(result, "scaler_targets", None):
        for key, value in result.scaler_targets.items():
            if auto.get(key) != value:
                notes.append(f"set deployment.autoscaling.{key} from {auto.get(key, 'unset')} to {value:g} "
                             "(the plan's model)")
                auto[key] = value
    text = dumped(yaml, doc)
    try:  # the spec's own reader decides whether the result is valid
        parse_spec(parse_yaml(text, target, "spec"))
    except SpecError as exc:
        raise SpecError([f"{label}: the planned spec would be invalid: {p}" for p in exc.problems]) from None
    return text, notes


def write_pins(source: str | Path, target: str | Path, pins: dict[str, tuple[str, tuple[str, ...]]]) -> None:
    """Write `source` to `target` with each image field of `pins` ({dotted field: (pinned reference,
    platforms)}) set to its pinned reference, and, where the spec lists platforms (images.platforms),
    its digest listed with them and the placeholder's own entry (keyed by its reference) gone. The
    written spec is validated by its kind's reader first; nothing is written otherwise."""
    from ruamel.yaml.comments import CommentedSeq

    from infra.images import is_placeholder, platform_key
    from infra.platform_stack.spec import parse_platform_spec

    target = Path(target)
    if not target.parent.is_dir() or target.is_dir():
        raise InputError(f"--write {target}: not a file in an existing folder. Nothing was written. Fix: name a file "
                         "in a folder that exists")
    yaml, doc = editable(source)
    platforms = (doc.get("images") or {}).get("platforms")
    for field, (ref, archs) in pins.items():
        *parents, leaf = field.split(".")
        node = doc
        for key in parents:
            node = node[key]
        before = str(node[leaf]["ref"]) if hasattr(node[leaf], "get") else str(node[leaf])
        node[leaf] = ref
        if platforms is not None and archs:
            if is_placeholder(before) and before in platforms and platform_key(before) != platform_key(ref):
                del platforms[before]
            listed = CommentedSeq(archs)
            listed.fa.set_flow_style()  # [amd64, arm64], as the shipped specs write them
            platforms[platform_key(ref)] = listed
    text = dumped(yaml, doc)
    data = parse_yaml(text, target, "spec")  # the spec's own reader, for its kind, decides whether it is valid
    parse_platform_spec(data, target) if data.get("kind") == "platform" else parse_spec(data)
    write_output(target, text)
