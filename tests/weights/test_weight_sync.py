"""RL weight sync across real processes: a trainer publishes versions of a small Qwen2-shaped model on one host;
one TP=2 engine (two rank processes, each a binding served as an instance) on another host swaps to them
together through gateway plans. Checked after every swap: each rank's tensors equal its slices of the version,
byte for byte, at unchanged addresses. Also: a delta version copies and moves only its changed tensors; GC
keeps ``keep_last`` versions plus those in use; a failed prepare, or the source worker killed mid-swap, leaves
every rank on its old version and a retry succeeds; a stale compare-and-swap is a typed error."""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument, SwapAborted, VersionConflict
from tensorcast.testing import running_cluster
from tensorcast.weights.versions import DELTA_TENSOR

MODEL = "qwen-tiny"
RANKS = ["eng-r0", "eng-r1"]
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def qwen_state(seed: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return {k: v.detach().clone() for k, v in Qwen2ForCausalLM(cfg).state_dict().items()}


def rank_slice(name: str, full: torch.Tensor, rank: int, world: int = 2) -> torch.Tensor:
    """What a rank must hold, computed with torch.chunk, independently of TensorCast's rules."""
    dim = 0 if any(p in name for p in COLUMN) else 1 if any(p in name for p in ROW) else None
    return full if dim is None else torch.chunk(full, world, dim=dim)[rank]


def digest(t: torch.Tensor) -> str:
    return blake3.blake3(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def engine(c: tc.Client, rank: str, command: str, **args: Any) -> dict[str, Any]:
    return c.call_instance(rank, "engine", args={"command": command, **args}, timeout=60).result


def assert_holds(c: tc.Client, state: dict[str, torch.Tensor], ptrs: dict[str, dict[str, int]] | None = None) -> None:
    for r, rank in enumerate(RANKS):
        got = engine(c, rank, "test.digests")
        assert {n: g["digest"] for n, g in got.items()} == {n: digest(rank_slice(n, t, r)) for n, t in state.items()}
        if ptrs is not None:
            assert {n: g["ptr"] for n, g in got.items()} == ptrs[rank]  # swapped in place, never reallocated


def addresses(c: tc.Client) -> dict[str, dict[str, int]]:
    return {rank: {n: g["ptr"] for n, g in engine(c, rank, "test.digests").items()} for rank in RANKS}


def active(c: tc.Client) -> list[int | None]:
    return [engine(c, rank, "weights.status")["active_version"] for rank in RANKS]


def shm_received(cluster: LocalCluster, worker: str) -> float:
    text = urllib.request.urlopen(cluster.metrics_urls[worker] + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(r'tensorcast_transport_bytes(_total)?\{', line)
               and 'transport="shm"' in line and 'direction="received"' in line)


def wait_until(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sync() -> Iterator[tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]]]:
    with running_cluster(workers=2, hosts=2) as cluster:
        published: dict[int, dict[str, torch.Tensor]] = {}
        with tc.connect(cluster.workers["w0"].address) as trainer:
            published[trainer.publisher(MODEL).publish(qwen_state(1)).version] = qwen_state(1)
        with concurrent.futures.ThreadPoolExecutor(len(RANKS)) as pool:  # the ranks live on the other host
            starts = [pool.submit(cluster.start_instance, rank, "w1",
                                  ["--model", MODEL, "--rank", str(r), "--world", "2", "--host-id",
                                   cluster.host_id_of(1)], module="tensorcast.testing.weight_rank")
                      for r, rank in enumerate(RANKS)]
            for start in starts:
                start.result()
        yield cluster, published


@pytest.fixture()
def clients(sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]]) -> Iterator[tuple[tc.Client, tc.Client]]:
    cluster, _ = sync
    with tc.connect(cluster.workers["w0"].address) as trainer, tc.connect(cluster.workers["w1"].address) as ctl:
        yield trainer, ctl  # the controller's gateway (which runs the plans) is w1


