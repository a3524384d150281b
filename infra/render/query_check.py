"""A PromQL query against the series the pinned engines really expose. Pure.

Parses with promql-parser (GreptimeTeam's Rust PromQL parser, the grammar Prometheus accepts) and
checks every vector selector and grouping: the series must be one the engine exposes
(infra.render.metrics.exposed_series: a Summary has no bare series, a Counter only `_total`), a
label matcher must name a label the metric carries or one the scrape adds, `by (...)` may group
only by labels the aggregated series carry, and histogram_quantile needs `le`.
"""

from __future__ import annotations

from infra.render import metrics

PREFIXES = {"sglang": "sglang:", "vllm": "vllm:"}


def _labels(series: str, engine: str, problems: list[str]) -> set[str] | None:
    """Label names a series carries (None: not an engine series, or not known)."""
    if series.startswith("DCGM_"):
        if series not in metrics.DCGM_METRICS:
            problems.append(f"{series}: not one of dcgm-exporter's default counters")
        return None
    if not series.startswith(PREFIXES[engine]):
        return None
    found = metrics.exposed_series(engine).get(series)
    if found is None:
        known = [s for s in metrics.exposed_series(engine) if s.startswith(series)]
        hint = f" (it exposes {', '.join(sorted(known))})" if known else ""
        problems.append(f"{series}: no such series in {engine} {metrics.ENGINE_VERSIONS[engine]}{hint}")
        return None
    name, entry = found
    if entry["labels"] is None:
        problems.append(f"{series}: labels of {name} unknown ({entry.get('labels_from')}); cannot check")
        return None
    extra = {"le"} if series.endswith("_bucket") else set()
    return {*entry["labels"], *entry["optional_labels"], *metrics.TARGET_LABELS, *extra}


def query_problems(expr: str, engine: str) -> list[str]:
    import promql_parser

    problems: list[str] = []
    try:
        tree = promql_parser.parse(expr)
    except Exception as exc:  # the parser raises its own error types
        return [f"does not parse: {exc}"]

    def walk(node) -> set[str] | None:
        """Labels the node's result carries (None: unknown, anything goes)."""
        kind = type(node).__name__
        if kind == "VectorSelector":
            carried = _labels(node.name, engine, problems) if node.name else None
            if carried is not None:
                for m in node.matchers.matchers:
                    if m.name not in carried:
                        problems.append(f"{node.name}: matcher on {m.name!r}, a label it does not carry "
                                        f"(it has {', '.join(sorted(carried - metrics.TARGET_LABELS))})")
            return carried
        if kind == "MatrixSelector":
            return walk(node.vector_selector)
        if kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
            return walk(node.expr)
        if kind == "AggregateExpr":
            inner = walk(node.expr)
            if node.param is not None:
                walk(node.param)
            modifier = node.modifier
            if modifier is None:
                return set()
            grouping = set(modifier.labels)
            if "By" in str(modifier.type):
                if inner is not None and grouping - inner:
                    problems.append(f"by ({', '.join(sorted(grouping))}): {', '.join(sorted(grouping - inner))} "
                                    f"not on the aggregated series")
                return grouping
            return None if inner is None else inner - grouping
        if kind == "Call":
            results = [walk(a) for a in node.args]
            name = node.func.name
            vectors = [r for r in results if r is not None]
            if name == "histogram_quantile":
                if results[1] is not None and "le" not in results[1]:
                    problems.append("histogram_quantile over series without 'le'")
                return None if results[1] is None else results[1] - {"le"}
            if name == "label_replace":
                return None if results[0] is None else results[0] | {node.args[1].val}
            if name in ("vector", "scalar", "time"):
                return set()
            return vectors[0] if vectors else None
        if kind == "BinaryExpr":
            left, right = walk(node.lhs), walk(node.rhs)
            return left if left is not None else right
        return set()

    walk(tree)
    return problems
