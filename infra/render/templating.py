"""The one jinja2 environment: every text pdstack renders comes from templates/."""

from __future__ import annotations

import functools
import shlex

import jinja2

from infra.spec import REPO_ROOT

TEMPLATES_DIR = REPO_ROOT / "templates"


def shell_arg(value: str) -> str:
    """Quote one argument for /bin/sh, leaving ${VAR} and "$@" references expandable."""
    if value == '"$@"':
        return value
    if "${" in value:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
    return shlex.quote(value)


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
    return env


def render_template(name: str, **values) -> str:
    return environment().get_template(name).render(**values)
