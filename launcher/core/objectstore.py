"""Object storage with the S3 API (``s3://bucket/prefix``): the one module that talks to it.

The client is boto3 with s3transfer's transfer manager (multipart, several parts and files in
flight at once); docs/storage.md says why it was chosen and how it measured against obstore and
s3torchconnector. Where the store is and who we are come from the standard AWS chain and never
from a trainwright config: the endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (or a
profile's ``endpoint_url``), the credentials from the environment, a profile, SSO, web identity
(Kubernetes service accounts) or the instance's role. Nothing here writes them anywhere; errors
name the endpoint and the bucket, never a key.

Every transfer retries transient failures (5xx, throttling, timeouts, connection resets)
twice inside botocore, then again with exponential backoff until the caller's ``deadline``
(seconds of :func:`time.monotonic`); what is still failing then raises :class:`StoreFailure`
naming the key. Wrong credentials, a missing bucket or an unreachable endpoint are
:class:`StoreUnusable` (a config error, exit 2) from :func:`check_writable`.
"""

from __future__ import annotations

import functools
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, TypeVar

from launcher.core.errors import CheckpointError
from launcher.core.exits import CONFIG_ERROR_EXIT

SCHEME = "s3://"
PART_BYTES = 32 * 2**20
"""Multipart part size (and the size from which an object goes in parts)."""
CONCURRENCY = 16
"""Parts (of one or several objects) in flight at once per process."""
TRANSIENT_BACKOFF_S = (0.5, 8.0)
"""First and longest wait between two tries of a transfer that failed transiently."""

T = TypeVar("T")


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names object storage (``s3://...``) rather than a local path."""
    return str(uri).startswith(SCHEME)


@dataclass(frozen=True)
class ObjectURI:
    """``s3://bucket/prefix``: a bucket and a key prefix (no leading or trailing '/')."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, uri: str) -> "ObjectURI":
        if not is_remote(uri):
            raise ValueError(f"{uri!r} is not an s3:// URI")
        bucket, _, prefix = str(uri)[len(SCHEME):].partition("/")
        if not bucket:
            raise ValueError(f"{uri!r} names no bucket (s3://<bucket>/<prefix>)")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        """The key of ``parts`` under this prefix."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))

    def child(self, *parts: str) -> "ObjectURI":
        return ObjectURI(self.bucket, self.key(*parts))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


class StoreFailure(CheckpointError):
    """A transfer that kept failing until its deadline; the message names the key and the
    error (never a credential)."""


class StoreUnusable(CheckpointError):
    """The store cannot be used as configured: wrong credentials, a missing bucket, an endpoint
    that does not answer. A config error (exit 2), found before any rank starts."""

    exit_code = CONFIG_ERROR_EXIT


@functools.lru_cache(maxsize=None)
def _client(pid: int):
    """One boto3 S3 client per process (``pid``: a forked child builds its own)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5,
                    read_timeout=60, max_pool_connections=CONCURRENCY * 2,
                    s3={"addressing_style": os.environ.get("AWS_S3_ADDRESSING_STYLE", "path")})
    session = boto3.session.Session()
    # a custom endpoint (SeaweedFS, MinIO, ...) still signs with a region: us-east-1 unless set
    return session.client("s3", config=config, region_name=session.region_name or "us-east-1")


def client():
    """This process's S3 client (endpoint, region and credentials from the AWS chain)."""
    return _client(os.getpid())


def endpoint() -> str:
    """The endpoint the client talks to (for messages)."""
    return str(client().meta.endpoint_url)


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                          max_concurrency=CONCURRENCY, use_threads=True)


def _error_text(exc: BaseException) -> str:
    """``ClientError: ...`` in one line (botocore's messages hold no credential)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:400]


def _is_permanent(exc: BaseException) -> bool:
    """A failure that retrying does not mend: access denied, no such bucket, bad request (also
    when wrapped, as boto3's S3UploadFailedError wraps the ClientError)."""
    cause = exc.__cause__ or exc.__context__
    return _is_permanent_itself(exc) or (cause is not None and _is_permanent_itself(cause))


def _is_permanent_itself(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, FileNotFoundError,
                        PermissionError, IsADirectoryError, NotADirectoryError)):
        return True  # local files and identity: no retry mends them
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500)
        return 400 <= int(status) < 500 and int(status) not in (408, 429)
    return False


def with_retries(what: str, call: Callable[[], T], deadline: float) -> T:
    """``call()``, tried again after transient failures (with backoff and jitter) until
    ``deadline`` (time.monotonic); :class:`StoreFailure` naming ``what`` when it still fails."""
    wait, tries = TRANSIENT_BACKOFF_S[0], 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - botocore/s3transfer raise many kinds
            if _is_permanent(exc) or time.monotonic() + wait > deadline:
                raise StoreFailure(f"{what}: {_error_text(exc)} (endpoint {endpoint()}, "
                                   f"{tries} tries)") from exc
        time.sleep(wait * (0.5 + random.random()))
        wait = min(wait * 2, TRANSIENT_BACKOFF_S[1])