def test_group_swaps_delta_and_gc(sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]],
                                  clients: tuple[tc.Client, tc.Client]) -> None:
    cluster, published = sync
    trainer, ctl = clients
    pub = trainer.publisher(MODEL, keep_last=2)
    ctl.group_swap(RANKS, MODEL, 1, expected=0, timeout=60)
    assert active(ctl) == [1, 1]
    ptrs = addresses(ctl)
    assert_holds(ctl, published[1], ptrs)
    again = ctl.group_swap(RANKS, MODEL, 1, timeout=60)  # a repeated swap: every rank is on it already
    assert again.version == 1 and active(ctl) == [1, 1]
    assert all(r["phase"] == "active" and r["status"] == "noop" for r in again.ranks.values())

    published[2] = {n: t + 1.0 for n, t in published[1].items()}  # every tensor changes
    assert pub.publish(published[2]).version == 2
    result = ctl.group_swap(RANKS, MODEL, expected=1, timeout=60)  # the newest
    assert result.version == 2 and active(ctl) == [2, 2]
    assert_holds(ctl, published[2], ptrs)
    # Both ranks stage through w1: it pulled the whole version once, and each rank sliced it there (a rank
    # that starts after the other's pull finished finds the version on its host: "local").
    paths = [r["path"] for r in result.ranks.values()]
    assert result.fetch == "whole" and "via w1 (whole)" in paths and set(paths) <= {"via w1 (whole)", "local"}
    # Blobs are content-addressed: equal tensors are one blob, and w1 holds version 1's already.
    held = {digest(t) for t in published[1].values()}
    new_blobs = sum(n for d, n in {digest(t): t.nbytes for t in published[2].values()}.items() if d not in held)
    assert new_blobs <= sum(r["fetched_bytes"] for r in result.ranks.values()) <= new_blobs + 64  # + version tag

    # A delta version: 10% of the tensors change. Only they are copied into the pool, moved and copied in.
    names = sorted(n for n in published[2] if n.endswith(("q_proj.weight", "down_proj.weight", "up_proj.weight")))
    changed = names[: max(1, len(published[2]) // 10)]
    published[3] = {n: (t * 2 if n in changed else t) for n, t in published[2].items()}
    before = shm_received(cluster, "w0")
    p3 = pub.publish(published[3])
    assert (p3.version, p3.changed_tensors) == (3, len(changed))
    assert p3.changed_bytes == sum(published[3][n].nbytes for n in changed)
    written = shm_received(cluster, "w0") - before
    # Plus the version tag's few bytes and the delta record (v3 is a delta from v2: which chunks changed).
    assert p3.delta_base == 2 and p3.delta_bytes == p3.changed_bytes  # whole tensors changed: all their chunks
    meta = p3.changed_bytes + 64 + trainer.artifact(p3.key).meta(DELTA_TENSOR).nbytes
    assert p3.changed_bytes <= written <= meta
    assert p3.deleted == (1,) and pub.versions() == [2, 3]  # v1: beyond keep_last, unused
    result = ctl.group_swap(RANKS, MODEL, 3, expected=2, timeout=60)
    for r, rank in enumerate(RANKS):
        report = result.ranks[rank]
        assert (report["phase"], report["changed"]) == ("active", len(changed))
        assert report["copied_bytes"] == sum(rank_slice(n, published[3][n], r).nbytes for n in changed)
    # Only the changed tensors crossed to w1 (it held the rest from version 2).
    assert p3.changed_bytes <= sum(r["fetched_bytes"] for r in result.ranks.values()) <= meta
    assert_holds(ctl, published[3], ptrs)

    # GC keeps keep_last versions plus those bindings use.
    for v in (4, 5):
        published[v] = {n: t + 0.5 for n, t in published[v - 1].items()}
        pub.publish(published[v])
    assert pub.versions() == [3, 4, 5] and pub.in_use() == {3: tuple(RANKS)}
    result = ctl.group_swap(RANKS, MODEL, 5, expected=3, timeout=60, fetch="view")  # each rank's slices only
    for r, rank in enumerate(RANKS):
        report = result.ranks[rank]
        want = sum(rank_slice(n, t, r).nbytes for n, t in published[5].items())
        # At most its slices (equal slices of equal tensors are one blob): never the other rank's.
        assert (report["path"], report["copied_bytes"]) == ("via w1", want) and 0 < report["fetched_bytes"] <= want
    assert_holds(ctl, published[5], ptrs)
    wait_until(lambda: pub.in_use() == {5: tuple(RANKS)}, "the ranks to release version 3")
    assert pub.gc() == (3,) and pub.versions() == [4, 5]


def test_failed_prepare_or_stale_cas_keeps_the_group_and_a_retry_succeeds(
        sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]], clients: tuple[tc.Client, tc.Client]) -> None:
    _, published = sync
    trainer, ctl = clients
    old = max(published)
    assert active(ctl) == [old, old]
    ptrs = addresses(ctl)
    new = trainer.publisher(MODEL).publish({n: t - 1.0 for n, t in published[old].items()}).version
    published[new] = {n: t - 1.0 for n, t in published[old].items()}

    with pytest.raises(SwapAborted, match="VERSION_CONFLICT"):
        ctl.group_swap(RANKS, MODEL, new, expected=old - 1, timeout=60)
    with pytest.raises(InvalidArgument, match="fetch must be one of"):
        ctl.group_swap(RANKS, MODEL, new, expected=old, timeout=60, fetch="all")
    engine(ctl, RANKS[1], "test.fault", mode="fail", count=1)
    with pytest.raises(SwapAborted, match="injected prepare failure"):
        ctl.group_swap(RANKS, MODEL, new, expected=old, timeout=60)
    assert active(ctl) == [old, old]
    assert all(engine(ctl, rank, "weights.status")["staged"] is None for rank in RANKS)  # aborted everywhere
    assert_holds(ctl, published[old], ptrs)

    ctl.group_swap(RANKS, MODEL, new, expected=old, timeout=60)
    assert active(ctl) == [new, new]
    assert_holds(ctl, published[new], ptrs)


