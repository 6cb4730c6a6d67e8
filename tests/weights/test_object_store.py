"""Checkpoints in S3-compatible object storage: registered in place with ranged GETs, loaded into rank views
byte-exact against the same files read locally, read from the bucket once for several workers, and clear
typed errors (missing objects, refused credentials, replaced objects, hostile headers) or recovery (throttling,
connections reset mid-body). A real S3 endpoint (moto's server, in its own process, with a first-byte delay)
and real worker processes."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

import tensorcast as tc  # noqa: E402
from tensorcast.cluster import LocalCluster  # noqa: E402
from tensorcast.config import WeightsConfig  # noqa: E402
from tensorcast.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable  # noqa: E402
from tensorcast.testing.s3_server import S3Server  # noqa: E402
from tensorcast.views import TP  # noqa: E402
from tensorcast.weights.object_checkpoint import open_object_checkpoint  # noqa: E402
from tensorcast.weights.object_store import ObjectPrefixes, ObjectStore, ObjectURL  # noqa: E402

BUCKET = "models"


def qwen_checkpoint(root: Path) -> Path:
    """A Qwen2-shaped checkpoint (random weights, sharded with an index), made here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(7)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = root / "qwen"
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB")
    return path


def upload(client: object, path: Path, prefix: str) -> None:
    for f in sorted(path.iterdir()):
        client.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server(first_byte_ms=5) as server:
        server.client().create_bucket(Bucket=BUCKET)
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())  # the workers' credentials: the standard AWS environment
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="module")
def local_ckpt(tmp_path_factory: pytest.TempPathFactory, s3: S3Server) -> Path:
    path = qwen_checkpoint(tmp_path_factory.mktemp("ckpt"))
    assert (path / "model.safetensors.index.json").exists()
    upload(s3.client(), path, "qwen")
    return path


@pytest.fixture(scope="module")
def cluster(s3: S3Server, local_ckpt: Path) -> Iterator[LocalCluster]:
    from tensorcast.testing import running_cluster

    config = {"weights.object_prefixes": f"s3://{BUCKET}/qwen,s3://{BUCKET}/bad",
              "weights.allowed_roots": str(local_ckpt.parent)}
    with running_cluster(workers=3, hosts=3, config=config) as c:
        yield c


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


def test_rank_views_from_the_bucket_equal_the_local_files(cluster: LocalCluster, local_ckpt: Path) -> None:
    with tc.connect(cluster.address) as c:
        remote = c.from_disk(f"s3://{BUCKET}/qwen", on="w0")
        local = c.from_disk(local_ckpt, on="w0")
        assert remote.id != local.id and set(remote.tensor_names) == set(local.tensor_names)
        assert remote.info.meta["model_type"] == "qwen2" and remote.info.meta["source"] == f"s3://{BUCKET}/qwen"
        assert c.from_disk(f"s3://{BUCKET}/qwen/", on="w0").id == remote.id  # registering again: the same
        for rank, worker in ((0, "w0"), (1, "w1")):
            remote.prefetch(to=worker, tp=TP(rank, 2)).result(timeout=120)
            got = _bytes(c.artifact(remote.id).view(tp=TP(rank, 2)).tensor_dict())
            want = _bytes(c.artifact(local.id).view(tp=TP(rank, 2)).tensor_dict())
            assert got == want, rank
        full = _bytes(c.artifact(remote.id).tensor_dict())
        assert full == _bytes(c.artifact(local.id).tensor_dict())


def test_several_workers_read_each_byte_from_the_bucket_once(cluster: LocalCluster, s3: S3Server,
                                                            local_ckpt: Path) -> None:
    prefix = "qwen/copy"
    upload(s3.client(), local_ckpt, prefix)
    with tc.connect(cluster.address) as c:
        art = c.from_disk(f"s3://{BUCKET}/{prefix}", on="w0")
        s3.stats(reset=True)
        with ThreadPoolExecutor(2) as pool:  # two serving replicas start at once, on other workers
            done = list(pool.map(lambda w: art.prefetch(to=w).result(timeout=120), ["w1", "w2"]))
        assert {d.worker_id for d in done} == {"w1", "w2"}
        stats = s3.stats()
        assert stats["bytes_sent"] == art.nbytes, (stats, art.nbytes)  # once, by w0, shared worker-to-worker
        # A file's tensors lie back to back: one ranged GET per file (each under object_chunk_bytes) reads them.
        assert stats["get_requests"] == len(list(local_ckpt.glob("*.safetensors"))), stats
        want = _bytes(c.artifact(c.from_disk(local_ckpt, on="w0").id).tensor_dict())
        assert _bytes(c.artifact(art.id).tensor_dict()) == want


