"""The one jinja2 environment: every text pdstack renders comes from templates/."""

from __future__ import annotations

import functools
import re
import shlex

import jinja2

from infra.spec import REPO_ROOT

TEMPLATES_DIR = REPO_ROOT / "templates"


# The only shell variables a launch script expands: the ones its own prelude sets from what
# LeaderWorkerSet injects (infra/render/engine_args.py, _rank_prelude). Anything else, however
# it looks, is quoted whole.
EXPANDED_VARIABLES = ("NNODES", "NODE_RANK", "LEADER", "START_RANK")
_EXPANDABLE = re.compile(r"(?:\$\{(?:" + "|".join(EXPANDED_VARIABLES) + r")\}|[A-Za-z0-9_.,:/=+@%-])+")


def shell_arg(value: str) -> str:
    """Quote one argument for /bin/sh, so that it arrives as exactly that one argument.

    Two exceptions, both written by pdstack itself: `"$@"` (the prelude's per-rank flags), and
    a value made only of ${NNODES}-style references to the prelude's variables and characters
    the shell gives no meaning to, which is double-quoted so the reference expands. A spec
    value can never be either: a `$(...)`, a backtick, a quote or a newline sends it through
    shlex.quote, which the shell reads as literal text."""
    if value == '"$@"':
        return value
    if "${" in value and _EXPANDABLE.fullmatch(value):
        return f'"{value}"'
    return shlex.quote(value)


def comment(text: str) -> str:
    """One line of a comment: a newline or other control character in a value (a spec path in a
    note) would otherwise end the comment and start a command."""
    return re.sub(r"[\x00-\x1f\x7f]", " ", str(text))


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["shell_arg"] = shell_arg
    env.filters["comment"] = comment
    return env


def render_template(name: str, **values) -> str:
    return environment().get_template(name).render(**values)
