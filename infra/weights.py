"""Model weights in S3-compatible object storage, with a sha256 manifest.

This file is self-contained (stdlib and boto3 only) on purpose: the storage layer ships
this very source in a ConfigMap, and each engine pod's init step runs it to pull the
weights into the node-local cache and verify every checksum before the engine starts.
One implementation serves the operator's upload, the node's fetch and the tests.

    python3 weights.py upload --endpoint URL --bucket B --prefix P --source DIR [--unreadable-bucket-policy-ok]
    python3 weights.py fetch  --endpoint URL --bucket B --prefix P --dest DIR [--workers N]

Every option also comes from the environment (PDSTACK_WEIGHTS_ENDPOINT, _REGION, _BUCKET,
_PREFIX, _DEST, _WORKERS): the pod passes the spec's values that way, never through a shell.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "SHA256SUMS.json"
VERIFIED_NAME = ".pdstack-verified.json"  # what was verified, against which object versions
LOCK_NAME = ".pdstack-fetch.lock"  # one fetch into a cache folder at a time (flock)
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
# An object's version id as S3-compatible stores write them (AWS: letters, digits, '.', '_', '+',
# '/', '='; MinIO and Ceph RGW: UUIDs and letters), never starting with '-' (it would read as an
# option to `aws s3api get-object --version-id`). Also a POSIX ERE.
VERSION_ID = r"[A-Za-z0-9._+/=][A-Za-z0-9._+/=-]{0,1023}"
KEY_MAX_BYTES = 1024  # S3's limit on a whole key
PART_MAX_BYTES = 255  # NAME_MAX of Linux filesystems: a longer part cannot be a file or folder on the node


# A first deploy's fetches go in waves (spec model.weights.fetch_nodes_at_once): a pod's node
# ordinal in the fleet (its pool's first node, plus its LWS group index times the group's nodes,
# plus its worker index) picks a wave, and a node that has anything to fetch waits its wave times
# WAVE_SECONDS (one node's whole fetch) before its first GET. PDSTACK_WEIGHTS_<name>, all unset for
# a pod in no pool: it waits for nothing. The aws-cli script computes the same in shell.
WAVE_ENV = ("FIRST_NODE", "GROUP_NODES", "GROUP_INDEX", "WORKER_INDEX", "NODES_AT_ONCE", "WAVES", "WAVE_SECONDS")


def fetch_wave(ordinal: int, nodes_at_once: int, waves: int) -> int:
    """The wave of the node at `ordinal`: runs of nodes_at_once consecutive nodes (a group's together,
    where it fits) share one; an ordinal past the fleet wraps round."""
    return (ordinal // nodes_at_once) % waves


class WaveSettingsError(RuntimeError):
    """The PDSTACK_WEIGHTS_ wave settings are not whole numbers; nothing was fetched."""


def wave_wait_seconds(env) -> int:
    """Seconds this node waits before its first GET (0 outside a pool)."""
    if not env.get("PDSTACK_WEIGHTS_WAVES"):
        return 0
    values = {k: env.get(f"PDSTACK_WEIGHTS_{k}", "") for k in WAVE_ENV}
    n = {k: int(v) if re.fullmatch(r"0|[1-9][0-9]{0,8}", v) else -1 for k, v in values.items()}
    bad = [f"PDSTACK_WEIGHTS_{k}={values[k]!r}" for k, v in n.items()
           if v < 0 or (v == 0 and k in ("NODES_AT_ONCE", "WAVES"))]
    if bad:
        raise WaveSettingsError(f"fetch wave settings must be whole numbers of at most 9 digits, no leading 0 "
                                f"(NODES_AT_ONCE and WAVES above 0): "
                                f"{', '.join(bad)}")
    ordinal = n["FIRST_NODE"] + n["GROUP_INDEX"] * n["GROUP_NODES"] + n["WORKER_INDEX"]
    return fetch_wave(ordinal, n["NODES_AT_ONCE"], n["WAVES"]) * n["WAVE_SECONDS"]


class WaitOnce:
    """Waits `seconds` the first time it is called (others calling meanwhile wait with it), then never."""

    def __init__(self, seconds: float):
        self.seconds, self.lock, self.waited = seconds, threading.Lock(), False

    def __call__(self) -> None:
        with self.lock:
            if not self.waited and self.seconds > 0:
                print(f"weights: waiting {self.seconds:g}s for this node's fetch wave", file=sys.stderr)
                time.sleep(self.seconds)
            self.waited = True


class BucketPostureError(RuntimeError):
    """The weights bucket is public or unversioned, or the store cannot say whether its policy is;
    nothing was uploaded."""


class ConcurrentUploadError(RuntimeError):
    """Another upload into the prefix wrote its manifest while this one ran; its manifest stands."""


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


_CANNOT_SAY = ("NotImplemented", "XNotImplemented", "MethodNotAllowed", "AccessDenied")
_READS = ("s3:getobject", "s3:getobjectversion", "s3:listbucket")


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
    except s3.exceptions.ClientError as exc:  # MinIO and Ceph RGW lack this API: bucket_policy_problems reads the policy
        if exc.response["Error"]["Code"] not in ("NotImplemented", "XNotImplemented"):
            raise


_PUBLIC_GRANTEES = ("http://acs.amazonaws.com/groups/global/AllUsers",
                    "http://acs.amazonaws.com/groups/global/AuthenticatedUsers")


def _glob_matches(pattern: str, value: str) -> bool:
    """IAM's matching of an Action: `*` any run, `?` one character, case-insensitive."""
    return re.fullmatch("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower()),
                        value) is not None


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def _allows_everyone_to_read(statement: dict) -> bool:
    """An Allow whose principal is anyone (`*`, {"AWS": "*"}, or a NotPrincipal) and whose actions
    take in reading an object or listing the bucket (a NotAction, or a pattern that matches one)."""
    if statement.get("Effect") != "Allow":
        return False
    principal = statement.get("Principal")
    everyone = "NotPrincipal" in statement or principal == "*" or (
        isinstance(principal, dict) and "*" in _listed(principal.get("AWS", [])))
    reads = "NotAction" in statement or any(_glob_matches(a, r) for a in _listed(statement.get("Action", []))
                                            for r in _READS)
    return everyone and reads


