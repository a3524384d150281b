"""Run the program on two specs of one environment (under Pulumi's mocks, as the offline preview
does) and put together what `pdctl diff` reports. The comparison itself is infra/review/diff.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from infra.inputs import InputError, parse_yaml
from infra.offline import run_spec
from infra.policy.rules import evaluate_offline
from infra.render.engine_args import all_launches
from infra.render.manifests import unwrap
from infra.review.diff import (CapacityModel, FieldChange, FleetDiff, Impact, classify, flag_changes, gpus_of,
                               labels_of, resource_changes)
from infra.spec import REPO_ROOT, SpecError, StackSpec
from infra.spec_checks import load_spec, parse_spec


def capacity_model(spec: StackSpec) -> CapacityModel:
    w = spec.model.weights
    pools = spec.deployment.pools()
    return CapacityModel(gpus_per_instance={r: p.gpus_per_instance() for r, p in pools.items()},
                         instances={r: p.instances for r, p in pools.items()},
                         restart_minutes=w.restart_seconds() / 60, gpus_per_node=spec.hardware.gpus_per_node)


def _violations(run) -> set[str]:
    found = evaluate_offline(run)
    return {f"{v.rule}: {v.message}" for v in found if v.level == "mandatory"}


def _images(spec: StackSpec) -> dict[str, str]:
    images = {"engine": spec.engine_image().image, "engine version": f"{spec.engine.kind} {spec.engine.version}"}
    # images.platforms describes the digests (it changes with them), it names no image; the
    # engines' images are listed under "engine" (the one the pools run)
    images.update({name: value for name, value in spec.images.model_dump().items()
                   if value and name not in ("platforms", "engines")})
    return images


def diff_specs(before: StackSpec, after: StackSpec) -> FleetDiff:
    """Everything `pdctl diff` reports about going from `before` to `after`."""
    run_before, run_after = run_spec(before), run_spec(after)
    report = FleetDiff(after.environment.name)
    report.changes = resource_changes(run_before, run_after, report.notes)
    labels = {**labels_of(run_before), **labels_of(run_after)}
    # The cost of a restart is the one of the fleet being restarted, as it is before the change.
    capacity = capacity_model(before)
    inputs = {(r.type, r.name): unwrap(r.inputs) for r in run_before.custom()}
    for change in report.changes:
        gpus = gpus_of(inputs[change.key]) if change.key in inputs else 0
        report.impacts += classify(change, labels.get(change.key, {}), capacity, gpus)
    report.flags = flag_changes(all_launches(before), all_launches(after))
    old, new = _images(before), _images(after)
    report.images = [FieldChange(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    before_v, after_v = _violations(run_before), _violations(run_after)
    report.policy_new, report.policy_fixed = sorted(after_v - before_v), sorted(before_v - after_v)
    report.impacts += [Impact("policy", "policy", line) for line in report.policy_new]
    return report


def spec_at(against: str, stack: str, current: Path) -> tuple[StackSpec, str]:
    """The spec to compare with: a spec file, or the stack's spec at a git ref (default: the merge
    base with main). Returns it and a label saying where it came from."""
    if Path(against).is_file():
        path = Path(against).resolve()
        return load_spec(path), (path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else against)
    rel = current.resolve().relative_to(REPO_ROOT) if current.resolve().is_relative_to(REPO_ROOT) else None
    if rel is None:
        raise InputError(f"--against {against}: not a file, and the spec {current} is outside the repository, so "
                         "it has no history. Fix: --against a spec file")
    ref = against
    if against == "merge-base":
        ref = _git("merge-base", "HEAD", "main", fix="Fix: fetch main (git fetch origin main:main), or --against REF")
    text = _git("show", f"{ref}:{rel.as_posix()}", fix=f"Fix: a ref where {rel} exists, or --against a spec file")
    data = parse_yaml(text, f"{ref}:{rel}", "spec")
    try:
        return parse_spec(data), f"{rel} at {ref[:12]}"
    except SpecError as exc:
        raise SpecError([f"{ref}:{rel}: {p}" for p in exc.problems]) from None


def _git(*args: str, fix: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise InputError("git is not installed here. Fix: install it, or --against a spec file") from None
    if done.returncode:
        raise InputError(f"git {' '.join(args)}: {done.stderr.strip() or 'failed'}. {fix}")
    return done.stdout.strip() if args[0] == "merge-base" else done.stdout
