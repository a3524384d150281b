"""Extract every Prometheus metric the pinned engines declare: name, type, label names, and where.

Why: an alert or a scaler that reads a series the engine never exports sees no data and never
fires. Names alone are not enough: a Counter `x` is exposed as `x_total`, a Histogram as
`x_bucket`/`x_sum`/`x_count`, a Summary only as `x_sum`/`x_count` (prometheus_client has no
quantiles), and a matcher on a label the metric does not carry selects nothing. This reads the
pinned wheels' Python source (no import, so no torch): every call that builds a prometheus_client
metric (`Counter(name=...)`, `self._gauge_cls(...)`, ...), its type, its `labelnames` (literal,
or a variable resolved in the enclosing function, or a collector's base labels resolved from the
function that builds them, see LABEL_SOURCES), its gauge multiprocess mode, and the collector class
(which process exports it: SGLang's tokenizer metrics come from the HTTP server on the group's
rank-0 node, its scheduler metrics from each scheduler, on every node).

    python scripts/extract_engine_metrics.py                 # the pinned wheels (scripts/pinned_wheels.py)
    python scripts/extract_engine_metrics.py --wheel-dir DIR # or read them from DIR
    python scripts/extract_engine_metrics.py --check         # exit 1 if a committed table differs

writes infra/render/pinned/<engine>-<version>-metrics.json with the wheel's name and sha256.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

from generated import write_or_check
from pinned_wheels import WHEELS, pinned_wheel

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "infra" / "render" / "pinned"
sys.path.insert(0, str(ROOT))

from infra.spec import PINNED_ENGINE_VERSIONS  # noqa: E402  (the one pin of each engine)

ENGINES = {engine: (engine, PINNED_ENGINE_VERSIONS[engine], f"{engine}:") for engine in ("sglang", "vllm")}
TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}

# Collector base labels that arrive as a constructor argument: (engine, class, variable) ->
# (file in the wheel, function that builds them, the variable there). Keys assigned under an
# `if` are optional (present only in some configurations).
LABEL_SOURCES = {
    ("sglang", "SchedulerMetricsCollector", "labels"):
        ("sglang/srt/observability/metrics_collector.py", "SchedulerMetricsCollector.init_new", "labels"),
    ("sglang", "TokenizerMetricsCollector", "labels"):
        ("sglang/srt/observability/metrics_collector.py", "tokenizer_metric_labels", "labels"),
    ("vllm", "NixlPromMetrics", "labelnames"):
        ("vllm/v1/metrics/loggers.py", "PrometheusStatLogger.__init__", "labelnames"),
    ("vllm", "KVConnectorPromMetrics", "labelnames"):
        ("vllm/v1/metrics/loggers.py", "PrometheusStatLogger.__init__", "labelnames"),
}


def metric_type(call: ast.Call) -> str | None:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    name = name.lower().strip("_").removeprefix("prom").removesuffix("_cls")
    return TYPES.get(name)


def kw(call: ast.Call, key: str, pos: int | None = None) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == key:
            return k.value
    if pos is not None and len(call.args) > pos:
        return call.args[pos]
    return None


def const_strs(node: ast.expr) -> list[str] | None:
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                       for e in node.elts):
        return [e.value for e in node.elts]
    return None


def split_labels(node: ast.expr) -> tuple[str | None, list[str]] | None:
    """labelnames expression -> (base variable or None, literal extra labels); None if unreadable."""
    literal = const_strs(node)
    if literal is not None:
        return None, literal
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = split_labels(node.left), split_labels(node.right)
        if left is None or right is None or (left[0] and right[0]):
            return None
        return left[0] or right[0], left[1] + right[1]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple") and node.args:
        return split_labels(node.args[0])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "keys" \
            and isinstance(node.func.value, ast.Name):
        return node.func.value.id, []
    if isinstance(node, ast.Name):
        return node.id, []
    if isinstance(node, (ast.List, ast.Tuple)):
        base, extra = None, []
        for e in node.elts:
            if isinstance(e, ast.Starred):
                inner = split_labels(e.value)
                if inner is None or base:
                    return None
                base, extra = inner[0], extra + inner[1]
            elif isinstance(e, ast.Constant) and isinstance(e.value, str):
                extra.append(e.value)
            else:
                return None
        return base, extra
    return None


def keys_assigned(func: ast.FunctionDef, var: str) -> tuple[list[str], list[str]] | None:
    """Labels a function gives `var`: the keys of the literal it is built from (`var = {...}` or
    `[...]`), and those added later by `var[k] = ...` (optional when added under an `if`)."""
    always: list[str] = []
    optional: list[str] = []
    found = False

    def visit(stmts: list[ast.stmt], conditional: bool) -> None:
        nonlocal found
        for st in stmts:
            if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var for t in st.targets):
                if isinstance(st.value, ast.Dict):
                    found = True
                    always.extend(k.value for k in st.value.keys if isinstance(k, ast.Constant))
                elif const_strs(st.value) is not None:
                    found = True
                    always.extend(const_strs(st.value))
            elif isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == var \
                            and isinstance(t.slice, ast.Constant):
                        (optional if conditional else always).append(t.slice.value)
            elif isinstance(st, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(st, field, []) or [], conditional or not isinstance(st, ast.With))
                for h in getattr(st, "handlers", []):
                    visit(h.body, True)

    visit(func.body, False)
    if not found:
        return None
    return always, [o for o in optional if o not in always]


def functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    """Functions by name, methods also as Class.name (the unqualified name may be ambiguous)."""
    found = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[f"{cls.name}.{item.name}"] = item
    return found


def resolve_base(engine: str, files: dict[str, ast.AST], cls: str | None, func: ast.FunctionDef | None,
                 var: str) -> tuple[list[str], list[str], str] | None:
    if func is not None:
        local = keys_assigned(func, var)
        if local is not None:
            return local[0], local[1], f"{func.name}: {var}"
    source = LABEL_SOURCES.get((engine, cls, var))
    if source is None:
        return None
    path, fname, svar = source
    fn = functions(files[path]).get(fname)
    found = keys_assigned(fn, svar) if fn else None
    if found is None:
        raise SystemExit(f"{path}: {fname} no longer builds {svar}; update LABEL_SOURCES")
    return found[0], found[1], f"{path} {fname}: {svar}"


def extract(engine: str, wheel: Path) -> dict:
    dist, version, prefix = ENGINES[engine]
    data = wheel.read_bytes()
    files: dict[str, ast.AST] = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for name in z.namelist():
            if name.endswith(".py") and "/test" not in name:
                source = z.read(name)
                if prefix.encode() in source:
                    files[name] = ast.parse(source, name)
    metrics: dict[str, dict] = {}
    for path, tree in sorted(files.items()):
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or (kind := metric_type(node)) is None:
                continue
            name = kw(node, "name", 0)
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith(prefix)):
                continue
            func = cls = None
            up = parents.get(node)
            while up is not None:
                if func is None and isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    func = up
                if isinstance(up, ast.ClassDef):
                    cls = up.name
                    break
                up = parents.get(up)
            entry = {"type": kind, "source": f"{path}:{node.lineno}", "collector": cls}
            labels = kw(node, "labelnames", 2)
            if labels is None:
                entry.update(labels=[], optional_labels=[])
            else:
                split = split_labels(labels)
                base = resolve_base(engine, files, cls, func, split[0]) if split and split[0] else None
                if split is None or (split[0] and base is None):
                    entry.update(labels=None, optional_labels=None,
                                 labels_from=ast.unparse(labels) + (f" in {cls}" if cls else ""))
                else:
                    always, optional, where = base or ([], [], None)
                    entry.update(labels=sorted(set(always + split[1])), optional_labels=sorted(set(optional)))
                    if where:
                        entry["base_labels_from"] = where
            mode = kw(node, "multiprocess_mode")
            if kind == "gauge":
                entry["multiprocess_mode"] = mode.value if isinstance(mode, ast.Constant) else "all"
            previous = metrics.get(name.value)
            if previous and (previous["type"], previous["labels"]) != (entry["type"], entry["labels"]):
                entry = {**entry, "also_declared": previous["source"]}
            metrics[name.value] = previous if previous and previous.get("labels") is not None \
                and entry.get("labels") is None else entry
    return {"engine": engine, "package": dist, "version": version, "wheel": wheel.name,
            "sha256": hashlib.sha256(data).hexdigest(), "metrics": dict(sorted(metrics.items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel-dir", type=Path, default=WHEELS,
                   help="folder holding the pinned wheels (default: the upstream cache's wheels/, downloaded once)")
    p.add_argument("--check", action="store_true", help="compare with the committed tables instead of writing; "
                   "exit 1 on a difference")
    args = p.parse_args(argv)
    files = {}
    for engine, (dist, version, _) in ENGINES.items():
        table = extract(engine, pinned_wheel(dist, version, args.wheel_dir))
        files[OUT_DIR / f"{engine}-{version}-metrics.json"] = json.dumps(table, indent=1, sort_keys=True) + "\n"
        unresolved = sum(1 for m in table["metrics"].values() if m["labels"] is None)
        print(f"{engine} {version}: {len(table['metrics'])} metrics, {unresolved} with labels unresolved")
    return write_or_check(files, args.check, "the pinned wheels' source", "python scripts/extract_engine_metrics.py")

if __name__ == "__main__":
    sys.exit(main())