def _error_code(exc) -> str:
    return exc.response.get("Error", {}).get("Code", "")


def bucket_policy_problems(s3, bucket: str, unreadable_ok: bool = False) -> list[str]:
    """What the bucket policy says about who may read the weights.

    The store's own verdict first (GetBucketPolicyStatus: IsPublic, AWS S3 API Reference). MinIO
    and Ceph RGW answer NotImplemented to it (and to PutPublicAccessBlock), so their policy is read
    (GetBucketPolicy) and an Allow to everyone that reads objects or lists the bucket is refused.
    Where neither is answered, or such an Allow carries conditions this cannot judge, it is
    refused unless `unreadable_ok` (the operator checked it)."""
    fix = ("Fix: look at the bucket's policy yourself (e.g. `mc anonymous get`), then pass "
           "--unreadable-bucket-policy-ok to upload_weights")
    try:
        status = s3.get_bucket_policy_status(Bucket=bucket)
    except s3.exceptions.ClientError as exc:
        if _error_code(exc) == "NoSuchBucketPolicy":
            return []
        if _error_code(exc) not in _CANNOT_SAY:
            raise
    else:
        return [f"bucket {bucket}: its bucket policy lets anyone read it (GetBucketPolicyStatus IsPublic)"] \
            if status.get("PolicyStatus", {}).get("IsPublic") else []
    try:
        text = s3.get_bucket_policy(Bucket=bucket)["Policy"]
    except s3.exceptions.ClientError as exc:
        if _error_code(exc) == "NoSuchBucketPolicy":
            return []
        if _error_code(exc) not in _CANNOT_SAY:
            raise
        return [] if unreadable_ok else [
            f"bucket {bucket}: the store answers neither GetBucketPolicyStatus nor GetBucketPolicy "
            f"({_error_code(exc)}), so whether its policy lets anyone read the weights is unknown. {fix}"]
    try:
        statements = _listed(json.loads(text).get("Statement", []))
    except (ValueError, AttributeError):
        statements = None
    if statements is None or not all(isinstance(st, dict) for st in statements):
        return [] if unreadable_ok else [f"bucket {bucket}: its bucket policy is not a policy this can read. {fix}"]
    problems = []
    for st in filter(_allows_everyone_to_read, statements):
        what = f"bucket {bucket}: its bucket policy allows {st.get('Action', 'NotAction')} to everyone" + (
            f" (statement {st['Sid']})" if st.get("Sid") else "")
        if "Condition" not in st:
            problems.append(what)
        elif not unreadable_ok:
            problems.append(f"{what}, under conditions this does not judge. {fix}")
    return problems


