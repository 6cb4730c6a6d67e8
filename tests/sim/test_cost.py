"""The simulator's cost model: its arithmetic, its JSON form, and the fit recovering known coefficients from
synthetic samples with its error reported on held-out samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.sim import (
    CostModel,
    DecodeSample,
    OverheadSample,
    PrefillSample,
    busy_overlap,
    fit,
    fit_overheads,
    fit_transfer,
    relative_errors,
)

TRUE = CostModel(prefill_base_s=0.05, prefill_per_token_s=1.5e-3, prefill_per_token2_s=3e-7,
                 prefill_per_cached_s=1e-7, decode_base_s=0.025, decode_per_seq_s=1.2e-3,
                 decode_per_context_s=3e-7)


def samples(model: CostModel, n: int, noise: float, seed: int) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """Prefills and decode steps spread over the shapes a live run sees, times multiplied by 1 +- noise."""
    rng = np.random.default_rng(seed)
    prefill, decode = [], []
    for _ in range(n):
        L, C = int(rng.integers(1, 4096)), int(rng.integers(0, 8192))
        prefill.append(PrefillSample(L, C, model.prefill_s(L, C) * (1 + noise * rng.standard_normal())))
        B = int(rng.integers(1, 33))
        ctx = B * int(rng.integers(64, 4096))
        decode.append(DecodeSample(B, ctx, model.decode_step_s(B, ctx) * (1 + noise * rng.standard_normal())))
    return prefill, decode


def test_costs_are_the_formulas() -> None:
    m = CostModel(prefill_base_s=0.1, prefill_per_token_s=0.01, prefill_per_token2_s=1e-4, prefill_per_cached_s=1e-5,
                  decode_base_s=0.02, decode_per_seq_s=0.003, decode_per_context_s=1e-6, kv_bytes_per_token=1000,
                  transfer_bandwidth=1e6, transfer_latency_s=0.001)
    assert m.prefill_s(100, 50) == pytest.approx(0.1 + 1.0 + 1.0 + 0.05)
    assert m.decode_step_s(4, 2000) == pytest.approx(0.02 + 0.012 + 0.002)
    assert m.kv_bytes(300) == 300_000
    assert m.transfer_s(300) == pytest.approx(0.001 + 0.3)
    assert m.move_s(300) == pytest.approx(3 * 0.301)


def test_fit_recovers_noise_free_coefficients_exactly() -> None:
    prefill, decode = samples(TRUE, 40, 0.0, seed=1)
    result = fit(prefill, decode)
    for name in ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s", "prefill_per_cached_s",
                 "decode_base_s", "decode_per_seq_s", "decode_per_context_s"):
        assert getattr(result.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert result.prefill_error.median < 1e-9 and result.decode_error.p90 < 1e-9
    assert result.prefill_error.samples == 10 and result.decode_error.samples == 10  # 25% held out


def test_fit_with_noise_is_close_and_reports_held_out_error() -> None:
    prefill, decode = samples(TRUE, 400, 0.03, seed=2)
    result = fit(prefill, decode, seed=7)
    m = result.model
    assert m.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.05)
    assert m.prefill_per_token2_s == pytest.approx(TRUE.prefill_per_token2_s, rel=0.1)
    assert m.prefill_per_cached_s == pytest.approx(TRUE.prefill_per_cached_s, rel=0.1)
    assert m.decode_base_s == pytest.approx(TRUE.decode_base_s, rel=0.05)
    assert m.decode_per_context_s == pytest.approx(TRUE.decode_per_context_s, rel=0.1)
    # 3% noise: the held-out relative error is the noise, about 0.67 * 3% at the median and 1.64 * 3% at p90.
    assert 0.005 < result.prefill_error.median < 0.04 and result.prefill_error.p90 < 0.08
    assert 0.005 < result.decode_error.median < 0.04 and result.decode_error.p90 < 0.08
    assert result.model.kv_bytes_per_token == CostModel().kv_bytes_per_token  # untouched by the fit


def test_fit_uses_given_held_out_samples_and_keeps_the_base_transfer_terms() -> None:
    prefill, decode = samples(TRUE, 30, 0.01, seed=3)
    test_prefill, test_decode = samples(TRUE, 12, 0.01, seed=4)
    base = CostModel(kv_bytes_per_token=4096, transfer_bandwidth=5e9)
    result = fit(prefill, decode, base=base, test_prefill=test_prefill, test_decode=test_decode)
    assert result.prefill_error.samples == 12 and result.decode_error.samples == 12
    assert result.model.kv_bytes_per_token == 4096 and result.model.transfer_bandwidth == 5e9


def test_fit_never_returns_negative_coefficients() -> None:
    # No quadratic or cached-context term, and noise: unconstrained least squares would go negative on some.
    flat = CostModel(prefill_base_s=0.01, prefill_per_token_s=2e-3, prefill_per_token2_s=0.0,
                     prefill_per_cached_s=0.0, decode_base_s=0.03, decode_per_seq_s=0.0, decode_per_context_s=0.0)
    prefill, decode = samples(flat, 60, 0.05, seed=5)
    m = fit(prefill, decode).model
    assert min(m.to_dict().values()) >= 0
    assert m.prefill_per_token_s == pytest.approx(2e-3, rel=0.1)
    assert m.decode_base_s == pytest.approx(0.03, rel=0.1)


def test_fit_refuses_bad_samples() -> None:
    prefill, decode = samples(TRUE, 10, 0.0, seed=6)
    with pytest.raises(InvalidArgument):
        fit(prefill[:3], decode)
    with pytest.raises(InvalidArgument):
        fit([*prefill, PrefillSample(10, 0, 0.0)], decode)
    with pytest.raises(InvalidArgument):
        fit(prefill, decode, test_fraction=1.0)
    with pytest.raises(InvalidArgument):
        fit(prefill, decode, test_decode=[])


def test_relative_errors() -> None:
    err = relative_errors([1.1, 2.0, 2.7], [1.0, 2.0, 3.0])
    assert err.samples == 3 and err.median == pytest.approx(0.1)
    assert np.isnan(relative_errors([], []).median)


def test_the_model_round_trips_through_json_and_refuses_nonsense() -> None:
    m = CostModel(prefill_per_token_s=1e-3, kv_bytes_per_token=2048)
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert CostModel.from_dict({"decode_base_s": 0.5}).decode_base_s == 0.5
    with pytest.raises(InvalidArgument):
        CostModel.from_dict({"prefill_per_tokens": 1.0})
    with pytest.raises(InvalidArgument):
        CostModel.from_dict({"decode_base_s": "fast"})
    with pytest.raises(InvalidArgument):
        CostModel(decode_base_s=-1.0)
    with pytest.raises(InvalidArgument):
        CostModel(transfer_bandwidth=0.0)


def test_busy_overlap_counts_each_other_instance_by_the_share_of_the_window_it_was_busy() -> None:
    others = {"a": [(0.0, 1.0), (0.5, 2.0)],  # overlapping turns of one instance count once: busy 0-2
              "b": [(3.0, 4.0)],             # wholly outside
              "c": [(1.5, 10.0)]}
    assert busy_overlap(1.0, 3.0, others) == pytest.approx(0.5 + 0.0 + 0.75)
    assert busy_overlap(2.0, 2.0, others) == 0.0
    assert busy_overlap(0.0, 1.0, {}) == 0.0


def test_fit_recovers_contention_and_the_per_request_decode_setup() -> None:
    true = CostModel(prefill_base_s=0.004, prefill_per_token_s=1.2e-5, prefill_per_token2_s=8e-9,
                     prefill_per_cached_s=3e-8, decode_base_s=0.002, decode_per_seq_s=0.0, decode_per_context_s=3.5e-7,
                     decode_per_request_s=0.003, prefill_contention=0.3, decode_contention=0.15)
    rng = np.random.default_rng(4)
    prefill, decode = [], []
    for _ in range(120):
        L, C, busy = int(rng.integers(1, 2048)), int(rng.integers(0, 4096)), float(rng.uniform(0, 3))
        prefill.append(PrefillSample(L, C, true.prefill_s(L, C, busy), busy))
        steps, ctx = int(rng.integers(1, 20)), int(rng.integers(64, 4096))
        decode.append(DecodeSample(1, ctx, true.decode_s(steps, 1, ctx, busy), busy, steps=steps))
    result = fit(prefill, decode)
    m = result.model
    assert m.prefill_contention == pytest.approx(0.3) and m.decode_contention == pytest.approx(0.15)
    assert m.decode_per_request_s == pytest.approx(0.003, rel=1e-6)
    assert m.decode_base_s == pytest.approx(0.002, rel=1e-6)
    assert result.prefill_error.median < 1e-9 and result.decode_error.median < 1e-9
    # Without the contention term the same samples fit worse: it is what explains their spread.
    alone = fit([PrefillSample(s.uncached, s.cached, s.seconds) for s in prefill],
                [DecodeSample(s.batch, s.context_tokens, s.seconds, steps=s.steps) for s in decode])
    assert alone.model.prefill_contention == 0.0 and alone.prefill_error.median > 0.05


def test_call_overheads_are_charged_and_fitted() -> None:
    m = CostModel(request_overhead_s=0.003, store_base_s=0.004, store_per_token_s=3e-6)
    assert m.overhead_s(1000, shared_store=False) == pytest.approx(0.003)
    assert m.overhead_s(1000, shared_store=True) == pytest.approx(0.003 + 0.004 + 0.003)
    rng = np.random.default_rng(5)
    samples = [OverheadSample(n, shared, m.overhead_s(n, shared) * (1 + 0.02 * rng.standard_normal()))
               for n in rng.integers(1, 3000, 200) for shared in (False, True)]
    o, s0, s1 = fit_overheads(samples)
    assert o == pytest.approx(0.003, rel=0.05)
    assert s0 == pytest.approx(0.004, rel=0.1) and s1 == pytest.approx(3e-6, rel=0.1)
    with pytest.raises(InvalidArgument, match="with and without"):
        fit_overheads([s for s in samples if s.shared_store])
    # Measured while other instances were busy: fitted for an instance alone, as the simulator slows them down.
    k = 0.2
    busy = [OverheadSample(x.computed, x.shared_store, x.seconds * (1 + k * b), b)
            for x, b in zip(samples, rng.uniform(0, 3, len(samples)), strict=True)]
    o2, s02, s12 = fit_overheads(busy, contention=k)
    assert (o2, s02, s12) == pytest.approx((o, s0, s1), rel=1e-6)


def test_a_copys_latency_and_bandwidth_are_fitted_from_reads() -> None:
    rng = np.random.default_rng(3)
    sizes = [int(b) for b in rng.integers(10_000, 5_000_000, 40)]
    exact = [(b, 0.003 + b / 7e8) for b in sizes]
    latency, bandwidth = fit_transfer(exact, 2e9)
    assert latency == pytest.approx(0.003) and bandwidth == pytest.approx(7e8)
    noisy = [(b, t * (1 + 0.05 * rng.standard_normal())) for b, t in exact]
    latency, bandwidth = fit_transfer(noisy, 2e9)
    assert latency == pytest.approx(0.003, rel=0.3) and bandwidth == pytest.approx(7e8, rel=0.2)
    # Reads all of one size cannot tell latency from bandwidth: the given bandwidth is kept.
    assert fit_transfer([(1_000_000, 0.004)] * 5, 1e9) == (pytest.approx(0.003), 1e9)
    # Bigger reads that took less time (noise): no negative cost per byte, the given bandwidth is kept.
    latency, bandwidth = fit_transfer([(1000, 0.005), (2_000_000, 0.004), (4_000_000, 0.003)], 1e9)
    assert bandwidth == 1e9 and latency >= 0
    with pytest.raises(InvalidArgument):
        fit_transfer([], 1e9)
