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


def _write_manifests(s3, bucket, prefix, files: dict[str, tuple[str, str]]):
    """Both manifests as upload writes them: name -> (sha256, pinned version id)."""
    import json

    s3.put_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS.json", Body=json.dumps(
        {"files": {n: {"sha256": d, "version_id": v} for n, (d, v) in files.items()}}).encode())
    s3.put_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS",
                  Body="".join(f"{d} {v}  {n}\n" for n, (d, v) in files.items()).encode())


def _pin_other_bytes(s3, bucket, prefix, name, body):
    """The manifests pin, for `name`, a version holding `body` under the digest they had: what a
    store handing out other bytes than were uploaded looks like to a fetcher."""
    import json

    version = s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)["VersionId"]
    files = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS.json")["Body"].read())["files"]
    files[name]["version_id"] = version
    _write_manifests(s3, bucket, prefix, {n: (f["sha256"], f["version_id"]) for n, f in files.items()})


def test_corrupted_object_is_caught_and_the_engine_would_not_start(s3_endpoint, model_dir, tmp_path):
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-bad", "m", model_dir)
    _pin_other_bytes(s3, "weights-bad", "m", "shards/model-00001.safetensors", b"bit rot")
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
    _pin_other_bytes(s3, "weights-cli", "m", "config.json", b"{}")
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

    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    files = {}
    for name, body in names.items():
        version = s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)["VersionId"]
        files[name] = (hashlib.sha256(body).hexdigest(), version)
    _write_manifests(s3, bucket, prefix, files)


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
    _pin_other_bytes(s3, "weights-sh", "m", "config.json", b"tampered")
    (dest / "config.json").unlink()
    done = _run_fetch_script(aws_cli_env, "weights-sh")
    assert done.returncode == 3 and "config.json: sha256 does not match" in done.stderr


def test_aws_cli_script_runs_with_the_real_aws_cli(s3_endpoint, model_dir, aws_cli_env, tmp_path):
    """The script under the real AWS CLI, not the stand-in: awscli 1.46.3 from PyPI
    (twin/weights-fetcher-requirements.txt, the twin's fetcher virtualenv). Its global options are
    awscli/data/cli.json's; --only-show-errors belongs to the `aws s3` transfer commands only
    (awscli/customizations/s3/subcommands.py), and `aws --only-show-errors s3api get-object`
    exits 255 "Unknown options", which the script once passed on every call."""
    from twin.init_containers import fetcher_venv

    (tmp_path / "bin" / "aws").write_text(f'#!/bin/sh\nexec {fetcher_venv()}/bin/python -m awscli "$@"\n')
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-real-cli", "m", model_dir)
    done = _run_fetch_script(aws_cli_env, "weights-real-cli")
    assert done.returncode == 0, done.stderr
    dest = Path(aws_cli_env["PDSTACK_WEIGHTS_DEST"])
    assert all((dest / f.relative_to(model_dir)).read_bytes() == f.read_bytes() for f in model_dir.rglob("*") if f.is_file())
    _pin_other_bytes(s3, "weights-real-cli", "m", "config.json", b"tampered")
    (dest / "config.json").unlink()
    done = _run_fetch_script(aws_cli_env, "weights-real-cli")
    assert done.returncode == 3 and "config.json: sha256 does not match the manifest" in done.stderr, done.stderr


@pytest.mark.parametrize("bad", ESCAPING_NAMES[:5])
def test_aws_cli_script_refuses_a_name_that_leaves_the_cache_folder(s3_endpoint, aws_cli_env, tmp_path, bad):
    s3 = weights.s3_client(s3_endpoint)
    _plant_manifest(s3, "weights-sh-escape", "m", {"config.json": b"{}", bad: b"evil"})
    done = _run_fetch_script(aws_cli_env, "weights-sh-escape")
    assert done.returncode == 3 and "nothing fetched" in done.stderr
    assert _tree(tmp_path / "node") == ["cache", "cache/m"]  # its work folder gone with it, nothing else written
    assert not Path("/tmp/pdstack-escaped.txt").exists()


# --- a bucket policy that lets anyone read (issue #36 item 5) ---------------------------------


def _store_answering_not_implemented(s3, *operations):
    """`s3` as MinIO or Ceph RGW answer it: NotImplemented (HTTP 501) to each of `operations`.
    A stub on the client (botocore's before-call event, whose answer replaces the request), for
    moto implements them all; the S3 server still answers every other call."""
    from botocore.awsrequest import AWSResponse

    def not_implemented(**_):
        return AWSResponse("", 501, {}, None), {"Error": {"Code": "NotImplemented", "Message": "A header you "
                                                          "provided implies functionality that is not implemented"}}

    for op in operations:
        s3.meta.events.register(f"before-call.s3.{op}", not_implemented)
    return s3


