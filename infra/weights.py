"""Model weights in S3-compatible object storage, with a sha256 manifest.

This file is self-contained (stdlib and boto3 only) on purpose: the storage layer ships
this very source in a ConfigMap, and each engine pod's init step runs it to pull the
weights into the node-local cache and verify every checksum before the engine starts.
One implementation serves the operator's upload, the node's fetch and the tests.

    python3 weights.py upload --endpoint URL --bucket B --prefix P --source DIR
    python3 weights.py fetch  --endpoint URL --bucket B --prefix P --dest DIR [--workers N]

Every option also comes from the environment (PDSTACK_WEIGHTS_ENDPOINT, _REGION, _BUCKET,
_PREFIX, _DEST, _WORKERS): the pod passes the spec's values that way, never through a shell.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "SHA256SUMS.json"
VERIFIED_NAME = ".pdstack-verified.json"  # what was verified, against which object versions
CHUNK = 8 * 1024 * 1024
DEFAULT_WORKERS = 8  # files hashed (and fetched) at once: sha256 runs outside the GIL

# Names of weight files, as S3 key suffixes and as paths under the node cache: AWS's "safe
# characters" for object keys (docs.aws.amazon.com/AmazonS3/latest/userguide/object-keys.html:
# 0-9 a-z A-Z ! - _ . * ' ( )) less ! * ' ( ), which shells and URLs treat specially; '/'
# between parts; no empty, "." or ".." part and no leading '/', so a name can never leave the
# folder it is fetched to; no part starts with '-', so none reads as an option. The same text is a Python regex and a POSIX ERE (the aws-cli fetch
# script checks SHA256SUMS with `grep -E`).
_PART = r"([A-Za-z0-9_][A-Za-z0-9._-]*|\.[A-Za-z0-9_-][A-Za-z0-9._-]*|\.\.[A-Za-z0-9._-]+)"
SAFE_NAME = rf"{_PART}(/{_PART})*"
KEY_MAX_BYTES = 1024  # S3's limit on a whole key
PART_MAX_BYTES = 255  # NAME_MAX of Linux filesystems: a longer part cannot be a file or folder on the node


class BucketPostureError(RuntimeError):
    """The weights bucket is public or unversioned; nothing was uploaded."""


class WeightsManifestError(RuntimeError):
    """The checksum manifest is not one pdstack can follow (a name leaving the folder, not a
    mapping of names to sha256 digests); nothing was fetched or written."""


def unsafe_name(name: object) -> str | None:
    """Why `name` cannot be a weight file's name (None when it can)."""
    if not isinstance(name, str) or not re.fullmatch(SAFE_NAME, name):
        return (f"{name!r} is not a relative name of letters, digits, '.', '_', '-' and '/' without '..' parts "
                "(it could leave the folder it is fetched to)")
    if len(name.encode()) > KEY_MAX_BYTES:
        return f"{name[:40]!r}... is longer than an S3 key may be ({KEY_MAX_BYTES} bytes)"
    if any(len(part.encode()) > PART_MAX_BYTES for part in name.split("/")):
        return f"{name[:40]!r}... has a part longer than a file name on the node may be ({PART_MAX_BYTES} bytes)"
    return None


