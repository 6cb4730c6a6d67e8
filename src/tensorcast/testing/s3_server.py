"""A real S3-compatible HTTP endpoint that behaves like a remote object store, for tests and benchmarks.

Owns: running moto's S3 in its own process (``python -m tensorcast.testing.s3_server``, werkzeug's threaded
server) behind a WSGI middleware that adds what a loopback moto lacks: a time to first byte per request, body
pacing per response and across all responses (a shared link), injected faults (HTTP 503 ``SlowDown``, a
connection cut mid-body), request/byte counters, and S3-like authentication (a moto IAM user whose SigV4
signatures are really verified: 403 ``InvalidAccessKeyId`` / ``SignatureDoesNotMatch``; or ``--anonymous``).
``S3Server`` starts it from a test, reads its JSON handshake line and stops it. Does not own: what is stored
(moto's S3), how tensorcast reads objects, network namespaces (``command_prefix`` only runs the process in one).

The control path ``/_tensorcast/faults`` and ``/_tensorcast/stats`` on the same port has no authentication:
this is a test server, to be bound to loopback or a test network namespace only. Requests are path-style
(``/bucket/key``); MB/s means 10**6 bytes per second. werkzeug's server closes each connection after one
response (no keep-alive), so every request pays a TCP connect, as a cold S3 client does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorcast.errors import Unavailable

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["S3Server"]

REGION = "us-east-1"
CONTROL = "/_tensorcast/"
CHUNK = 256 * 1024  # bytes written per paced step
UNPACED_CHUNK = 4 * 1024 * 1024  # bytes written per step without pacing (fewer copies and system calls)
RESET_PARTIAL_MAX = 64 * 1024  # a reset fault sends half the body, at most this much, then cuts the connection
# Query parameters that make a GET on /bucket/key something other than reading the object's bytes.
_SUBRESOURCES = frozenset({"acl", "tagging", "attributes", "legal-hold", "retention", "torrent", "uploadId",
                           "restore", "select"})
_USER = "tensorcast"
_ANONYMOUS_AUTHORIZATION = ("AWS4-HMAC-SHA256 Credential=anonymous/20000101/us-east-1/s3/aws4_request, "
                            "SignedHeaders=host, Signature=0")
_ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def _object_request(environ: WSGIEnvironment) -> bool:
    """A path-style request on an object (``/bucket/key``), not on one of its subresources."""
    bucket, _, key = str(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
    if not bucket or not key:
        return False
    query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")), keep_blank_values=True)
    return not _SUBRESOURCES.intersection(query)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class _Link:
    """A rate shared by every response: a token bucket without burst. Each chunk reserves its transmit time
    after the link's previous reservation and is written when that time has passed."""

    def __init__(self, bytes_per_s: float) -> None:
        self._bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._busy_until = 0.0

    def reserve(self, n: int) -> float:
        with self._lock:
            start = max(time.monotonic(), self._busy_until)
            self._busy_until = start + n / self._bytes_per_s
            return self._busy_until