def test_default_deny_missing_and_replaced_objects(cluster: LocalCluster, s3: S3Server, local_ckpt: Path) -> None:
    client = s3.client()
    with tc.connect(cluster.address) as c:
        with pytest.raises(PermissionDenied, match="object_prefixes"):
            c.from_disk(f"s3://{BUCKET}/elsewhere", on="w0")
        with pytest.raises(PermissionDenied):
            c.from_disk(f"s3://{BUCKET}/qwen-lookalike/model.safetensors", on="w0")  # a prefix, not a substring
        with pytest.raises(NotFound):
            c.from_disk(f"s3://{BUCKET}/qwen/none-such.safetensors", on="w0")
        with pytest.raises(NotFound):
            c.from_disk(f"s3://{BUCKET}/qwen/empty-dir", on="w0")
        # An object replaced after registration: its reads are refused, not mixed with the new bytes.
        one = sorted(local_ckpt.glob("*.safetensors"))[0]
        client.upload_file(str(one), BUCKET, "qwen/swap/model.safetensors")
        art = c.from_disk(f"s3://{BUCKET}/qwen/swap/model.safetensors", on="w0")
        data = bytearray(one.read_bytes())
        data[-1] ^= 0xFF
        client.put_object(Bucket=BUCKET, Key="qwen/swap/model.safetensors", Body=bytes(data))
        with pytest.raises(InvalidArgument, match="changed since it was registered"):
            art.prefetch(to="w0").result(timeout=60)
        assert c.from_disk(f"s3://{BUCKET}/qwen/swap/model.safetensors", on="w0").id != art.id  # a new version
        # Hostile objects: a header length past the object, an index naming a file outside the prefix.
        client.put_object(Bucket=BUCKET, Key="bad/huge/model.safetensors", Body=struct.pack("<Q", 1 << 60) + b"{}")
        with pytest.raises(InvalidArgument, match="not a safetensors file"):
            c.from_disk(f"s3://{BUCKET}/bad/huge", on="w0")
        index = {"weight_map": {"x": "../qwen/model-00001-of-00002.safetensors"}}
        client.put_object(Bucket=BUCKET, Key="bad/escape/model.safetensors.index.json", Body=json.dumps(index))
        with pytest.raises(InvalidArgument):
            c.from_disk(f"s3://{BUCKET}/bad/escape", on="w0")
        assert c.artifact(c.from_disk(local_ckpt, on="w0").id).nbytes > 0  # the worker still serves


def _store(**overrides: object) -> ObjectStore:
    return ObjectStore(WeightsConfig(object_backoff=0.01, **overrides))  # type: ignore[arg-type]


def test_throttling_and_resets_recover_and_give_up_typed(s3: S3Server, local_ckpt: Path) -> None:
    store = _store(object_attempts=4, object_chunk_bytes=64 * 1024)
    url = ObjectURL(BUCKET, "qwen/" + sorted(p.name for p in local_ckpt.glob("*.safetensors"))[0])
    want = (local_ckpt / url.name).read_bytes()
    _head, info = store.read_head(url, 8)
    got = bytearray(len(want))
    s3.faults(throttle=3)  # 503 SlowDown three times: the fourth attempt succeeds
    store.read_into(url, 0, memoryview(got), info.etag, "all")
    assert bytes(got) == want
    s3.faults(reset=2)  # connections cut mid-body: resumed where they broke
    got[:] = bytes(len(got))
    store.read_into(url, 0, memoryview(got), info.etag, "all")
    assert bytes(got) == want
    s3.faults(throttle=10)
    with pytest.raises(Unavailable, match="4 times"):
        store.read_into(url, 0, memoryview(got), info.etag, "all")
    s3.faults(throttle=0)


def test_wrong_credentials_and_anonymous_access_are_refused_typed(s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                                   local_ckpt: Path) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermissionDenied, match="SignatureDoesNotMatch"):
        open_object_checkpoint(f"s3://{BUCKET}/qwen", _store())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDNOBODYHAS")
    with pytest.raises(PermissionDenied, match="InvalidAccessKeyId"):
        open_object_checkpoint(f"s3://{BUCKET}/qwen", _store())
    with pytest.raises(PermissionDenied):
        open_object_checkpoint(f"s3://{BUCKET}/qwen", _store(object_anonymous=True))
    with pytest.raises(PermissionDenied, match="object_prefixes: none"):  # default-deny
        open_object_checkpoint(f"s3://{BUCKET}/qwen", _store(), ObjectPrefixes(()))


def test_object_urls_and_prefixes() -> None:
    assert ObjectURL.parse("s3://bkt/a/b.safetensors") == ObjectURL("bkt", "a/b.safetensors")
    for bad in ("s3://", "s3://B!/x", "s3://bkt/../x", "/local/path", "s3://bkt/a\x00"):
        with pytest.raises(InvalidArgument):
            ObjectURL.parse(bad)
    prefixes = ObjectPrefixes(["s3://bkt/models", "s3://open"])
    assert prefixes.check("s3://bkt/models/q") == ObjectURL("bkt", "models/q")
    assert prefixes.check("s3://open/anything").key == "anything"
    for denied in ("s3://bkt/models2/x", "s3://bkt/other", "s3://openx/y"):
        with pytest.raises(PermissionDenied):
            prefixes.check(denied)


def test_a_registration_survives_its_worker_killed_and_restarted(cluster: LocalCluster, s3: S3Server,
                                                                  local_ckpt: Path) -> None:
    upload(s3.client(), local_ckpt, "qwen/restart")
    with tc.connect(cluster.address) as c:
        art = c.from_disk(f"s3://{BUCKET}/qwen/restart", key="bucket/restart", on="w2")
        cluster.kill_worker("w2")  # kill -9: nothing of it in memory, the registration on its disk
        cluster.restart_worker("w2")
        art.prefetch(to="w2").result(timeout=120)  # re-opened from the bucket at start, read from it now
        want = _bytes(c.artifact(c.from_disk(local_ckpt, on="w0").id).tensor_dict())
        assert _bytes(c.artifact("bucket/restart").tensor_dict()) == want
