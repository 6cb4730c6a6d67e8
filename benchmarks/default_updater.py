"""The weight-sync benchmark's baseline: the default updater (``benchmarks/weight_sync.py``).

Owns: the trainer's save (safetensors shards and an index, as ``save_pretrained``), the rank processes that load
every file and slice their shard (whole reads, sliced reads, or files streamed over TCP from an HTTP server on
host A), the file server, and ``DefaultSide``/``run_default``, which time one update at a TP size. A rank process
is this file run with ``--rank-server SPEC``. Does not own: the model, TensorCast's side or the report.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchlib import read_exactly
from weight_sync_model import (
    GiB,
    cpu_by_pid,
    cpu_by_role,
    digest,
    ensure_memory,
    shard_of,
    shard_range,
    shard_shape,
    split_dim,
    train_step,
)

SYSTEMS_DEFAULT = ("whole", "sliced", "tcp")  # read every tensor whole; read only the rank's slice; over TCP


def save_checkpoint(state: dict[str, Any], path: Path, shard_bytes: int = GiB) -> list[str]:
    """The trainer's save: safetensors shards of <= ``shard_bytes`` and an index, as ``save_pretrained``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    files: list[dict[str, Any]] = [{}]
    for name, t in state.items():
        if files[-1] and sum(x.nbytes for x in files[-1].values()) + t.nbytes > shard_bytes:
            files.append({})
        files[-1][name] = t
    names, weight_map = [], {}
    for i, f in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(f, str(path / fname), metadata={"format": "pt"})
        names.append(str(path / fname))
        weight_map.update({k: fname for k in f})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


def rank_server(spec_path: str) -> None:
    """One rank of the default updater (a process of its own): its tensors, and a load command on stdin."""
    import torch
    from safetensors import safe_open

    torch.set_num_threads(1)  # as the TensorCast ranks (one CPU thread each)
    spec = json.loads(Path(spec_path).read_text())
    rank, world = spec["rank"], spec["world"]
    bound = {n: torch.zeros(shard_shape(n, tuple(s), rank, world), dtype=torch.bfloat16)
             for n, s in spec["shapes"].items()}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "digests":
            print(json.dumps({n: digest(t) for n, t in bound.items()}), flush=True)
            continue
        t0 = time.perf_counter()
        if cmd["mode"] == "tcp":
            loaded = load_over_tcp(cmd["url"], cmd["files"], bound, rank, world)
            print(json.dumps({"seconds": time.perf_counter() - t0, "copied_bytes": loaded}), flush=True)
            continue
        loaded = 0
        for f in cmd["files"]:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    if cmd["mode"] == "whole":  # the default loaders: the whole tensor, then this rank's part
                        part = shard_of(name, fh.get_tensor(name), rank, world)
                    else:  # sliced reads: only this rank's part
                        sl = fh.get_slice(name)
                        shape = tuple(sl.get_shape())
                        dim = split_dim(name)
                        if dim is None:
                            part = sl[:]
                        else:
                            lo, hi = shard_range(shape[dim], rank, world)
                            part = sl[lo:hi] if dim == 0 else sl[:, lo:hi]
                    bound[name].copy_(part)
                    loaded += part.nbytes
        print(json.dumps({"seconds": time.perf_counter() - t0, "copied_bytes": loaded}), flush=True)