def test_source_worker_killed_mid_swap(sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]],
                                       tmp_path: Path) -> None:
    cluster, published = sync
    old = max(published)
    with tc.connect(cluster.workers["w0"].address) as trainer:
        new = trainer.publisher(MODEL, policy="durable").publish({n: t * 3 for n, t in published[old].items()}).version
    published[new] = {n: t * 3 for n, t in published[old].items()}
    release = tmp_path / "go"
    with tc.connect(cluster.workers["w1"].address) as ctl, concurrent.futures.ThreadPoolExecutor(1) as pool:
        ptrs = addresses(ctl)
        engine(ctl, RANKS[1], "test.fault", mode="hold", path=str(release))  # rank 1 waits before fetching
        # Each rank fetches its own slices from w0 (with "whole", rank 0 would bring rank 1's too).
        swap = pool.submit(ctl.group_swap, RANKS, MODEL, new, expected=old, timeout=60, fetch="view")
        wait_until(lambda: (engine(ctl, RANKS[0], "weights.status")["staged"] or {}).get("version") == new,
                   "rank 0 to prepare")
        cluster.kill_worker("w0")  # the only holder of the new version, while rank 1 has not fetched it
        release.touch()
        # UNAVAILABLE: its source refused the connection; NOT_FOUND: the store declared it dead meanwhile.
        with pytest.raises(SwapAborted, match=r"rank eng-r1 failed to prepare: (UNAVAILABLE|NOT_FOUND)"):
            swap.result(timeout=60)
        assert active(ctl) == [old, old]
        assert engine(ctl, RANKS[0], "weights.status")["staged"] is None  # rank 0 dropped what it had staged
        assert_holds(ctl, published[old], ptrs)

        cluster.restart_worker("w0")  # its disk copy of the version comes back
        wait_until(lambda: any(r.alive for r in ctl.artifact(f"{MODEL}@v{new}").replicas), "the version's replica")
        ctl.group_swap(RANKS, MODEL, new, expected=old, timeout=60)
        assert active(ctl) == [new, new]
        assert_holds(ctl, published[new], ptrs)


