"""Model weights in S3-compatible object storage, with a sha256 manifest.

This file is self-contained (stdlib and boto3 only) on purpose: the storage layer ships
this very source in a ConfigMap, and each engine pod's init step runs it to pull the
weights into the node-local cache and verify every checksum before the engine starts.
One implementation serves the operator's upload, the node's fetch and the tests.

    python3 weights.py upload --endpoint URL --bucket B --prefix P --source DIR
    python3 weights.py fetch  --endpoint URL --bucket B --prefix P --dest DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "SHA256SUMS.json"
CHUNK = 8 * 1024 * 1024


class BucketPostureError(RuntimeError):
    """The weights bucket is public or unversioned; nothing was uploaded."""


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


def build_manifest(source: Path) -> dict[str, str]:
    """sha256 of every file under source, by relative POSIX path."""
    return {
        p.relative_to(source).as_posix(): sha256_file(p)
        for p in sorted(source.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


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


def upload(s3, bucket: str, prefix: str, source: Path) -> dict[str, str]:
    """Upload every file, then the manifest last, so a half-done upload has no manifest.

    Refuses (before writing anything) a bucket that is public or unversioned: weights are
    the model's IP, and versioning is what lets a bad upload be undone.
    """
    ensure_private_versioned_bucket(s3, bucket)
    problems = bucket_posture_problems(s3, bucket)
    if problems:
        raise BucketPostureError("; ".join(problems) + ". Fix: make it private (remove the public grant) "
                                 "and enable versioning, then upload again")
    manifest = build_manifest(source)
    for rel in manifest:
        s3.upload_file(str(source / rel), bucket, _key(prefix, rel))
    # The same sums in `sha256sum -c` form, for fetchers that have coreutils but no Python.
    sums = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(manifest.items()))
    s3.put_object(Bucket=bucket, Key=_key(prefix, SUMS_NAME), Body=sums.encode())
    s3.put_object(Bucket=bucket, Key=_key(prefix, MANIFEST_NAME), Body=json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def fetch_and_verify(s3, bucket: str, prefix: str, dest: Path) -> dict[str, str]:
    """Pull what the node cache lacks, then verify every file. Raises on any mismatch."""
    body = s3.get_object(Bucket=bucket, Key=_key(prefix, MANIFEST_NAME))["Body"].read()
    manifest: dict[str, str] = json.loads(body)
    dest.mkdir(parents=True, exist_ok=True)
    problems = []
    for rel, expected in sorted(manifest.items()):
        target = dest / rel
        if not (target.is_file() and sha256_file(target) == expected):
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            s3.download_file(bucket, _key(prefix, rel), str(partial))
            os.replace(partial, target)
        actual = sha256_file(target)
        if actual != expected:
            problems.append(f"{rel}: sha256 {actual[:12]}... but the manifest says {expected[:12]}...")
    if problems:
        raise WeightsIntegrityError(problems)
    (dest / MANIFEST_NAME).write_bytes(body)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["upload", "fetch"])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--source", type=Path, help="upload: local folder of weight files")
    parser.add_argument("--dest", type=Path, help="fetch: node-local cache folder")
    args = parser.parse_args(argv)
    s3 = s3_client(args.endpoint, args.region)
    try:
        if args.action == "upload":
            if not args.source or not args.source.is_dir():
                parser.error("--source must be a folder of weight files")
            manifest = upload(s3, args.bucket, args.prefix, args.source)
            print(f"uploaded {len(manifest)} files and {MANIFEST_NAME} to s3://{args.bucket}/{args.prefix}")
        else:
            if not args.dest:
                parser.error("--dest is required for fetch")
            manifest = fetch_and_verify(s3, args.bucket, args.prefix, args.dest)
            print(f"verified {len(manifest)} files in {args.dest}")
    except (WeightsIntegrityError, BucketPostureError) as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
