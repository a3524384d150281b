"""A small OCI distribution client: what digest and platforms a registry serves for an image reference.

What it follows, and where each rule comes from:

- Pulling a manifest: `GET /v2/<name>/manifests/<tag or digest>` with an `Accept` of the OCI image
  index and Docker manifest list (multi-platform) and the OCI and Docker image manifests (OCI
  distribution-spec v1.1, spec.md "Pulling manifests"). The digest is the sha256 of the body as
  served; a `Docker-Content-Digest` header that disagrees, or a body that does not hash to the digest
  asked for, is refused (the spec: "the client SHOULD verify the returned manifest's digest").
- Platforms: an index lists each manifest's `platform` (OCI image-spec v1.1, image-index.md);
  entries for `unknown/unknown` are buildx's attestations, not images. A single manifest's
  platform is its config blob's `architecture` (image-spec config.md), fetched and hashed too.
- Authentication: a 401 with `WWW-Authenticate: Bearer realm=...,service=...,scope=...` is answered
  by a token from the realm (`GET realm?service=...&scope=repository:<name>:pull`, with the user's
  credentials as HTTP Basic if any; the JSON's `token` or `access_token`), then the request is sent
  again with `Authorization: Bearer` (distribution's docs/spec/auth/token.md, "Requesting a
  Token"); a `Basic` challenge takes the credentials directly. Credentials come from the Docker
  CLI's config (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`): `credHelpers` /
  `credsStore` run `docker-credential-<helper> get` with the registry on standard input, as the
  Docker CLI does (docker/docker-credential-helpers' protocol), else `auths.<registry>.auth`
  (base64 `user:password`). A credential never reaches a command line, a log or an error message.
- Names: `docker.io` (or no registry) is Docker Hub, served at `registry-1.docker.io`, its one-part
  names under `library/` (github.com/distribution/reference normalize.go); a registry on a loopback
  address is spoken to over plain HTTP, every other over HTTPS (go-containerregistry
  pkg/name/registry.go, `Scheme`), as crane does.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
ACCEPT = ", ".join(INDEX_TYPES + MANIFEST_TYPES)
MAX_DOCUMENT = 4 * 1024 * 1024  # distribution's own limit on a manifest it accepts (4 MiB)
DOCKER_HUB = "docker.io"
DOCKER_HUB_ENDPOINT = "registry-1.docker.io"
DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"  # the key `docker login` stores Docker Hub under
ARCHITECTURES = ("amd64", "arm64")  # what the specs' images.platforms can say
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


class RegistryError(Exception):
    """A registry that cannot be reached, refuses, or serves something that is not what was asked."""


@dataclass(frozen=True)
class ImageName:
    registry: str  # as written (docker.io for Docker Hub)
    repository: str  # path inside the registry (library/... for Docker Hub's official images)
    tag: str | None
    digest: str | None

    @property
    def endpoint(self) -> str:
        return DOCKER_HUB_ENDPOINT if self.registry == DOCKER_HUB else self.registry

    @property
    def scheme(self) -> str:
        host = self.endpoint.rsplit(":", 1)[0] if self.endpoint.count(":") == 1 else self.endpoint
        host = host.strip("[]")
        if host == "localhost":
            return "http"
        try:
            return "http" if ipaddress.ip_address(host).is_loopback else "https"
        except ValueError:
            return "https"


def parse_reference(ref: str) -> ImageName:
    """`[registry/]path[:tag][@sha256:...]` as the Docker CLI reads it (a first part with a '.' or
    ':' or `localhost` is a registry; otherwise the name is Docker Hub's)."""
    name, _, digest = ref.partition("@")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, name
    tag = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, _, tag = path.rpartition(":")
    if registry in (DOCKER_HUB, "index.docker.io"):
        registry = DOCKER_HUB
        path = path if "/" in path else f"library/{path}"
    return ImageName(registry, path, tag, digest or None)


@dataclass(frozen=True)
class Resolved:
    digest: str
    media_type: str
    platforms: tuple[str, ...]  # of ARCHITECTURES, in that order; others the image has are left out
    other_platforms: tuple[str, ...]  # os/architecture entries outside ARCHITECTURES


def docker_config_path() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"


def credentials(registry: str, config: Path | None = None) -> tuple[str, str] | None:
    """(user, secret) for `registry` from the Docker CLI's config, or None (anonymous)."""
    path = config or docker_config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path}: not a Docker config file pdctl can read ({type(exc).__name__}). Fix: correct "
                            "it, or move it away to resolve anonymously") from None
    key = DOCKER_HUB_AUTH_KEY if registry == DOCKER_HUB else registry
    helper = (data.get("credHelpers") or {}).get(key) or data.get("credsStore")
    if helper:
        return _from_helper(helper, key)
    entry = (data.get("auths") or {}).get(key) or {}
    if entry.get("auth"):
        try:
            user, _, secret = base64.b64decode(entry["auth"]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise RegistryError(f"{path}: auths.{key}.auth is not base64 of user:password. Fix: `docker login "
                                f"{registry}` again") from None
        return user, secret
    return None


def _from_helper(helper: str, key: str) -> tuple[str, str] | None:
    if not re.fullmatch(r"[A-Za-z0-9._-]+", helper):
        raise RegistryError(f"{docker_config_path()}: credential helper {helper[:40]!r} is not a helper name. Fix: "
                            "correct credHelpers / credsStore")
    try:
        done = subprocess.run([f"docker-credential-{helper}", "get"], input=key, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RegistryError(f"docker-credential-{helper} could not be run for {key} ({type(exc).__name__}). Fix: "
                            "install it, or remove it from the Docker config") from None
    if done.returncode != 0:  # the helper's "credentials not found in native keychain": anonymous
        return None
    try:
        found = json.loads(done.stdout)
        return found["Username"], found["Secret"]
    except (ValueError, KeyError, TypeError):
        raise RegistryError(f"docker-credential-{helper} answered something other than its JSON for {key}. "
                            "Fix: check the helper") from None


class _KeepCredentialsHome(urllib.request.HTTPRedirectHandler):
    """Registries send blobs from elsewhere (a storage service's signed URL): a redirect to another
    host drops the Authorization header, which urllib would otherwise send along (to a third party,
    which may also refuse a request with two kinds of authentication)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_KeepCredentialsHome)


class RegistryClient:
    """One repository of one registry, pulling only; the authorization a challenge asked for is kept
    for the client's life."""

    def __init__(self, name: ImageName, timeout: float = 30.0, config: Path | None = None):
        self.name = name
        self.base = f"{name.scheme}://{name.endpoint}"
        self.timeout = timeout
        self._config = config
        self._authorization: str | None = None

    def _open(self, url: str, accept: str | None, authorization: str | None):
        headers = {"User-Agent": "pdstack"}
        if accept:
            headers["Accept"] = accept
        if authorization:
            headers["Authorization"] = authorization
        return _OPENER.open(urllib.request.Request(url, headers=headers), timeout=self.timeout)

    def get(self, path: str, accept: str | None = None) -> tuple[bytes, dict[str, str]]:
        """GET `path`, answering one authentication challenge; the body (at most MAX_DOCUMENT) and headers."""
        url = self.base + path
        for attempt in (1, 2):
            try:
                with self._open(url, accept, self._authorization) as resp:
                    body = resp.read(MAX_DOCUMENT + 1)
                    if len(body) > MAX_DOCUMENT:
                        raise RegistryError(f"{url}: the answer is larger than {MAX_DOCUMENT} bytes; not a manifest")
                    return body, {k.lower(): v for k, v in resp.headers.items()}
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and attempt == 1:
                    self._authorization = self._answer(exc.headers.get("WWW-Authenticate", ""), url)
                    continue
                if exc.code == 401:
                    raise RegistryError(f"{url} answered 401 Unauthorized again, with the credentials of "
                                        f"{docker_config_path()}. Fix: `docker login {self.name.registry}` with an account that may pull "
                                        f"{self.name.repository}") from None
                raise RegistryError(f"{url} answered {exc.code} {exc.reason}{_registry_error(exc)}") from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise RegistryError(f"{self.base}: cannot be reached ({reason}). Fix: check the registry's name and "
                                    "the network") from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _answer(self, challenge: str, url: str) -> str:
        scheme, _, params = challenge.partition(" ")
        creds = credentials(self.name.registry, self._config)
        if scheme.lower() == "basic":
            if creds is None:
                raise RegistryError(f"{url}: the registry asks for a password and {docker_config_path()} has none "
                                    f"for {self.name.registry}. Fix: `docker login {self.name.registry}`")
            return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        if scheme.lower() != "bearer":
            raise RegistryError(f"{url} answered 401 with a challenge pdctl does not speak ({scheme[:20]!r}). Fix: a registry "
                                "with Bearer (token) or Basic authentication")
        fields = dict(_CHALLENGE_PARAM.findall(params))
        realm = fields.get("realm", "")
        if not realm.startswith(("https://", "http://")):
            raise RegistryError(f"{url}: the Bearer challenge names no token realm. Fix: check the registry")
        query = {k: v for k, v in (("service", fields.get("service")),
                                   ("scope", fields.get("scope") or f"repository:{self.name.repository}:pull")) if v}
        token_url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        basic = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode() if creds else None
        try:
            with self._open(token_url, "application/json", basic) as resp:
                answer = json.loads(resp.read(MAX_DOCUMENT))
        except urllib.error.HTTPError as exc:
            raise RegistryError(f"token service {realm} answered {exc.code} {exc.reason} for {query.get('scope')}. Fix: "
                                f"`docker login {self.name.registry}` with an account that may pull it") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RegistryError(f"token service {realm}: no token ({type(exc).__name__}). Fix: check the "
                                "registry") from None
        token = answer.get("token") or answer.get("access_token") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"token service {realm}: its answer holds no token. Fix: check the registry")
        return f"Bearer {token}"

    def document(self, kind: str, reference: str, accept: str | None) -> tuple[dict, str, str]:
        """A manifest or blob by tag or digest: (JSON, its sha256 digest, its media type), verified."""
        body, headers = self.get(f"/v2/{self.name.repository}/{kind}/{reference}", accept)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        served = headers.get("docker-content-digest")
        where = f"{self.name.registry}/{self.name.repository} {kind} {reference}"
        if served and served != digest:
            raise RegistryError(f"{where}: the registry says {served}, the body it sent hashes to {digest}")
        if reference.startswith("sha256:") and reference != digest:
            raise RegistryError(f"{where}: the body the registry sent hashes to {digest}, not the digest asked for")
        try:
            data = json.loads(body)
        except ValueError:
            raise RegistryError(f"{where}: not JSON") from None
        if not isinstance(data, dict):
            raise RegistryError(f"{where}: not a JSON object")
        return data, digest, str(data.get("mediaType") or headers.get("content-type", "")).split(";")[0]

    def resolve(self) -> Resolved:
        """The digest the registry serves for the name's digest (verified) or else its tag, and the
        architectures it runs on."""
        reference = self.name.digest or self.name.tag or "latest"
        manifest, digest, media_type = self.document("manifests", reference, ACCEPT)
        where = f"{self.name.registry}/{self.name.repository}@{digest}"
        if media_type in INDEX_TYPES or "manifests" in manifest:
            pairs = [((m.get("platform") or {}).get("os", ""), (m.get("platform") or {}).get("architecture", ""))
                     for m in manifest.get("manifests") or [] if isinstance(m, dict)]
        elif media_type in MANIFEST_TYPES or "config" in manifest:
            config_digest = (manifest.get("config") or {}).get("digest", "")
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(config_digest)):
                raise RegistryError(f"{where}: its config names no sha256 digest")
            config, _, _ = self.document("blobs", config_digest, None)
            pairs = [(str(config.get("os", "")), str(config.get("architecture", "")))]
        else:
            raise RegistryError(f"{where}: {media_type or 'no media type'} is neither an image index nor a manifest")
        pairs = [p for p in pairs if p != ("unknown", "unknown")]
        linux = {arch for os_, arch in pairs if os_ == "linux"}
        return Resolved(digest, media_type, tuple(a for a in ARCHITECTURES if a in linux),
                        tuple(sorted(f"{o}/{a}" for o, a in pairs if o != "linux" or a not in ARCHITECTURES)))


def _registry_error(exc: urllib.error.HTTPError) -> str:
    """The registry's own error code and message (distribution-spec's error body), if it sent one."""
    try:
        first = json.loads(exc.read(65536))["errors"][0]
        return f" ({str(first.get('code'))[:40]}: {str(first.get('message'))[:120]})"
    except Exception:  # noqa: BLE001 - any other body: the status line says enough
        return ""


def resolve(ref: str, timeout: float = 30.0, config: Path | None = None) -> Resolved:
    return RegistryClient(parse_reference(ref), timeout, config).resolve()
