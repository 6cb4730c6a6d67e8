"""RL weight sync on a CPU host: TensorCast's publish + group swap against the default updater (the paper's
Fig 7, scaled to one 2-core machine), all measured in one run.

A trainer (this process) holds a Qwen2-shaped bf16 model with random weights: Qwen2.5-1.5B's dimensions (hidden
1536, 12 heads, 2 KV heads, MLP 8960, vocabulary 151936, tied embeddings, q/k/v biases) with 18 of its 28 layers,
~1.08B parameters, 2.0 GiB (``--quick``: Qwen2.5-0.5B's dimensions, 9 of its 24 layers, 0.5 GiB). It runs on
host A; an engine of TP = 1, 2 and 4 ranks (one process per rank, each holding its slices as plain torch tensors,
one CPU thread each) runs on host B. Every update is a training step's new weights reaching every rank, in place:
- **full**: every tensor changed (each bf16 value moves by one unit in the last place);
- **delta**: 10% of the tensors changed, holding just under 10% of the bytes (largest first, layers picked
  at random, seeded); the goal is a time of about 10% of a full update. Run twice: as a trainer that does not
  know what changed (the publisher finds out: XXH3-128 of every tensor, BLAKE3 of the changed ones), and as
  one that does (``publish(changed=names)``: LoRA, frozen layers; the other tensors are not read at all).
Time per update: from the trainer starting to publish until every rank reports the new version active.

Systems:
- **TensorCast**: ``client.publisher(model, keep_last=2).publish(state_dict)`` into host A's worker (w0;
  shared memory, only changed tensors copied), then ``client.group_swap(ranks, model, version)`` through host
  B's gateway (w1): every rank (``tensorcast.testing.weight_rank``: a binding served as an instance) prepares
  (all ranks stage through w1, so w1 pulls the changed tensors whole from w0 over TCP, once for all ranks,
  and each rank maps its slices of them) and, once all have, activates (copies them into its tensors).
- **default updater** (the paper's "Default", what RL frameworks do without a weight service): the trainer
  saves the state dict as safetensors shards (<= 1 GiB each) to a directory shared with host B (``--files-dir``;
  by default a tmpfs under /dev/shm: the baseline at its best, and free of this host's disk write-back,
  which made saves to ext4 take 0.2-1.7 s for 0.5 GiB from one step to the next); every rank
  opens every file, reads each tensor whole (``safe_open().get_tensor``, as vLLM's and SGLang's default
  loaders do), narrows it to its shard and copies it into its tensor. It has no delta path: a delta update
  rewrites and rereads everything, so its delta time is its full time (only full updates are timed).
  Also measured: **sliced reads** (``get_slice``: each rank reads only its shard), a stronger variant; and
  **files over TCP**: every rank streams every file from host A (an HTTP server in this process,
  ``sendfile``) and narrows each tensor as it arrives, into a buffer reused across tensors: what reading
  from a network file system without a local cache costs. The first two read the local page cache: on one
  machine host B reads what host A just wrote at memory speed, with no network in between (in the paper the
  files cross the network from a shared file system, JuiceFS); the third puts that network back (loopback
  TCP, as TensorCast's w0 -> w1 traffic; with ``--netns`` the ranks run in host B's namespace and the files
  cross its veth and the bridge).
- **checkpoint-engine** (MoonshotAI, PyPI 0.4.2): its ``ParameterServer`` is constructed in a subprocess; it
  needs CUDA or an Ascend NPU, so without a GPU its exact error is reported instead of a time.

Hosts: ``running_cluster(workers=2, hosts=2)``: two workers with distinct host ids on this machine, so that
w0 -> w1 traffic takes the network path (TCP over loopback), never shared memory. ``--netns`` instead puts each
host in its own network namespace (root only): w0 -> w1 crosses a veth pair and a bridge.

Steady state between updates (untimed, as between training steps): the trainer's tensors are changed; view
artifacts w1 materialized for the previous version are deleted, and versions older than the active one (before
a full update, the active one too: nothing deduplicates against it); then the workers' pre-faulted stock
(``worker.prefault_bytes``, sized to the model with ``--stock model``, the default, as the worker
documentation advises for a host's largest burst; ``--stock default`` keeps 512 MiB) is let refill.
This keeps host A at one or two versions rather than keep_last=2's three during a publish: a memory limit of
this host, not a speed-up (a put's cost does not depend on the versions already held). One untimed full update
(TensorCast) or load (default updater) per TP warms up before the timed ones.
After the last update of each TP, every rank's tensors are checked (BLAKE3) against the trainer's slices.

Also reported: the trainer's hashing alone. ``publish`` needs every tensor's BLAKE3 digest before its put (to
find the unchanged tensors); it reuses its previous publish's digest for a tensor whose XXH3-128 is unchanged.
So BLAKE3 of every tensor is a floor under a full update, and XXH3-128 of every tensor plus BLAKE3 of the
changed ones one under a delta update.

CPU seconds per update (user + system, summed over every process involved: the trainer, the workers, the
global store and the ranks; for the default updater, the trainer, its file server and the ranks) are reported
beside the times: on a host shared with other work they are steadier than wall time. TensorCast's workers
also re-fault their stock between updates (untimed, reported apart).

Statistics: ``--reps`` updates per case (3; quick 2): the table gives the median and the range; ratios are
default/TensorCast of medians, with the range from the extremes. Goals (reported, not enforced): TensorCast
>= 2.63x the default updater at TP = 4 (the paper's best speed-up, on H800 nodes with files read over a
network), and a delta update ~10% of a full one.

Memory: the trainer's model, the ranks' copies, a version (two during a delta) on w0 and one rank-sliced copy
on w1, plus the stocks: about 5x the model plus 2.5 GiB at peak (the default updater runs after the cluster has
stopped, except with ``--netns``). The run refuses to start when /proc/meminfo's MemAvailable is below that
(``--force`` overrides), and stops (cleanly) rather than start an update when other work on the host has taken
the memory it needs, so as not to drive the host into its OOM killer.

The model and the measuring helpers are in ``weight_sync_model.py``, the default updater (its save, rank
processes and file server) in ``default_updater.py``, the summary, table, goals and figure in
``weight_sync_report.py``; this file runs TensorCast's side, probes checkpoint-engine and drives the run.

``--smoke``: a narrow Qwen2-shaped model of a few MiB (the same tensors), TP=2, one timed update per case, a
small stock refilled soon (``benchlib.SMOKE_STOCK``) (figures meaningless; every system, kind and row).

Usage: python benchmarks/weight_sync.py [--quick | --smoke] [--tp 1,2,4] [--reps N] [--size-gib G]
       [--stock model|default] [--netns] [--files-dir DIR] [--json PATH] [--plot PATH] [--force]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from benchlib import SMOKE_STOCK, mem_available, parse_args, parser, pick, shm_pages, write_json
from default_updater import DefaultSide, file_server, run_default
from weight_sync_model import (
    MODEL,
    QWEN_FULL,
    QWEN_QUICK,
    QWEN_SMOKE,
    GiB,
    cpu_by_pid,
    cpu_by_role,
    cpu_seconds,
    digest,
    ensure_memory,
    layers_for,
    make_state,
    nbytes_of,
    pick_delta,
    qwen2_shapes,
    shard_of,
    summarize,
    train_step,
)
from weight_sync_report import KINDS, fmt, report


# ----------------------------------------------------------------------------------------------- TensorCast
class TensorCastSide:
    """The trainer's publisher (host A, w0), the controller (host B's gateway, w1), and a TP engine's ranks."""

    def __init__(self, cluster: Any, trainer: Any, ctl: Any, stock: int) -> None:
        self.cluster, self.trainer, self.ctl, self.stock = cluster, trainer, ctl, stock
        self.pub = trainer.publisher(MODEL, keep_last=2)
        self.ranks: list[str] = []
        self.own: dict[str, tuple[subprocess.Popen[bytes], Any]] = {}  # --netns: rank processes started here
        self.version = 0  # the trainer's step: version numbers stay increasing although old ones are deleted

    def publish(self, state: dict[str, Any], changed: list[str] | None = None) -> Any:
        self.version += 1
        return self.pub.publish(state, version=self.version, changed=changed)

    def start_ranks(self, tp: int) -> None:
        ids = [f"tc-tp{tp}-r{r}" for r in range(tp)]
        args = ["--model", MODEL, "--world", str(tp), "--host-id", self.cluster.host_id_of(1), "--rules", "qwen2"]
        if self.cluster.net is not None:
            self._start_in_namespace(ids, args)
            return
        with concurrent.futures.ThreadPoolExecutor(tp) as pool:
            starts = [pool.submit(self.cluster.start_instance, rid, "w1", [*args, "--rank", str(r)],
                                  module="tensorcast.testing.weight_rank") for r, rid in enumerate(ids)]
            for s in starts:
                s.result()
        self.ranks = ids

    def _start_in_namespace(self, ids: list[str], args: list[str]) -> None:
        """``--netns``: the ranks run in host B's namespace (``start_instance`` runs them here, where w1 could
        not reach the 127.0.0.1 address they serve on)."""
        w1 = self.cluster.workers["w1"].address
        env = {**os.environ, "TENSORCAST_TOKEN": self.cluster.token or ""}
        for r, rid in enumerate(ids):
            ready = self.cluster.data_dir / f"{rid}.ready"
            ready.unlink(missing_ok=True)
            cmd = [*self.cluster.net.exec_args(1), sys.executable, "-m", "tensorcast.testing.weight_rank",
                   "--worker", w1, "--id", rid, "--ready-file", str(ready), *args, "--rank", str(r)]
            log = open(self.cluster.data_dir / "logs" / f"{rid}.log", "ab")  # noqa: SIM115 - the child's lifetime
            self.own[rid] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              stdin=subprocess.DEVNULL), log)
        end = time.monotonic() + 120
        for rid in ids:
            while not (self.cluster.data_dir / f"{rid}.ready").exists():
                if self.own[rid][0].poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"rank {rid} did not start (log: {self.cluster.data_dir}/logs/{rid}.log)")
                time.sleep(0.05)
        self.ranks = ids

    def stop_ranks(self) -> None:
        for rid in self.ranks:
            if rid in self.own:
                proc, log = self.own.pop(rid)
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                log.close()
            else:
                handle = self.cluster.instances.get(rid)
                try:
                    self.cluster.stop_instance(rid)
                except subprocess.TimeoutExpired:  # slow to exit (a loaded host): it must not outlive the run
                    handle.popen.kill()
                    handle.popen.wait()
        self.ranks = []

    def pids(self) -> list[int]:
        """This process (the trainer and the controller), the global store, the workers and the ranks."""
        return list(self.roles())

    def roles(self) -> dict[int, str]:
        out = {os.getpid(): "trainer"}  # the trainer and the controller: this process
        out.update({pid: "ranks" if name in self.ranks else name for name, pid in self.cluster.pids().items()})
        out.update({p.pid: "ranks" for p, _ in self.own.values()})
        return out

    def engine(self, rank: str, command: str) -> dict[str, Any]:
        return dict(self.ctl.call_instance(rank, "engine", args={"command": command}, timeout=300).result)

    def active(self) -> int:
        versions = {self.engine(r, "weights.status")["active_version"] or 0 for r in self.ranks}
        assert len(versions) == 1, f"ranks disagree on the active version: {versions}"
        return versions.pop()

    def update(self, state: dict[str, Any], changed: list[str] | None = None) -> dict[str, Any]:
        """Publish ``state`` (``changed``: the tensors the caller says changed) and swap every rank to it; the
        timed update."""
        expected = self.active()
        roles = self.roles()
        c0 = cpu_by_pid(list(roles))
        t0 = time.perf_counter()
        p = self.publish(state, changed)
        t1 = time.perf_counter()
        res = self.ctl.group_swap(self.ranks, MODEL, p.version, expected=expected, timeout=600)
        t2 = time.perf_counter()
        by = cpu_by_role(c0, cpu_by_pid(list(roles)), roles)
        cpu = sum(by.values())
        reports = list(res.ranks.values())
        assert all(r["phase"] == "active" and r["version"] == p.version for r in reports), reports
        return {"seconds": t2 - t0, "cpu_s": cpu, "cpu_by": by, "publish_s": t1 - t0, "swap_s": t2 - t1,
                "version": p.version,
                "changed_tensors": p.changed_tensors, "changed_bytes": p.changed_bytes,
                "fetched_bytes": sum(int(r["fetched_bytes"]) for r in reports),
                "copied_bytes": sum(int(r["copied_bytes"]) for r in reports),
                "prepare_s": max(float(r["prepare_s"]) for r in reports),
                "activate_s": max(float(r["activate_s"]) for r in reports),
                "path": sorted({str(r["path"]) for r in reports})}

    def tidy(self, keep_active: bool) -> None:
        """Between updates: drop w1's views and the versions no update will deduplicate against."""
        versions = self.pub.versions()
        latest = max(versions, default=0)
        from tensorcast.errors import NotFound

        for a in self.ctl.ls():
            if a.info.meta.get("view_of"):
                with contextlib.suppress(NotFound):  # evicted meanwhile
                    self.ctl.delete(a.info.id)
        for v in versions:
            if v < latest or not keep_active:
                with contextlib.suppress(NotFound):  # collected by the publisher meanwhile
                    self.ctl.delete(f"{MODEL}@v{v}")

    def settle(self, timeout: float = 90.0) -> None:
        """Let both workers' pre-faulted stock refill: it starts after an idle spell, and the signal comes with
        heartbeats (only those sent after that spell count). Done when it is full, or has stopped growing for
        two heartbeats (size classes demanded by large tensors can keep it a little under its budget)."""
        since = time.time() + self.cluster.client_config().worker.prefault_idle_seconds + 0.2
        end = time.monotonic() + timeout
        last: tuple[int, ...] = ()
        steady = time.monotonic()
        while time.monotonic() < end:
            workers = self.ctl.list_workers()
            now = tuple(w.memory_prefaulted for w in workers)
            full = all(x >= self.stock for x in now) or (now == last and time.monotonic() - steady > 2.2)
            if full and all(w.last_heartbeat > since for w in workers):
                return
            if now != last:
                last, steady = now, time.monotonic()
            time.sleep(0.25)
        got = {w.worker_id: round(w.memory_prefaulted / GiB, 2) for w in self.ctl.list_workers()}
        print(f"    (the pre-faulted stock did not settle in {timeout:.0f} s: {got} GiB)")

    def verify(self, state: dict[str, Any], tp: int) -> None:
        for r, rid in enumerate(self.ranks):
            got = self.engine(rid, "test.digests")
            want = {n: digest(shard_of(n, t, r, tp)) for n, t in state.items()}
            bad = [n for n in want if got.get(n, {}).get("digest") != want[n]]
            assert not bad, f"TensorCast rank {r}/{tp} holds wrong bytes for {len(bad)} tensors, e.g. {bad[:3]}"


