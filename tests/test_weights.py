"""Weights upload and node-side verification against a real S3 endpoint on loopback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infra import weights
from infra.weights import MANIFEST_NAME, BucketPostureError, WeightsIntegrityError


@pytest.fixture
def model_dir(tmp_path):
    src = tmp_path / "model"
    (src / "shards").mkdir(parents=True)
    (src / "config.json").write_text('{"num_layers": 2}')
    for i in range(3):
        (src / "shards" / f"model-{i:05d}.safetensors").write_bytes(bytes([i]) * (1024 * 64 + i))
    return src


def test_upload_writes_manifest_and_fetch_verifies_every_file(s3_endpoint, model_dir, tmp_path):
    s3 = weights.s3_client(s3_endpoint)
    manifest = weights.upload(s3, "weights-ok", "m/", model_dir)
    assert set(manifest) == {"config.json", *(f"shards/model-{i:05d}.safetensors" for i in range(3))}
    assert s3.get_bucket_versioning(Bucket="weights-ok")["Status"] == "Enabled"
    dest = tmp_path / "node-cache"
    assert weights.fetch_and_verify(s3, "weights-ok", "m/", dest) == manifest
    assert (dest / "shards/model-00002.safetensors").read_bytes() == (model_dir / "shards/model-00002.safetensors").read_bytes()
    assert (dest / MANIFEST_NAME).exists()


def test_corrupted_object_is_caught_and_the_engine_would_not_start(s3_endpoint, model_dir, tmp_path):
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-bad", "m", model_dir)
    s3.put_object(Bucket="weights-bad", Key="m/shards/model-00001.safetensors", Body=b"bit rot")
    with pytest.raises(WeightsIntegrityError) as caught:
        weights.fetch_and_verify(s3, "weights-bad", "m", tmp_path / "cache")
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith("shards/model-00001.safetensors: sha256")
    assert not (tmp_path / "cache" / MANIFEST_NAME).exists()


def test_corrupted_node_cache_file_is_refetched(s3_endpoint, model_dir, tmp_path):
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-cache", "m", model_dir)
    dest = tmp_path / "cache"
    weights.fetch_and_verify(s3, "weights-cache", "m", dest)
    (dest / "config.json").write_text("tampered")
    weights.fetch_and_verify(s3, "weights-cache", "m", dest)
    assert (dest / "config.json").read_text() == '{"num_layers": 2}'


def test_init_step_script_exits_nonzero_on_mismatch(s3_endpoint, model_dir, tmp_path):
    """The very file the init container runs, as a process: exit 3 stops the pod."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "PATH": "/usr/bin:/bin"}
    script = weights.__file__
    up = subprocess.run([sys.executable, script, "upload", "--endpoint", s3_endpoint, "--bucket", "weights-cli",
                         "--prefix", "m", "--source", str(model_dir)], capture_output=True, text=True, env=env)
    assert up.returncode == 0, up.stderr
    s3 = weights.s3_client(s3_endpoint)
    s3.put_object(Bucket="weights-cli", Key="m/config.json", Body=b"{}")
    fetch = subprocess.run([sys.executable, script, "fetch", "--endpoint", s3_endpoint, "--bucket", "weights-cli",
                            "--prefix", "m", "--dest", str(tmp_path / "c")], capture_output=True, text=True, env=env)
    assert fetch.returncode == 3
    assert "config.json: sha256" in fetch.stderr


def test_upload_refuses_a_public_bucket_and_writes_nothing(s3_endpoint, model_dir):
    s3 = weights.s3_client(s3_endpoint)
    s3.create_bucket(Bucket="weights-public", ACL="public-read")
    with pytest.raises(BucketPostureError, match="ACL grants READ to AllUsers"):
        weights.upload(s3, "weights-public", "m/", model_dir)
    assert s3.list_objects_v2(Bucket="weights-public").get("KeyCount", 0) == 0
