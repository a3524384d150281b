"""`pdctl images`: what digest and platforms the registry serves for each image a spec names, and
(--write) the spec with them pinned, edited as `plan --write` edits it (infra/spec_edit.py).

A marked placeholder is resolved by its tag; an image already pinned is verified by its digest (the
registry must serve it, and its platforms are read again), so a pin never moves unasked."""

from __future__ import annotations

import argparse

from rich.markup import escape

from infra.cli.common import EXIT_FAILED, console, emit, err_console, print_table, spec_path, with_spec


def register(sub) -> None:
    p = with_spec(sub.add_parser("images", help="resolve each image of a spec to the digest and platforms its "
                                                "registry serves (and --write them)"), output=True)
    p.add_argument("--write", metavar="PATH", help="write the spec with every image pinned to this path (it may be "
                                                   "the spec itself)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per registry request (default 30)")
    p.set_defaults(func=cmd_images)


def cmd_images(args: argparse.Namespace) -> int:
    from infra.images import image_fields, is_placeholder
    from infra.program import load_any_spec
    from infra.registry import RegistryError, resolve

    if not args.timeout > 0:
        from infra.inputs import InputError

        raise InputError(f"--timeout {args.timeout}: not a positive number of seconds. Fix: e.g. --timeout 30")
    path = spec_path(args)
    spec = load_any_spec(path)
    rows, pins, failed = [], {}, []
    for field, ref in image_fields(spec):
        name = ref.partition("@")[0]
        try:
            found = resolve(ref, timeout=args.timeout)
        except RegistryError as exc:
            failed.append(f"{field} ({ref}): {exc}")
            rows.append({"field": field, "reference": ref, "digest": None, "platforms": [], "status": "failed"})
            continue
        pinned = f"{name}@{found.digest}"
        status = "resolved (was a placeholder)" if is_placeholder(ref) else "verified"
        rows.append({"field": field, "reference": pinned, "digest": found.digest, "platforms": list(found.platforms),
                     "other_platforms": list(found.other_platforms), "status": status})
        pins[field] = (pinned, found.platforms)
    if failed:  # all or nothing: a spec half pinned would read as if the rest had been checked
        for line in failed:
            err_console.print(f"[red]{escape(line)}[/red]", highlight=False, soft_wrap=True)
        err_console.print(f"{len(failed)} image(s) not resolved; nothing was written", highlight=False)
    elif args.write:
        from infra.spec_edit import write_pins

        write_pins(path, args.write, pins)

    def text() -> None:
        print_table("images", ("field", "reference", "platforms", "status"),
                    [(r["field"], r["reference"], ", ".join(r["platforms"]) or "-", r["status"]) for r in rows])
        if args.write and not failed:
            console.print(f"wrote {escape(str(args.write))}", highlight=False)

    emit(args, "images", {"spec": str(path), "images": rows, "written": args.write if args.write and not failed
                          else None}, text)
    return EXIT_FAILED if failed else 0
