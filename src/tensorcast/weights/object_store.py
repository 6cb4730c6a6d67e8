"""Checkpoint bytes in S3-compatible object storage: naming objects, who may read which, and ranged reads.

Owns: ``s3://bucket/key`` URLs (``ObjectURL``); the prefixes a worker may read (``ObjectPrefixes``, from
``weights.object_prefixes``: default-deny, since a worker reads with its own credentials on a caller's
behalf); one client per process configuration (``ObjectStore``: endpoint, region, profile and credentials
from ``weights.object_*`` or, where those are empty, the standard AWS environment variables and files, as
boto3 resolves them; anonymous access); and reads: a small object whole, a prefix's listing, and one byte
range straight into a caller's buffer (``read_into``: ``readinto`` on the response body, no intermediate
copy), pinned to the object's ETag (``If-Match``), so that an object replaced since registration is refused
instead of mixing two versions. Throttling (503 SlowDown), server errors and connections reset before or
during a body are retried with jittered exponential backoff (``weights.object_attempts``); a resumed read
asks only for the bytes still missing. Errors are typed and name the object, never its bytes:
``NotFound`` (no such bucket or key), ``PermissionDenied`` (credentials refused or missing),
``InvalidArgument`` (changed since registration, range outside it), ``Unavailable`` (still failing after
every attempt, endpoint unreachable).

boto3 (``pip install 'tensorcast[s3]'``) because it is the AWS credential chain users already configure
(environment, profiles, SSO, instance roles) and its response bodies read into a caller's buffer; measured
against the alternatives (obstore, boto3 reading to bytes) on the test server the throughput was the same
(the store is the limit), and obstore hands back a buffer of its own (one more copy). Imported on first use.

Integrity: every ranged GET is checked for its length and ETag; a store's whole-object checksums cannot be
checked on a range, and TLS (https endpoints) guards bytes in flight. Does not own: which ranges to read or
in what order (``weights.reader``), or parsing headers (``weights.safetensors``).
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tensorcast.config import WeightsConfig
from tensorcast.errors import InvalidArgument, NotFound, PermissionDenied, TensorCastError, Unavailable, clip

__all__ = ["ObjectInfo", "ObjectPrefixes", "ObjectStore", "ObjectURL", "is_object_url", "object_store"]

SCHEME = "s3://"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "AllAccessDisabled", "AccountProblem", "403"}
_MISSING = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_CHANGED = {"PreconditionFailed", "412"}
_RANGE = {"InvalidRange", "416"}


def is_object_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class ObjectURL:
    bucket: str
    key: str  # "" for a whole bucket

    @classmethod
    def parse(cls, url: str) -> ObjectURL:
        if not url.startswith(SCHEME):
            raise InvalidArgument(f"{clip(url)} is not an s3:// URL")
        bucket, _, key = url[len(SCHEME):].partition("/")
        if not _BUCKET_RE.match(bucket) or ".." in key or "\x00" in url:
            raise InvalidArgument(f"{clip(url)}: not a valid s3://bucket/key URL")
        return cls(bucket, key)

    def child(self, name: str) -> ObjectURL:
        return ObjectURL(self.bucket, f"{self.key.rstrip('/')}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


class ObjectPrefixes:
    """The s3:// prefixes a worker reads checkpoints from (``weights.object_prefixes``); none by default."""

    def __init__(self, prefixes: Iterable[str]) -> None:
        self.prefixes = tuple(str(ObjectURL.parse(p)) for p in prefixes if p)

    def check(self, url: str) -> ObjectURL:
        parsed = ObjectURL.parse(url)
        text = str(parsed)
        if not any(text == p or text.startswith(p if p.endswith("/") else p + "/") for p in self.prefixes):
            allowed = ", ".join(self.prefixes) or "none"
            raise PermissionDenied(f"{clip(url)} is outside the object-store prefixes this worker reads checkpoints "
                                   f"from (weights.object_prefixes: {allowed})")
        return parsed


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    size: int
    etag: str
    mtime_ns: int


