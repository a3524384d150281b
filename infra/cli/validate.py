"""`pdctl validate`: check a spec; writes nothing."""

from __future__ import annotations

import argparse

from infra.cli.common import console, emit, spec_from_args, with_spec


def register(sub) -> None:
    with_spec(sub.add_parser("validate", help="check a spec; writes nothing"), output=True).set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    pools = {role: {"instances": p.instances, "gpus_per_instance": p.gpus_per_instance()}
             for role, p in spec.deployment.pools().items()}
    text = ", ".join(f"{role} {p['instances']}x{p['gpus_per_instance']} GPUs" for role, p in pools.items())
    emit(args, "validate", {"environment": spec.environment.name, "valid": True, "mode": spec.deployment.mode,
                            "pools": pools},
         lambda: console.print(f"[green]ok[/green] {spec.environment.name}: {spec.deployment.mode}, {text}"))
    return 0
