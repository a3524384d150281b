"""`pdctl diff`'s report as Markdown (the pull-request comment), plain text and a JSON-ready
mapping. One summary, three renderings; no rich markup here (the CLI adds colour)."""

from __future__ import annotations

from dataclasses import asdict

from infra.review.diff import IMPACT_CLASSES, FleetDiff

COMMENT_MARKER = "<!-- pdstack-diff -->"  # the workflow finds and updates its own comment by this line

def redacted(render):
    """Every rendering goes out through the one redaction (infra/redaction.py)."""
    import functools

    from infra.redaction import redact_data, redact_text

    @functools.wraps(render)
    def wrapper(*args, **kwargs):
        out = render(*args, **kwargs)
        return redact_text(out) if isinstance(out, str) else redact_data(out)
    return wrapper


_LABEL = {"restart": "GPU restart", "track": "needs a release track", "node-replacement": "node replacement",
          "roll": "pods roll",
          "scale": "scale", "traffic": "traffic", "config": "in place", "create": "create", "delete": "delete",
          "policy": "policy regression"}


def summary_line(d: FleetDiff) -> str:
    if d.empty:
        return f"{d.environment}: no changes"
    counts = {a: sum(1 for c in d.changes if c.action == a) for a in ("create", "update", "delete")}
    classes = [_LABEL[k] for k in IMPACT_CLASSES if k in d.classes()]
    minutes = d.gpu_minutes()
    return (f"{d.environment}: {counts['create']} to create, {counts['update']} to change, {counts['delete']} to delete"
            f"; impact: {', '.join(classes) or 'none'}"
            + (f"; about {minutes:,.0f} GPU-minutes out of service while it rolls" if minutes else ""))


@redacted
def as_data(d: FleetDiff) -> dict:
    return {"environment": d.environment, "empty": d.empty, "summary": summary_line(d),
            "impact_classes": [k for k in IMPACT_CLASSES if k in d.classes()],
            "gpu_minutes": round(d.gpu_minutes(), 1),
            "impacts": [asdict(i) | {"class": i.klass} for i in d.impacts],
            "changes": [{"action": c.action, "layer": c.layer, "kind": c.kind, "name": c.name,
                         "fields": [asdict(f) for f in c.fields]} for c in d.changes],
            "engine_flags": [asdict(f) for f in d.flags], "images": [asdict(i) for i in d.images],
            "not_applied": d.notes,
            "policy": {"new": d.policy_new, "fixed": d.policy_fixed}}


def _short(text: str, most: int = 80) -> str:
    """Long values keep both ends: image digests and paths differ at either. Redacted before it
    is cut: a credential cut in half no longer has its shape, and its half would be shown."""
    from infra.redaction import redact_text

    text = redact_text(text)
    return text if len(text) <= most else f"{text[:most // 2 - 2]}...{text[-(most // 2 - 1):]}"


def _value(v) -> str:
    text = "(unset)" if v is None else str(v)
    if "\n" in text:
        return f"({text.count(chr(10)) + 1} lines)"
    return _short(text)


def _field_lines(f, indent: str, most: int = 8) -> list[str]:
    """One line per changed field; a changed text (a script, a config file) as its changed lines."""
    if isinstance(f.before, str) and isinstance(f.after, str) and "\n" in f.before + f.after:
        import difflib

        changed = [line for line in difflib.unified_diff(f.before.splitlines(), f.after.splitlines(), lineterm="", n=0)
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        shown = [f"{indent}  {line[0]} {_short(line[1:].strip(), 110)}" for line in changed[:most]]
        more = [f"{indent}  ... {len(changed) - most} more changed lines"] if len(changed) > most else []
        return [f"{indent}{f.path}:"] + shown + more
    return [f"{indent}{f.path}: {_value(f.before)} -> {_value(f.after)}"]


@redacted
def markdown(d: FleetDiff, against: str) -> str:
    lines = [COMMENT_MARKER, f"### pdstack diff: `{d.environment}` against {against}", "", f"**{summary_line(d)}**"]
    if d.empty:
        return "\n".join(lines) + "\n"
    if d.impacts:
        lines += ["", "| impact | resource | what happens | GPU-min |", "| --- | --- | --- | ---: |"]
        for i in sorted(d.impacts, key=lambda i: IMPACT_CLASSES.index(i.klass)):
            lines.append(f"| {_LABEL[i.klass]} | `{i.resource}` | {i.detail.replace('|', '/')} | "
                         f"{i.gpu_minutes:,.0f} |" if i.gpu_minutes else
                         f"| {_LABEL[i.klass]} | `{i.resource}` | {i.detail.replace('|', '/')} | |")
    if d.notes:
        lines += ["", "**Not applied by `pulumi up`**", ""] + [f"- {n}" for n in d.notes]
    if d.flags:
        lines += ["", "**Engine command lines**", "", "| role | flag | before | after |", "| --- | --- | --- | --- |"]
        lines += [f"| {f.role} | `{f.flag}` | {_value(f.before)} | {_value(f.after)} |" for f in d.flags]
    if d.images:
        lines += ["", "**Images and versions**", ""] + [f"- {i.path}: `{_value(i.before)}` -> `{_value(i.after)}`"
                                                         for i in d.images]
    if d.policy_new or d.policy_fixed:
        lines += ["", "**Policy**", ""] + [f"- new violation: {p}" for p in d.policy_new] + \
                 [f"- fixed: {p}" for p in d.policy_fixed]
    lines += ["", "<details><summary>Resources by layer</summary>", ""]
    for layer in sorted({c.layer for c in d.changes}):
        lines.append(f"**{layer}**")
        for c in (c for c in d.changes if c.layer == layer):
            lines.append(f"- {c.action} `{c.kind}/{c.name}`")
            for f in c.fields[:20]:
                _, *changed = _field_lines(f, "")
                if changed:  # a changed text: its changed lines, as a diff inside the list item
                    lines += [f"  - `{f.path}`", "    ```diff", *[f"    {r.strip()}" for r in changed], "    ```"]
                else:
                    lines.append(f"  - `{f.path}`: {_value(f.before)} -> {_value(f.after)}")
            if len(c.fields) > 20:
                lines.append(f"  - and {len(c.fields) - 20} more fields")
    lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


@redacted
def text(d: FleetDiff, against: str) -> str:
    lines = [f"pdstack diff of {d.environment} against {against}", summary_line(d)]
    if d.empty:
        return "\n".join(lines) + "\n"
    for i in sorted(d.impacts, key=lambda i: IMPACT_CLASSES.index(i.klass)):
        lines.append(f"  [{_LABEL[i.klass]}] {i.resource}: {i.detail}"
                     + (f" (~{i.gpu_minutes:,.0f} GPU-minutes)" if i.gpu_minutes else ""))
    for n in d.notes:
        lines.append(f"  not applied: {n}")
    for f in d.flags:
        lines.append(f"  flag {f.role} {f.flag}: {_value(f.before)} -> {_value(f.after)}")
    for i in d.images:
        lines.append(f"  image {i.path}: {_value(i.before)} -> {_value(i.after)}")
    for p in d.policy_new:
        lines.append(f"  policy, new violation: {p}")
    for p in d.policy_fixed:
        lines.append(f"  policy, fixed: {p}")
    for c in d.changes:
        lines.append(f"  {'+' if c.action == 'create' else '-' if c.action == 'delete' else '~'} {c.layer}: "
                     f"{c.kind}/{c.name}")
        for f in c.fields:
            lines += _field_lines(f, "      ")
    return "\n".join(lines) + "\n"
