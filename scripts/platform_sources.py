"""Fetch the Go modules the platform catalog reads (infra/platform_stack/catalog.py) and extract each
chart's own values into infra/platform_stack/pinned/, with the origin of every file.

Each module is pinned once in twin/*/go.mod and verified by its go.sum (`go mod download`);
what is kept is the chart's Chart.yaml name and versions, its values.yaml (values.tmpl.yaml
where the project generates values.yaml at release) and its values.schema.json if it has one:
what infra/platform_stack/values.py checks pdstack's values against. CRDs and manifests are read
from the module cache when the program runs, not copied.

    python scripts/platform_sources.py            # download, then rewrite infra/platform_stack/pinned/
    python scripts/platform_sources.py --check    # exit 1 if infra/platform_stack/pinned/ differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from generated import write_or_check

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.platform_stack.catalog import CATALOG, modules_used  # noqa: E402
from infra.platform_stack.modules import module_dir, pin  # noqa: E402
from infra.platform_stack.values import PINNED  # noqa: E402


def extract(name: str, module: str, chart_path: str) -> str:
    folder = module_dir(module) / chart_path
    chart = yaml.safe_load((folder / "Chart.yaml").read_text())
    values_file = next(f for f in ("values.yaml", "values.tmpl.yaml") if (folder / f).is_file())
    schema = folder / "values.schema.json"
    record = {
        "origin": {**pin(module).origin(f"{chart_path}/{values_file}"),
                   "schema": f"{chart_path}/values.schema.json" if schema.is_file() else None},
        "chart": {k: str(chart.get(k)) for k in ("name", "version", "appVersion")},
        "defaults": yaml.safe_load((folder / values_file).read_text()) or {},
        "schema": json.loads(schema.read_text()) if schema.is_file() else None,
    }
    return json.dumps(record, indent=1, sort_keys=True, default=str) + "\n"


def wanted() -> dict[str, str]:
    return {f"{c.name}.json": extract(c.name, c.values_source.module, c.values_source.path)
            for c in CATALOG if c.values_source}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = p.parse_args(argv)
    for module in modules_used():
        print(f"{module}@{pin(module).version}: {module_dir(module)}")
    PINNED.mkdir(exist_ok=True)
    return write_or_check({PINNED / n: text for n, text in wanted().items()}, args.check, "the pinned modules",
                          "python scripts/platform_sources.py")


if __name__ == "__main__":
    sys.exit(main())
