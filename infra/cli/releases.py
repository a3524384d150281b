"""`pdctl releases`: every revision, its status and its traffic, from the release store."""

from __future__ import annotations

import argparse

from rich.markup import escape

from infra.cli.common import emit, print_table, spec_from_args, with_spec
from infra.cli.rollout import RELEASES_HELP, store


def register(sub) -> None:
    p = with_spec(sub.add_parser("releases", help="list revisions, their status and traffic"), output=True)
    p.add_argument("--releases", help=RELEASES_HELP)
    p.set_defaults(func=cmd_releases)


def cmd_releases(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    releases = store(args, spec)
    traffic = releases.traffic()
    revisions = []
    for rev in releases.revisions():
        r = releases.get(rev)
        revisions.append({"revision": rev, "created_at": r.created_at, "author": r.author,
                          "status": releases.status(rev), "traffic_percent": traffic.get(rev, 0),
                          "message": r.message})
    # Author and message come plain from the record (records.PlainLine); as text they are also
    # not rich markup (`[link=...]` in a message must be shown, not made a link).
    emit(args, "releases", {"environment": spec.environment.name, "revisions": revisions},
         lambda: print_table(f"releases of {spec.environment.name}",
                             ("revision", "created", "author", "status", "traffic", "message"),
                             [(str(r["revision"]), r["created_at"], escape(r["author"]), r["status"] or "",
                               f"{r['traffic_percent']}%", escape(r["message"])) for r in revisions]))
    return 0
