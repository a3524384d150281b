"""Tracing: every hop sends spans to one OpenTelemetry Collector in the namespace, which
keeps a share of traces (by trace id, so a request stays whole) and forwards them to the
backend the spec names. Pure.

Flag formats, from the pinned packages: SGLang 0.5.23 and sglang-router 0.3.2 take
`--otlp-traces-endpoint <host>:<port>` with `--enable-trace`
(sglang/srt/arg_groups/fields/observability.py, sglang_router/router_args.py); vLLM 0.33.0
takes an endpoint URL (vllm/config/observability.py).
"""

from __future__ import annotations

from urllib.parse import urlparse

from infra import naming
from infra.spec import StackSpec

OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318
COLLECTOR_HEALTH_PORT = 13133


def enabled(spec: StackSpec) -> bool:
    return spec.observability.otlp_endpoint is not None


def collector_host(spec: StackSpec) -> str:
    return naming.service_dns(naming.OTEL_COLLECTOR, spec.environment.namespace)


def engine_trace_args(spec: StackSpec, role: str) -> list[str]:
    if not enabled(spec):
        return []
    if spec.engine.kind == "vllm":
        return ["--otlp-traces-endpoint", f"http://{collector_host(spec)}:{OTLP_GRPC_PORT}"]
    return ["--enable-trace", "--otlp-traces-endpoint", f"{collector_host(spec)}:{OTLP_GRPC_PORT}",
            "--otlp-service-name", f"pdstack-{spec.environment.name}-{role}"]


def router_trace_args(spec: StackSpec) -> list[str]:
    if not enabled(spec):
        return []
    return ["--enable-trace", "--otlp-traces-endpoint", f"{collector_host(spec)}:{OTLP_GRPC_PORT}"]


def backend_port(spec: StackSpec) -> int:
    url = urlparse(spec.observability.otlp_endpoint)
    return url.port or (443 if url.scheme == "https" else OTLP_GRPC_PORT)


def collector_config(spec: StackSpec) -> dict:
    """otelcol-contrib configuration: OTLP in, sample by trace id, batch, OTLP out."""
    backend = urlparse(spec.observability.otlp_endpoint)
    return {
        "receivers": {"otlp": {"protocols": {
            "grpc": {"endpoint": f"0.0.0.0:{OTLP_GRPC_PORT}"},
            "http": {"endpoint": f"0.0.0.0:{OTLP_HTTP_PORT}"}}}},
        "processors": {
            "memory_limiter": {"check_interval": "1s", "limit_percentage": 80, "spike_limit_percentage": 20},
            "probabilistic_sampler": {"sampling_percentage": spec.observability.trace_sample_rate * 100},
            "batch": {"send_batch_size": 2048, "timeout": "5s"},
        },
        "exporters": {"otlp": {
            "endpoint": f"{backend.hostname}:{backend_port(spec)}",
            "tls": {"insecure": backend.scheme != "https"}}},
        "extensions": {"health_check": {"endpoint": f"0.0.0.0:{COLLECTOR_HEALTH_PORT}"}},
        "service": {"extensions": ["health_check"], "pipelines": {"traces": {
            "receivers": ["otlp"], "processors": ["memory_limiter", "probabilistic_sampler", "batch"],
            "exporters": ["otlp"]}}},
    }
