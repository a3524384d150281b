"""Weights upload and node-side verification against a real S3 endpoint on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


# --- names that leave the cache folder (issue #24) --------------------------------------------


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _plant_manifest(s3, bucket, prefix, names: dict[str, bytes]):
    """A bucket whose manifest (both forms) names `names`, each object holding its bytes, as a
    careless or hostile uploader could leave it."""
    import hashlib
    import json

    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    sums = {}
    for name, body in names.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)
        sums[name] = hashlib.sha256(body).hexdigest()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS.json", Body=json.dumps(sums).encode())
    s3.put_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS",
                  Body="".join(f"{d}  {n}\n" for n, d in sums.items()).encode())


ESCAPING_NAMES = ["../escaped.txt", "shards/../../escaped.txt", "/tmp/pdstack-escaped.txt", "a//b", "./x",
                  "x;touch INJECTED", "a\\b"]


@pytest.mark.parametrize("bad", ESCAPING_NAMES)
def test_fetch_refuses_a_manifest_name_that_leaves_the_cache_folder(s3_endpoint, tmp_path, bad):
    """Before the fix `../escaped.txt` was written beside the cache folder."""
    s3 = weights.s3_client(s3_endpoint)
    _plant_manifest(s3, "weights-escape", "m", {"config.json": b"{}", bad: b"evil"})
    dest = tmp_path / "node" / "cache"
    with pytest.raises(weights.WeightsManifestError, match="nothing fetched"):
        weights.fetch_and_verify(s3, "weights-escape", "m", dest)
    assert _tree(tmp_path) == [] and not Path("/tmp/pdstack-escaped.txt").exists()


def test_fetch_writes_through_no_symbolic_link_in_the_cache(s3_endpoint, model_dir, tmp_path):
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-link", "m", model_dir)
    dest, outside = tmp_path / "cache", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "shards").symlink_to(outside, target_is_directory=True)
    with pytest.raises(weights.WeightsManifestError, match="symbolic link"):
        weights.fetch_and_verify(s3, "weights-link", "m", dest)
    assert _tree(outside) == []


def test_upload_refuses_names_a_node_could_not_fetch_safely(s3_endpoint, model_dir):
    (model_dir / "bad name;x").write_text("x")
    s3 = weights.s3_client(s3_endpoint)
    with pytest.raises(weights.WeightsManifestError, match="bad name;x"):
        weights.upload(s3, "weights-names", "m", model_dir)
    assert "weights-names" not in {b["Name"] for b in s3.list_buckets()["Buckets"]}


# --- verified once per object version, in parallel (issue #25) --------------------------------


def test_a_warm_cache_is_not_hashed_again_until_an_object_version_or_a_file_changes(s3_endpoint, model_dir,
                                                                                   tmp_path, monkeypatch):
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-warm", "m", model_dir)
    dest = tmp_path / "cache"
    hashed = []
    real = weights.sha256_file
    monkeypatch.setattr(weights, "sha256_file", lambda p: (dest in p.parents and hashed.append(p)) or real(p))
    weights.fetch_and_verify(s3, "weights-warm", "m", dest)
    assert len(hashed) >= 4
    hashed.clear()
    weights.fetch_and_verify(s3, "weights-warm", "m", dest)  # a pod restart on a warm node
    assert hashed == []
    weights.upload(s3, "weights-warm", "m", model_dir)  # same files, new object versions
    weights.fetch_and_verify(s3, "weights-warm", "m", dest)
    assert len(hashed) == 4
    hashed.clear()
    (dest / "config.json").write_text('{"num_layers": 3}')  # changed on the node, not in S3
    weights.fetch_and_verify(s3, "weights-warm", "m", dest)
    assert (dest / "config.json").read_text() == '{"num_layers": 2}' and len(hashed) >= 4
    hashed.clear()
    weights.fetch_and_verify(s3, "weights-warm", "m", dest)
    assert hashed == []


def test_files_are_hashed_several_at_once(s3_endpoint, model_dir, tmp_path, monkeypatch):
    """Two hashes must be in flight together to pass the barrier; one at a time it breaks."""
    import threading

    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-parallel", "m", model_dir)
    barrier = threading.Barrier(2, timeout=120)
    real = weights.sha256_file

    def hash_together(path):
        barrier.wait()
        return real(path)

    monkeypatch.setattr(weights, "sha256_file", hash_together)
    weights.fetch_and_verify(s3, "weights-parallel", "m", tmp_path / "cache", workers=2)
    barrier = threading.Barrier(2, timeout=5)  # one at a time it can only break, however long it waits
    with pytest.raises(threading.BrokenBarrierError):
        weights.fetch_and_verify(s3, "weights-parallel", "m", tmp_path / "cache-2", workers=1)


# --- the aws-cli image's script, run as the init container runs it ----------------------------


@pytest.fixture
def aws_cli_env(s3_endpoint, tmp_path):
    """PATH with the `aws` stand-in (tests/aws_standin.py, boto3 against moto) and a logging
    sha256sum wrapper in front of the real one; the PDSTACK_WEIGHTS_* the pod gets."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).parent / "aws_standin.py"} "$@"\n')
    (bin_dir / "sha256sum").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/sha256sum.log\nexec /usr/bin/sha256sum "$@"\n')
    for tool in ("aws", "sha256sum"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
           "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"], "AWS_STANDIN_LOG": str(tmp_path / "aws.log"),
           "PDSTACK_WEIGHTS_ENDPOINT": s3_endpoint, "PDSTACK_WEIGHTS_REGION": "us-east-1",
           "PDSTACK_WEIGHTS_PREFIX": "m", "PDSTACK_WEIGHTS_DEST": str(tmp_path / "node" / "cache" / "m"),
           "PDSTACK_WEIGHTS_WORKERS": "3"}
    return env