class _Middleware:
    """Delay, pace, fault and count moto's S3 responses; answer the control path itself."""

    def __init__(self, app: WSGIApplication, *, first_byte_s: float, stream_bytes_per_s: float,
                 link_bytes_per_s: float, anonymous: bool) -> None:
        self._app = app
        self._anonymous = anonymous
        self._first_byte_s = first_byte_s
        self._stream_bytes_per_s = stream_bytes_per_s
        self._link = _Link(link_bytes_per_s) if link_bytes_per_s > 0 else None
        self._lock = threading.Lock()
        self._stats = {"get_requests": 0, "head_requests": 0, "bytes_sent": 0}
        self._faults = {"throttle": 0, "reset": 0}

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if str(environ.get("PATH_INFO", "")).startswith(CONTROL):
            return self._control(environ, start_response)
        method = environ["REQUEST_METHOD"]
        get_object = method == "GET" and _object_request(environ)
        fault = ""
        with self._lock:
            if get_object:
                self._stats["get_requests"] += 1
                fault = next((f for f in ("throttle", "reset") if self._faults[f] > 0), "")
                if fault:
                    self._faults[fault] -= 1
            elif method == "HEAD" and _object_request(environ):
                self._stats["head_requests"] += 1
        if self._first_byte_s > 0:
            time.sleep(self._first_byte_s)
        if "HTTP_AUTHORIZATION" not in environ:
            if not self._anonymous:  # unsigned or presigned: moto would answer a bare 403, or a 500
                return _error(start_response, "403 Forbidden", "AccessDenied", "Access Denied")
            # moto checks no signature here, but refuses unsigned reads of objects that are not public-read.
            environ["HTTP_AUTHORIZATION"] = _ANONYMOUS_AUTHORIZATION
        if fault == "throttle":
            return _error(start_response, "503 Slow Down", "SlowDown", "Please reduce your request rate.")
        status: list[str] = []

        def capture(code: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status.append(code)
            return start_response(code, headers, exc_info)

        body = self._app(environ, capture)
        return self._paced(environ, body, status, count=get_object, reset=fault == "reset")

    def _paced(self, environ: WSGIEnvironment, body: Iterable[bytes], status: list[str], *, count: bool,
               reset: bool) -> Iterator[bytes]:
        try:
            data = b"".join(body)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        count = count and bool(status) and status[0][:3] in ("200", "206")
        end = min(len(data) // 2, RESET_PARTIAL_MAX) if reset else len(data)
        yield b""  # werkzeug sends the status line and headers now
        start, sent = time.monotonic(), 0
        step = CHUNK if self._stream_bytes_per_s > 0 or self._link is not None else UNPACED_CHUNK
        while sent < end:
            n = min(step, end - sent)
            if self._stream_bytes_per_s > 0:
                _sleep_until(start + (sent + n) / self._stream_bytes_per_s)
            if self._link is not None:
                _sleep_until(self._link.reserve(n))
            yield data[sent:sent + n]
            sent += n
            if count:
                with self._lock:
                    self._stats["bytes_sent"] += n
        if reset:
            _cut(environ)

    def _control(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")))
        code, out = "200 OK", {}
        try:
            with self._lock:
                if path == CONTROL + "faults":
                    for name in self._faults:
                        if name in query:
                            self._faults[name] = max(0, int(query[name][0]))
                    out = dict(self._faults)
                elif path == CONTROL + "stats":
                    out = dict(self._stats)
                    if query.get("reset", ["0"])[0] not in ("0", "", "false"):
                        self._stats = dict.fromkeys(self._stats, 0)
                else:
                    code = "404 Not Found"
        except ValueError:
            code = "400 Bad Request"
        body = json.dumps(out).encode()
        start_response(code, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]


def _error(start_response: StartResponse, status: str, code: str, message: str) -> list[bytes]:
    """An S3 error response."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            "<RequestId>tensorcast-s3-server</RequestId></Error>").encode()
    start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body]


def _cut(environ: WSGIEnvironment) -> None:
    """End the response mid-body: half-close the socket (the client reads what was sent, then EOF short of
    Content-Length) and raise a connection error, which werkzeug treats as a dropped connection."""
    sock = environ.get("werkzeug.socket")
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
    raise ConnectionAbortedError("tensorcast.testing.s3_server: injected connection reset")


def _iam_credentials() -> tuple[str, str]:
    """Turn on moto's request authentication and create the one IAM user allowed everything."""
    from moto import settings
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends

    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(REGION, _USER)
    iam.put_user_policy(_USER, "allow-all", json.dumps(_ALLOW_ALL))
    key = iam.create_access_key(_USER)
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # every request from now on is authenticated
    return key.access_key_id, key.secret_access_key


def _first_line(path: Path) -> str:
    """The file's first line once it is complete, else ``""``."""
    text = path.read_text()
    return text.partition("\n")[0] if "\n" in text else ""


def _child_env() -> dict[str, str]:
    """Our environment, with this tensorcast importable whether or not it is installed."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else src}


def _exit_on_stdin_eof() -> None:
    """The parent holds our stdin open: when it exits, however it dies, we exit too."""
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorcast.testing.s3_server",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--first-byte-ms", type=float, default=0.0, help="delay before every S3 response")
    parser.add_argument("--stream-mbps", type=float, default=0.0, help="MB/s per response body (0: unlimited)")
    parser.add_argument("--link-mbps", type=float, default=0.0, help="MB/s of all bodies together (0: unlimited)")
    parser.add_argument("--anonymous", action="store_true", help="no authentication: any or no credentials")
    parser.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when stdin closes (parent died)")
    args = parser.parse_args(argv)
    # Keep object bytes in memory however large (moto spools values over ~5 MiB to temporary files).
    os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(1 << 40))
    import logging

    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request; errors still show
    key_id, secret = ("anonymous", "anonymous") if args.anonymous else _iam_credentials()
    app = _Middleware(create_backend_app("s3"), first_byte_s=args.first_byte_ms / 1e3, anonymous=args.anonymous,
                      stream_bytes_per_s=args.stream_mbps * 1e6, link_bytes_per_s=args.link_mbps * 1e6)
    server = make_server(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)
    host = f"[{args.host}]" if ":" in args.host else args.host
    if args.exit_on_stdin_eof:
        threading.Thread(target=_exit_on_stdin_eof, name="stdin-watch", daemon=True).start()
    # The socket listens already: connections queue until serve_forever accepts them.
    print(json.dumps({"url": f"http://{host}:{server.server_port}", "access_key_id": key_id,
                      "secret_access_key": secret, "region": REGION}), flush=True)
    server.serve_forever()


class S3Server:
    """Context manager: starts the server process, waits for its JSON line (bounded wait, clear error with
    the process's stderr if it dies), stops it (terminate, then kill) on exit.

    ``command_prefix`` runs the process under another command, e.g. ``["ip", "netns", "exec", "tcn-x"]`` with
    ``host`` an address of that namespace.
    """

    def __init__(self, *, host: str = "127.0.0.1", first_byte_ms: float = 0.0, stream_mbps: float = 0.0,
                 link_mbps: float = 0.0, anonymous: bool = False, command_prefix: Sequence[str] = (),
                 start_timeout_s: float = 60.0) -> None:
        self.command = [*command_prefix, sys.executable, "-m", "tensorcast.testing.s3_server", "--host", host,
                        "--first-byte-ms", str(first_byte_ms), "--stream-mbps", str(stream_mbps),
                        "--link-mbps", str(link_mbps), "--exit-on-stdin-eof", *(["--anonymous"] if anonymous else [])]
        self.start_timeout_s = start_timeout_s
        self.url = self.access_key_id = self.secret_access_key = ""
        self.region = REGION
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="tensorcast-s3-")
        out, err = Path(self._tmp.name, "stdout"), Path(self._tmp.name, "stderr")
        # Files, not pipes: nobody has to drain them while the server runs.
        with out.open("wb") as out_f, err.open("wb") as err_f:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=out_f, stderr=err_f,
                                          env=_child_env())
        deadline = time.monotonic() + self.start_timeout_s
        while not (line := _first_line(out)):
            rc = self._proc.poll()
            if rc is not None or time.monotonic() > deadline:
                why = f"exited with {rc}" if rc is not None else f"printed nothing in {self.start_timeout_s:g} s"
                stderr = err.read_text(errors="replace")[-4000:]
                self.stop()
                raise Unavailable(f"the S3 test server {why}: {' '.join(self.command)}\n{stderr}")
            time.sleep(0.02)
        info = json.loads(line)
        self.url, self.region = info["url"], info["region"]
        self.access_key_id, self.secret_access_key = info["access_key_id"], info["secret_access_key"]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def env(self) -> dict[str, str]:
        """Environment variables that point an AWS SDK (or tensorcast) at this server."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region, "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, config: Any = None) -> Any:
        """A boto3 S3 client for this server with valid credentials and path-style addressing. ``config`` (a
        ``botocore.config.Config``) is merged over that: ``Config(retries={"total_max_attempts": 1})`` for no
        retries (``{"max_attempts": 1}`` still retries once)."""
        import boto3
        from botocore.config import Config

        merged = Config(s3={"addressing_style": "path"})
        if config is not None:
            merged = merged.merge(config)
        return boto3.client("s3", endpoint_url=self.url, region_name=self.region, config=merged,
                            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key)

    def faults(self, *, throttle: int = 0, reset: int = 0) -> None:
        """The next ``throttle`` GET-object requests answer 503 ``SlowDown``; the ones after those, ``reset``
        of them, send headers and part of the body, then cut the connection. Replaces what was pending."""
        self._control("faults", {"throttle": throttle, "reset": reset}, method="POST")

    def stats(self, *, reset: bool = False) -> dict[str, int]:
        """``get_requests`` and ``head_requests`` on objects (faulted ones too) and ``bytes_sent`` of 200/206
        GET-object bodies (partial ones too); ``reset`` zeroes them after reading."""
        return self._control("stats", {"reset": 1} if reset else {}, method="GET")

    def _control(self, what: str, query: dict[str, int], *, method: str) -> dict[str, int]:
        url = f"{self.url}{CONTROL}{what}?{urllib.parse.urlencode(query)}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy
        with opener.open(urllib.request.Request(url, method=method, data=b"" if method == "POST" else None),
                         timeout=30) as resp:
            out: dict[str, int] = json.loads(resp.read())
            return out


if __name__ == "__main__":
    main()