def bucket_posture_problems(s3, bucket: str, unreadable_ok: bool = False) -> list[str]:
    """What makes the bucket unfit for weights: not versioned, or readable by anyone (by an ACL
    grant or by its bucket policy)."""
    problems = []
    if s3.get_bucket_versioning(Bucket=bucket).get("Status") != "Enabled":
        problems.append(f"bucket {bucket}: versioning is not enabled")
    for grant in s3.get_bucket_acl(Bucket=bucket).get("Grants", []):
        if grant.get("Grantee", {}).get("URI") in _PUBLIC_GRANTEES:
            problems.append(f"bucket {bucket}: ACL grants {grant['Permission']} to {grant['Grantee']['URI'].rsplit('/', 1)[-1]}")
    return problems + bucket_policy_problems(s3, bucket, unreadable_ok)


class _VersionsWritten:
    """The VersionId S3 answered for each key this client wrote while it is open: the answer to
    PutObject, or to CompleteMultipartUpload for the large files upload_file sends in parts (which
    answers nobody). Read from botocore's events (botocore `client.py`: before-parameter-build
    and after-call, each with the call's own context)."""

    OPERATIONS = ("PutObject", "CompleteMultipartUpload")

    def __init__(self, s3):
        self.events, self.versions = s3.meta.events, {}

    def _key(self, params, context, **_):
        context["pdstack_key"] = params.get("Key")

    def _answer(self, parsed, context, **_):
        if "pdstack_key" in context and parsed.get("VersionId"):
            self.versions[context["pdstack_key"]] = parsed["VersionId"]

    def __enter__(self):
        for op in self.OPERATIONS:
            self.events.register(f"before-parameter-build.s3.{op}", self._key, unique_id=f"pdstack-key-{op}-{id(self)}")
            self.events.register(f"after-call.s3.{op}", self._answer, unique_id=f"pdstack-version-{op}-{id(self)}")
        return self.versions

    def __exit__(self, *exc):
        for op in self.OPERATIONS:
            self.events.unregister(f"before-parameter-build.s3.{op}", unique_id=f"pdstack-key-{op}-{id(self)}")
            self.events.unregister(f"after-call.s3.{op}", unique_id=f"pdstack-version-{op}-{id(self)}")


def _etag_now(s3, bucket: str, key: str) -> str | None:
    try:
        return s3.head_object(Bucket=bucket, Key=key)["ETag"]
    except s3.exceptions.ClientError as exc:
        if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def upload(s3, bucket: str, prefix: str, source: Path, workers: int = DEFAULT_WORKERS,
           unreadable_policy_ok: bool = False) -> dict[str, str]:
    """Upload every file, then the manifests, which pin the object version of each file.

    A fetch follows a manifest only, and fetches the versions it names: an upload cut half way
    (or one going on) leaves the manifest before it, over the very objects it names, so a node
    fetching afresh gets what the nodes that fetched before have. Each manifest is written only
    if it is still the one this upload began over (If-Match, or If-None-Match: * where there was
    none: the S3 API's conditional PutObject); when another upload wrote it meanwhile, this one
    is refused (ConcurrentUploadError) and the other stands whole.

    Refuses (before writing anything) a bucket that is public or unversioned: weights are
    the model's IP, and the versions are what the manifest pins.
    """
    manifest = build_manifest(source, workers)  # names checked before the bucket is touched
    ensure_private_versioned_bucket(s3, bucket)
    problems = bucket_posture_problems(s3, bucket, unreadable_policy_ok)
    if problems:
        raise BucketPostureError("; ".join(problems) + ("" if all("Fix:" in p for p in problems) else (
            ". Fix: make it private (remove the public grant or statement) and enable versioning, then upload again")))
    began_over = {name: _etag_now(s3, bucket, _key(prefix, name)) for name in (SUMS_NAME, MANIFEST_NAME)}
    with _VersionsWritten(s3) as written:
        for rel in manifest:
            s3.upload_file(str(source / rel), bucket, _key(prefix, rel))
    versions = {rel: written.get(_key(prefix, rel)) for rel in manifest}
    unversioned = [rel for rel, v in versions.items() if not (v and v != "null" and re.fullmatch(VERSION_ID, v))]
    if unversioned:
        raise BucketPostureError(f"bucket {bucket}: the store gave no object version for {unversioned[:3]}, so no "
                                 "manifest can pin them; nothing points at them. Fix: enable versioning on the bucket")
    # `<sha256> <version id>  <name>` lines, for the fetcher that has coreutils but no Python
    sums = "".join(f"{manifest[rel]} {versions[rel]}  {rel}\n" for rel in sorted(manifest))
    pinned = {"files": {rel: {"sha256": manifest[rel], "version_id": versions[rel]} for rel in manifest}}
    for name, body in ((SUMS_NAME, sums.encode()), (MANIFEST_NAME, json.dumps(pinned, indent=1, sort_keys=True).encode())):
        condition = {"IfMatch": began_over[name]} if began_over[name] else {"IfNoneMatch": "*"}
        try:
            s3.put_object(Bucket=bucket, Key=_key(prefix, name), Body=body, **condition)
        except s3.exceptions.ClientError as exc:
            if _error_code(exc) not in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"):
                raise
            raise ConcurrentUploadError(
                f"s3://{bucket}/{_key(prefix, name)} was written by another upload while this one ran; that upload's "
                "manifests stand, and nothing of this one is fetched. Fix: upload again once no other upload "
                "into this prefix runs") from None
    return manifest