class WeightsIntegrityError(RuntimeError):
    """A weight file is missing or its sha256 does not match the manifest."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("weights failed verification, refusing to start:\n" + "\n".join(f"  - {p}" for p in problems))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(source: Path, workers: int = DEFAULT_WORKERS) -> dict[str, str]:
    """sha256 of every file under source, by relative POSIX path. A name a node could not
    fetch safely (see SAFE_NAME) or a symbolic link is refused before anything is uploaded."""
    files = [p for p in sorted(source.rglob("*")) if (p.is_file() or p.is_symlink()) and p.name != MANIFEST_NAME]
    problems = [f"{p}: {why}" for p in files if (why := unsafe_name(p.relative_to(source).as_posix()))]
    problems += [f"{p}: a symbolic link (upload the file it points to instead)" for p in files if p.is_symlink()]
    if problems:
        raise WeightsManifestError("; ".join(problems[:5]) + ". Fix: rename or replace them, then upload again")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(zip((p.relative_to(source).as_posix() for p in files), pool.map(sha256_file, files)))


def s3_client(endpoint: str, region: str = "us-east-1"):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=region)


def _key(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def ensure_private_versioned_bucket(s3, bucket: str) -> None:
    """Create the bucket if needed; block public access where the endpoint supports it."""
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    try:
        s3.put_public_access_block(
            Bucket=bucket,
            PublicAccessBlockConfiguration={
                "BlockPublicAcls": True, "IgnorePublicAcls": True,
                "BlockPublicPolicy": True, "RestrictPublicBuckets": True,
            },
        )
    except s3.exceptions.ClientError as exc:  # MinIO and Ceph RGW lack this API
        if exc.response["Error"]["Code"] not in ("NotImplemented", "XNotImplemented"):
            raise


_PUBLIC_GRANTEES = ("http://acs.amazonaws.com/groups/global/AllUsers",
                    "http://acs.amazonaws.com/groups/global/AuthenticatedUsers")


def bucket_posture_problems(s3, bucket: str) -> list[str]:
    """What makes the bucket unfit for weights: not versioned, or readable by anyone."""
    problems = []
    if s3.get_bucket_versioning(Bucket=bucket).get("Status") != "Enabled":
        problems.append(f"bucket {bucket}: versioning is not enabled")
    for grant in s3.get_bucket_acl(Bucket=bucket).get("Grants", []):
        if grant.get("Grantee", {}).get("URI") in _PUBLIC_GRANTEES:
            problems.append(f"bucket {bucket}: ACL grants {grant['Permission']} to {grant['Grantee']['URI'].rsplit('/', 1)[-1]}")
    return problems


def upload(s3, bucket: str, prefix: str, source: Path, workers: int = DEFAULT_WORKERS) -> dict[str, str]:
    """Upload every file, then the manifest last, so a half-done upload has no manifest.

    Refuses (before writing anything) a bucket that is public or unversioned: weights are
    the model's IP, and versioning is what lets a bad upload be undone.
    """
    manifest = build_manifest(source, workers)  # names checked before the bucket is touched
    ensure_private_versioned_bucket(s3, bucket)
    problems = bucket_posture_problems(s3, bucket)
    if problems:
        raise BucketPostureError("; ".join(problems) + ". Fix: make it private (remove the public grant) "
                                 "and enable versioning, then upload again")
    for rel in manifest:
        s3.upload_file(str(source / rel), bucket, _key(prefix, rel))
    # The same sums in `sha256sum -c` form, for fetchers that have coreutils but no Python.
    sums = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(manifest.items()))
    s3.put_object(Bucket=bucket, Key=_key(prefix, SUMS_NAME), Body=sums.encode())
    s3.put_object(Bucket=bucket, Key=_key(prefix, MANIFEST_NAME), Body=json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def checked_manifest(body: bytes) -> dict[str, str]:
    """The manifest's names and digests, refused whole if any name could leave the folder."""
    try:
        manifest = json.loads(body)
    except ValueError:
        raise WeightsManifestError(f"{MANIFEST_NAME} is not JSON. Fix: upload the weights again") from None
    if not isinstance(manifest, dict):
        raise WeightsManifestError(f"{MANIFEST_NAME} is not a mapping of file names to sha256 digests. Fix: upload "
                                   "the weights again")
    problems = [why for name in manifest if (why := unsafe_name(name))]
    problems += [f"{name!r}: {digest!r} is not a sha256 digest" for name, digest in manifest.items()
                 if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest))]
    problems += [f"{name!r} is a name pdstack keeps for itself" for name in manifest
                 if name.split("/")[0] in (MANIFEST_NAME, SUMS_NAME, VERIFIED_NAME)]
    if problems:
        raise WeightsManifestError(f"{MANIFEST_NAME} refused, nothing fetched: " + "; ".join(problems[:5])
                                   + ". Fix: upload the weights again with scripts/upload_weights")
    return manifest


def _no_link_on_the_way(dest: Path, name: str) -> None:
    """Refuse a symbolic link at any step from dest to dest/name: a file written through it
    would land wherever it points."""
    step = dest
    for part in name.split("/"):
        step = step / part
        if step.is_symlink():
            raise WeightsManifestError(f"{step}: a symbolic link in the weights cache; nothing is written through "
                                       "one. Fix: remove it")


def _object_versions(s3, bucket: str, prefix: str) -> dict[str, str]:
    """Every object under the prefix with its ETag (and the manifest's VersionId when the bucket
    is versioned): what a verification was made against."""
    versions: dict[str, str] = {}
    root = _key(prefix, "")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root):
        for item in page.get("Contents", []):
            versions[item["Key"][len(root):]] = f"{item['ETag']} {item['Size']}"
    return versions