@functools.lru_cache(maxsize=None)
def _manager(pid: int):
    """This process's one s3transfer TransferManager: every file of every call shares its
    :data:`CONCURRENCY` parts in flight (a manager per file multiplied them, and a local
    server buffering gigabytes timed out its own writes)."""
    from s3transfer.manager import TransferConfig, TransferManager

    return TransferManager(client(), TransferConfig(
        multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
        max_request_concurrency=CONCURRENCY))


def _transfer_all(items: list, submit: Callable, what: Callable[[T], str],
                  deadline: float, started: Optional[dict] = None) -> None:
    """Submit every item to the manager (an item in ``started`` is already in flight: its
    future is its first try), wait for all, and submit again those that failed transiently
    (backoff with jitter) until ``deadline``; StoreFailure naming the first item still failing
    then, or failing permanently."""
    pending, wait, tries = list(items), TRANSIENT_BACKOFF_S[0], 0
    first = dict(started or {})
    while pending:
        tries += 1
        futures = [(item, first.pop(item) if item in first else submit(item))
                   for item in pending]
        failed = []
        for item, future in futures:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - botocore/s3transfer raise many kinds
                failed.append((item, exc))
        for item, exc in failed:
            if _is_permanent(exc) or time.monotonic() + wait > deadline:
                raise StoreFailure(f"{what(item)}: {_error_text(exc)} (endpoint {endpoint()}, "
                                   f"{tries} tries)") from exc
        if failed:
            time.sleep(wait * (0.5 + random.random()))
            wait = min(wait * 2, TRANSIENT_BACKOFF_S[1])
        pending = [item for item, _ in failed]


def start_upload(path: Path, bucket: str, key: str):
    """Begin uploading the file ``path`` to ``key`` now, on this process's transfer manager;
    its future (:func:`upload` waits for it, and retries it, when given it as ``started``)."""
    return _manager(os.getpid()).upload(str(path), bucket, key)


def upload(files: Sequence[tuple[Path, str]], bucket: str, deadline: float,
           started: Optional[dict] = None) -> int:
    """Upload each (local file, key) to ``bucket`` (multipart, every file in flight at once);
    the bytes sent. ``started``: (local file, key) -> the future of its upload already begun
    (:func:`start_upload`), waited for instead of a first submission. Raises StoreFailure
    naming the first key that could not be written by ``deadline``."""
    files = list(files)
    manager = _manager(os.getpid())
    _transfer_all(files, lambda item: manager.upload(str(item[0]), bucket, item[1]),
                  lambda item: f"upload of s3://{bucket}/{item[1]}", deadline, started)
    return sum(Path(path).stat().st_size for path, _ in files)


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def download(objects: Sequence[tuple[str, Path, int]], bucket: str, deadline: float) -> int:
    """Download each (key, local file, expected size) of ``bucket``, written under a temporary
    name and renamed once its size is the expected one; the bytes read. Raises StoreFailure
    naming a key that is missing, truncated or unreadable by ``deadline``."""
    objects = list(objects)
    for _, path, _ in objects:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    manager = _manager(os.getpid())
    _transfer_all(objects, lambda item: manager.download(bucket, item[0], str(_part(item[1]))),
                  lambda item: f"download of s3://{bucket}/{item[0]}", deadline)
    for key, path, size in objects:
        got = _part(path).stat().st_size
        if got != size:
            _part(path).unlink(missing_ok=True)
            raise StoreFailure(f"s3://{bucket}/{key} holds {got} bytes, its checkpoint's "
                               f"manifest says {size}: truncated or replaced; it is not loaded")
        os.replace(_part(path), path)
    return sum(size for _, _, size in objects)


def put_text(uri: ObjectURI, text: str, deadline: float) -> None:
    """One small object (a commit record, a pointer), written whole or not at all."""
    with_retries(f"write of {uri}", lambda: client().put_object(
        Bucket=uri.bucket, Key=uri.prefix, Body=text.encode()), deadline)


def get_text(uri: ObjectURI, deadline: float) -> Optional[str]:
    """A small object's text; None when it does not exist."""
    from botocore.exceptions import ClientError

    def get() -> Optional[str]:
        try:
            return client().get_object(Bucket=uri.bucket, Key=uri.prefix)["Body"].read().decode()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    return with_retries(f"read of {uri}", get, deadline)