def test_stale_cas_and_wait_newer_in_process(sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]]) -> None:
    cluster, _ = sync
    with tc.connect(cluster.workers["w0"].address) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pub = c.publisher("cas-model")
        v1 = pub.publish({"w": torch.ones(4, 4)}).version
        target = {"w": torch.zeros(4, 4)}
        binding = c.bind("cas-model", into=target)
        assert binding.swap(expected=0).version == v1 and torch.equal(target["w"], torch.ones(4, 4))
        waiter = pool.submit(binding.wait_newer, 30)
        v2 = pub.publish({"w": torch.full((4, 4), 2.0)}).version
        assert waiter.result(timeout=30) == v2
        with pytest.raises(VersionConflict):
            binding.swap(v2, expected=v2 + 5)
        assert binding.active_version == v1 and torch.equal(target["w"], torch.ones(4, 4))
        assert binding.swap(v2, expected=v1).status == "activated" and torch.equal(target["w"], torch.full((4, 4), 2.0))
        assert binding.swap(v2, expected=v1).status == "noop"  # a retried swap: already there
        assert pub.wait_newer(v2, timeout=0.2) is None
        binding.close()
        assert pub.in_use() == {}


def test_transformers_model_swapped_in_place_generates_like_a_fresh_load(
        sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]]) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tensorcast.instance.binding import BindingAdaptor
    from tensorcast.instance.hf import HFCausalLMAdaptor

    cluster, _ = sync
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(10)
    trained = Qwen2ForCausalLM(cfg)
    torch.manual_seed(11)
    serving = Qwen2ForCausalLM(cfg).eval()  # other weights until the first swap
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 1]])
    addresses = {n: p.data_ptr() for n, p in serving.named_parameters()}
    with tc.connect(cluster.workers["w0"].address) as c:
        pub = c.publisher("hf-qwen")
        binding = c.bind("hf-qwen", into=serving)  # the module's state_dict: its parameters, in place
        engine = HFCausalLMAdaptor(serving)
        adaptor = BindingAdaptor(binding, inner=engine)  # what serve_binding serves: weights + the engine
        for step in range(2):
            with torch.no_grad():  # a training step
                for p in trained.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            version = pub.publish(trained.state_dict()).version
            if step == 0:
                assert binding.swap().version == version
            else:  # the commands a group swap sends; the engine learns that its weights changed
                fingerprint = engine.kv_layout().model_id
                adaptor.engine_command("weights.prepare", {"version": version, "swap_id": "s2", "expected": 1})
                assert adaptor.engine_command("weights.activate", {"swap_id": "s2"})["status"] == "activated"
                assert engine.kv_layout().model_id != fingerprint
                assert adaptor.engine_command("weights.status", {})["active_version"] == version
            fresh = Qwen2ForCausalLM(cfg).eval()
            weights = c.artifact(f"hf-qwen@v{version}").tensor_dict()
            fresh.load_state_dict({n: t for n, t in weights.items() if n in fresh.state_dict()})
            with torch.no_grad():
                assert torch.equal(serving(prompt).logits, fresh(prompt).logits)
            kw = {"max_new_tokens": 8, "do_sample": False, "attention_mask": torch.ones_like(prompt)}
            assert torch.equal(serving.generate(prompt, **kw), fresh.generate(prompt, **kw))
            assert {n: p.data_ptr() for n, p in serving.named_parameters()} == addresses
        ids = [int(t) for t in prompt[0]]
        assert adaptor.engine_command("prefill", {"request_id": "r", "input_ids": ids})["logits"]  # the engine's
        binding.close()