def _public_read_policy(bucket, principal, **condition):
    import json

    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Sid": "PublicRead", "Effect": "Allow", "Principal": principal, "Action": ["s3:GetObject"],
        "Resource": [f"arn:aws:s3:::{bucket}/*"], **({"Condition": condition} if condition else {})}]})


def _nothing_uploaded(s3, bucket):
    return s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_upload_refuses_a_bucket_whose_policy_lets_anyone_read(s3_endpoint, model_dir):
    """Before, only ACL grants were read: a policy allowing s3:GetObject to "*" uploaded the
    weights into a public bucket. Where the store judges its own policy (GetBucketPolicyStatus,
    AWS S3 API Reference: PolicyStatus.IsPublic; moto implements it), its verdict refuses it."""
    s3 = weights.s3_client(s3_endpoint)
    s3.create_bucket(Bucket="weights-policy-public")
    s3.put_bucket_policy(Bucket="weights-policy-public", Policy=_public_read_policy("weights-policy-public", "*"))
    with pytest.raises(BucketPostureError, match="policy lets anyone read it"):
        weights.upload(s3, "weights-policy-public", "m", model_dir)
    assert _nothing_uploaded(s3, "weights-policy-public")


def test_a_store_that_cannot_judge_its_policy_has_it_read_and_an_allow_to_everyone_refused(s3_endpoint, model_dir):
    """MinIO and Ceph RGW answer NotImplemented to GetBucketPolicyStatus and PutPublicAccessBlock
    (the error was swallowed and nothing else looked). Their policy is read instead: MinIO's own
    anonymous-download policy (`mc anonymous set download`: Principal {"AWS": ["*"]}) is refused,
    one allowing a named role is not."""
    import json

    s3 = _store_answering_not_implemented(weights.s3_client(s3_endpoint), "GetBucketPolicyStatus",
                                          "PutPublicAccessBlock")
    s3.create_bucket(Bucket="weights-minio-public")
    s3.put_bucket_policy(Bucket="weights-minio-public",
                         Policy=_public_read_policy("weights-minio-public", {"AWS": ["*"]}))
    with pytest.raises(BucketPostureError, match=r"allows \['s3:GetObject'\] to everyone \(statement PublicRead\)"):
        weights.upload(s3, "weights-minio-public", "m", model_dir)
    assert _nothing_uploaded(s3, "weights-minio-public")

    s3.create_bucket(Bucket="weights-minio-private")
    s3.put_bucket_policy(Bucket="weights-minio-private", Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::123456789012:role/weights-reader"},
        "Action": "s3:GetObject", "Resource": "arn:aws:s3:::weights-minio-private/*"}]}))
    assert set(weights.upload(s3, "weights-minio-private", "m", model_dir)) >= {"config.json"}


def test_where_the_store_cannot_say_the_upload_needs_the_operators_word(s3_endpoint, model_dir, capsys, monkeypatch):
    """A store that answers neither call, or an allow to everyone under conditions this does not
    judge: refused, saying so, with nothing uploaded, unless the operator passes
    --unreadable-bucket-policy-ok (weights.py, as upload_weights runs it: exit 3, then 0)."""
    talking = _store_answering_not_implemented(weights.s3_client(s3_endpoint), "GetBucketPolicyStatus")
    s3 = _store_answering_not_implemented(weights.s3_client(s3_endpoint), "GetBucketPolicyStatus",
                                          "PutPublicAccessBlock", "GetBucketPolicy")
    monkeypatch.setattr(weights, "s3_client", lambda *_: s3)
    s3.create_bucket(Bucket="weights-mute")
    command = ["upload", "--endpoint", s3_endpoint, "--bucket", "weights-mute", "--prefix", "m",
               "--source", str(model_dir)]
    assert weights.main(command) == 3
    err = capsys.readouterr().err
    assert "answers neither GetBucketPolicyStatus nor GetBucketPolicy (NotImplemented)" in err, err
    assert "--unreadable-bucket-policy-ok" in err and _nothing_uploaded(s3, "weights-mute")
    assert weights.main([*command, "--unreadable-bucket-policy-ok"]) == 0

    talking.create_bucket(Bucket="weights-conditional")
    talking.put_bucket_policy(Bucket="weights-conditional", Policy=_public_read_policy(
        "weights-conditional", "*", IpAddress={"aws:SourceIp": "10.0.0.0/8"}))
    with pytest.raises(BucketPostureError, match="under conditions this does not judge"):
        weights.upload(talking, "weights-conditional", "m", model_dir)
    assert _nothing_uploaded(talking, "weights-conditional")
    weights.upload(talking, "weights-conditional", "m", model_dir, unreadable_policy_ok=True)