def load_over_tcp(url: str, files: list[str], bound: dict[str, Any], rank: int, world: int) -> int:
    """Stream each safetensors file from ``url`` (host A) and copy this rank's part of every tensor as it
    arrives; one buffer, the size of the largest tensor, is reused."""
    import torch

    host, port = url.rsplit(":", 1)
    buf = torch.empty(0, dtype=torch.uint8)
    loaded = 0
    for fname in files:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        try:
            conn.request("GET", "/" + fname)
            resp = conn.getresponse()
            if resp.status != 200:
                raise ConnectionError(f"GET {fname}: HTTP {resp.status}")
            head = bytearray(8)
            read_exactly(resp.readinto, memoryview(head))
            header = bytearray(int.from_bytes(head, "little"))
            read_exactly(resp.readinto, memoryview(header))
            metas = json.loads(header)
            metas.pop("__metadata__", None)
            pos = 0
            for name, meta in sorted(metas.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                start, stop = meta["data_offsets"]
                assert start == pos and meta["dtype"] == "BF16", (name, start, pos, meta["dtype"])
                if buf.numel() < stop - start:
                    buf = torch.empty(stop - start, dtype=torch.uint8)
                read_exactly(resp.readinto, memoryview(buf.numpy().data)[: stop - start])
                full = buf[: stop - start].view(torch.bfloat16).view(meta["shape"])
                part = shard_of(name, full, rank, world)
                bound[name].copy_(part)
                loaded += part.nbytes
                pos = stop
        finally:
            conn.close()
    return loaded


class _FileHandler(http.server.BaseHTTPRequestHandler):
    """GET /NAME: the file NAME of the server's directory, sent with sendfile (no copy through Python)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # the name http.server calls
        path = Path(self.server.root) / self.path.lstrip("/")  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.end_headers()
        with open(path, "rb") as f:
            self.connection.sendfile(f)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def file_server(root: Path, host: str) -> Iterator[str]:
    """Host A's files over HTTP; yields ``host:port``."""
    server = http.server.ThreadingHTTPServer((host, 0), _FileHandler)
    server.root = str(root)  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class DefaultSide:
    """The default updater's ranks: processes of their own, each with its tensors, driven over pipes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], tmp: Path, url: str, prefix: list[str]) -> None:
        self.shapes, self.tmp, self.url, self.prefix = shapes, tmp, url, prefix  # prefix: run on host B
        self.procs: list[subprocess.Popen[str]] = []
        self.step = 0

    def start_ranks(self, tp: int) -> None:
        for r in range(tp):
            spec = self.tmp / f"rank-{tp}-{r}.json"
            spec.write_text(json.dumps({"rank": r, "world": tp, "shapes": self.shapes}))
            proc = subprocess.Popen([*self.prefix, sys.executable, __file__, "--rank-server", str(spec)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
        for p in self.procs:
            self._read(p)

    @staticmethod
    def _read(p: subprocess.Popen[str]) -> dict[str, Any]:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"default-updater rank exited ({p.wait()})")
        return dict(json.loads(line))

    def _all(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return [self._read(p) for p in self.procs]

    def stop_ranks(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError, ValueError):
                assert p.stdin is not None
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def update(self, state: dict[str, Any], mode: str) -> dict[str, Any]:
        self.step += 1
        path = self.tmp / f"step-{self.step}"
        roles = {os.getpid(): "trainer", **{p.pid: "ranks" for p in self.procs}}  # trainer: + the file server
        c0 = cpu_by_pid(list(roles))
        t0 = time.perf_counter()
        files = save_checkpoint(state, path)
        t1 = time.perf_counter()
        if mode == "tcp":  # the same files, named relative to the server's directory
            files = [str(Path(f).relative_to(self.tmp)) for f in files]
        got = self._all({"op": "load", "files": files, "mode": mode, "url": self.url})
        t2 = time.perf_counter()
        by = cpu_by_role(c0, cpu_by_pid(list(roles)), roles)
        cpu = sum(by.values())
        shutil.rmtree(path)  # untimed: the next step writes a new directory
        return {"seconds": t2 - t0, "cpu_s": cpu, "cpu_by": by, "save_s": t1 - t0, "load_s": t2 - t1,
                "rank_load_s": max(g["seconds"] for g in got), "copied_bytes": sum(g["copied_bytes"] for g in got)}

    def verify(self, state: dict[str, Any], tp: int) -> None:
        for r, got in enumerate(self._all({"op": "digests"})):
            bad = [n for n, t in state.items() if got[n] != digest(shard_of(n, t, r, tp))]
            assert not bad, f"default-updater rank {r}/{tp} holds wrong bytes for {len(bad)} tensors, e.g. {bad[:3]}"


def run_default(side: DefaultSide, state: dict[str, Any], tp: int, reps: int) -> dict[str, list[dict[str, Any]]]:
    everything = sorted(state)
    side.start_ranks(tp)
    try:
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in SYSTEMS_DEFAULT}
        for mode in out:
            for i in range(reps + 1):  # the first: warm-up
                # The files, and per rank one tensor read whole at a time (at most the largest).
                largest = max(t.nbytes for t in state.values())
                ensure_memory(sum(t.nbytes for t in state.values()) + tp * largest + GiB, f"default TP={tp} {mode}")
                train_step(state, everything)
                row = side.update(state, mode)
                if i:
                    out[mode].append(row)
                print(f"    default TP={tp} {mode:<6} {'warm-up' if not i else 'full':<7} {row['seconds']:7.3f} s, "
                      f"{row['cpu_s']:6.2f} CPU s  "
                      f"(save {row['save_s']:.3f} s, load {row['load_s']:.3f} s; CPU s {row['cpu_by']})", flush=True)
        side.verify(state, tp)
        return out
    finally:
        side.stop_ranks()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a default-updater rank process (started by weight_sync.py)")
    ap.add_argument("--rank-server", required=True)
    rank_server(ap.parse_args().rank_server)
