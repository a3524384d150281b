"""`pdctl rollout` and `pdctl rollback`: the commands that change an environment, through one
runner that turns how a change ended into an exit code and says what the cluster serves."""

from __future__ import annotations

import argparse

from rich.markup import escape

from infra.cli.canary import observer, with_gates
from infra.cli.common import EXIT_FAILED, EXIT_REFUSED, console, err_console, spec_from_args, spec_path, with_spec
from infra.cli.preflight import preflight
from infra.images import RESOLVE_FIX, placeholders
from infra.inputs import InputError
from infra.spec import StackSpec

RELEASES_HELP = ("release store: s3://bucket/prefix or a folder (default: the spec's environment.release_store, "
                 "else releases/)")


def with_target(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a command that changes an environment: its spec, release store and cluster."""
    with_spec(p)
    p.add_argument("--releases", help=RELEASES_HELP)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--pulumi-stack", help="the real stack, through Pulumi's Automation API (needs the CLI)")
    # Where there is no cluster (CI, this machine): a simulated one kept in a file, so that a
    # rollout and a later rollback see the same state.
    where.add_argument("--sim", help="simulated cluster state file (created if missing)")
    p.add_argument("--pulumi-project", metavar="DIR",
                   help="with --pulumi-stack: the Pulumi project's folder (Pulumi.yaml, Pulumi.<stack>.yaml), "
                        "where the CLI keeps the stack's settings (default: this checkout)")
    return p


def pulumi_project(args: argparse.Namespace):
    """The project folder `--pulumi-project` names, checked before anything changes."""
    from pathlib import Path

    from infra.spec import REPO_ROOT

    if args.pulumi_project is None:
        return REPO_ROOT
    if not args.pulumi_stack:
        raise InputError("--pulumi-project: only with --pulumi-stack (the simulated cluster has no project). "
                         "Nothing was changed")
    folder = Path(args.pulumi_project)
    if not (folder / "Pulumi.yaml").is_file():
        raise InputError(f"--pulumi-project {args.pulumi_project}: no Pulumi.yaml there. Fix: the folder of the "
                         "project (this checkout, or a copy with its Pulumi.<stack>.yaml). Nothing was changed")
    return folder


def register_rollout(sub) -> None:
    p = with_gates(with_target(sub.add_parser("rollout", help="deploy the spec as a new revision and canary it")),
                   required=False)  # not needed for --abort; checked in cmd_rollout
    p.add_argument("--inventory", help="run the SSH preflight on these hosts first")
    p.add_argument("--stages", default="1,5,25,50,100", help="canary traffic shares in percent")
    p.add_argument("--bake", type=float, default=300.0, help="seconds at each stage before judging")
    p.add_argument("--message", default="", help="why this release (kept in its record)")
    p.add_argument("--abort", action="store_true",
                   help="end an unfinished rollout: traffic back to what served before it, its revision taken down")
    p.add_argument("--resume", action="store_true",
                   help="carry on an unfinished rollout from its recorded canary stage")
    p.add_argument("--force", action="store_true", help="with --abort: take over a live lease (audited)")
    p.set_defaults(func=cmd_rollout)


def register_rollback(sub) -> None:
    p = with_target(sub.add_parser("rollback", help="send all traffic back to the previous good revision"))
    p.add_argument("--to", type=int, help="roll back to this revision instead")
    p.add_argument("--force", action="store_true", help="take over a live lease (says whose it was; audited)")
    p.set_defaults(func=cmd_rollback)


def store(args: argparse.Namespace, spec: StackSpec):
    from infra.rollout.releases import store_for

    return store_for(spec, args.releases)


def run_change(args: argparse.Namespace, spec: StackSpec, action) -> int:
    """Run `action(store, cluster)` on the simulated cluster file, saving it whatever happens.

    Exit codes: 0 done; 1 stopped (a failed step or gate, with traffic left on the serving
    revision); 3 refused (lock held, unknown revision, ...), nothing changed.
    """
    from infra.rollout.cluster import load_simulated  # written through on every change
    from infra.rollout.pulumi_cluster import PulumiCluster
    from infra.rollout.objectstore import StoreUnavailable
    from infra.rollout.releases import LeaseLost, ReleaseError
    from infra.rollout.rollout import CanaryFailed, StepFailed

    project = pulumi_project(args)
    releases = store(args, spec)
    try:
        # The real stack's kubectl context comes from its stack file (refused without one).
        cluster = (PulumiCluster(args.pulumi_stack, releases, work_dir=project) if args.pulumi_stack
                   else load_simulated(args.sim))
    except InputError as exc:  # a folder, not UTF-8, not JSON
        if args.pulumi_stack:
            raise
        raise InputError(f"--sim {exc}. Nothing was changed") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # another program's JSON
        raise InputError(f"--sim {args.sim}: not a simulated cluster file (no {exc} as pdctl writes it). Nothing "
                         "was changed. Fix: point --sim at a file pdctl wrote, or at a new path") from None
    try:
        action(releases, cluster)
        return 0
    except (CanaryFailed, StepFailed) as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except (StoreUnavailable, LeaseLost) as exc:
        # Stopped between two changes: what it was about to do is recorded, the rest not done.
        try:
            left = f"the cluster serves {cluster.traffic()}"
        except Exception:  # noqa: BLE001 - the cluster may be what failed; the message must still go out
            left = "the cluster's traffic could not be read"
        err_console.print(f"[red]{escape(str(exc))}[/red]\nThe operation stopped there; {left}. Fix the above, then "
                          "`pdctl rollout --resume` or `--abort` (or `scripts/rollback`)", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except ReleaseError as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_REFUSED


def refuse_placeholders(spec: StackSpec, path) -> None:
    """A real cluster would pull each image: a marked placeholder names none that exists. The
    simulated cluster (--sim) pulls nothing, so it runs the spec as it is."""
    found = placeholders(spec)
    if found:
        raise InputError(f"rollout: {path} names placeholder images, which a cluster cannot pull: "
                         + "; ".join(f"{field} = {ref}" for field, ref in found.items())
                         + f". Nothing was changed. Fix: {RESOLVE_FIX}")


def cmd_rollout(args: argparse.Namespace) -> int:
    from infra.rollout.rollout import RolloutOptions, rollout

    spec = spec_from_args(args)
    if args.force and not args.abort:
        raise InputError("rollout: --force only goes with --abort (to take over a stuck operation's lease). "
                         "Fix: drop --force, or add --abort")
    if args.abort and args.resume:
        raise InputError("rollout: --resume and --abort are opposites. Fix: pick one")
    if args.abort:
        from infra.rollout.rollback import abort

        return run_change(args, spec, lambda store, cluster: abort(store, cluster, console=console, force=args.force))
    if args.pulumi_stack and not args.resume:  # a resumed rollout deploys its own, admitted, spec
        refuse_placeholders(spec, spec_path(args))
    if not args.prometheus:
        raise InputError("rollout: --prometheus is required (the canary gates read it). Fix: e.g. "
                         "--prometheus http://prometheus.monitoring.svc:9090")
    if args.inventory and not preflight(spec, args.inventory):
        err_console.print("rollout stopped before any change: fix the hosts above")
        return EXIT_FAILED
    try:
        options = RolloutOptions(stages=tuple(int(x) for x in args.stages.split(",")), bake_seconds=args.bake)
    except ValueError as exc:  # checked before anything changes
        raise InputError(f"--stages {args.stages} / --bake {args.bake}: {exc}".replace(
            "invalid literal for int() with base 10", "not a whole number")) from None
    observe = observer(spec, args)  # an unusable URL is refused here, before anything changes
    if args.resume:  # the unfinished rollout's own spec and stages; --bake applies to what is left
        from infra.rollout.rollout import resume

        return run_change(args, spec, lambda store, cluster: resume(store, cluster, observe, options, console))
    return run_change(args, spec, lambda store, cluster: rollout(
        spec, store, cluster, observe, options, args.message, console))


def cmd_rollback(args: argparse.Namespace) -> int:
    from infra.rollout.rollback import rollback

    spec = spec_from_args(args)
    return run_change(args, spec, lambda store, cluster: rollback(store, cluster, to=args.to, console=console,
                                                                  force=args.force))