def test_composed_tensors_and_copy_staging(sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]]) -> None:
    """An engine's fused parameter (here: rank 1's rows of ``a`` then of ``b``, plus a padding row) bound with
    ``sources``; ``staging="copy"`` stages private copies while fetching; a delta swap copies only ``b``."""
    cluster, _ = sync
    a, b = torch.arange(12.0).reshape(3, 4), torch.arange(8.0).reshape(2, 4) + 100
    fused, norm = torch.full((3, 4), -1.0), torch.zeros(4)
    with tc.connect(cluster.workers["w0"].address) as c:
        pub = c.publisher("fused-model")
        pub.publish({"a": a, "b": b, "norm": torch.ones(4)})
        binding = c.bind("fused-model", into={"fused": fused, "norm": norm}, tp=tc.TP(1, 2),
                         rules={"a": 0, "b": 0, "*": "replicated"}, sources={"fused": ["a", "b"]}, staging="copy")
        report = binding.swap()
        assert (report.changed, report.status) == (3, "activated")
        assert torch.equal(fused, torch.stack([a[2], b[1], torch.full((4,), -1.0)]))  # the padding row is kept
        assert torch.equal(norm, torch.ones(4))
        pub.publish({"a": a, "b": b * 2, "norm": torch.ones(4)})
        report = binding.swap()
        assert (report.changed, report.unchanged, report.copied_bytes) == (1, 2, 16)
        assert torch.equal(fused[1], b[1] * 2) and torch.equal(fused[0], a[2])
        # A staged swap skips what is unchanged; if another swap changed those tensors meanwhile, it is refused.
        pub.publish({"a": a, "b": b * 3, "norm": torch.ones(4)})
        staged = binding.prepare(swap_id="late")
        binding.inner.held[("fused", "a")] = ("changed by another swap", ())
        with pytest.raises(tc.errors.SwapAborted, match="prepare it again"):
            binding.activate(staged.swap_id)
        assert binding.status()["staged"] is None and torch.equal(fused[1], b[1] * 2)
        with pytest.raises(tc.errors.InvalidArgument, match="cannot take"):
            c.bind("fused-model", into={"fused": torch.zeros(1, 4)}, tp=tc.TP(1, 2), rules={"*": 0},
                   sources={"fused": ["a", "b"]}).swap()


def test_a_binding_of_some_tensors_fetches_views_even_when_asked_for_whole(
        sync: tuple[LocalCluster, dict[int, dict[str, torch.Tensor]]]) -> None:
    """A pipeline stage's binding (some of the version's tensors) on host B: ``fetch="whole"`` would make its
    worker pull the other stages' tensors too, so it fetches its views; a binding of every tensor pulls whole."""
    cluster, _ = sync
    full = {"stage0": torch.arange(64.0).reshape(8, 8), "stage1": torch.arange(64.0).reshape(8, 8) + 1000}
    on_b = tc.Config.load(overrides={"client.host_id": cluster.host_id_of(1)})
    with tc.connect(cluster.workers["w0"].address) as trainer, \
            tc.connect(cluster.workers["w1"].address, config=on_b) as rank:
        trainer.publisher("staged-model").publish(full)
        part = {"stage0": torch.zeros(4, 8)}
        report = rank.bind("staged-model", into=part, tp=tc.TP(0, 2), rules={"*": 0}).swap(fetch="whole")
        assert report.path == "via w1" and report.fetched_bytes == part["stage0"].nbytes
        assert torch.equal(part["stage0"], full["stage0"][:4])
        both = {"stage0": torch.zeros(4, 8), "stage1": torch.zeros(4, 8)}
        report = rank.bind("staged-model", into=both, tp=tc.TP(1, 2), rules={"*": 0}).swap(fetch="whole")
        whole = sum(t.nbytes for t in full.values())
        assert report.path == "via w1 (whole)" and whole <= report.fetched_bytes <= whole + 64  # + the version tag
        assert all(torch.equal(both[n], full[n][4:]) for n in full)
        with pytest.raises(InvalidArgument, match="fetch must be one of"):
            rank.bind("staged-model", into=part, tp=tc.TP(0, 2), rules={"*": 0}).prepare(fetch="all")
