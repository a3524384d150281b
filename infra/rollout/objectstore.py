"""Where the release store keeps its objects: a local folder, or an S3-compatible bucket.

The release store (releases.py) needs four things of its storage, and both kinds give them
with their own primitives, so two writers can never both win:

    read(key)                  -> (bytes, etag), or None if absent
    create(key, data)          -> etag; Conflict if the key exists        (S3: If-None-Match: *)
    replace(key, data, etag)   -> etag; Conflict if it changed meanwhile  (S3: If-Match: <etag>)
    list(prefix)               -> keys under prefix, sorted
    read_dated(key)            -> the object (or None) with the times the store itself gives

Nothing is ever deleted: a released lease is replaced by a released marker, the audit log is
one object per entry. A store that cannot be written (full or read-only disk, a bucket that
refuses, an endpoint that is down) raises StoreUnavailable naming the store, the key and the
cause. Every create and replace passes `before_change` first (the crash-safety tests kill or
break the process there).

`open_store(url)`: `s3://bucket/prefix` is a bucket (endpoint from the spec or the standard
AWS_ENDPOINT_URL_S3, credentials from the standard AWS chain, never from pdstack's files);
a path is a folder; anything else shaped like a URL (`s3:/bucket`, `S3://`) is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Iterator, Protocol

from infra.naming import release_store_url_problem
from infra.rollout.faultpoints import before_change, sweep_dead_writers


class Conflict(Exception):
    """A conditional write lost: the key exists (create) or changed since it was read (replace)."""


class StoreUnavailable(RuntimeError):
    """The store cannot be read or written. Nothing after the failed write was changed."""


@dataclass(frozen=True)
class Dated:
    """An object read with the store's own clock, so that how old it is never depends on the
    clock of the machine asking: `found` as read() gives it, `modified` when the store last wrote
    it, `now` the store's time as it answered (None where the store gives none)."""

    found: tuple[bytes, str] | None
    modified: datetime | None
    now: datetime | None


class ObjectStore(Protocol):
    location: str

    def read(self, key: str) -> tuple[bytes, str] | None: ...
    def read_dated(self, key: str) -> Dated: ...
    def create(self, key: str, data: bytes) -> str: ...
    def replace(self, key: str, data: bytes, etag: str) -> str: ...
    def list(self, prefix: str) -> list[str]: ...


def etag_of(data: bytes) -> str:
    """S3's ETag of a single-part object; the folder store uses the same, so both compare alike."""
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


class FolderStore:
    """Objects as files under one folder. A create is a hard link of a fully written temp file
    (fails if the name exists); a replace holds an flock while it compares and renames (the
    kernel drops the flock when its process dies, so a crash never leaves it held)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _unavailable(self, key: str, exc: OSError) -> StoreUnavailable:
        fix = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "raise the quota or free space",
               errno.EROFS: "remount it read-write, or point the store elsewhere",
               errno.EACCES: "give this user write access"}.get(exc.errno, "check the folder")
        return StoreUnavailable(f"release store {self.location}: cannot write {key} ({exc.strerror or exc}). "
                                f"Fix: {fix}")

    def read(self, key: str) -> tuple[bytes, str] | None:
        found = self._read_file(key)
        return None if found is None else (found[0], etag_of(found[0]))

    def _read_file(self, key: str) -> tuple[bytes, float] | None:
        """The file's bytes and its modification time, of one and the same version."""
        try:
            with open(self._path(key), "rb") as f:
                return f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise StoreUnavailable(f"release store {self.location}: {key} is a folder, not a file. "
                                   "Fix: move it away") from None
        except OSError as exc:
            raise StoreUnavailable(f"release store {self.location}: cannot read {key} ({exc.strerror or exc}). "
                                   "Fix: check the folder and its disk") from None

    def read_dated(self, key: str) -> Dated:
        """Times from the file system: a file is stamped with the kernel's clock when it is
        written, so on a local disk the store's clock is this machine's (and its time now is
        `time.time()`, the same clock). On NFS the server stamps the files: a skew between it
        and this machine is not seen here."""
        found = self._read_file(key)
        now = datetime.fromtimestamp(time.time(), timezone.utc)
        if found is None:
            return Dated(None, None, now)
        data, mtime = found
        return Dated((data, etag_of(data)), datetime.fromtimestamp(mtime, timezone.utc), now)

    def _write_temp(self, key: str, data: bytes) -> Path:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.urandom(3).hex()}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # whole on disk before it gets its name
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._unavailable(key, exc) from None
        return tmp

    def create(self, key: str, data: bytes) -> str:
        before_change(f"create {key}")
        tmp = self._write_temp(key, data)
        try:
            os.chmod(tmp, 0o444)  # a created object is never written again (a replace renames a new file over it)
            os.link(tmp, self._path(key))
        except FileExistsError:
            raise Conflict(key) from None
        except OSError as exc:
            raise self._unavailable(key, exc) from None
        finally:
            tmp.unlink(missing_ok=True)
        return etag_of(data)

    @contextlib.contextmanager
    def _exclusive(self, key: str) -> Iterator[None]:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".cas", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._unavailable(key, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def replace(self, key: str, data: bytes, etag: str) -> str:
        before_change(f"replace {key}")
        with self._exclusive(key):
            current = self.read(key)
            if current is None or current[1] != etag:
                raise Conflict(key)
            tmp = self._write_temp(key, data)
            try:
                os.replace(tmp, self._path(key))
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise self._unavailable(key, exc) from None
        return etag_of(data)

    def list(self, prefix: str) -> list[str]:
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix}{p.name}" for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))

    def sweep(self) -> None:
        """Temp files of writers that died between writing and linking them."""
        if self.root.is_dir():
            sweep_dead_writers(p for p in self.root.rglob(".*.tmp"))


