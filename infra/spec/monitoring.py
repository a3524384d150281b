"""What the stack is held to and how it is watched: the SLOs, traces and metrics scraping."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from infra.inputs import Strict
from infra.spec._base import PositiveInt, _service_url


class SLOSpec(Strict):
    ttft_p99_ms: Annotated[float, Field(gt=0)]
    tpot_p99_ms: Annotated[float, Field(gt=0)]
    tokens_per_second_per_user: Annotated[float, Field(gt=0)]
    max_error_rate: Annotated[float, Field(ge=0, lt=1)] = 0.01


class ObservabilitySpec(Strict):
    otlp_endpoint: str | None = Field(
        None, description="Where traces go (OTLP/gRPC), e.g. http://tempo.observability:4317. When set, an "
                          "OpenTelemetry Collector in the namespace receives every hop's spans and forwards them.")
    trace_sample_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        0.05, description="Share of traces the collector keeps (by trace id, so a request is kept whole).")
    scrape_interval_seconds: PositiveInt = 15

    _url = field_validator("otlp_endpoint")(classmethod(lambda cls, v: _service_url(v)))
