"""Calibration end to end: a cost model fitted to the noisy per-call samples of one run reproduces that run's
TTFTs (the same sessions, issue times and policies) within the stated error, and a wrong model does not.

The "measured" run here is itself simulated with a known model, so that the test needs no live engines; the
samples are what a live run records (a prefill's computed and cached tokens and seconds, a turn's decoding in
one call), with +-10% noise. What it checks is the loop ``rebalance.py --fit`` then ``--check`` runs on a live
run's JSON: samples in, a model out, the same turns re-simulated, medians compared."""

from __future__ import annotations

import dataclasses

import numpy as np

from tensorcast.policies import LoadAwareShared, PowerOfTwo, StickySessions
from tensorcast.sim import CostModel, DecodeSample, Policy, PrefillSample, Replay, SimConfig, SimResult, fit, simulate
from tensorcast.workloads import AgentWorkload, Session

TRUE = CostModel(prefill_base_s=0.002, prefill_per_token_s=8e-6, prefill_per_token2_s=7e-9, prefill_per_cached_s=2.5e-8,
                 decode_base_s=0.001, decode_per_seq_s=0.0, decode_per_context_s=2.5e-7, decode_per_request_s=0.003,
                 kv_bytes_per_token=1031, transfer_bandwidth=7e8, transfer_latency_s=0.0035)
LIVE_SHAPE = SimConfig(instances=4, max_batch=1, kv_capacity_tokens=1 << 22, block_tokens=16,
                       max_prefill_tokens=1 << 22, cost=TRUE, prefix_sharing=False, load_signal="sessions")
POLICIES = {"power-of-two": lambda: Policy("power-of-two", PowerOfTwo(seed=0)),
            "sticky+shared": lambda: Policy("sticky+shared", StickySessions(LoadAwareShared()), shared_kv=True)}


def sessions() -> list[Session]:
    """16 agent sessions started 0.05 s apart, each turn issued 0.2 s after the previous one was issued."""
    drawn = AgentWorkload(gaps="fast", scale=0.1, mean_turns=6, max_turns=12, seed=3).sessions(16)
    return [Session(s.session_id, tuple(dataclasses.replace(t, arrival_s=0.05 * k + 0.2 * t.turn) for t in s.turns))
            for k, s in enumerate(drawn)]


def run(name: str, cost: CostModel) -> SimResult:
    return simulate(POLICIES[name](), Replay(sessions()), dataclasses.replace(LIVE_SHAPE, cost=cost), seed=0)


def samples(result: SimResult, rng: np.random.Generator) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """What a live run of these turns would have measured, each call's time off by up to +-10%."""
    prefill, decode = [], []
    for t in result.turns:
        cached = t.local_hit_tokens + t.store_hit_tokens
        noise = 1 + 0.1 * rng.uniform(-1, 1, 2)
        prefill.append(PrefillSample(t.prompt_tokens - cached, cached,
                                     TRUE.prefill_s(t.prompt_tokens - cached, cached) * noise[0]))
        if t.output_tokens > 1:
            steps = t.output_tokens - 1
            decode.append(DecodeSample(1, t.prompt_tokens, TRUE.decode_s(steps, 1, t.prompt_tokens) * noise[1],
                                       steps=steps))
    return prefill, decode


def median_errors(cost: CostModel) -> list[float]:
    out = []
    for name in POLICIES:
        measured, again = run(name, TRUE), run(name, cost)
        out.append(abs(again.summary()["median_ttft_s"] / measured.summary()["median_ttft_s"] - 1))
    return out


def test_a_model_fitted_to_a_runs_samples_reproduces_its_ttfts() -> None:
    rng = np.random.default_rng(0)
    prefill: list[PrefillSample] = []
    decode: list[DecodeSample] = []
    for name in POLICIES:
        p, d = samples(run(name, TRUE), rng)
        prefill += p
        decode += d
    fitted = fit(prefill, decode, base=TRUE)
    assert fitted.prefill_error.median < 0.15 and fitted.decode_error.median < 0.15
    errors = median_errors(fitted.model)
    assert max(errors) < 0.15, errors
    # The check can fail: a model that prices prefill at half the measured speed misses by far more.
    slow = dataclasses.replace(fitted.model, prefill_per_token_s=2 * fitted.model.prefill_per_token_s,
                               prefill_base_s=2 * fitted.model.prefill_base_s)
    assert min(median_errors(slow)) > 0.3
