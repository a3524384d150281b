"""A catalog row's chart built from its source in the pinned Go module, for
`controllers.chart_source: pinned-modules`: clusters that reach no chart registry (air-gapped
ones, and the cluster twin).

A chart's source at a release tag is not quite the chart its project publishes. The release
stamps the chart's version (the source's Chart.yaml says v0.0.0, 0.1.0, v0.0.0-latest or
v1.0.0-devel), and the chart's images default to `.Chart.AppVersion`. Envoy Gateway ships its
values as a template: its release fills `values.tmpl.yaml`'s `${...}` placeholders with an image.
`prepared_chart` copies the chart folder out of the read-only module cache into
`.pdstack/charts/<row>-<version>/`. It sets `version` to the module's pinned version and
`appVersion` to the row's release (the images that release published). It writes `values.yaml`
from a `values.tmpl.yaml` with each placeholder left null, so the chart's own default applies;
Envoy Gateway's is `docker.io/envoyproxy/gateway:{{ .Chart.Version }}`
(charts/gateway-helm/templates/_helpers.tpl at v1.9.0). What the copy came from is written
beside it in ORIGIN.json.

Not done: image tags the source's values set outright. LWS's values.yaml names tag `main`, so
set a mirror's images through the row's values. The GPU operator's module is a commit, not the
v25.3.4 release (twin/platform/go.mod says why): its chart is that commit's, with appVersion v25.3.4.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from infra.platform_stack.catalog import Controller
from infra.platform_stack.modules import REPO_ROOT, module_dir, pin
from infra.rollout.faultpoints import process_alive

CHARTS_DIR = REPO_ROOT / ".pdstack" / "charts"
_PLACEHOLDER = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")


def chart_origin(row: Controller) -> dict[str, str]:
    source = row.values_source
    return {**pin(source.module).origin(source.path), "row": row.name, "app_version": row.version}


def prepared_chart(row: Controller, charts_dir: Path = CHARTS_DIR) -> Path:
    """The row's chart folder, ready for `helm template` (helm.v4.Chart with a local path).

    It is made once per row and version. It is written to a temporary folder and renamed into
    place, so a killed run leaves no half-made chart, and two runs at once both get a whole one."""
    origin = chart_origin(row)
    target = charts_dir / f"{row.name}-{origin['version']}"
    stamp = target / "ORIGIN.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == origin:
        return target
    charts_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_work(charts_dir, row.name)
    work = Path(tempfile.mkdtemp(prefix=f".{row.name}-{os.getpid()}-", dir=charts_dir))
    try:
        chart = work / "chart"
        shutil.copytree(module_dir(row.values_source.module) / row.values_source.path, chart,
                        copy_function=shutil.copyfile)
        # The module cache is read-only and copytree copies a folder's mode: make the copy
        # writable, or it could not be stamped, nor removed later.
        for folder, _, _ in os.walk(chart):
            os.chmod(folder, 0o755)
        _stamp(chart / "Chart.yaml", version=origin["version"], app_version=row.version)
        template = chart / "values.tmpl.yaml"
        if template.is_file() and not (chart / "values.yaml").exists():
            (chart / "values.yaml").write_text(_PLACEHOLDER.sub("null", template.read_text()))
        (chart / "ORIGIN.json").write_text(json.dumps(origin, indent=1, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)  # a copy of another version's origin, or one without its stamp
        try:
            os.rename(chart, target)
        except OSError:
            if not (target / "ORIGIN.json").is_file():  # not another run that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _remove_abandoned_work(charts_dir: Path, row_name: str) -> None:
    """The work folders of runs that were killed half way (`.<row>-<pid>-*`, whose process is
    gone): litter, never a chart anyone reads, since only a whole one is renamed into place."""
    for work in charts_dir.glob(f".{row_name}-*-*"):
        pid = work.name[len(row_name) + 2:].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _stamp(chart_yaml: Path, version: str, app_version: str) -> None:
    meta = yaml.safe_load(chart_yaml.read_text())
    meta["version"] = version
    meta["appVersion"] = app_version
    chart_yaml.write_text(yaml.safe_dump(meta, sort_keys=False))


# A hook annotation as templates write it: helm.sh/hook: <events>, the key and value quoted or not.
_HOOK_LINE = re.compile(r"""^\s*["']?helm\.sh/hook["']?\s*:\s*(.+?)\s*(?:#.*)?$""")
HOOK_KEY = "helm.sh/hook"


def _events(value: str) -> frozenset[str]:
    """The events of a hook annotation's value; one set from a value (a template expression
    that Helm fills in) stays whole, so it must be listed as it is written."""
    value = value.strip().strip("\"'")
    if "{{" in value:
        return frozenset({value})
    return frozenset(e.strip() for e in value.split(",") if e.strip())


def chart_hooks(folder: Path) -> dict[str, frozenset[str]]:
    """Where a chart's source makes Helm hooks, and at which events: each template (its
    subcharts' too) annotated `helm.sh/hook`, and each values map that sets the annotation for a
    template to copy (cert-manager's startupapicheck.jobAnnotations), as `<values file>:<path>`.
    Read from the source, not rendered: a hook behind a condition the values turn off is listed
    too, so every hook a chart can make is accounted for."""
    found: dict[str, frozenset[str]] = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if not path.is_file():
            continue
        if "templates" in path.relative_to(folder).parts[:-1]:
            events = frozenset().union(*(_events(m.group(1)) for m in map(_HOOK_LINE.match, path.read_text().splitlines())
                                         if m))
            if events:
                found[relative] = events
        elif path.name in ("values.yaml", "values.tmpl.yaml"):
            for where, value in _hook_values(yaml.safe_load(path.read_text()) or {}):
                found[f"{relative}:{where}"] = _events(str(value))
    return found


def _hook_values(node, where: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == HOOK_KEY:
                yield where, value
            else:
                yield from _hook_values(value, f"{where}.{key}" if where else str(key))