def run_tensorcast(side: TensorCastSide, state: dict[str, Any], delta: list[str], tp: int,
                   reps: int) -> dict[str, list[dict[str, Any]]]:
    everything = sorted(state)
    side.start_ranks(tp)
    try:
        side.ctl.group_swap(side.ranks, MODEL, expected=0, timeout=600)  # the ranks' first load
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
        plan = [("warm-up", everything)] + [("full", everything)] * reps + [("delta", delta)] * reps + \
            [("named", delta)] * reps
        for kind, names in plan:
            c0 = cpu_seconds(side.pids())
            side.tidy(keep_active=kind in ("delta", "named"))
            side.settle()
            between = cpu_seconds(side.pids()) - c0  # mostly the workers re-faulting their stock
            # New memory: the changed bytes on w0 and again (sliced) on w1, less what the stocks hold ready.
            changed = sum(state[n].nbytes for n in names)
            ensure_memory(max(0, 2 * changed - 2 * side.stock) + GiB, f"TensorCast TP={tp} {kind}")
            train_step(state, names)
            row = side.update(state, changed=names if kind == "named" else None)
            row["between_cpu_s"] = between
            if kind != "warm-up":
                out[kind].append(row)
            print(f"    TensorCast TP={tp} {kind:<7} {row['seconds']:7.3f} s, {row['cpu_s']:6.2f} CPU s  (publish "
                  f"{row['publish_s']:.3f} s, "
                  f"{row['changed_bytes'] / GiB:.3f} GiB new; swap {row['swap_s']:.3f} s, prepare "
                  f"{row['prepare_s']:.3f}, activate {row['activate_s']:.3f}; {row['fetched_bytes'] / GiB:.3f} GiB "
                  f"fetched, {','.join(row['path'])}; CPU s {row['cpu_by']})", flush=True)
        side.verify(state, tp)
        side.tidy(keep_active=True)  # the next TP's ranks are allocated from the newest version
        return out
    finally:
        side.stop_ranks()



