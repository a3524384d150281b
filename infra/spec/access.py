"""Who may call the service: the gateway, its domains and certificate, the address allowlist and
the API keys with their rate limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from infra.inputs import Strict
from infra.naming import is_dns_subdomain
from infra.spec._base import _DNS_LABEL, PositiveInt, _checked, _cidr_list, _dns_label, _dns_subdomain, repeated


class ApiKeySpec(Strict):
    name: str
    requests_per_minute: PositiveInt

    _dns = field_validator("name")(classmethod(lambda cls, v: _dns_label(v)))


class AccessSpec(Strict):
    domains: list[str] = Field(min_length=1)
    tls_secret_name: str = Field(description="Existing Secret with the certificate (cert-manager).")

    _names = field_validator("tls_secret_name")(classmethod(lambda cls, v: _dns_subdomain(v)))
    _domains = field_validator("domains")(classmethod(lambda cls, v: [_dns_subdomain(d) for d in v]))
    gateway_class: str = Field("envoy-gateway", description="A GatewayClass of Envoy Gateway (its policies carry auth and rate limits).")
    gateway_namespace: str = Field("envoy-gateway-system", description="Where the gateway's proxy pods run.")
    allowlist_cidrs: list[str] = Field(min_length=1)
    api_keys: list[ApiKeySpec] = Field(min_length=1)
    gateway_replicas: PositiveInt = Field(2, description="Envoy proxy replicas of this environment's Gateway.")
    rate_limit_scope: Literal["local", "global"] = Field(
        "local", description="local: each Envoy replica counts on its own, so each gets its share of a key's "
                             "limit (requests_per_minute / gateway_replicas, rounded up). global: Envoy Gateway's "
                             "rate-limit service counts across replicas (needs its Redis backend enabled).")

    _cidrs = field_validator("allowlist_cidrs")(classmethod(lambda cls, v: _cidr_list(v, "10.0.0.0/8")))
    _class = field_validator("gateway_class")(_checked(is_dns_subdomain, "is not a GatewayClass name. Fix: e.g. "
                                                                         "envoy-gateway"))
    _gw_ns = field_validator("gateway_namespace")(_checked(lambda v: _DNS_LABEL.fullmatch(v) and len(v) <= 63,
                                                           "is not a namespace name. Fix: e.g. envoy-gateway-system"))

    @field_validator("api_keys")
    @classmethod
    def _unique_key_names(cls, v: list[ApiKeySpec]) -> list[ApiKeySpec]:
        twice = repeated([k.name for k in v])
        if twice:
            raise ValueError(f"API key name(s) {', '.join(twice)} appear more than once (each is a client id "
                             "and a key in one Secret). Fix: give every key its own name")
        return v
