"""One redaction for every output (infra/redaction.py): each credential shape, then each place
output goes: diff (text, Markdown, JSON), pdctl's messages, audit entries, rendered manifests.

Issue #24: `pdctl diff` and its Markdown showed an AWS secret key and a GitHub token (5 times
each) and cut an AWS key id to a prefix that still identified it."""

from __future__ import annotations

import json
import random
import re
import string

import pytest
import yaml

from infra.cli import main
from infra.redaction import redact_text, secret_shapes
from tests.conftest import stack_data

# AWS's documented example key pair: AWS IAM User Guide, "Managing access keys for IAM users"
# (and "Understanding and getting your security credentials"), docs.aws.amazon.com/IAM/latest/UserGuide/
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GITHUB = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"

SAMPLES = {  # shape -> (text holding it, the part that must not survive)
    "AWS access key id": (f"key {AWS_KEY_ID} here", AWS_KEY_ID[4:]),
    "AWS secret access key (bare)": (f"s3 secret {AWS_SECRET} end", AWS_SECRET[:12]),
    "AWS secret access key (in a path)": (f"/mnt/weights/v3/{AWS_SECRET}/x", AWS_SECRET[:12]),
    "AWS secret access key (quoted)": (f'aws_secret_access_key = "{AWS_SECRET}"', AWS_SECRET[:12]),
    "AWS secret access key (env)": (f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}", AWS_SECRET[:12]),
    "GitHub token": (f"token {GITHUB}", GITHUB[4:]),
    "GitHub OAuth token": ("gho_" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2", "Z9y8X7w6V5u4"),
    "GitHub fine-grained token": ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV"
                                  "WXYZ0123456789abcdef", "11ABCDEFG0123456789"),
    "Slack token": ("xoxb-1234567890-1234567890123-abcdefghijklmnopqrstuvwx", "abcdefghijklmnop"),
    "Slack webhook": ("https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
                      "XXXXXXXXXXXXXXXX"),
    "JWT": ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
            "dozjgNryP4J3"),
    "private key": ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
                    "-----END OPENSSH PRIVATE KEY-----", "b3BlbnNzaC1rZXkt"),
    "bearer token": ("Authorization: Bearer abc.DEF-123_xyz~tok", "abc.DEF-123"),
    "password": ("db password=hunter2-correct-horse", "hunter2"),
    "password in a URL": ("https://admin:s3cr3tpass@registry.internal/v2", "s3cr3tpass"),
}


@pytest.mark.parametrize("shape", SAMPLES)
def test_every_credential_shape_is_redacted_whole(shape):
    text, secret = SAMPLES[shape]
    out = redact_text(text)
    assert secret not in out and "redacted>" in out, out
    assert secret_shapes(text)


def test_what_pdstack_renders_is_not_taken_for_a_credential():
    """Digests, config hashes, paths and flags of both shipped stacks, with either engine, pass
    untouched (the endpoint picker's `--metrics-endpoint-auth=false` among them, issue #37)."""
    from infra.offline import run_spec
    from infra.render.engine_check import variant_spec
    from infra.render.manifests import as_rendered, manifests

    for stack in ("dev", "prod"):
        for engine in ("sglang", "vllm"):
            text = yaml.safe_dump_all([as_rendered(m) for m in manifests(run_spec(variant_spec(stack, engine)))])
            assert redact_text(text) == text


def _secret_spec(tmp_path):
    """prod with an AWS key pair pasted into the weights prefix and a GitHub token as the model's
    repository name: both pass validate (the characters are legal there), both must never show."""
    data = stack_data("prod")
    data["model"]["weights"]["prefix"] = f"deepseek-v3/{AWS_SECRET}/{AWS_KEY_ID}/"
    data["model"]["name"] = f"deepseek-ai/{GITHUB}"
    path = tmp_path / "prod-secret.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _leaks(text: str) -> list[str]:
    return [piece for piece in (AWS_SECRET[:10], AWS_SECRET[-10:], "AKIA", AWS_KEY_ID[4:12], GITHUB[:8], GITHUB[-8:])
            if piece in text]


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_diff_shows_no_credential_in_any_format(tmp_path, capsys, fmt):
    """Before: the secret and the token 5 times each in the Markdown, the key id cut to AKIA...."""
    from infra.spec import REPO_ROOT

    spec = _secret_spec(tmp_path)
    capsys.readouterr()
    assert main(["diff", "--stack", "prod", "--spec", str(spec), "--against", str(REPO_ROOT / "stacks/prod.yaml"),
                 "--output", fmt]) == 0
    out = capsys.readouterr()
    assert "redacted>" in out.out
    assert _leaks(out.out + out.err) == []
    if fmt == "json":
        json.loads(out.out)