# ----------------------------------------------------------------------------------------------- checkpoint-engine
CKPT_ENGINE_PROBE = """
import os
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")  # ParameterServer reads rank 0 from $RANK
from checkpoint_engine.ps import ParameterServer
ps = ParameterServer(rank=0, world_size=1, auto_pg=False)
print("constructed")
"""


def probe_checkpoint_engine() -> dict[str, Any]:
    """Whether checkpoint-engine's parameter server starts here; its exact error when it does not."""
    try:
        from importlib.metadata import version

        ver = version("checkpoint-engine")
    except Exception:
        return {"runs": False, "error": "not installed (pip install -c <(echo torch==2.13.0) checkpoint-engine==0.4.2)"}
    try:
        proc = subprocess.run([sys.executable, "-c", CKPT_ENGINE_PROBE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"version": ver, "runs": False, "error": "ParameterServer() did not return in 120 s"}
    if proc.returncode == 0 and "constructed" in proc.stdout:
        return {"version": ver, "runs": True, "error": "", "note": "constructed; no CPU update path measured"}
    lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
    where = next((x.strip() for x in reversed(lines) if x.strip().startswith("File ")), "")
    return {"version": ver, "runs": False, "error": lines[-1] if lines else f"exit code {proc.returncode}",
            "where": where}


@contextlib.contextmanager
def cluster_of(args: argparse.Namespace, capacity: int, config: dict[str, Any]) -> Iterator[Any]:
    if args.netns:
        from tensorcast.cluster import LocalCluster

        with LocalCluster(workers=2, hosts=2, netns=True, memory_capacity=capacity, config=config) as cluster:
            yield cluster
    else:
        from tensorcast.testing import running_cluster

        with running_cluster(workers=2, hosts=2, memory_capacity=capacity, config=config) as cluster:
            yield cluster


def main() -> None:
    ap = parser(__doc__, "a 0.5 GiB model, 2 repetitions")
    ap.add_argument("--tp", default=None, help="comma-separated TP sizes (default 1,2,4; smoke 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed updates per case (default 3; quick 2; smoke 1)")
    ap.add_argument("--size-gib", type=float, default=None, help="model size (default 2.0; quick 0.5)")
    ap.add_argument("--stock", choices=("model", "default"), default="model",
                    help="workers' pre-faulted stock: sized to the model (default) or the worker default")
    ap.add_argument("--netns", action="store_true", help="hosts in network namespaces (root)")
    ap.add_argument("--files-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the default updater's checkpoints go (default: /dev/shm, a tmpfs)")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--force", action="store_true", help="run even if MemAvailable looks too small")
    args = parse_args(ap)

    import tensorcast as tc
    from tensorcast.netns import ROOT
    from tensorcast.tensors import normalize_tensors

    # --smoke: TP=2 takes every path TP=1 does (and slices); each TP size starts its ranks, seconds each.
    tps = [int(x) for x in (args.tp or pick(args, "1,2,4", "1,2,4", "2")).split(",")]
    reps = args.reps or pick(args, 3, 2, 1)
    dims = pick(args, QWEN_FULL, QWEN_QUICK, QWEN_SMOKE)
    target = int((args.size_gib or pick(args, 2.0, 0.5, 1 / 256)) * GiB)
    layers = layers_for(dims, target)
    shapes = qwen2_shapes(dims, layers)
    total = sum(nbytes_of(s) for s in shapes.values())
    params = sum(math.prod(s) for s in shapes.values())
    delta = pick_delta(shapes)
    delta_bytes = sum(nbytes_of(shapes[n]) for n in delta)
    chunk = pick(args, 256 << 20, 256 << 20, 16 << 20)  # worker.prefault_chunk_bytes: the stock fills in chunks
    stock = (-(-total // chunk) + 1) * chunk if args.stock == "model" else tc.Config().worker.prefault_bytes
    need = 5 * total + (2 * stock - 2 * total if stock > total else 0) + int(2.5 * GiB)
    model_desc = (f"{dims['name']} shapes, {layers} of {dims['layers']} layers, {params / 1e9:.2f}B params, "
                  f"{total / GiB:.2f} GiB bf16, {len(shapes)} tensors")
    print(f"model: {model_desc}")
    print(f"delta: {len(delta)} tensors ({len(delta) / len(shapes):.1%}), {delta_bytes / GiB:.3f} GiB "
          f"({delta_bytes / total:.1%} of the bytes)")
    print(f"hosts: {'network namespaces (veth + bridge)' if args.netns else 'running_cluster(hosts=2): loopback TCP'};"
          f" worker stock {stock / GiB:.2f} GiB; TP {tps}; {reps} timed updates per case")
    avail = mem_available()
    print(f"memory: ~{need / GiB:.1f} GiB needed at peak, {avail / GiB:.1f} GiB available")
    if avail < need and not args.force:
        sys.exit(f"not enough memory for this run ({avail / GiB:.1f} < {need / GiB:.1f} GiB): wait, use --quick, "
                 "--size-gib or --stock default, or --force")

    ckpt = probe_checkpoint_engine()
    print(f"checkpoint-engine {ckpt.get('version', '')}: "
          + ("runs" if ckpt["runs"] else f"does not run here: {ckpt['error']}"))
    t0 = time.perf_counter()
    state = make_state(shapes)
    print(f"trainer's model generated in {time.perf_counter() - t0:.1f} s")
    hash_s = []
    for _ in range(reps):  # what publish does first: every tensor's digest (BLAKE3)
        t0 = time.perf_counter()
        _ = [t.meta for t in normalize_tensors(state)]
        hash_s.append(time.perf_counter() - t0)
    hashing = summarize(hash_s)
    quick_s = []
    for _ in range(reps):  # what a delta publish does first: every tensor's XXH3-128 (BLAKE3 only where changed)
        t0 = time.perf_counter()
        _ = [xxhash.xxh3_128_hexdigest(t.data.data) for t in normalize_tensors(state)]
        quick_s.append(time.perf_counter() - t0)
    quick = summarize(quick_s)
    print(f"trainer's hashing alone: BLAKE3 of every tensor (a full publish) {fmt(hashing)} "
          f"({total / hashing['median'] / 1e9:.1f} GB/s); XXH3-128 of every tensor (a delta publish's check) "
          f"{fmt(quick)} ({total / quick['median'] / 1e9:.1f} GB/s)\n")

    results: dict[int, dict[str, Any]] = {tp: {} for tp in tps}
    config = {"worker.prefault_bytes": stock, "worker.prefault_chunk_bytes": chunk,
              **(SMOKE_STOCK if args.smoke else {})}
    def default_updater(on_b: list[str], bind: str) -> None:
        # The files are on this machine's filesystem, which every "host" shares.
        with tempfile.TemporaryDirectory(prefix="tc-weight-sync-", dir=args.files_dir) as tmp, \
                file_server(Path(tmp), bind) as url:
            dside = DefaultSide(shapes, Path(tmp), url, on_b)
            for tp in tps:
                print(f"TP={tp}: default updater", flush=True)
                results[tp]["default"] = run_default(dside, state, tp, reps)

    # Capacity: two versions (a delta's and the one it builds on) with room to spare; it is a limit, not a
    # reservation.
    with cluster_of(args, 2 * total + GiB, config) as cluster:
        trainer_cfg = tc.Config.load(overrides={"client.host_id": cluster.host_id_of(0)})
        with tc.connect(cluster.workers["w0"].address, cluster.token, config=trainer_cfg) as trainer, \
                tc.connect(cluster.workers["w1"].address, cluster.token) as ctl:
            side = TensorCastSide(cluster, trainer, ctl, stock)
            side.publish(state)  # the first version, that the ranks are allocated from
            for tp in tps:
                print(f"TP={tp}: TensorCast", flush=True)
                results[tp]["tensorcast"] = run_tensorcast(side, state, delta, tp, reps)
            for v in side.pub.versions():  # TensorCast is done: its memory goes back before the files come
                ctl.delete(f"{MODEL}@v{v}")
        if cluster.net is not None:  # its ranks in host B's namespace, fetching over the bridge
            default_updater(cluster.net.exec_args(1), cluster.net.address(ROOT))
    if not args.netns:  # once the cluster is gone: its workers' stock would hold memory the files need
        default_updater([], "127.0.0.1")

    summary, goals, note = report(results, reps, ckpt, model_desc, total, delta_bytes, args.netns, args.plot)
    print(shm_pages())
    write_json(args.json, "weight_sync", args.quick, model=model_desc, model_bytes=total, tensors=len(shapes),
               delta_tensors=len(delta), delta_bytes=delta_bytes, hosts="netns" if args.netns else "loopback",
               stock_bytes=stock, reps=reps, files_dir=args.files_dir, hashing=hashing, quick_check=quick,
               checkpoint_engine=ckpt,
               goals=goals, summary=summary, runs={str(tp): results[tp] for tp in tps}, plot=note or args.plot)


if __name__ == "__main__":
    main()