# --- uploads cut half way or run side by side (issue #36 item 6) ------------------------------


def _changed_copy(source: Path, to: Path, mark: bytes) -> Path:
    """The same names as `source`, every file's bytes different: a new version of the model."""
    import shutil

    shutil.copytree(source, to)
    for f in (p for p in to.rglob("*") if p.is_file()):
        f.write_bytes(f.read_bytes() + mark)
    return to


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_an_upload_cut_half_way_changes_nothing_a_fresh_node_fetches(s3_endpoint, model_dir, tmp_path, aws_cli_env,
                                                                      monkeypatch):
    """Before: a re-upload into the same prefix cut after two files left the old manifest over
    two new objects and two old ones; a fetcher took each key's latest version, so every node
    fetching afresh failed verification (its pods never started) while warm nodes kept serving.
    Now the manifests pin each object's version and both fetchers fetch those (GetObject's
    versionId, AWS S3 API Reference; `aws s3api get-object --version-id`)."""
    s3 = weights.s3_client(s3_endpoint)
    before = weights.upload(s3, "weights-cut", "m", model_dir)
    sent, real = [], s3.upload_file

    def cut_after_two(*args, **kwargs):
        if len(sent) == 2:
            raise ConnectionError("the uploader's connection was cut")
        sent.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(s3, "upload_file", cut_after_two)
    with pytest.raises(ConnectionError):
        weights.upload(s3, "weights-cut", "m", _changed_copy(model_dir, tmp_path / "model-2", b"v2"))
    assert len(sent) == 2  # two keys' latest versions are the new upload's, the manifests the old one's
    assert weights.fetch_and_verify(s3, "weights-cut", "m", tmp_path / "fresh-node") == before
    assert _same_files(model_dir, tmp_path / "fresh-node")
    done = _run_fetch_script(aws_cli_env, "weights-cut")
    assert done.returncode == 0, done.stderr
    assert _same_files(model_dir, Path(aws_cli_env["PDSTACK_WEIGHTS_DEST"]))


def test_a_file_sent_in_parts_is_pinned_at_the_version_its_completion_made(s3_endpoint, model_dir):
    """upload_file sends a file over its multipart threshold (8 MiB, boto3's TransferConfig
    default) in parts; its version is in CompleteMultipartUpload's answer, not PutObject's."""
    import json

    (model_dir / "shards" / "large.safetensors").write_bytes(b"\1" * (9 * 1024 * 1024))
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-parts", "m", model_dir)
    files = json.loads(s3.get_object(Bucket="weights-parts", Key="m/SHA256SUMS.json")["Body"].read())["files"]
    for name, pinned in files.items():
        assert pinned["version_id"] == s3.head_object(Bucket="weights-parts", Key=f"m/{name}")["VersionId"], name
    assert s3.head_object(Bucket="weights-parts", Key="m/shards/large.safetensors")["ETag"].endswith('-2"')  # 2 parts


def test_two_uploads_into_one_prefix_at_once_one_stands_whole_and_the_other_is_refused(s3_endpoint, model_dir,
                                                                                       tmp_path, monkeypatch):
    """Upload A is under way when upload B runs whole. Before, A went on writing over B's objects
    and then its own manifest: a mix no fresh node could verify. Now A's manifest write is
    conditional on the manifest A began over (If-Match / If-None-Match, the S3 API's conditional
    PutObject), so A is refused, changes no manifest, and B's weights are what nodes fetch."""
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-race", "m", model_dir)
    a, b = (_changed_copy(model_dir, tmp_path / name, name.encode()) for name in ("model-a", "model-b"))
    real, others = s3.upload_file, []

    def b_runs_whole_meanwhile(*args, **kwargs):
        real(*args, **kwargs)
        if not others:
            others.append(weights.upload(weights.s3_client(s3_endpoint), "weights-race", "m", b))

    monkeypatch.setattr(s3, "upload_file", b_runs_whole_meanwhile)
    with pytest.raises(weights.ConcurrentUploadError, match="written by another upload while this one ran"):
        weights.upload(s3, "weights-race", "m", a)
    assert weights.fetch_and_verify(s3, "weights-race", "m", tmp_path / "fresh-node") == others[0]
    assert _same_files(b, tmp_path / "fresh-node")


# --- two fetches into one node cache at once (issue #36 item 10) ------------------------------


