"""The one redaction every output goes through: diff (text, Markdown, JSON), policy findings,
rendered manifests, audit entries and what pdctl prints. Anything shaped like a credential is
replaced by `<what redacted>`, whole: never cut to a prefix that still identifies it.

Where the shapes come from:
- detect-secrets 1.5.0 (Yelp, pinned in pyproject.toml), each plugin's own `denylist`, read from
  the installed package: AWS key ids and quoted AWS secret keys (plugins/aws.py), GitHub tokens
  ghp_/gho_/ghu_/ghs_/ghr_ (plugins/github_token.py), Slack tokens and webhooks (plugins/slack.py),
  JWTs (plugins/jwt.py), URL user:password@ (plugins/basic_auth.py); its Base64HighEntropyString
  limit (4.5 bits a character, plugins/high_entropy_strings.py) for a bare 40-character AWS secret
  access key, which has no fixed prefix.
- GitHub fine-grained tokens `github_pat_` (not in detect-secrets 1.5.0): GitHub's token formats,
  docs.github.com "About authentication to GitHub", "GitHub's token formats".
- PEM private key blocks, whole (RFC 7468 section 2: BEGIN/END lines around base64); detect-secrets'
  PrivateKeyDetector only finds the BEGIN line.
- Bearer tokens (RFC 6750 section 2.1, the b64token grammar), Hugging Face `hf_` tokens and
  OpenAI-style `sk-` keys, and `password=`-style assignments (keywords of detect-secrets'
  KeywordDetector, plugins/keyword.py, reduced to the plain `key=value` and `key: value` forms).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any


def _jwt_whole(pattern: re.Pattern) -> re.Pattern:
    # detect-secrets ends its JWT pattern lazily (it only needs to find one); redaction takes it all
    return re.compile(pattern.pattern.replace("*?", "*"))


@functools.cache
def shapes() -> dict[str, re.Pattern]:
    """Name -> pattern, most specific first (a PEM block before the base64 inside it)."""
    from detect_secrets.plugins.aws import AWSKeyDetector
    from detect_secrets.plugins.basic_auth import BasicAuthDetector
    from detect_secrets.plugins.github_token import GitHubTokenDetector
    from detect_secrets.plugins.jwt import JwtTokenDetector
    from detect_secrets.plugins.slack import SlackDetector

    aws_key_id, aws_secret_quoted = AWSKeyDetector.denylist
    found = {
        "private key": re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
                                  r"(?:[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|[\s\S]*)"),
        "JWT": _jwt_whole(JwtTokenDetector.denylist[0]),
        "AWS access key id": re.compile(rf"\b{aws_key_id.pattern}\b"),
        "AWS secret access key": re.compile(aws_secret_quoted.pattern, re.I),
        "GitHub token": re.compile(rf"\b(?:{GitHubTokenDetector.denylist[0].pattern}|github_pat_[A-Za-z0-9_]{{22,}})"),
        "Slack token": re.compile("|".join(p.pattern for p in SlackDetector.denylist)),
        "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"),
        "OpenAI-style API key": re.compile(r"\bsk-[A-Za-z0-9_-]{20,}\b"),
        "bearer token": re.compile(r"\bBearer\s+[A-Za-z0-9._~+/-]{8,}=*", re.I),
        "password in a URL": BasicAuthDetector.denylist[0],
        "password": re.compile(r"(?i)(?<![a-z0-9])(?:aws_?secret_?access_?key|secret_?access_?key|password|passwd|pwd|"
                               r"secret|secret_?key|api_?key|access_?key|token|auth)"
                               r"\s*[=:]\s*(?!<)(\"[^\"\n]*\"|'[^'\n]*'|[^\s,;&\"'<>]+)"),
    }
    return found


_BASE64_RUN = re.compile(r"[A-Za-z0-9/+]{40,}=*")
SECRET_KEY_LENGTH = 40  # an AWS secret access key: 40 base64 characters, no fixed prefix


def _high_entropy(text: str) -> bool:
    """A random base64 string, as detect-secrets' Base64HighEntropyString judges one (Shannon
    entropy above its 4.5-bit limit), with upper case, lower case and a digit."""
    from detect_secrets.plugins.high_entropy_strings import Base64HighEntropyString

    plugin = Base64HighEntropyString()
    return (plugin.calculate_shannon_entropy(text) > plugin.entropy_limit and re.search(r"[0-9]", text) is not None
            and re.search(r"[A-Z]", text) is not None and re.search(r"[a-z]", text) is not None)


def _random_spans(text: str) -> list[tuple[int, int]]:
    """Spans of 40 random-looking base64 characters, wherever they sit (an AWS secret key holds
    '/' and '+', so in a path it runs into its neighbours: every 40-character window is judged)."""
    spans: list[tuple[int, int]] = []
    for run in _BASE64_RUN.finditer(text):
        start, end = run.span()
        for i in range(start, end - SECRET_KEY_LENGTH + 1):
            if _high_entropy(text[i:i + SECRET_KEY_LENGTH]):
                if spans and spans[-1][1] >= i:
                    spans[-1] = (spans[-1][0], i + SECRET_KEY_LENGTH)
                else:
                    spans.append((i, i + SECRET_KEY_LENGTH))
    return spans


def _placeholder(what: str) -> str:
    return f"<{what} redacted>"


def redact_text(text: str) -> str:
    """`text` with every credential shape replaced by `<what redacted>`."""
    for what, pattern in shapes().items():
        if pattern.groups and what in ("AWS secret access key", "password in a URL", "password"):
            text = pattern.sub(lambda m: m.group(0).replace(m.group(1), _placeholder(what)), text)
        else:
            text = pattern.sub(_placeholder(what), text)
    for start, end in reversed(_random_spans(text)):
        text = text[:start] + _placeholder("AWS secret access key") + text[end:]
    return text


def secret_shapes(text: str) -> list[str]:
    """The names of the credential shapes in `text` (the policy names what it found)."""
    found = [what for what, pattern in shapes().items() if pattern.search(text)]
    if _random_spans(text) and "AWS secret access key" not in found:
        found.append("AWS secret access key")
    return found


def redact_data(value: Any) -> Any:
    """A JSON-shaped value (mappings, lists, strings) with every string redacted, keys included."""
    return json.loads(redact_text(json.dumps(value)))


class RedactingStream:
    """A text stream that redacts what it is given and hands it to sys.stdout or sys.stderr as
    they are at that moment (tests and callers replace them), for pdctl's consoles."""

    def __init__(self, name: str):
        self.name = name

    def _target(self):
        import sys

        return getattr(sys, self.name)

    def write(self, text: str) -> int:
        self._target().write(redact_text(text))
        return len(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()

    def fileno(self) -> int:
        return self._target().fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._target(), "encoding", "utf-8")