def test_render_refuses_a_credential_outside_a_secret(tmp_path, capsys):
    """Render writes what the cluster is sent (issue #37), so a credential pasted into a spec field
    cannot be written redacted (the file would not be what is applied) nor in plain text: the
    render is refused, naming the objects and fields, and nothing is written."""
    spec = _secret_spec(tmp_path)
    capsys.readouterr()
    assert main(["render", "--spec", str(spec), "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr()
    assert not (tmp_path / "out").exists()
    err = " ".join(out.err.split())
    assert "ConfigMap/engine-decode-launch data.launch.sh: AWS access key id" in err and "Nothing was written" in err
    assert "AWS secret access key" in err and "GitHub token" in err
    assert _leaks(out.out + out.err) == []


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_render_writes_what_the_provider_is_sent_less_secret_values(tmp_path, stack, engine):
    """Issue #37: the rendered YAML is what is applied, so every object equals the one the program
    registers (what the provider receives, recorded under Pulumi's mocks), every container arg
    included, apart from a Secret's values and the keys pulumi-random generates. The picker's
    `--metrics-endpoint-auth=false` was written as `--metrics-endpoint-auth=<password redacted>`."""
    from infra.offline import run_spec
    from infra.render.engine_check import variant_spec
    from infra.render.manifests import SECRET_PLACEHOLDER, manifest_path, manifests, unwrap

    out = tmp_path / "out"
    assert main(["render", "--stack", stack, "--engine", engine, "--out", str(out)]) == 0
    sent = manifests(run_spec(variant_spec(stack, engine)))
    written_text = "".join(p.read_text() for p in out.rglob("*.yaml"))
    args = []
    for manifest in sent:
        plain = unwrap(manifest)
        written = yaml.safe_load((out / manifest_path(manifest)).read_text())
        if manifest["kind"] == "Secret":
            values = {k: plain.pop(k) for k in ("data", "stringData") if k in plain}
            assert values and {k: written.pop(k) for k in values} == dict.fromkeys(values, SECRET_PLACEHOLDER)
            assert all(v not in written_text for fields in values.values() for v in fields.values())
        assert written == plain, manifest_path(manifest)
        args += _command_lines(written)
    assert args and not [a for a in args if "redacted>" in a]
    if engine == "vllm":  # the endpoint picker runs with it (infra/render/router_config.py)
        assert "--metrics-endpoint-auth=false" in args


def _command_lines(value) -> list[str]:
    """Every container's command and args in an object, wherever its pod templates sit."""
    if isinstance(value, list):
        return [a for v in value for a in _command_lines(v)]
    if not isinstance(value, dict):
        return []
    found = [a for key in ("command", "args") if "image" in value for a in value.get(key) or []]
    return found + [a for v in value.values() for a in _command_lines(v)]


def test_a_refusal_quoting_a_credential_prints_it_redacted(tmp_path, capsys):
    data = stack_data("prod")
    data["model"]["weights"]["region"] = AWS_KEY_ID
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.weights.region" in err and "<AWS access key id redacted>" in err and _leaks(err) == []


def test_audit_entries_are_written_redacted(tmp_path):
    from infra.rollout.releases import ReleaseStore

    store = ReleaseStore("dev", tmp_path / "releases")
    store.audit("rollout", 1, "started", message=f"ship it; temp creds {AWS_KEY_ID} {AWS_SECRET} {GITHUB}")
    stored = "".join(p.read_text() for p in (tmp_path / "releases").rglob("audit/*.json"))
    assert "redacted>" in stored and _leaks(stored) == []


def random_secret_keys(n: int = 1000, seed: int = 36) -> list[str]:
    """AWS's example secret key and `n` seeded random ones: 40 characters of base64's alphabet, the
    form the IAM User Guide gives ("Managing access keys for IAM users"); they have no prefix."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + "/+"
    return [AWS_SECRET] + ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(n)]


def below_entropy_limit(key: str) -> bool:
    """A key detect-secrets 1.5.0's Base64HighEntropyString would pass as not random (Shannon
    entropy at most its 4.5-bit limit, plugins/high_entropy_strings.py): about 2% of random keys."""
    from detect_secrets.plugins.high_entropy_strings import Base64HighEntropyString

    plugin = Base64HighEntropyString()
    return plugin.calculate_shannon_entropy(key) <= plugin.entropy_limit


NEIGHBOURS = {  # where a secret key sits -> the text around it ({key}, {key_id})
    "YAML": "aws_secret_access_key: {key}\nregion: us-east-1\n",
    "YAML, camel case, quoted": 'secretAccessKey: "{key}"',
    "JSON (iam create-access-key's answer)": '{{"AccessKey": {{"UserName": "Bob", "Status": "Active", '
                                             '"SecretAccessKey": "{key}", "CreateDate": "2015-03-09T18:39:23Z"}}}}',
    "JSON, secret_key": '{{"endpoint": "https://s3.example", "secret_key": "{key}"}}',
    "INI (~/.aws/credentials)": "[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {key}\n",
    "env": "export AWS_SECRET_ACCESS_KEY={key}\n",
    "command-line flag": "mc alias set s3 https://s3.example --secret-key {key} --api S3v4",
    "CSV beside its key id (the IAM console's download)": "Access key ID,Secret access key\n{key_id},{key}\n",
    "three lines below its key id": "id: {key_id}\nuser: bob\nstatus: Active\nvalue: {key}\n",
    "a path after its key id": "s3://bucket/{key_id}/{key}/weights",
}


@pytest.mark.parametrize("form", NEIGHBOURS)
def test_a_secret_key_beside_its_name_or_key_id_is_caught_every_time(form):
    """Issue #36: a bare 40-character key was judged by entropy, which about 2% of random keys
    fall under. Known by its neighbours, every key is caught: in the text, in a JSON document of
    it (JSON inside a JSON string, as diff --output json carries a config), and named."""
    from infra.redaction import redact_data

    keys = random_secret_keys()
    assert any(below_entropy_limit(k) for k in keys)  # the batch holds keys chance would let through
    missed = []
    for key in keys:
        text = NEIGHBOURS[form].format(key=key, key_id=AWS_KEY_ID)
        shown = redact_text(text) + json.dumps(redact_data({"config": text}))
        if key in shown or key.replace("/", "\\/") in shown or "AWS secret access key" not in secret_shapes(text):
            missed.append(key)
    assert missed == [], f"{len(missed)} of {len(keys)} keys shown, e.g. {missed[0]}"


def test_values_that_are_not_keys_stay_beside_a_key_id():
    """Git SHAs and image digests (hex), a 40-letter word, and a flag whose name ends in auth are no
    credentials, even next to a key id (issue #37: `--metrics-endpoint-auth=false` became
    `<password redacted>`)."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    digest = "registry.example/engine@sha256:" + "5e1f" * 16
    kept = [sha, sha.upper(), digest, "deepseekdeepseekdeepseekdeepseekdeepseek", "--metrics-endpoint-auth=false",
            "--enable-auth=true"]
    text = "\n".join([f"id {AWS_KEY_ID}", *kept])
    out = redact_text(text)
    assert all(value in out for value in kept) and AWS_KEY_ID not in out, out
    assert redact_text("--metrics-endpoint-auth=false") == "--metrics-endpoint-auth=false"


def test_diff_shows_no_secret_key_beside_its_key_id_in_any_format(tmp_path, capsys):
    """Keys chance would let through (below detect-secrets' entropy limit) and AWS's example key,
    pasted into the weights prefix after their key id: text, Markdown and JSON show none."""
    from infra.spec import REPO_ROOT

    safe = re.compile(r"[A-Za-z0-9][A-Za-z0-9/]*[A-Za-z0-9]")  # what a prefix may hold (no '+', no '//')
    keys = [AWS_SECRET] + [k for k in random_secret_keys() if below_entropy_limit(k) and safe.fullmatch(k)
                           and "//" not in k][:9]
    data = stack_data("prod")
    data["model"]["weights"]["prefix"] = "/_/".join([f"v3/{AWS_KEY_ID}", *keys]) + "/"
    spec = tmp_path / "prod-keys.yaml"
    spec.write_text(yaml.safe_dump(data))
    for fmt in ("text", "markdown", "json"):
        capsys.readouterr()
        assert main(["diff", "--stack", "prod", "--spec", str(spec), "--against", str(REPO_ROOT / "stacks/prod.yaml"),
                     "--output", fmt]) == 0
        out = capsys.readouterr()
        shown = [k for k in keys if k in out.out + out.err or k.replace("/", "\\/") in out.out]
        assert "<AWS secret access key redacted>" in out.out and shown == [], (fmt, shown)