def test_two_fetches_into_one_node_cache_take_turns(s3_endpoint, model_dir, tmp_path, monkeypatch):
    """Two pods starting on one node run two fetches into one hostPath cache. Before, both wrote
    `<file>.partial` and one's os.replace found the file gone (FileNotFoundError, the init
    container crashed). Now a fetch holds an flock of the cache folder's .pdstack-fetch.lock: the
    first is paused inside its first download, the lock is held (a non-blocking flock is
    refused), a second fetch waits its turn, and both finish with the weights verified."""
    import fcntl
    import threading

    s3 = weights.s3_client(s3_endpoint)
    manifest = weights.upload(s3, "weights-two", "m", model_dir)
    dest, paused, go, results = tmp_path / "cache", threading.Event(), threading.Event(), []
    first_client = weights.s3_client(s3_endpoint)
    real = first_client.download_file

    def pause_after_the_first_file(*args, **kwargs):
        real(*args, **kwargs)
        if not paused.is_set():
            paused.set()
            go.wait()

    monkeypatch.setattr(first_client, "download_file", pause_after_the_first_file)

    def fetch(client):
        try:
            results.append(weights.fetch_and_verify(client, "weights-two", "m", dest))
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's own error
            results.append(exc)

    first = threading.Thread(target=fetch, args=(first_client,), daemon=True)
    first.start()
    try:
        assert paused.wait(300)
        with open(dest / weights.LOCK_NAME) as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        second = threading.Thread(target=fetch, args=(weights.s3_client(s3_endpoint),), daemon=True)
        second.start()
    finally:
        go.set()
    first.join()
    second.join()
    assert results == [manifest, manifest]
    assert _same_files(model_dir, dest)


def test_two_aws_cli_fetches_into_one_node_cache_both_finish(s3_endpoint, model_dir, aws_cli_env, tmp_path):
    """The aws-cli image's script: the first run pauses after its first weight file (the `aws`
    stand-in's AWS_STANDIN_PAUSE), a second runs whole meanwhile, then the first goes on. Each
    keeps what it has not finished in a work folder of its own, so neither removes or renames
    the other's files; both exit 0 and leave no work folder."""
    import time

    weights.upload(weights.s3_client(s3_endpoint), "weights-sh-two", "m", model_dir)
    pause = tmp_path / "pause"
    pause.mkdir()
    from infra.components.storage import aws_cli_fetch_script

    first = subprocess.Popen(["/bin/sh", "-c", aws_cli_fetch_script()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**aws_cli_env, "PDSTACK_WEIGHTS_BUCKET": "weights-sh-two",
                                             "AWS_STANDIN_PAUSE": str(pause)})
    try:
        while not (pause / "paused").exists() and first.poll() is None:
            time.sleep(0.05)
        assert (pause / "paused").exists(), first.communicate()
        second = _run_fetch_script(aws_cli_env, "weights-sh-two")
        assert second.returncode == 0, second.stderr
    finally:
        (pause / "go").touch()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    dest = Path(aws_cli_env["PDSTACK_WEIGHTS_DEST"])
    assert _same_files(model_dir, dest)
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith(".")) == [".pdstack-verified"]


# --- manifests written before versions were pinned, on upgrade (#36 item 6 follow-up) ---------