UNPINNED_WARNING = (
    "WARNING: the weights manifest pins no object versions (written by an upload_weights before manifests pinned "
    "them): each file's latest version is fetched and verified by its sha256 only, so an upload cut half way or "
    "going on fails fresh nodes. Fix: upload the weights again with scripts/upload_weights")


def checked_manifest(body: bytes) -> dict[str, tuple[str, str | None]]:
    """The manifest's names, each with its sha256 and the object version it pins (None: a manifest
    written before manifests pinned versions, `{name: sha256}`, whose files are fetched at their
    latest version as then), refused whole if any name could leave the folder."""
    try:
        manifest = json.loads(body)
    except ValueError:
        raise WeightsManifestError(f"{MANIFEST_NAME} is not JSON. Fix: upload the weights again") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    versioned = isinstance(files, dict) and all(isinstance(f, dict) for f in files.values())
    if versioned:
        listed = {name: (f.get("sha256"), f.get("version_id")) for name, f in files.items()}
    elif isinstance(manifest, dict) and all(isinstance(digest, str) for digest in manifest.values()):
        listed = {name: (digest, None) for name, digest in manifest.items()}  # as upload_weights wrote it before
    else:
        raise WeightsManifestError(f"{MANIFEST_NAME} is not {{\"files\": {{name: {{sha256, version_id}}}}}} nor "
                                   "{name: sha256}, as upload_weights writes it. Fix: upload the weights again with "
                                   "scripts/upload_weights")
    problems = [why for name in listed if (why := unsafe_name(name))]
    problems += [f"{name!r}: {digest!r} is not a sha256 digest" for name, (digest, _) in listed.items()
                 if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest))]
    problems += [f"{name!r}: {version!r} is not an object version id" for name, (_, version) in listed.items()
                 if versioned and not (isinstance(version, str) and re.fullmatch(VERSION_ID, version))]
    problems += [f"{name!r} is a name pdstack keeps for itself" for name in listed
                 if name.split("/")[0] in (MANIFEST_NAME, SUMS_NAME, VERIFIED_NAME, LOCK_NAME)]
    if problems:
        raise WeightsManifestError(f"{MANIFEST_NAME} refused, nothing fetched: " + "; ".join(problems[:5])
                                   + ". Fix: upload the weights again with scripts/upload_weights")
    return listed


def _no_link_on_the_way(dest: Path, name: str) -> None:
    """Refuse a symbolic link at any step from dest to dest/name: a file written through it
    would land wherever it points."""
    step = dest
    for part in name.split("/"):
        step = step / part
        if step.is_symlink():
            raise WeightsManifestError(f"{step}: a symbolic link in the weights cache; nothing is written through "
                                       "one. Fix: remove it")


def _local_state(dest: Path, manifest: dict) -> dict[str, list[int]]:
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