def _local_state(dest: Path, manifest: dict[str, str]) -> dict[str, list[int]]:
    """Size and modification time of each cached file: a file replaced or cut since it was
    verified shows here without reading it."""
    state = {}
    for name in manifest:
        try:
            st = os.lstat(dest / name)
        except OSError:
            return {}
        state[name] = [st.st_size, st.st_mtime_ns]
    return state


def fetch_and_verify(s3, bucket: str, prefix: str, dest: Path, workers: int = DEFAULT_WORKERS) -> dict[str, str]:
    """Pull what the node cache lacks, then verify every file. Raises on any mismatch.

    Verified once per object version: a marker in dest records the manifest's VersionId and
    ETag, every object's ETag and size, and each cached file's size and mtime. A pod start that
    finds all of them unchanged reads no file; any change (a new upload, a file touched on the
    node) verifies everything again, `workers` files at a time."""
    got = s3.get_object(Bucket=bucket, Key=_key(prefix, MANIFEST_NAME))
    body = got["Body"].read()
    manifest = checked_manifest(body)
    dest.mkdir(parents=True, exist_ok=True)
    for name in manifest:
        _no_link_on_the_way(dest, name)
    marker = dest / VERIFIED_NAME
    against = {"bucket": bucket, "prefix": prefix.strip("/"),
               "manifest": {"version_id": got.get("VersionId"), "etag": got.get("ETag")},
               "objects": _object_versions(s3, bucket, prefix)}
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, dict) and recorded.get("against") == against and recorded.get("files") and \
            recorded.get("files") == _local_state(dest, manifest):
        return manifest
    marker.unlink(missing_ok=True)  # a verification stopped half way leaves no marker

    def check(item: tuple[str, str]) -> str | None:
        name, expected = item
        target = dest / name
        if not (target.is_file() and sha256_file(target) == expected):
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            partial.unlink(missing_ok=True)  # never write through whatever was left there
            s3.download_file(bucket, _key(prefix, name), str(partial))
            os.replace(partial, target)
            actual = sha256_file(target)
            if actual != expected:
                return f"{name}: sha256 {actual[:12]}... but the manifest says {expected[:12]}..."
        return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        problems = [p for p in pool.map(check, sorted(manifest.items())) if p]
    if problems:
        raise WeightsIntegrityError(problems)
    (dest / MANIFEST_NAME).write_bytes(body)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"against": against, "files": _local_state(dest, manifest)}, sort_keys=True))
    os.replace(tmp, marker)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    parser.add_argument("action", choices=["upload", "fetch"])
    parser.add_argument("--endpoint", default=env("PDSTACK_WEIGHTS_ENDPOINT"))
    parser.add_argument("--region", default=env("PDSTACK_WEIGHTS_REGION", "us-east-1"))
    parser.add_argument("--bucket", default=env("PDSTACK_WEIGHTS_BUCKET"))
    parser.add_argument("--prefix", default=env("PDSTACK_WEIGHTS_PREFIX"))
    parser.add_argument("--source", type=Path, help="upload: local folder of weight files")
    parser.add_argument("--dest", type=Path, default=env("PDSTACK_WEIGHTS_DEST"),
                        help="fetch: node-local cache folder")
    parser.add_argument("--workers", type=int, default=int(env("PDSTACK_WEIGHTS_WORKERS") or DEFAULT_WORKERS),
                        help="files hashed and fetched at once")
    args = parser.parse_args(argv)
    missing = [f"--{k}" for k in ("endpoint", "bucket", "prefix") if getattr(args, k) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required (or PDSTACK_WEIGHTS_{missing[0][2:].upper()})")
    s3 = s3_client(args.endpoint, args.region)
    try:
        if args.action == "upload":
            if not args.source or not args.source.is_dir():
                parser.error("--source must be a folder of weight files")
            manifest = upload(s3, args.bucket, args.prefix, args.source, args.workers)
            print(f"uploaded {len(manifest)} files and {MANIFEST_NAME} to s3://{args.bucket}/{args.prefix}")
        else:
            if not args.dest:
                parser.error("--dest is required for fetch")
            manifest = fetch_and_verify(s3, args.bucket, args.prefix, Path(args.dest), args.workers)
            print(f"verified {len(manifest)} files in {args.dest}")
    except (WeightsIntegrityError, WeightsManifestError, BucketPostureError) as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