def _upload_the_old_way(s3, bucket, prefix, source: Path) -> dict[str, str]:
    """The files and both manifests as upload_weights wrote them before manifests pinned versions
    (infra/weights.py at a311ade~1): SHA256SUMS.json `{name: sha256}`, SHA256SUMS lines
    `<sha256>  <name>` (coreutils `sha256sum` output, two spaces), each file its key's latest version."""
    import json

    manifest = weights.build_manifest(source)
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    for rel in manifest:
        s3.upload_file(str(source / rel), bucket, f"{prefix}/{rel}")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS",
                  Body="".join(f"{digest}  {rel}\n" for rel, digest in sorted(manifest.items())).encode())
    s3.put_object(Bucket=bucket, Key=f"{prefix}/SHA256SUMS.json",
                  Body=json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def test_a_manifest_written_before_versions_were_pinned_is_still_fetched_and_verified(s3_endpoint, model_dir,
                                                                                      tmp_path, capsys):
    """Upgrading the stack ships the new fetcher to every pod that starts next; the bucket still
    holds the manifest the last upload wrote. Before, a `{name: sha256}` manifest was refused
    ("upload again"): a restarted engine pod or a new group never started while warm pods served.
    Now it is fetched as then (each key's latest version, verified by sha256), with a warning in
    the init container's log to upload again; a file that does not match still fails the pod."""
    s3 = weights.s3_client(s3_endpoint)
    old = _upload_the_old_way(s3, "weights-legacy", "m", model_dir)
    dest = tmp_path / "cache"
    assert weights.main(["fetch", "--endpoint", s3_endpoint, "--bucket", "weights-legacy", "--prefix", "m",
                         "--dest", str(dest)]) == 0
    err = capsys.readouterr().err
    assert "pins no object versions" in err and "upload the weights again with scripts/upload_weights" in err, err
    assert _same_files(model_dir, dest)
    assert weights.fetch_and_verify(s3, "weights-legacy", "m", dest) == old  # warm: the same answer, and said again
    assert "pins no object versions" in capsys.readouterr().err
    s3.put_object(Bucket="weights-legacy", Key="m/shards/model-00001.safetensors", Body=b"bit rot")
    with pytest.raises(WeightsIntegrityError) as caught:
        weights.fetch_and_verify(s3, "weights-legacy", "m", tmp_path / "fresh-node")
    assert [p.split(":")[0] for p in caught.value.problems] == ["shards/model-00001.safetensors"]
    assert not (tmp_path / "fresh-node" / MANIFEST_NAME).exists()


def test_aws_cli_script_fetches_and_verifies_a_manifest_written_before_versions_were_pinned(
        s3_endpoint, model_dir, aws_cli_env, tmp_path):
    """The aws-cli image's script with SHA256SUMS in its old shape (`<sha256>  <name>`, every
    line): each key's latest version is fetched (no --version-id) and checked by `sha256sum -c`,
    with the warning on stderr; a key whose latest bytes do not match still exits 3."""
    s3 = weights.s3_client(s3_endpoint)
    _upload_the_old_way(s3, "weights-sh-legacy", "m", model_dir)
    done = _run_fetch_script(aws_cli_env, "weights-sh-legacy")
    assert done.returncode == 0, done.stderr
    assert "pins no object versions" in done.stderr and "scripts/upload_weights" in done.stderr
    dest = Path(aws_cli_env["PDSTACK_WEIGHTS_DEST"])
    assert _same_files(model_dir, dest)
    fetched = [line for line in (tmp_path / "aws.log").read_text().splitlines() if "/SHA256SUMS " not in line]
    assert len(fetched) == 4 and not any("--version-id" in line for line in fetched), fetched
    done = _run_fetch_script(aws_cli_env, "weights-sh-legacy")
    assert done.returncode == 0 and "verified before" in done.stdout and "pins no object versions" in done.stderr
    s3.put_object(Bucket="weights-sh-legacy", Key="m/config.json", Body=b"tampered")
    (dest / "config.json").unlink()
    done = _run_fetch_script(aws_cli_env, "weights-sh-legacy")
    assert done.returncode == 3 and "config.json: sha256 does not match" in done.stderr


@pytest.mark.parametrize("sums", [
    "{d}  config.json\n{d} 3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY  shards/a\n",  # both shapes in one file
    "{d}  ../escaped.txt\n",  # the old shape, a name that leaves the folder
    "{d} config.json\n",  # one space: neither shape
    "{d}   config.json\n",  # three spaces: neither shape
])
def test_aws_cli_script_takes_only_the_two_line_shapes_whole(s3_endpoint, aws_cli_env, tmp_path, sums):
    """The old shape is taken only for a whole file of it; anything else is refused before a byte
    is fetched, as before."""
    s3 = weights.s3_client(s3_endpoint)
    _plant_manifest(s3, "weights-sh-shapes", "m", {"config.json": b"{}"})
    s3.put_object(Bucket="weights-sh-shapes", Key="m/SHA256SUMS", Body=sums.format(d="0" * 64).encode())
    done = _run_fetch_script(aws_cli_env, "weights-sh-shapes")
    assert done.returncode == 3 and "nothing fetched" in done.stderr, done.stderr
    assert _tree(tmp_path / "node") == ["cache", "cache/m"]


@pytest.mark.parametrize("body", [
    {"../escaped.txt": "0" * 64},  # the old shape, a name that leaves the folder
    {"config.json": "not a digest"},
    {"config.json": "0" * 64, "shards": {"sha256": "0" * 64, "version_id": "v1"}},  # the two shapes mixed
    {"files": {"config.json": {"sha256": "0" * 64}}},  # the new shape without its version
])
def test_a_manifest_of_neither_shape_whole_is_refused_before_anything_is_fetched(body):
    import json

    with pytest.raises(weights.WeightsManifestError, match="Fix: upload the weights again"):
        weights.checked_manifest(json.dumps(body).encode())