def fetch_and_verify(s3, bucket: str, prefix: str, dest: Path, workers: int = DEFAULT_WORKERS,
                     wait_seconds: float = 0) -> dict[str, str]:
    """Pull what the node cache lacks, then verify every file. Raises on any mismatch.

    Fetches the object versions the manifest pins (GetObject's versionId, S3 API Reference), so
    an upload cut half way or going on changes nothing a node fetches. Verified once per
    manifest: a marker in dest records the manifest's VersionId and ETag and each cached file's
    size and mtime. A pod start that finds them unchanged reads no file; any change (a new
    upload, a file touched on the node) verifies everything again, `workers` files at a time.
    Two fetches into one cache folder (two pods starting on one node) take turns on an flock of
    LOCK_NAME, so neither writes under the other; the second finds the first's work verified.
    Before its first GET of a weight file it waits `wait_seconds` (its fetch wave, wave_wait_seconds);
    a cache already verified, or whole, waits for nothing."""
    got = s3.get_object(Bucket=bucket, Key=_key(prefix, MANIFEST_NAME))
    body = got["Body"].read()
    manifest = checked_manifest(body)  # before anything is written
    if any(version is None for _, version in manifest.values()):
        print(UNPINNED_WARNING, file=sys.stderr)  # each start says it, in the init container's log
    for name in (*manifest, LOCK_NAME):
        _no_link_on_the_way(dest, name)
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_and_verify_locked(s3, bucket, prefix, dest, workers, got, body, manifest, WaitOnce(wait_seconds))


def _fetch_and_verify_locked(s3, bucket: str, prefix: str, dest: Path, workers: int, got: dict, body: bytes,
                             manifest: dict[str, tuple[str, str | None]], wait_turn=lambda: None) -> dict[str, str]:
    marker = dest / VERIFIED_NAME
    against = {"bucket": bucket, "prefix": prefix.strip("/"),
               "manifest": {"version_id": got.get("VersionId"), "etag": got.get("ETag")}}
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        recorded = None
    digests = {name: digest for name, (digest, _) in manifest.items()}
    if isinstance(recorded, dict) and recorded.get("against") == against and recorded.get("files") and \
            recorded.get("files") == _local_state(dest, manifest):
        return digests
    marker.unlink(missing_ok=True)  # a verification stopped half way leaves no marker

    def check(item: tuple[str, tuple[str, str | None]]) -> str | None:
        name, (expected, version_id) = item
        target = dest / name
        if not (target.is_file() and sha256_file(target) == expected):
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            partial.unlink(missing_ok=True)  # never write through whatever was left there
            wait_turn()
            try:
                s3.download_file(bucket, _key(prefix, name), str(partial),
                                 ExtraArgs={"VersionId": version_id} if version_id else {})
            except s3.exceptions.ClientError as exc:
                return f"{name}: {f'version {version_id} the manifest pins' if version_id else 'its latest version'} " \
                       f"cannot be fetched ({exc})"
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
    return digests


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
    parser.add_argument("--unreadable-bucket-policy-ok", action="store_true",
                        help="upload: the store cannot say whether its bucket policy lets anyone read the weights "
                             "(MinIO, Ceph RGW), and you have checked it yourself")
    args = parser.parse_args(argv)
    missing = [f"--{k}" for k in ("endpoint", "bucket", "prefix") if getattr(args, k) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required (or PDSTACK_WEIGHTS_{missing[0][2:].upper()})")
    s3 = s3_client(args.endpoint, args.region)
    try:
        if args.action == "upload":
            if not args.source or not args.source.is_dir():
                parser.error("--source must be a folder of weight files")
            manifest = upload(s3, args.bucket, args.prefix, args.source, args.workers, args.unreadable_bucket_policy_ok)
            print(f"uploaded {len(manifest)} files and {MANIFEST_NAME} to s3://{args.bucket}/{args.prefix}")
        else:
            if not args.dest:
                parser.error("--dest is required for fetch")
            manifest = fetch_and_verify(s3, args.bucket, args.prefix, Path(args.dest), args.workers,
                                        wave_wait_seconds(os.environ))
            print(f"verified {len(manifest)} files in {args.dest}")
    except (WeightsIntegrityError, WeightsManifestError, BucketPostureError, ConcurrentUploadError,
            WaveSettingsError) as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
