"""The one redaction every output goes through: diff (text, Markdown, JSON), policy findings,
rendered manifests, audit entries and what pdctl prints. Anything shaped like a credential is
replaced by `<what redacted>`, whole: never cut to a prefix that still identifies it.

Where the shapes come from:
- detect-secrets 1.5.0 (Yelp, pinned in pyproject.toml), each plugin's own `denylist`, read from
  the installed package: AWS key ids and quoted AWS secret keys (plugins/aws.py), GitHub tokens
  ghp_/gho_/ghu_/ghs_/ghr_ (plugins/github_token.py), Slack tokens and webhooks (plugins/slack.py),
  JWTs (plugins/jwt.py), URL user:password@ (plugins/basic_auth.py), the keywords of
  plugins/keyword.py.
- An AWS secret access key has no prefix: 40 characters of base64's alphabet (AWS IAM User Guide,
  "Managing access keys for IAM users", whose example pair is AKIAIOSFODNN7EXAMPLE /
  wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY). It is known by its neighbours, every time: a
  secret-key name before it (aws_secret_access_key, SecretAccessKey, secret_key, ... in YAML, JSON,
  INI, env or flag form), or an access key id (detect-secrets' AKIA/ASIA/... pattern) within
  NEAR_KEY_ID_LINES lines. Only with no neighbour is chance left to judge: detect-secrets'
  Base64HighEntropyString limit (4.5 bits a character, plugins/high_entropy_strings.py), which
  about 2% of random keys fall under.
- GitHub fine-grained tokens `github_pat_` (not in detect-secrets 1.5.0): GitHub's token formats,
  docs.github.com "About authentication to GitHub", "GitHub's token formats".
- PEM private key blocks, whole (RFC 7468 section 2: BEGIN/END lines around base64); detect-secrets'
  PrivateKeyDetector only finds the BEGIN line.
- Bearer tokens (RFC 6750 section 2.1, the b64token grammar), Hugging Face `hf_` tokens and
  OpenAI-style `sk-` keys, and `password=`-style assignments: detect-secrets' KeywordDetector
  keywords (plugins/keyword.py DENYLIST) plus token, access key and secret key, in the plain
  `key=value` and `key: value` forms on one line. Not a bare `auth`: detect-secrets has none, and
  `--metrics-endpoint-auth=false` is a flag, not a password (issue #37).

This is for text whose structure is unknown (logs, diff, audit). A render knows its structure and
hides only Secret values (infra/render/manifests.py `redact`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Iterator


def _jwt_whole(pattern: re.Pattern) -> re.Pattern:
    # detect-secrets ends its JWT pattern lazily (it only needs to find one); redaction takes it all
    return re.compile(pattern.pattern.replace("*?", "*"))


# Names a credential goes by that detect-secrets' keyword list lacks (it has `secret`, `api_?key`, ...).
_KEYWORDS_ADDED = ("aws_?secret_?access_?key", "secret_?access_?key", "secret_?key", "access_?key", "token")


@functools.cache
def shapes() -> dict[str, re.Pattern]:
    """Name -> pattern, most specific first (a PEM block before the base64 inside it)."""
    from detect_secrets.plugins.aws import AWSKeyDetector
    from detect_secrets.plugins.basic_auth import BasicAuthDetector
    from detect_secrets.plugins.github_token import GitHubTokenDetector
    from detect_secrets.plugins.jwt import JwtTokenDetector
    from detect_secrets.plugins.keyword import DENYLIST
    from detect_secrets.plugins.slack import SlackDetector

    aws_key_id, aws_secret_quoted = AWSKeyDetector.denylist
    keywords = (*DENYLIST, *_KEYWORDS_ADDED)
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
        "password": re.compile(rf"(?i)(?<![a-z0-9])(?:{'|'.join(keywords)})"
                               r"[ \t]*[=:][ \t]*(?!\\?[\"']?<)(\"[^\"\n]*\"|'[^'\n]*'|[^\s,;&\"'<>\\]+)"),
    }
    return found


_BASE64_RUN = re.compile(r"[A-Za-z0-9/+]{40,}=*")
SECRET_KEY_LENGTH = 40  # an AWS secret access key: 40 base64 characters, no fixed prefix
NEAR_KEY_ID_LINES = 3  # a key id this near a 40-character value makes it the pair's secret key
_KEY_RUN = re.compile(r"[A-Za-z0-9/+]{40,}")
# A secret key's name, any case and separator (aws_secret_access_key, AWS_SECRET_ACCESS_KEY,
# SecretAccessKey, secret-key, aws.secretKey), then how YAML, JSON (also JSON inside a JSON string),
# INI, env files and command lines put a value after a name; the value starts where this ends.
_SECRET_KEY_NAMED = re.compile(r"(?i)(?:aws[_.-]?)?secret[_.-]?(?:access[_.-]?)?key"
                               r"(?=[\s\"'\\:=\]])[\"'\\\]]*[ \t]*(?:[:=]>?)?[ \t]*[\"'\\]*")


def _key_candidates(text: str) -> Iterator[tuple[int, int]]:
    """Spans of 40 base64 characters that stand alone: a whole run, or a run's part between '/'
    (a key holds '/', so in a path it runs into the folders around it)."""
    for run in _KEY_RUN.finditer(text):
        start, end = run.span()
        for i in range(start, end - SECRET_KEY_LENGTH + 1):
            j = i + SECRET_KEY_LENGTH
            if (i == start or text[i - 1] == "/") and (j == end or text[j] == "/"):
                yield i, j


def _aws_secret_key_spans(text: str) -> list[tuple[int, int]]:
    """Spans of AWS secret access keys known by their neighbours (module docstring): named by a
    secret-key name right before them, or within NEAR_KEY_ID_LINES lines of an access key id or
    of where one was redacted (then with upper and lower case letters, as all but one in 10^9 random keys have: hex digests
    and git SHAs near a key id stay)."""
    import bisect

    named_at = {m.end() for m in _SECRET_KEY_NAMED.finditer(text)}
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    key_ids = re.compile(f"{shapes()['AWS access key id'].pattern}|{re.escape(_placeholder('AWS access key id'))}")
    id_lines = [bisect.bisect_right(line_starts, m.start()) for m in key_ids.finditer(text)]
    spans = []
    for i, j in _key_candidates(text):
        line = bisect.bisect_right(line_starts, i)
        near_id = any(abs(line - n) <= NEAR_KEY_ID_LINES for n in id_lines)
        mixed_case = re.search("[A-Z]", text[i:j]) is not None and re.search("[a-z]", text[i:j]) is not None
        if i in named_at or near_id and mixed_case:
            spans.append((i, j))
    return _merged(spans)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and merged[-1][1] >= start:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _replaced(text: str, spans: list[tuple[int, int]], what: str) -> str:
    for start, end in reversed(spans):
        text = text[:start] + _placeholder(what) + text[end:]
    return text


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
    return _merged([(i, i + SECRET_KEY_LENGTH) for run in _BASE64_RUN.finditer(text)
                    for i in range(run.start(), run.end() - SECRET_KEY_LENGTH + 1)
                    if _high_entropy(text[i:i + SECRET_KEY_LENGTH])])


def _placeholder(what: str) -> str:
    return f"<{what} redacted>"


def redact_text(text: str) -> str:
    """`text` with every credential shape replaced by `<what redacted>`. Secret keys known by their
    neighbours go first, while the key id beside one is still there to see."""
    text = _replaced(text, _aws_secret_key_spans(text), "AWS secret access key")
    for what, pattern in shapes().items():
        if pattern.groups and what in ("AWS secret access key", "password in a URL", "password"):
            text = pattern.sub(lambda m: m.group(0).replace(m.group(1), _placeholder(what)), text)
        else:
            text = pattern.sub(_placeholder(what), text)
    return _replaced(text, _random_spans(text), "AWS secret access key")


def secret_shapes(text: str) -> list[str]:
    """The names of the credential shapes in `text` (the policy names what it found)."""
    found = [what for what, pattern in shapes().items() if pattern.search(text)]
    if (_aws_secret_key_spans(text) or _random_spans(text)) and "AWS secret access key" not in found:
        found.append("AWS secret access key")
    return found


def redact_data(value: Any) -> Any:
    """A JSON-shaped value (mappings, lists, strings) with every string redacted, keys included:
    each string on its own first (in JSON its line breaks are `\\n`, which would hide a key id at
    a line's start), then the whole as JSON, where a name in one field and a key in the next are
    neighbours."""
    def each(v: Any) -> Any:
        if isinstance(v, str):
            return redact_text(v)
        if isinstance(v, dict):
            return {each(k) if isinstance(k, str) else k: each(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [each(x) for x in v]
        return v
    return json.loads(redact_text(json.dumps(each(value))))


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
