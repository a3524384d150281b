"""A real OCI registry on 127.0.0.1 for the image resolver's tests: distribution's own registry
(github.com/distribution/distribution/v3 cmd/registry at the version twin/registry/go.mod pins),
with token authentication as Docker Hub and GHCR do it, the token service a small server here,
and a minimal pusher (blobs, image manifests, an index) since no container tool is installed.

The token service follows distribution's docs/spec/auth/token.md: the registry answers 401 with
`WWW-Authenticate: Bearer realm=...,service=...,scope=...`; the service checks HTTP Basic
credentials and signs a JWT (ES256) whose `x5c` header holds its certificate, which the registry
trusts through `auth.token.rootcertbundle` (registry/auth/token/token.go, verifyCertChain).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import tarfile
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.servers import free_port, running, send_json, serving

SERVICE = "pdstack-test-registry"
ISSUER = "pdstack-test-token-service"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    """Signs registry tokens for one user; counts what it was asked (the test reads `requests`)."""

    def __init__(self, folder: Path, user: str, password: str):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.user, self.password = user, password
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = time.time()
        import datetime

        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(datetime.datetime.fromtimestamp(now - 3600, datetime.timezone.utc))
                .not_valid_after(datetime.datetime.fromtimestamp(now + 86400, datetime.timezone.utc))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.bundle = folder / "token-ca.pem"
        self.bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.requests: list[dict[str, str]] = []

    def token(self, scope: str) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        kind, name, actions = scope.split(":")
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [base64.b64encode(self.cert_der).decode()]}
        claims = {"iss": ISSUER, "sub": self.user, "aud": SERVICE, "exp": now + 600, "nbf": now - 60, "iat": now,
                  "jti": hashlib.sha256(f"{scope}{time.monotonic_ns()}".encode()).hexdigest()[:16],
                  "access": [{"type": kind, "name": name, "actions": actions.split(",")}]}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    @contextmanager
    def serving(self):
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                service.requests.append({"service": query.get("service", ""), "scope": query.get("scope", ""),
                                         "authorization": (self.headers.get("Authorization") or "").split(" ")[0]})
                expected = "Basic " + base64.b64encode(f"{service.user}:{service.password}".encode()).decode()
                if self.headers.get("Authorization") != expected or query.get("service") != SERVICE:
                    self.send_response(401)
                    self.end_headers()
                    return
                send_json(self, 200, {"token": service.token(query["scope"])})

            def log_message(self, *args):
                pass

        with serving(Handler) as url:
            yield f"{url}/token"


@dataclass
class Registry:
    host: str  # 127.0.0.1:<port>
    tokens: TokenService

    def _request(self, method: str, url: str, scope: str, body: bytes = b"", content_type: str | None = None):
        headers = {"Authorization": f"Bearer {self.tokens.token(scope)}"}
        if content_type:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url if url.startswith("http") else f"http://{self.host}{url}", data=body or None,
                                     headers=headers, method=method)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers)

    def push_blob(self, repository: str, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        scope = f"repository:{repository}:pull,push"
        _, headers = self._request("POST", f"/v2/{repository}/blobs/uploads/", scope)
        location = headers["Location"]
        location = location if location.startswith("http") else f"http://{self.host}{location}"
        sep = "&" if "?" in location else "?"
        self._request("PUT", f"{location}{sep}digest={digest}", scope, data, "application/octet-stream")
        return digest

    def push_manifest(self, repository: str, reference: str, manifest: dict, media_type: str) -> str:
        body = json.dumps(manifest, separators=(",", ":")).encode()
        self._request("PUT", f"/v2/{repository}/manifests/{reference}", f"repository:{repository}:pull,push", body,
                      media_type)
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def push_image(self, repository: str, tag: str | None, arch: str, media_type: str = OCI_MANIFEST) -> tuple[str, int]:
        """One image for linux/`arch`: a config blob, a one-file layer, its manifest (tagged if `tag`).
        Returns (manifest digest, manifest size)."""
        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w:gz") as tar:
            content = f"{repository} {arch}\n".encode()
            info = tarfile.TarInfo("hello.txt")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        layer_bytes = layer.getvalue()
        config = json.dumps({"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": []},
                             "config": {}}).encode()
        docker = media_type == DOCKER_MANIFEST
        manifest = {"schemaVersion": 2, "mediaType": media_type, "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json" if docker
            else "application/vnd.oci.image.config.v1+json",
            "digest": self.push_blob(repository, config), "size": len(config)},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip" if docker
                        else "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": self.push_blob(repository, layer_bytes), "size": len(layer_bytes)}]}
        body = json.dumps(manifest, separators=(",", ":")).encode()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self.push_manifest(repository, tag or digest, manifest, media_type)
        return digest, len(body)

    def push_index(self, repository: str, tag: str, archs: list[str], attestation: bool = True) -> str:
        """A multi-platform image: one manifest per architecture, and (as buildx adds) an attestation
        manifest listed as unknown/unknown; the index tagged `tag`. Returns the index's digest."""
        entries = []
        for arch in archs:
            digest, size = self.push_image(repository, None, arch)
            entries.append({"mediaType": OCI_MANIFEST, "digest": digest, "size": size,
                            "platform": {"architecture": arch, "os": "linux"}})
        if attestation:
            digest, size = self.push_image(repository, None, "unknown")
            entries.append({"mediaType": OCI_MANIFEST, "digest": digest, "size": size,
                            "platform": {"architecture": "unknown", "os": "unknown"}})
        return self.push_manifest(repository, tag, {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries},
                                  OCI_INDEX)


@contextmanager
def oci_registry(folder: Path, user: str, password: str):
    """distribution's registry with token authentication, on 127.0.0.1; yields a Registry."""
    from twin.build import TEST_MODULES, build_module, program

    build_module(TEST_MODULES["registry"])  # nothing to do once `make test` (registry-build) built it
    folder.mkdir(parents=True, exist_ok=True)
    tokens = TokenService(folder, user, password)
    with tokens.serving() as realm:
        port, debug = free_port(), free_port()
        config = folder / "config.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(folder / "data")}, "delete": {"enabled": False}},
            "http": {"addr": f"127.0.0.1:{port}", "debug": {"addr": f"127.0.0.1:{debug}"}},
            "auth": {"token": {"realm": realm, "service": SERVICE, "issuer": ISSUER,
                               "rootcertbundle": str(tokens.bundle)}}}))
        # /debug/health answers 200 when the registry is up, without authentication
        with running([str(program("registry")), "serve", str(config)], ready_url=f"http://127.0.0.1:{debug}/debug/health"):
            yield Registry(f"127.0.0.1:{port}", tokens)