def _run_fetch_script(env, bucket):
    from infra.components.storage import aws_cli_fetch_script

    return subprocess.run(["/bin/sh", "-c", aws_cli_fetch_script()], env={**env, "PDSTACK_WEIGHTS_BUCKET": bucket},
                          capture_output=True, text=True, timeout=300)


def test_aws_cli_script_fetches_verifies_repairs_and_skips_a_warm_cache(s3_endpoint, model_dir, aws_cli_env, tmp_path):
    """Real /bin/sh, split and sha256sum; `aws` is the boto3 stand-in against moto."""
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-sh", "m", model_dir)
    dest = Path(aws_cli_env["PDSTACK_WEIGHTS_DEST"])
    done = _run_fetch_script(aws_cli_env, "weights-sh")
    assert done.returncode == 0, done.stderr
    target = dest / "shards/model-00002.safetensors"
    assert target.read_bytes() == (model_dir / "shards/model-00002.safetensors").read_bytes()
    assert (tmp_path / "sha256sum.log").read_text().count("-c") >= 3  # slices checked side by side
    (tmp_path / "sha256sum.log").unlink()
    done = _run_fetch_script(aws_cli_env, "weights-sh")  # warm: nothing hashed
    assert done.returncode == 0 and "verified before" in done.stdout and not (tmp_path / "sha256sum.log").exists()
    target.write_bytes(b"\0" * target.stat().st_size)  # same size; a new upload's versions make it look again
    weights.upload(s3, "weights-sh", "m", model_dir)
    done = _run_fetch_script(aws_cli_env, "weights-sh")
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == (model_dir / "shards/model-00002.safetensors").read_bytes()
    s3.put_object(Bucket="weights-sh", Key="m/config.json", Body=b"tampered")
    (dest / "config.json").unlink()
    done = _run_fetch_script(aws_cli_env, "weights-sh")
    assert done.returncode == 3 and "config.json: sha256 does not match" in done.stderr


@pytest.mark.parametrize("bad", ESCAPING_NAMES[:5])
def test_aws_cli_script_refuses_a_name_that_leaves_the_cache_folder(s3_endpoint, aws_cli_env, tmp_path, bad):
    s3 = weights.s3_client(s3_endpoint)
    _plant_manifest(s3, "weights-sh-escape", "m", {"config.json": b"{}", bad: b"evil"})
    done = _run_fetch_script(aws_cli_env, "weights-sh-escape")
    assert done.returncode == 3 and "nothing fetched" in done.stderr
    cache = Path(aws_cli_env["PDSTACK_WEIGHTS_DEST"])
    assert sorted(p.name for p in cache.iterdir()) == [".SHA256SUMS.new"]  # the sums it read, nothing else
    assert _tree(tmp_path / "node") == ["cache", "cache/m", "cache/m/.SHA256SUMS.new"]
    assert not Path("/tmp/pdstack-escaped.txt").exists()