class ObjectStore:
    """One S3 client (thread-safe; a connection pool sized for ``object_streams``) and the reads on it."""

    def __init__(self, config: WeightsConfig) -> None:
        self.config = config
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        try:
            import boto3
            import botocore
            from botocore.config import Config
        except ImportError:
            raise InvalidArgument("reading s3:// checkpoints needs boto3: pip install 'tensorcast[s3]'") from None
        cfg = self.config
        anonymous = cfg.object_anonymous or os.environ.get("AWS_NO_SIGN_REQUEST", "").lower() in ("1", "true")
        region = cfg.object_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        options: dict[str, Any] = dict(
            max_pool_connections=cfg.object_streams + 4, connect_timeout=cfg.object_timeout,
            read_timeout=cfg.object_timeout, retries={"mode": "standard", "max_attempts": 1})  # ours: below
        if anonymous:
            options["signature_version"] = botocore.UNSIGNED
        try:
            session = boto3.session.Session(profile_name=cfg.object_profile or None, region_name=region)
            return session.client("s3", endpoint_url=cfg.object_endpoint_url or None, config=Config(**options))
        except botocore.exceptions.BotoCoreError as exc:  # an unknown profile, a malformed config file
            raise InvalidArgument(f"object store client: {exc}") from None

    # ----------------------------------------------------------------- reads
    def read_small(self, url: ObjectURL, limit: int, what: str) -> bytes:
        """A whole object of at most ``limit`` bytes (an index, a config)."""
        reply = self._get(url, f"bytes=0-{limit}", "", what)
        body = reply["Body"].read()
        if len(body) > limit:
            raise InvalidArgument(f"{url}: {what} is larger than {limit} bytes")
        return bytes(body)

    def read_head(self, url: ObjectURL, n: int) -> tuple[bytes, ObjectInfo]:
        """The first ``n`` bytes (fewer if the object is shorter) and the object's size, ETag and mtime."""
        reply = self._get(url, f"bytes=0-{n - 1}", "", "header")
        data = bytes(reply["Body"].read())
        total = reply.get("ContentRange", "").rpartition("/")[2]
        size = int(total) if total.isdigit() else len(data)
        modified = reply.get("LastModified")
        mtime_ns = int(modified.timestamp() * 1e9) if modified is not None else 0
        return data, ObjectInfo(size, str(reply.get("ETag", "")), mtime_ns)

    def names_under(self, url: ObjectURL) -> list[str]:
        """The names directly under ``url`` (a "directory": keys ``url/NAME``), one page at a time."""
        prefix = url.key.rstrip("/") + "/" if url.key else ""
        names: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = self._call(lambda t=token: self.client.list_objects_v2(
                Bucket=url.bucket, Prefix=prefix, Delimiter="/", **t), url, "listing")
            names += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return names
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def read_into(self, url: ObjectURL, offset: int, dest: memoryview | list[memoryview], etag: str,
                  what: str) -> None:
        """The object's bytes from ``offset`` into ``dest`` (or into several buffers in turn: adjacent tensors,
        one GET); a connection reset mid-body resumes where it broke."""
        parts = dest if isinstance(dest, list) else [dest]
        starts = list(itertools.accumulate((len(p) for p in parts), initial=0))
        total = starts[-1]
        pos, attempt = 0, 0
        while pos < total:
            try:
                reply = self._get(url, f"bytes={offset + pos}-{offset + total - 1}", etag, what)
                body = reply["Body"]
                if int(reply.get("ContentLength", -1)) != total - pos:
                    raise InvalidArgument(f"{url}: asked for {total - pos} bytes at {offset + pos}, the store "
                                          f"answered {reply.get('ContentLength')} (tensor {clip(what)})")
                while pos < total:
                    i = bisect.bisect_right(starts, pos) - 1
                    n = body.readinto(parts[i][pos - starts[i]:])
                    if not n:
                        raise ConnectionError("body ended early")
                    pos += n
            except TensorCastError:
                raise
            except Exception as exc:  # a reset mid-body, a timeout: the rest again, after a pause
                attempt += 1
                if attempt >= self.config.object_attempts:
                    raise Unavailable(f"{url}: reading tensor {clip(what)} failed {attempt} times: "
                                      f"{exc.__class__.__name__}") from None
                self._pause(attempt)

    def _get(self, url: ObjectURL, byte_range: str, etag: str, what: str) -> Any:
        args = {"Bucket": url.bucket, "Key": url.key, "Range": byte_range, **({"IfMatch": etag} if etag else {})}
        return self._call(lambda: self.client.get_object(**args), url, what)

    def _call(self, request: Any, url: ObjectURL, what: str) -> Any:
        """One request, retried on throttling, server errors and lost connections; errors typed."""
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        attempt = 0
        while True:
            try:
                return request()
            except ClientError as exc:
                err = exc.response.get("Error", {})
                code = str(err.get("Code", ""))
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                typed = _typed(url, what, code, status)
                if typed is not None:
                    raise typed from None
                failure = f"{code or status}"
            except (NoCredentialsError, PartialCredentialsError) as exc:
                raise PermissionDenied(f"{url}: no object-store credentials ({exc}); set AWS_ACCESS_KEY_ID and "
                                       "AWS_SECRET_ACCESS_KEY, a profile, or weights.object_anonymous") from None
            except Exception as exc:  # connection refused or reset, timeouts: botocore's and urllib3's
                failure = exc.__class__.__name__
            attempt += 1
            if attempt >= self.config.object_attempts:
                raise Unavailable(f"{url}: {what} failed {attempt} times (last: {failure})")
            self._pause(attempt)

    def _pause(self, attempt: int) -> None:
        base = self.config.object_backoff * 2 ** (attempt - 1)
        time.sleep(min(5.0, base) * random.uniform(0.5, 1.0))


def _typed(url: ObjectURL, what: str, code: str, status: int) -> TensorCastError | None:
    """The error a store's reply means (None: worth another attempt: throttling, 5xx)."""
    codes = {code, str(status)}
    if codes & _MISSING:
        return NotFound(f"{url} does not exist ({code or status}; {clip(what)})")
    if codes & _DENIED:
        return PermissionDenied(f"{url}: the object store refused this worker's credentials ({code or status})")
    if codes & _CHANGED:
        return InvalidArgument(f"{url} changed since it was registered (its ETag differs); register it again")
    if codes & _RANGE:
        return InvalidArgument(f"{url}: {clip(what)} lies outside the object (truncated since registration?)")
    if status >= 500 or status in (0, 408, 429) or code in ("SlowDown", "Throttling", "RequestTimeout"):
        return None
    return InvalidArgument(f"{url}: the object store refused {clip(what)} ({code or status})")


_process_store = [ObjectStore(WeightsConfig())]  # its client is made on first use


def object_store() -> ObjectStore:
    """The process's store: the settings a worker configured (``configure``), else the defaults."""
    return _process_store[0]


def configure(config: WeightsConfig) -> None:
    """Use ``config``'s settings for this process's reads (a worker's, at start: one worker per process)."""
    if _process_store[0].config != config:
        _process_store[0] = ObjectStore(config)

