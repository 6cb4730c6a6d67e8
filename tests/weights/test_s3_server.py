"""The S3 test server (``tensorcast.testing.s3_server``): moto's S3 in its own process, with S3's
authentication, paced bodies, injected faults and counters. Times are lower bounds only: a busy machine is
slower, never faster."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from tensorcast.testing.s3_server import S3Server

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

NO_RETRIES = Config(retries={"total_max_attempts": 1})  # {"max_attempts": 1} would still retry once


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server() as s:
        yield s


@pytest.fixture()
def bucket(server: S3Server) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=name)
    server.faults()  # nothing pending from an earlier test
    return name


def _error_code(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response: Any = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def test_objects_round_trip_byte_exact_and_gets_are_counted(server: S3Server, bucket: str) -> None:
    s3 = server.client()
    data = os.urandom(2 << 20)
    s3.put_object(Bucket=bucket, Key="w/a.bin", Body=data)
    server.stats(reset=True)
    assert s3.get_object(Bucket=bucket, Key="w/a.bin")["Body"].read() == data
    part = s3.get_object(Bucket=bucket, Key="w/a.bin", Range="bytes=1000-1999999")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["Body"].read() == data[1000:2_000_000]
    assert s3.head_object(Bucket=bucket, Key="w/a.bin")["ContentLength"] == len(data)
    assert server.stats(reset=True) == {"get_requests": 2, "head_requests": 1,
                                        "bytes_sent": len(data) + 1_999_000}
    assert server.stats() == {"get_requests": 0, "head_requests": 0, "bytes_sent": 0}


def test_a_throttle_answers_slow_down_once(server: S3Server, bucket: str) -> None:
    s3 = server.client(NO_RETRIES)
    s3.put_object(Bucket=bucket, Key="k", Body=b"x" * 1000)
    server.faults(throttle=1)
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="k")
    assert _error_code(exc) == ("SlowDown", 503)
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x" * 1000


def test_a_reset_cuts_the_body_and_the_reader_sees_an_error(server: S3Server, bucket: str) -> None:
    s3 = server.client(NO_RETRIES)
    data = os.urandom(1 << 20)
    s3.put_object(Bucket=bucket, Key="k", Body=data)
    server.faults(reset=1)
    server.stats(reset=True)
    body = s3.get_object(Bucket=bucket, Key="k")["Body"]  # status and headers arrive whole
    with pytest.raises(BotoCoreError):  # ResponseStreamingError: IncompleteRead, not silently short data
        body.read()
    assert 0 < server.stats()["bytes_sent"] < len(data)
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == data


def test_wrong_credentials_are_refused_as_s3_does(server: S3Server, bucket: str) -> None:
    server.client().put_object(Bucket=bucket, Key="k", Body=b"secret")
    for key_id, secret, code in ((server.access_key_id, server.secret_access_key + "x", "SignatureDoesNotMatch"),
                                 ("AKIA" + "Z" * 16, server.secret_access_key, "InvalidAccessKeyId")):
        s3 = boto3.client("s3", endpoint_url=server.url, region_name=server.region, aws_access_key_id=key_id,
                          aws_secret_access_key=secret,
                          config=NO_RETRIES.merge(Config(s3={"addressing_style": "path"})))
        with pytest.raises(ClientError) as exc:
            s3.get_object(Bucket=bucket, Key="k")
        assert _error_code(exc) == (code, 403)
    assert set(server.env()) >= {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}


def test_anonymous_mode_takes_any_or_no_credentials() -> None:
    from botocore import UNSIGNED

    with S3Server(anonymous=True) as server:
        server.client().create_bucket(Bucket="open")
        server.client().put_object(Bucket="open", Key="k", Body=b"public")
        for config in (Config(signature_version=UNSIGNED), None):
            s3 = boto3.client("s3", endpoint_url=server.url, region_name=server.region, aws_access_key_id="any",
                              aws_secret_access_key="thing", config=config)
            assert s3.get_object(Bucket="open", Key="k")["Body"].read() == b"public"


def test_a_paced_stream_takes_at_least_size_over_rate() -> None:
    with S3Server(stream_mbps=20, first_byte_ms=20) as server:
        s3 = server.client()
        s3.create_bucket(Bucket="paced")
        data = os.urandom(4 << 20)
        s3.put_object(Bucket="paced", Key="k", Body=data)
        start = time.monotonic()
        assert s3.get_object(Bucket="paced", Key="k")["Body"].read() == data
        assert time.monotonic() - start >= 0.17 + 0.02  # 4 MiB at 20 MB/s is 0.21 s, plus the first byte
