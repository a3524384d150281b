"""The offline run of a spec: the program that builds it (infra/program.py for a serving spec,
infra/platform_stack/program.py for a platform's), run under Pulumi's mocks (infra/recording.py),
with the outputs its StackReferences read.

This is how pdstack previews and renders without a Pulumi CLI or a cluster, and the one
fixture the tests share. It sits above the programs; what is below them (the renderers, the
platform's own objects) records a run with infra/recording.py and imports nothing from here.
"""

from __future__ import annotations

from infra.recording import OfflineRun, record
from infra.spec import REPO_ROOT, STACKS_DIR, StackSpec


def platform_outputs(reference: str) -> dict:
    """What the platform stack a StackReference names would export, from its spec in stacks/
    (<org>/<project>/<stack> -> stacks/<stack>.yaml); nothing for another stack."""
    from infra.platform_stack.program import expected_outputs
    from infra.platform_stack.spec import load_platform_spec

    path = STACKS_DIR / f"{reference.rsplit('/', 1)[-1]}.yaml"
    return expected_outputs(load_platform_spec(path)) if path.is_file() else {}


def run_offline(program, project: str = "pdstack", stack: str = "dev",
                stack_outputs: dict[str, dict] | None = None) -> OfflineRun:
    """Run `program()` (a Pulumi program) under mocks; return every registration. A StackReference
    reads `stack_outputs` for its stack, else what the platform stack of stacks/<stack>.yaml would
    export (platform_outputs)."""
    given = stack_outputs or {}
    return record(program, project=project, stack=stack,
                  stack_outputs=lambda reference: given.get(reference) or platform_outputs(reference))


def run_spec(spec, project: str = "pdstack", tracks=None) -> OfflineRun:
    """The offline run of a serving spec (its platform stack's outputs as that stack would export
    them), or of a platform spec. `tracks` (infra/tracks.py plan_tracks): the release tracks to
    run side by side, as the program builds them from the release store, `spec` the newest's."""
    from infra.program import build_stack

    if not isinstance(spec, StackSpec):
        from infra.platform_stack.program import build_platform

        return run_offline(lambda: build_platform(spec), project=project, stack=spec.name)
    outputs = {}
    if spec.platform is not None:  # the spec names the platform's file: read that one
        from infra.platform_stack.program import expected_outputs
        from infra.platform_stack.spec import load_platform_spec

        outputs[spec.platform.stack] = expected_outputs(load_platform_spec(REPO_ROOT / spec.platform.spec))
    release = str(max(t.revision for t in tracks)) if tracks else "unreleased"
    return run_offline(lambda: build_stack(spec, release=release, tracks=tracks), project=project,
                       stack=spec.environment.name, stack_outputs=outputs)
