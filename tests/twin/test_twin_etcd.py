"""The running twin keeps its secrets to itself: etcd, which holds every Secret, answers only a
client with a certificate from etcd's own CA, and the twin's folders and keys are its user's.

etcd v3.6.4 (go.etcd.io/etcd/server/v3, as twin/kube/go.mod pins it), set up as kubeadm does
(its etcd static pod: --cert-file, --key-file, --client-cert-auth, --trusted-ca-file and the
--peer-* ones; a CA of etcd's own under pki/etcd/). etcd's documentation, "Transport security
model": with --client-cert-auth, etcd refuses a client that presents no certificate signed by
the --trusted-ca-file CA. Before, etcd listened on plain HTTP with no client authentication, so
any local user could read /registry/secrets/ and write any key.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from twin.paths import RUN_DIR, STATE_DIR

PKI = RUN_DIR / "pki"
ETCD_CA = PKI / "etcd" / "ca.crt"


def _range_count(port: int, prefix: str, client: tuple[Path, Path] | None) -> int:
    """How many keys start with `prefix`, asked of etcd's v3 JSON gateway over TLS."""
    context = ssl.create_default_context(cafile=str(ETCD_CA))
    if client:
        context.load_cert_chain(str(client[0]), str(client[1]))
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                       "range_end": base64.b64encode(end.encode()).decode(), "count_only": True}).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{port}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        return int(json.loads(answer.read()).get("count", 0))


def _logs_soon(log: Path, offset: int, text: str) -> bool:
    """Whether `text` appears in `log` after `offset` within a minute (etcd writes its log itself)."""
    deadline = time.monotonic() + 60
    while True:
        with log.open("rb") as f:
            f.seek(offset)
            if text.encode() in f.read():
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _plain_http(port: int, path: str) -> bytes:
    """What a plain HTTP GET of `path` gets back (the bytes until the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        try:
            while chunk := conn.recv(65536):
                answer += chunk
        except (ConnectionError, TimeoutError):
            pass
        return answer


def test_etcd_answers_only_a_client_with_a_certificate_from_its_own_ca(twin):
    ports = twin["ports"]
    apiserver_client = (PKI / "etcd" / "apiserver-etcd-client.crt", PKI / "etcd" / "apiserver-etcd-client.key")
    # the positive control: the API server's certificate reads (the namespaces it made are there)
    assert _range_count(ports["etcd"], "/registry/namespaces/", apiserver_client) >= 4

    log = RUN_DIR / "logs" / "etcd.log"
    for client, reason in ((None, "tls: client didn't provide a certificate"),  # the cluster CA's system:masters:
                           ((PKI / "admin.crt", PKI / "admin.key"), "certificate signed by unknown authority")):
        logged = log.stat().st_size
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            _range_count(ports["etcd"], "/registry/secrets/", client)
        assert _logs_soon(log, logged, reason), f"etcd's log does not say {reason!r} after the refusal"

    for port, path in ((ports["etcd"], "/health"), (ports["etcd"], "/v3/kv/range"), (ports["etcd_peer"], "/members")):
        answer = _plain_http(port, path)
        assert not answer.startswith(b"HTTP/1.1 200") and b"health" not in answer and b"peerURLs" not in answer, \
            f"etcd answered plain HTTP on {port}{path}: {answer[:200]!r}"


def test_the_twins_folders_and_private_keys_are_its_users_alone(twin):
    """Folders 0700, every private key 0600 (the keys' creation itself: test_twin_supervision.py)."""
    for folder in (STATE_DIR, RUN_DIR, PKI, PKI / "etcd"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    keys = [p for p in PKI.rglob("*.key") if p.is_file()]
    assert len(keys) >= 12
    assert {str(k): oct(stat.S_IMODE(k.stat().st_mode)) for k in keys
            if stat.S_IMODE(k.stat().st_mode) != 0o600} == {}