class BucketStore:
    """Objects in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW; moto's server in tests),
    with S3's conditional writes. Credentials come from the standard AWS chain."""

    CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"}

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str = "us-east-1"):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.location = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint_url}" if endpoint_url else "")
        # Bounded: a dead endpoint fails the write in seconds, not minutes (the rollback budget is 60 s).
        config = Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 3, "mode": "standard"})
        self.s3 = boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, Key=self._key(key), **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in self.CONFLICT_CODES or code in ("412", "409"):
                raise Conflict(key) from None
            fix = {"NoSuchBucket": "create the bucket", "AccessDenied": "grant this identity s3:GetObject, "
                   "s3:PutObject and s3:ListBucket on it"}.get(code, "check the bucket and its endpoint")
            raise StoreUnavailable(f"release store {self.location}: cannot {what} {key} ({code}: "
                                   f"{exc.response.get('Error', {}).get('Message', '')}). Fix: {fix}") from None
        except BotoCoreError as exc:  # endpoint down, timeouts, no credentials
            raise StoreUnavailable(f"release store {self.location}: cannot {what} {key} ({exc}). "
                                   "Fix: check the endpoint and the AWS credentials of this shell") from None

    def read(self, key: str) -> tuple[bytes, str] | None:
        try:
            answer = self._call("read", key, self.s3.get_object)
        except Conflict:  # NoSuchKey
            return None
        return answer["Body"].read(), answer["ETag"]

    def read_dated(self, key: str) -> Dated:
        """LastModified is set by the server when it stores the object, and every S3 answer
        carries the server's Date (AWS S3 API reference, "Common Response Headers"); for an
        absent object, the Date of a HEAD of the bucket."""
        try:
            answer = self._call("read", key, self.s3.get_object)
        except Conflict:  # NoSuchKey
            return Dated(None, None, self._date(self._call("read", key, self._head_bucket)))
        return Dated((answer["Body"].read(), answer["ETag"]), answer["LastModified"], self._date(answer))

    def _head_bucket(self, Bucket: str, Key: str):  # noqa: N803 - _call's keywords
        return self.s3.head_bucket(Bucket=Bucket)

    @staticmethod
    def _date(answer: dict) -> datetime | None:
        date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return parsedate_to_datetime(date) if date else None
        except (TypeError, ValueError):  # a Date that is no HTTP date: none given
            return None

    def create(self, key: str, data: bytes) -> str:
        before_change(f"create {key}")
        return self._call("create", key, self.s3.put_object, Body=data, IfNoneMatch="*")["ETag"]

    def replace(self, key: str, data: bytes, etag: str) -> str:
        before_change(f"replace {key}")
        return self._call("replace", key, self.s3.put_object, Body=data, IfMatch=etag)["ETag"]

    def list(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        start = self._key(prefix)
        try:
            keys = [o["Key"] for page in self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start) for o in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as exc:
            raise StoreUnavailable(f"release store {self.location}: cannot list {prefix} ({exc}). "
                                   "Fix: check the bucket, its endpoint and the AWS credentials of this shell") from None
        return sorted(prefix + k[len(start):] for k in keys if "/" not in k[len(start):])

    def sweep(self) -> None:
        """Nothing to sweep: a put is whole or absent."""


def open_store(url: str, endpoint_url: str | None = None, region: str = "us-east-1") -> FolderStore | BucketStore:
    """`s3://bucket/prefix` -> a bucket; a folder (relative to the caller's directory) -> a
    folder; anything else that looks like a URL (`s3:/bucket`) is refused, never a folder."""
    problem = release_store_url_problem(url)
    if problem:
        from infra.inputs import InputError

        raise InputError(f"release store {url[:80]!r}: {problem}")
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        return BucketStore(bucket, prefix, endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or None, region)
    return FolderStore(Path(url))
