"""The simulated cluster (``tensorcast.testing.sim``): the failover scenarios of the real-process KV tests in
virtual time (well under a second each), a few hundred seeded runs (KV pages and durable artifacts) with every
invariant checked after every step, and proof that the checker catches a broken home. The artifact scenarios
are in ``test_sim_artifacts``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorcast import clock
from tensorcast.kv.keys import page_keys, shard_of
from tensorcast.kv.leases import HomeLeases
from tensorcast.testing.sim import (
    Checker,
    InvariantBroken,
    SimCluster,
    SimSettings,
    page_for,
    run_seed,
    settle,
    simulate,
)
from tensorcast.testing.sim.checker import lease_table
from tensorcast.testing.sim.scenario import LAYOUT

SETTINGS = SimSettings(homes=3, num_shards=16, lease_ttl=3.0, renew_interval=1.0)


def keys(n: int, seq: int = 0) -> list[str]:
    return page_keys([seq * 10_000 + i for i in range(n)], LAYOUT)


async def put(cluster: SimCluster, checker: Checker, ks: list[str]) -> None:
    kv = cluster.clients[0] if cluster.clients else cluster.client()
    assert await kv.put(ks, [page_for(k) for k in ks]) == len(ks)
    checker.acked.update(ks)


async def readable(cluster: SimCluster, checker: Checker, ks: list[str]) -> int:
    return checker.read(ks, await cluster.clients[0].get(ks))


def holder_of(cluster: SimCluster, key: str) -> tuple[str, int]:
    holder, token, _ = lease_table(cluster)[shard_of(key, cluster.settings.num_shards)]
    return holder, token


def test_a_killed_home_s_shards_move_within_a_lease_ttl_under_fresh_tokens() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        ks = keys(64)
        await put(cluster, checker, ks)
        victim = cluster.workers["w1"]
        mine = {shard_of(k, 16): holder_of(cluster, k)[1] for k in ks if holder_of(cluster, k)[0] == "w1"}
        assert mine
        killed = clock.monotonic()
        checker.killed(victim)
        victim.kill()
        await settle(cluster)
        moved = clock.monotonic() - killed
        table = lease_table(cluster)
        assert all(table[s][1] > t and table[s][0] != "w1" for s, t in mine.items())
        assert moved <= SETTINGS.lease_ttl + SETTINGS.renew_interval + 1.5, moved  # virtual seconds, exactly
        assert await readable(cluster, checker, ks) == len(ks) - len(checker.at_risk & set(ks))

    simulate(1, body, SETTINGS)


def test_a_paused_home_is_fenced_off_and_its_pages_are_not_served_when_it_wakes() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        ks = keys(48)
        await put(cluster, checker, ks)
        paused = cluster.workers["w2"]
        checker.risk(paused)
        cluster.pause(paused)
        await asyncio.sleep(2 * SETTINGS.lease_ttl)  # its leases expire meanwhile; others take its shards
        cluster.resume(paused)
        assert not any(paused.home.served.token(s) for s in range(16))  # it refuses at once on waking
        await settle(cluster)
        await readable(cluster, checker, ks)  # no wrong bytes (the checker fences every answer meanwhile)

    simulate(2, body, SETTINGS)


def test_a_global_store_outage_within_the_lease_ttl_loses_nothing() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        ks = keys(200)
        await put(cluster, checker, ks)
        cluster.kill_gs()
        await asyncio.sleep(2.0)
        cluster.restart_gs()
        await settle(cluster)
        assert await readable(cluster, checker, ks) == len(ks)

    simulate(3, body, SETTINGS)


def test_a_joining_worker_takes_its_shards_with_their_pages() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        ks = keys(200)
        await put(cluster, checker, ks)
        new = await cluster.add_worker()
        await settle(cluster)
        assert await readable(cluster, checker, ks) == len(ks)
        assert new.home.store.index and new.home.handover.pulled > 0

    simulate(4, body, SETTINGS)


def test_a_drained_worker_hands_every_page_over() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        ks = keys(200)
        await put(cluster, checker, ks)
        t0 = clock.monotonic()
        assert await cluster.workers["w0"].drain() == 0
        assert clock.monotonic() - t0 < SETTINGS.lease_ttl + 2 * SETTINGS.renew_interval
        await settle(cluster)
        assert await readable(cluster, checker, ks) == len(ks)

    simulate(5, body, SETTINGS)


def test_with_two_replicas_a_killed_home_loses_nothing() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        ks = keys(200)
        await put(cluster, checker, ks)
        await asyncio.sleep(2 * SETTINGS.renew_interval)  # backups filled for the shards served since start
        cluster.workers["w0"].kill()
        await settle(cluster)
        assert await readable(cluster, checker, ks) == len(ks)

    simulate(6, body, SimSettings(homes=3, num_shards=16, replicas=2))


def test_hundreds_of_seeds_keep_every_promise(tmp_path: Path) -> None:
    """Each seed: faults of its choosing for 20 virtual seconds, then everything healed and read back."""
    out = tmp_path / "seeds.json"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    run = subprocess.run([sys.executable, "-m", "tensorcast.testing.sim", "--seeds", "0-199", "--fault-seconds",
                          "20", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["seeds"]
    assert len(rows) == 200 and all(r["ok"] for r in rows)
    assert sum(r["acked"] - r["at_risk"] for r in rows) > 10_000  # pages that had to survive, and did
    assert sum(r["artifacts"] for r in rows) > 800  # durable artifact keys that had to be readable, and were
    assert sum(r["checks"] for r in rows) > 100_000


def test_a_seed_replays_exactly(tmp_path: Path) -> None:
    """Given the hash seed the runner fixes, a seed is the same run every time: its faults, what was
    acknowledged, every check."""
    outcomes = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        subprocess.run([sys.executable, "-m", "tensorcast.testing.sim", "--seed", "7", "--fault-seconds", "10",
                        "--json", str(out)], check=True, capture_output=True, timeout=120)
        outcomes.append(json.loads(out.read_text())["seeds"])
    assert outcomes[0] == outcomes[1] and outcomes[0][0]["faults"]


@pytest.mark.parametrize("bug", ["keeps serving after stepping down", "serves a handed-over shard at once"])
def test_the_checker_catches_a_broken_home(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if bug == "keeps serving after stepping down":
        monkeypatch.setattr(HomeLeases, "lost", lambda self, shard: None)
    else:
        import tensorcast.kv.home as home
        monkeypatch.setattr(home, "serve_at_once", lambda kept, token, me: True)
    for seed in range(40):
        try:
            run_seed(seed, fault_seconds=20)
        except InvariantBroken as exc:
            assert str(seed) in str(exc)
            return
    pytest.fail(f"a home that {bug} was not caught in 40 seeds")