def list_keys(uri: ObjectURI, deadline: float) -> list[tuple[str, int]]:
    """Every (key, size) under ``uri``'s prefix (as a folder: ``prefix/``)."""
    prefix = uri.prefix + "/" if uri.prefix else ""

    def listing() -> list[tuple[str, int]]:
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=uri.bucket,
                                                                  Prefix=prefix)
        return [(o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", [])]

    return with_retries(f"listing of {uri}/", listing, deadline)


def list_folders(uri: ObjectURI, deadline: float) -> list[str]:
    """The names of the 'folders' right under ``uri`` (common prefixes, without '/')."""
    prefix = uri.prefix + "/" if uri.prefix else ""

    def listing() -> list[str]:
        pages = client().get_paginator("list_objects_v2").paginate(
            Bucket=uri.bucket, Prefix=prefix, Delimiter="/")
        return [p["Prefix"][len(prefix):].rstrip("/") for page in pages
                for p in page.get("CommonPrefixes", [])]

    return with_retries(f"listing of {uri}/", listing, deadline)


def delete_keys(bucket: str, keys: Sequence[str], deadline: float) -> None:
    """Delete ``keys`` of ``bucket`` (a thousand per request)."""
    for start in range(0, len(keys), 1000):
        chunk = [{"Key": k} for k in keys[start:start + 1000]]
        with_retries(f"delete under s3://{bucket}/{keys[start]}", lambda: client().delete_objects(
            Bucket=bucket, Delete={"Objects": chunk, "Quiet": True}), deadline)


def delete_folder(uri: ObjectURI, deadline: float) -> None:
    """Delete every object under ``uri``'s prefix, and abort its unfinished multipart
    uploads (a rank killed mid-upload leaves parts that are billed but never listed)."""
    delete_keys(uri.bucket, [k for k, _ in list_keys(uri, deadline)], deadline)
    prefix = uri.prefix + "/"
    uploads = with_retries(f"multipart listing of {uri}/", lambda: client().list_multipart_uploads(
        Bucket=uri.bucket, Prefix=prefix).get("Uploads", []), deadline)
    for up in uploads:
        with_retries(f"abort of s3://{uri.bucket}/{up['Key']}", lambda: client()
                     .abort_multipart_upload(Bucket=uri.bucket, Key=up["Key"],
                                             UploadId=up["UploadId"]), deadline)


def check_usable(uri: ObjectURI, *, write: bool, timeout_s: float = 8.0) -> None:
    """Raise :class:`StoreUnusable` (exit 2) unless this process can list (and, ``write``,
    write and delete) under ``uri``: names the endpoint, the bucket and what answered, never
    the secret. Takes seconds, not the transfers' retry budget."""
    deadline = time.monotonic() + timeout_s
    probe = uri.child(f".trainwright-write-check-{os.getpid()}-{random.getrandbits(32):08x}")
    try:
        with_retries(f"bucket {uri.bucket}", lambda: client().head_bucket(Bucket=uri.bucket),
                     deadline)
        list_folders(uri, deadline)
        if write:
            put_text(probe, "write check\n", deadline)
            delete_keys(uri.bucket, [probe.prefix], deadline)
    except Exception as exc:  # noqa: BLE001
        doing = "write checkpoints to" if write else "read checkpoints from"
        raise StoreUnusable(f"cannot {doing} {uri} (endpoint {endpoint()}, bucket "
                            f"{uri.bucket!r}): {unusable_reason(exc)}") from None


def _unusable_reason(exc: BaseException) -> str:
    """What to fix for a store that refused the write check."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return ("no credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                "or a role (the AWS chain)")
    if isinstance(exc, EndpointConnectionError):
        return ("the endpoint does not answer; check AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and "
                "that the server is up")
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchBucket", "404") or status == 404:
            return "the bucket does not exist; create it or fix the URI"
        if status in (401, 403) or "AccessDenied" in code or "Signature" in code:
            return (f"access denied ({code or status}); check the credentials of the AWS chain "
                    "and that they may list and write this bucket")
    return _error_text(exc)


def fetch_object(uri: ObjectURI, path: Path, deadline: float,
                 on_bytes: Optional[Callable[[int], None]] = None) -> int:
    """Download the object ``uri`` into ``path`` as it is (the caller names a temporary file
    and renames it once it has checked it); the bytes written. ``on_bytes(n)`` is called as
    each ``n`` bytes arrive (from the transfer's threads; a retried transfer counts again).
    Raises StoreFailure naming the key when it is missing or unreadable by ``deadline``."""
    transfer = _transfer_config()
    path.parent.mkdir(parents=True, exist_ok=True)
    with_retries(f"download of {uri}", lambda: client().download_file(
        uri.bucket, uri.prefix, str(path), Config=transfer, Callback=on_bytes), deadline)
    return path.stat().st_size


def unusable_reason(exc: BaseException) -> str:
    """What to fix for a store that refused a request (``exc`` or, for a StoreFailure, its
    cause): credentials, endpoint, bucket or access, else the error in one line; never a
    secret. For the messages of other readers of the store (data shards)."""
    cause = exc.__cause__ if isinstance(exc, StoreFailure) and exc.__cause__ else exc
    return _unusable_reason(cause)
