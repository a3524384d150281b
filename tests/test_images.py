"""Image digests (issue #37 item 3, #38 item 9): a spec's image is pinned by a digest a registry
served, or marked a placeholder; placeholders are named in every preview and refused by the policy
pack (so by `pulumi up`) and by `pdctl rollout` against a real stack; `pdctl images` resolves each
reference against a real OCI registry (distribution's, twin/registry/go.mod) on 127.0.0.1 with
token authentication, and writes the digests and platforms into the spec as `plan --write` edits it.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from infra.cli import main
from infra.images import image_fields, placeholders
from infra.offline import run_spec
from infra.platform_stack.spec import load_platform_spec
from infra.policy.rules import Resource, images_by_digest
from infra.recording import OfflineRun
from infra.render.manifests import unwrap
from infra.spec import STACKS_DIR, SpecError
from infra.spec_checks import load_spec, parse_spec
from tests.conftest import shipped_run, stack_data
from tests.oci_registry import DOCKER_MANIFEST, oci_registry

SERVING = ("dev", "prod")
PLATFORMS = ("platform-dev", "platform-prod")


def digest_problems(run: OfflineRun) -> list[str]:
    """What the policy pack's "pinned by digest" rule says about every resource a stack's run registers."""
    return [p for r in run.custom() for p in images_by_digest(Resource(r.type, r.name, unwrap(r.inputs)))]


def committed(stack: str):
    path = STACKS_DIR / f"{stack}.yaml"
    return load_platform_spec(path) if stack.startswith("platform-") else load_spec(path)


@pytest.mark.parametrize("stack", SERVING + PLATFORMS)
def test_the_policy_pack_refuses_every_placeholder_image_of_the_committed_stacks(stack):
    """No registry was reachable where the committed digests were written, and they were made up
    (stepping hex walks): each image is now a marked placeholder, and the pack's "pinned by digest"
    rule (the gate of `pulumi up`) refuses each one a workload runs, Grafana's on the platform
    stack included (its made-up digest used to pass, and a tag alone passed as a release)."""
    spec = committed(stack)
    refs = placeholders(spec)
    assert refs and set(refs.values()) == {ref for _, ref in image_fields(spec)}
    problems = digest_problems(shipped_run(stack))
    rendered = {ref for ref in refs.values() if any(f"image {ref!r} is not pinned by digest" in p for p in problems)}
    assert rendered and all("pdctl images --write" in p for p in problems)
    if stack.startswith("platform-"):
        assert rendered == {spec.images.grafana, spec.images.grafana_sidecar}


def test_the_mooncake_master_names_the_repository_upstream_publishes():
    """Mooncake's images are published as kvcacheai/mooncake (issue #37 item 3); kvcache/mooncake
    is another account."""
    for stack in SERVING:
        assert committed(stack).images.mooncake_master.startswith("docker.io/kvcacheai/mooncake:")


def test_a_reference_without_a_digest_must_be_marked_and_the_mark_round_trips():
    data = stack_data("dev")
    data["images"]["router"] = "docker.io/lmsysorg/sglang-router:v0.3.2"
    with pytest.raises(SpecError) as unmarked:
        parse_spec(data)
    assert "images.router" in str(unmarked.value) and "digest: placeholder" in str(unmarked.value)
    data["images"]["router"] = {"ref": "docker.io/lmsysorg/sglang-router:v0.3.2", "digest": "sha256:" + "ab" * 32}
    with pytest.raises(SpecError, match="marks a placeholder"):
        parse_spec(data)
    data["images"]["router"] = {"ref": "docker.io/lmsysorg/sglang-router", "digest": "placeholder"}
    with pytest.raises(SpecError, match="path:tag"):
        parse_spec(data)
    spec = load_spec(STACKS_DIR / "dev.yaml")
    dumped = spec.model_dump(mode="json")  # what a release record and `render --engine` re-read
    assert dumped["images"]["router"] == {"ref": spec.images.router, "digest": "placeholder"}
    assert parse_spec(dumped) == spec


@pytest.mark.parametrize("stack", ["dev", "platform-prod"])
def test_every_preview_names_each_placeholder(stack, capsys):
    assert main(["preview", "--offline", "--stack", stack]) == 0
    out = capsys.readouterr().out
    for field, ref in placeholders(committed(stack)).items():
        assert f"placeholder image: {field} = {ref}" in out
    assert main(["preview", "--offline", "--stack", stack, "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["placeholder_images"] == placeholders(committed(stack))


def test_rollout_to_a_real_stack_refuses_placeholders_before_any_change(tmp_path, capsys):
    store = tmp_path / "releases"
    code = main(["rollout", "--stack", "dev", "--pulumi-stack", "dev", "--releases", str(store),
                 "--prometheus", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "images.router = docker.io/lmsysorg/sglang-router:v0.3.2" in " ".join(err.split())
    assert "Nothing was changed" in err and not store.exists()


# --- pdctl images, against a real registry ----------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with oci_registry(tmp_path_factory.mktemp("registry"), "alice", "correct horse") as reg:
        yield reg


def docker_config(folder: Path, registry, password: str = "correct horse") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"alice:{password}".encode()).decode()
    (folder / "config.json").write_text(json.dumps({"auths": {registry.host: {"auth": auth}}}))
    return folder


def local_copy(tmp_path: Path, stack: str, registry) -> Path:
    """The committed spec, its images named in the test's registry (same paths and tags)."""
    text = (STACKS_DIR / f"{stack}.yaml").read_text()
    for host in ("docker.io/", "ghcr.io/", "registry.example.com/"):
        text = text.replace(host, f"{registry.host}/")
    path = tmp_path / f"{stack}.yaml"
    path.write_text(text)
    return path


