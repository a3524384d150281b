"""The bottom of the spec package: where the project lives, the field types and the validators
every layer's models share (names, URLs, address ranges), and the error a spec that cannot be
deployed raises. Imports nothing of the package."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from pathlib import Path
from typing import Annotated

from pydantic import Field

from infra.naming import is_dns_subdomain


REPO_ROOT = Path(__file__).resolve().parent.parent.parent
STACKS_DIR = REPO_ROOT / "stacks"


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

PositiveInt = Annotated[int, Field(gt=0)]
Seconds = Annotated[float, Field(gt=0)]


def _dns_label(v: str, most: int = 63) -> str:
    if not _DNS_LABEL.match(v):
        raise ValueError(f"{v!r} is not a DNS label. Fix: lower-case letters, digits and '-'")
    if len(v) > most:
        raise ValueError(f"{v!r} has {len(v)} characters; at most {most} fit"
                         + (" (a DNS label is 63 at most)" if most == 63 else
                            " (release tracks run in '<namespace>-r<revision>', itself a DNS label of 63 at most)")
                         + ". Fix: shorten it")
    return v


NAMESPACE_MAX = 63 - len("-r9999")  # room for the release-track suffix (infra/tracks.py)


_SECRET_QUERY_KEYS = re.compile(r"(key|token|secret|password|passwd|signature|sig|credential|auth)", re.I)


def _url_without_credentials(v: str | None) -> str | None:
    """A URL in the spec may name a host, never carry a secret: specs live in git and in plain
    ConfigMaps. Credentials come from Kubernetes Secrets (e.g. weights.credentials_secret)."""
    if v is None:
        return v
    parsed = urllib.parse.urlsplit(v)
    if parsed.username or parsed.password:
        raise ValueError("the URL carries credentials (user:password@). Fix: remove them; the credentials "
                         "belong in a Kubernetes Secret the component reads")
    leaked = [k for k, _ in urllib.parse.parse_qsl(parsed.query) if _SECRET_QUERY_KEYS.search(k)]
    if leaked:
        raise ValueError(f"the URL's query carries {', '.join(leaked)}, which looks like a credential. Fix: "
                         "remove it; the credentials belong in a Kubernetes Secret")
    return v


def _service_url(v: str | None) -> str | None:
    """An http(s) URL of a service (no credentials in it): what a component will connect to."""
    if v is None:
        return v
    try:
        parsed = urllib.parse.urlsplit(v)
        parsed.port  # noqa: B018 - raises for a port out of range
    except ValueError as exc:
        raise ValueError(f"{v!r} is not a URL ({exc}). Fix: e.g. http://name.namespace.svc:port") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{v[:80]!r} is not an http:// or https:// URL with a host. Fix: e.g. "
                         "http://name.namespace.svc:port")
    return _url_without_credentials(v)


def _dns_subdomain(v: str) -> str:
    if not is_dns_subdomain(v.removeprefix("*.")):
        raise ValueError(f"{v[:80]!r} is not a DNS name (lower-case labels of letters, digits and '-', at most 63 "
                         "each and 253 in all). Fix: correct it")
    return v


def _shown(v: str) -> str:
    return repr(v[:80])


def _checked(test, fix: str):
    """A field validator: `test(v)` must hold, else the value (cut, quoted) and the fix. Every
    string that reaches a rendered script, a command line or a path is held to what the system
    that reads it accepts, so no spec value can be read as shell syntax, an option or a path
    elsewhere."""
    def check(cls, v):
        if v is not None and not test(v):
            raise ValueError(f"{_shown(v)} {fix}")
        return v
    return classmethod(check)


_REGION = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,30}[a-z0-9])?")  # us-east-1; a MinIO/RGW zone group like "default"


def is_aws_s3(endpoint_url: str) -> bool:
    host = urllib.parse.urlsplit(endpoint_url).hostname or ""
    return host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")


def _cidr_list(v: list[str], example: str) -> list[str]:
    for cidr in v:
        try:
            ipaddress.ip_network(cidr, strict=True)
        except ValueError as exc:
            raise ValueError(f"{cidr!r} is not a CIDR ({exc}). Fix: e.g. '{example}'") from None
        if ipaddress.ip_network(cidr).prefixlen == 0:
            raise ValueError(f"{cidr!r} allows the whole internet. Fix: name the address ranges")
    return v


def repeated(values: list[str]) -> list[str]:
    """The values listed more than once, sorted: what a list whose items must be unique refuses."""
    return sorted({v for v in values if values.count(v) > 1})


class SpecError(ValueError):
    """A spec that cannot be deployed. `problems` holds one line per field: path, what, fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid spec:\n" + "\n".join(f"  - {p}" for p in problems))


def stack_spec_path(stack: str) -> Path:
    """The spec file of a named stack (Pulumi.<stack>.yaml selects the same name)."""
    return STACKS_DIR / f"{stack}.yaml"
