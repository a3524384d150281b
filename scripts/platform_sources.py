"""Fetch the Go modules the platform catalog reads (infra/platform_stack/catalog.py) and extract each
chart's own values into infra/platform_stack/pinned/, with the origin of every file.

Each module is pinned once in twin/*/go.mod and verified by its go.sum (`go mod download`);
what is kept is the chart's Chart.yaml name and versions, its values.yaml (values.tmpl.yaml
where the project generates values.yaml at release) and its values.schema.json if it has one:
what infra/platform_stack/values.py checks pdstack's values against. CRDs and manifests are read
from the module cache when the program runs, not copied.

    python scripts/platform_sources.py            # download, then rewrite infra/platform_stack/pinned/
    python scripts/platform_sources.py --check    # exit 1 if infra/platform_stack/pinned/ differs

A chart published from a git repository that is no Go module (a row's `values_git`: the EFA device
plugin's, from aws/eks-charts) is read from a checkout of that repository, at the commit the row
names, into infra/platform_stack/pinned_from_git/:

    python scripts/platform_sources.py --git-checkout github.com/aws/eks-charts=../eks-charts

Without a checkout (no route to GitHub here), its committed record is only held to the row: the
same repository, commit, folder and chart version.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml
from generated import write_or_check

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.platform_stack.catalog import CATALOG, modules_used  # noqa: E402
from infra.platform_stack.modules import module_dir, pin  # noqa: E402
from infra.platform_stack.values import PINNED, PINNED_FROM_GIT  # noqa: E402


def record(origin: dict, read, chart_path: str) -> str:
    """The chart's own values as values.py reads them; `read(path)` is a file's text, or None."""
    chart = yaml.safe_load(read(f"{chart_path}/Chart.yaml"))
    values_file = next(f for f in ("values.yaml", "values.tmpl.yaml") if read(f"{chart_path}/{f}") is not None)
    schema = read(f"{chart_path}/values.schema.json")
    data = {
        "origin": {**origin, "path": f"{chart_path}/{values_file}",
                   "schema": f"{chart_path}/values.schema.json" if schema is not None else None},
        "chart": {k: str(chart.get(k)) for k in ("name", "version", "appVersion")},
        "defaults": yaml.safe_load(read(f"{chart_path}/{values_file}")) or {},
        "schema": json.loads(schema) if schema is not None else None,
    }
    return json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"


def extract(name: str, module: str, chart_path: str) -> str:
    root = module_dir(module)

    def read(path: str) -> str | None:
        return (root / path).read_text() if (root / path).is_file() else None

    return record(pin(module).origin(chart_path), read, chart_path)


def extract_from_git(row, checkout: Path) -> str:
    """The row's chart values at its commit in a checkout of its repository (`git show`: the
    checkout's work tree, wherever it stands, is not read)."""
    source = row.values_git

    def read(path: str) -> str | None:
        done = subprocess.run(["git", "-C", str(checkout), "show", f"{source.commit}:{path}"],
                              capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    if read(f"{source.path}/Chart.yaml") is None:
        raise SystemExit(f"{checkout}: no {source.path}/Chart.yaml at {source.commit}. Fix: a checkout of "
                         f"{source.repository} that has that commit (git fetch)")
    text = record({"repository": source.repository, "commit": source.commit, "version": row.chart.version},
                  read, source.path)
    found = json.loads(text)["chart"]["version"]
    if found != row.chart.version:
        raise SystemExit(f"{row.name}: {source.repository}@{source.commit} {source.path} is chart {found}; the row "
                         f"installs {row.chart.version}. Fix: the commit that published {row.chart.version}")
    return text


def git_record_matches_row(row) -> bool:
    """Without a checkout: the committed record is of the row's repository, commit, folder and chart version."""
    path = PINNED_FROM_GIT / f"{row.name}.json"
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    origin, source = data["origin"], row.values_git
    return (origin.get("repository"), origin.get("commit"), origin["path"].rsplit("/", 1)[0],
            data["chart"]["version"]) == (source.repository, source.commit, source.path, row.chart.version)


def wanted() -> dict[str, str]:
    return {f"{c.name}.json": extract(c.name, c.values_source.module, c.values_source.path)
            for c in CATALOG if c.values_source}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    p.add_argument("--git-checkout", action="append", default=[], metavar="REPOSITORY=PATH",
                   help="a checkout of a git repository a row's chart is read from (the row's values_git)")
    args = p.parse_args(argv)
    checkouts = dict(c.split("=", 1) for c in args.git_checkout)
    for module in modules_used():
        print(f"{module}@{pin(module).version}: {module_dir(module)}")
    PINNED.mkdir(exist_ok=True)
    status = write_or_check({PINNED / n: text for n, text in wanted().items()}, args.check, "the pinned modules",
                            "python scripts/platform_sources.py")
    for row in (c for c in CATALOG if c.values_git):
        source = row.values_git
        if source.repository in checkouts:
            PINNED_FROM_GIT.mkdir(exist_ok=True)
            status |= write_or_check({PINNED_FROM_GIT / f"{row.name}.json": extract_from_git(row, Path(checkouts[
                source.repository]))}, args.check, f"{source.repository}@{source.commit}",
                f"python scripts/platform_sources.py --git-checkout {source.repository}=<checkout>")
        elif git_record_matches_row(row):
            print(f"infra/platform_stack/pinned_from_git/{row.name}.json: of {source.repository}@{source.commit} "
                  f"{source.path}, chart {row.chart.version}, as the row says (not read again: no --git-checkout)")
        else:
            print(f"infra/platform_stack/pinned_from_git/{row.name}.json: missing, or not of the row's repository, "
                  f"commit, folder and chart version. Fix: python scripts/platform_sources.py --git-checkout "
                  f"{source.repository}=<checkout>")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