def push_placeholders(registry, spec) -> dict[str, tuple[str, list[str]]]:
    """Each placeholder pushed: the engines as single-platform Docker images for the spec's
    architecture, everything else as a two-platform OCI index (with buildx's attestation entry)."""
    pushed = {}
    arch = getattr(getattr(spec, "hardware", None), "cpu_architecture", "amd64")
    for field, ref in placeholders(spec).items():
        name, _, tag = ref.partition(f"{registry.host}/")[2].rpartition(":")
        if field.startswith("images.engines."):
            digest, _ = registry.push_image(name, tag, arch, DOCKER_MANIFEST)
            pushed[field] = (digest, [arch])
        else:
            pushed[field] = (registry.push_index(name, tag, ["amd64", "arm64"]), ["amd64", "arm64"])
    return pushed


@pytest.mark.parametrize("stack", ["prod", "platform-dev"])
def test_images_write_pins_each_placeholder_to_what_the_registry_serves(stack, registry, tmp_path, monkeypatch, capsys):
    """`pdctl images --write`: each placeholder resolved by its tag through the registry's token
    authentication (credentials from the Docker config), the digest the registry served written as
    name:tag@digest, its platforms read from the index (attestations left out) or, for a single
    manifest, from its config blob; the placeholders' own platform entries replaced; comments and
    layout kept. The written spec previews without a placeholder and passes "pinned by digest"."""
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "docker", registry)))
    source = local_copy(tmp_path, stack, registry)
    before = source.read_text()
    spec = committed(stack).model_validate(yaml.safe_load(before))
    pushed = push_placeholders(registry, spec)
    out = tmp_path / "pinned.yaml"
    assert main(["images", str(source), "--write", str(out), "--output", "json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["written"] == str(out) and source.read_text() == before
    pinned = load_platform_spec(out) if stack.startswith("platform-") else load_spec(out)
    fields = dict(image_fields(pinned))
    assert placeholders(pinned) == {}
    for field, (digest, archs) in pushed.items():
        ref = placeholders(spec)[field]
        assert fields[field] == f"{ref}@{digest}"
        assert {r["field"]: r["platforms"] for r in report["images"]}[field] == archs
        if hasattr(pinned.images, "platforms"):
            assert ref not in pinned.images.platforms
            if ref in spec.images.platforms:  # a placeholder whose platforms the spec listed: now its digest's
                assert pinned.images.platforms[digest] == archs
    text = out.read_text()
    assert [line for line in before.splitlines() if line.lstrip().startswith("#")] == [
        line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert digest_problems(run_spec(pinned)) == []

    # run again on the pinned spec: each pin is verified by its digest, and nothing moves
    assert main(["images", str(out), "--output", "json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert {r["status"] for r in again["images"]} == {"verified"}
    assert {r["field"]: r["reference"] for r in again["images"]} == fields


def test_images_refuses_without_credentials_and_writes_nothing(registry, tmp_path, monkeypatch, capsys):
    """The token service refuses a wrong password: every image is reported, exit 1, nothing is
    written, and the password appears in no output."""
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "docker", registry, "wrong horse")))
    source = local_copy(tmp_path, "platform-prod", registry)
    out = tmp_path / "pinned.yaml"
    assert main(["images", str(source), "--write", str(out)]) == 1
    captured = capsys.readouterr()
    assert "401 Unauthorized" in captured.err and "docker login" in captured.err and "nothing was written" in captured.err
    assert not out.exists()
    assert "wrong horse" not in captured.out + captured.err
    assert any(r["authorization"] == "Basic" for r in registry.tokens.requests)


def test_a_digest_the_registry_does_not_serve_is_reported(registry, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "docker", registry)))
    data = yaml.safe_load((STACKS_DIR / "platform-dev.yaml").read_text())
    data["images"]["grafana"] = f"{registry.host}/grafana/grafana:12.0.2@sha256:" + "0" * 64
    source = tmp_path / "platform.yaml"
    source.write_text(yaml.safe_dump(data))
    assert main(["images", str(source)]) == 1
    assert "404" in capsys.readouterr().err


@pytest.mark.parametrize("lie", ["header", "body"])
def test_a_manifest_that_does_not_hash_to_its_digest_is_refused(lie, tmp_path, monkeypatch):
    """OCI distribution-spec v1.1 (spec.md, "Pulling manifests"): the digest is the sha256 of the
    body as served, and a client verifies it. A server whose Docker-Content-Digest disagrees with
    the body it sends, or whose body does not hash to the digest asked for, is refused; nothing is
    taken from it."""
    import hashlib
    import http.server
    import threading

    from infra.registry import RegistryError, resolve

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))  # no config: anonymous
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 1,
                                       "digest": "sha256:" + "1" * 64,
                                       "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
    served = "sha256:" + hashlib.sha256(index).hexdigest()
    other = "sha256:" + hashlib.sha256(b"another manifest").hexdigest()

    class Lying(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.oci.image.index.v1+json")
            self.send_header("Docker-Content-Digest", other if lie == "header" else served)
            self.end_headers()
            self.wfile.write(index)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ref = f"127.0.0.1:{server.server_address[1]}/pdstack/router" + (":v1" if lie == "header" else f"@{other}")
        with pytest.raises(RegistryError, match="hashes to"):
            resolve(ref)
    finally:
        server.shutdown()
        server.server_close()
