"""The simulator's cost model: how long a prefill, a decode step and a KV transfer take, and fitting it.

Owns: ``CostModel`` (coefficients in the style of DistServe and Vidur: a prefill costs ``a + b·L + c·L² +
e·L·C`` for ``L`` uncached prompt tokens on top of ``C`` cached ones; a decode step costs ``d0 + d1·batch +
d2·Σcontext``, and a request's decoding ``r`` once on top; moving ``n`` tokens of KV costs ``latency +
n·kv_bytes_per_token / bandwidth``; every prefill call ``o`` more, and on an instance that shares a page store,
``s0 + s1·L`` to look its pages up and store its new ones before the reply), the measured samples a live run
yields (``PrefillSample``, ``DecodeSample``, ``OverheadSample``), ``busy_overlap`` (how many other instances
were busy while a sample ran), ``fit``: non-negative least squares on relative error, reported with its error
on held-out samples, ``fit_overheads`` and ``fit_transfer``. Pure arithmetic on numbers passed in.

Why ``e·L·C``: on top of a cached context each new token attends to the ``C`` cached tokens, so an agent
turn (a few hundred new tokens on a context of thousands) pays attention work that ``L²`` alone misses.

Why contention (``k``): instances that share CPUs (or a GPU's memory bandwidth) slow each other down. A
prefill or decode step takes ``(1 + k·n)`` times its cost alone while ``n`` other instances are busy. On the
live runs of this project (4 instances on 2 cores) it is what most of the fit's error was: the same prefill
took a third longer when the other instances were busy.

Does not own: when work happens (``sim.engine`` schedules it) or measuring samples (a live run does).
The defaults are **placeholders** for a small model on CPU, not measurements: replace them with ``fit`` on a
live run's samples (``CostModel.from_dict`` reads what ``to_dict`` wrote).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import numpy.typing as npt

from tensorcast.errors import InvalidArgument

__all__ = ["CostModel", "DecodeSample", "Fit", "FitError", "OverheadSample", "PrefillSample", "busy_overlap", "fit",
           "fit_overheads", "fit_transfer", "relative_errors"]


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work. Placeholder defaults: a ~0.5B-parameter model on a few CPU cores (about 500
    prefill tokens/s, 30 ms per decode step), 12 KiB of KV per token (24 layers x 2 KV heads x 64 x K,V x
    2 bytes), 2 GB/s between an engine and TensorCast and 2 ms per transfer. Uncalibrated."""

    prefill_base_s: float = 0.02          # a: per prefill (launch, sampling)
    prefill_per_token_s: float = 2e-3     # b: per uncached token (weights x tokens)
    prefill_per_token2_s: float = 2e-7    # c: per pair of uncached tokens (their attention to each other)
    prefill_per_cached_s: float = 2e-7    # e: per (uncached, cached) pair (attention to the cached context)
    decode_base_s: float = 0.03           # d0: per step (reading the weights)
    decode_per_seq_s: float = 2e-3        # d1: per sequence in the batch
    decode_per_context_s: float = 4e-7    # d2: per context token over the batch (reading its KV)
    decode_per_request_s: float = 0.0     # r: once per request that decodes (setting up its generation)
    request_overhead_s: float = 0.0       # o: per prefill call beyond its forward pass (the call, the adaptor)
    store_base_s: float = 0.0             # s0: per prefill with a shared page store (page lookup, store call)
    store_per_token_s: float = 0.0        # s1: per computed token, stored as pages before the reply
    prefill_contention: float = 0.0       # k: slowdown per other busy instance, prefill
    decode_contention: float = 0.0        # k: slowdown per other busy instance, decode
    kv_bytes_per_token: int = 12288
    transfer_bandwidth: float = 2e9       # bytes/s, one copy between an engine and a worker (or two workers)
    transfer_latency_s: float = 2e-3      # per copy

    def __post_init__(self) -> None:
        bad = [f.name for f in fields(self) if not math.isfinite(getattr(self, f.name)) or getattr(self, f.name) < 0]
        if bad or self.transfer_bandwidth <= 0:
            raise InvalidArgument(f"cost model coefficients must be finite and >= 0 (bandwidth > 0): {bad}")

    def prefill_s(self, uncached: int, cached: int = 0, busy_others: float = 0.0) -> float:
        """One prefill of ``uncached`` prompt tokens whose first ``cached`` tokens' KV is already present, while
        ``busy_others`` other instances are busy."""
        L = uncached
        alone = (self.prefill_base_s + self.prefill_per_token_s * L + self.prefill_per_token2_s * L * L
                 + self.prefill_per_cached_s * L * cached)
        return alone * (1 + self.prefill_contention * busy_others)

    def decode_step_s(self, batch: int, context_tokens: int, busy_others: float = 0.0) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` tokens of KV between them."""
        alone = self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_context_s * context_tokens
        return alone * (1 + self.decode_contention * busy_others)

    def decode_s(self, steps: int, batch: int, context_tokens: int, busy_others: float = 0.0) -> float:
        """A whole request's decoding as one call: its setup and ``steps`` steps (the unit a live sample has)."""
        alone = self.decode_per_request_s + steps * self.decode_step_s(batch, context_tokens)
        return alone * (1 + self.decode_contention * busy_others)

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def overhead_s(self, computed: int, shared_store: bool) -> float:
        """What a prefill call costs beyond its forward pass: ``o``, plus ``s0 + s1·computed`` with a shared page
        store (the engine looks its pages up and stores the new ones before replying)."""
        store = self.store_base_s + self.store_per_token_s * computed if shared_store else 0.0
        return self.request_overhead_s + store

    def transfer_s(self, tokens: int) -> float:
        """One copy of ``tokens`` tokens of KV (a fetch from the shared store into an engine is one)."""
        return self.transfer_latency_s + self.kv_bytes(tokens) / self.transfer_bandwidth

    def move_s(self, tokens: int) -> float:
        """A rebalancing move: publish (engine -> its worker), prefetch (-> the target's worker) and hydrate
        (-> the target engine), three copies one after another."""
        return 3 * self.transfer_s(tokens)

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> CostModel:
        """A model from ``to_dict``'s output (unknown keys refused; missing ones keep their default)."""
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise InvalidArgument(f"unknown cost model fields: {unknown}")
        out: dict[str, float | int] = {}
        for key, value in values.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidArgument(f"cost model field {key!r} must be a number, got {value!r}")
            out[key] = int(value) if key == "kv_bytes_per_token" else float(value)
        return cls(**out)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PrefillSample:
    """A measured prefill: ``uncached`` tokens computed on top of ``cached`` ones took ``seconds``, while
    ``busy_others`` other instances were busy (on average over its duration)."""

    uncached: int
    cached: int
    seconds: float
    busy_others: float = 0.0


@dataclass(frozen=True)
class DecodeSample:
    """Measured decoding of ``batch`` sequences with ``context_tokens`` tokens between them: one step
    (``steps`` None), or a request's whole decoding in one call, its setup and ``steps`` steps (0 or more)."""

    batch: int
    context_tokens: int
    seconds: float
    busy_others: float = 0.0
    steps: int | None = None

    def predicted(self, model: CostModel) -> float:
        if self.steps is not None:
            return model.decode_s(self.steps, self.batch, self.context_tokens, self.busy_others)
        return model.decode_step_s(self.batch, self.context_tokens, self.busy_others)


@dataclass(frozen=True)
class OverheadSample:
    """A measured prefill call's seconds beyond its forward pass and its reads from the store: ``computed``
    tokens on an instance with (``shared_store``) or without a shared page store, while ``busy_others`` other
    instances were busy."""

    computed: int
    shared_store: bool
    seconds: float
    busy_others: float = 0.0


def fit_overheads(samples: Sequence[OverheadSample], contention: float = 0.0) -> tuple[float, float, float]:
    """``(o, s0, s1)`` for an instance alone: each sample is first divided by ``1 + contention·busy_others`` (the
    simulator slows the overheads down as it does the prefill they belong to). ``o`` is the median overhead
    without a store; ``s0 + s1·computed`` the least-squares line (non-negative) through what calls with a store
    took beyond ``o``. Absolute seconds: these are a few ms each, and a median is robust to stretched calls."""
    def alone(s: OverheadSample) -> float:
        return s.seconds / (1 + contention * s.busy_others)

    plain = [alone(s) for s in samples if not s.shared_store]
    stored = [s for s in samples if s.shared_store]
    if not plain or len(stored) < 2:
        raise InvalidArgument(f"need calls with and without a shared store to fit overheads "
                              f"({len(plain)} without, {len(stored)} with)")
    o = float(np.median(plain))
    s0, s1 = _nnls(np.array([[1.0, float(s.computed)] for s in stored]), np.array([alone(s) - o for s in stored]))
    return max(o, 0.0), float(s0), float(s1)


def fit_transfer(samples: Sequence[tuple[int, float]], bandwidth: float) -> tuple[float, float]:
    """``(latency, bandwidth)`` of a copy from ``(bytes, seconds)`` samples: the least-squares line through
    them when its slope is positive and its intercept not negative; otherwise (too few samples, sizes too alike
    to tell, or a line that makes no sense) the median of what the samples took beyond ``bandwidth``, with
    ``bandwidth`` kept."""
    if not samples:
        raise InvalidArgument("need at least one transfer sample")
    x = np.array([[1.0, float(b)] for b, _ in samples])
    y = np.array([sec for _, sec in samples])
    if len(samples) >= 3 and np.ptp(x[:, 1]) > 0:
        (latency, per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
        if per_byte > 0 and latency >= 0:
            return float(latency), float(1.0 / per_byte)
    return max(0.0, float(np.median(y - x[:, 1] / bandwidth))), bandwidth


def busy_overlap(start: float, end: float, others: Mapping[str, Sequence[tuple[float, float]]]) -> float:
    """How many other instances were busy during ``[start, end]``, on average: the sum over instances of the
    fraction of the window that their busy intervals (``others``: instance -> [(start, end)]) cover."""
    span = end - start
    if span <= 0:
        return 0.0
    total = 0.0
    for intervals in others.values():
        covered, reach = 0.0, start
        for s, e in sorted(intervals):
            s, e = max(s, reach), min(e, end)
            if e > s:
                covered += e - s
                reach = e
        total += covered / span
    return total


@dataclass(frozen=True)
class FitError:
    """Relative error |predicted - measured| / measured over ``samples`` held-out samples."""

    median: float
    p90: float
    samples: int


@dataclass(frozen=True)
class Fit:
    model: CostModel
    prefill_error: FitError
    decode_error: FitError


Matrix = npt.NDArray[np.float64]


def _nnls(x: Matrix, y: Matrix) -> Matrix:
    """Non-negative coefficients minimising the squared error of ``x @ w`` against ``y``. Exact for the few
    features here: the best least-squares solution over every subset of features whose solution is
    non-negative (one of them is the constrained optimum); zeros if there is none."""
    best, best_res = np.zeros(x.shape[1]), math.inf
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((x[:, cols] @ sol - y) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(x.shape[1])
                best[list(cols)] = sol
    return best


def _nnls_relative(x: Matrix, y: Matrix) -> Matrix:
    """``_nnls`` on *relative* error: rows are divided by their target, so a 5 ms step counts as much as a 5 s
    prefill."""
    return _nnls(x / y[:, None], np.ones_like(y))


def _prefill_rows(samples: Sequence[PrefillSample], k: float) -> tuple[Matrix, Matrix]:
    x = np.array([[1.0, s.uncached, float(s.uncached) ** 2, float(s.uncached) * s.cached]
                  for s in samples]) * np.array([[1 + k * s.busy_others] for s in samples])
    return x.reshape(-1, 4), np.array([s.seconds for s in samples], dtype=np.float64)


def _decode_rows(samples: Sequence[DecodeSample], k: float) -> tuple[Matrix, Matrix]:
    """Features ``d0, d1, d2, r``: a step's are counted once per step (once for a one-step sample)."""
    x = np.array([[n, n * s.batch, n * s.context_tokens, 1.0 if s.steps is not None else 0.0]
                  for s in samples for n in [float(1 if s.steps is None else s.steps)]], dtype=np.float64)
    x = x * np.array([[1 + k * s.busy_others] for s in samples])
    return x.reshape(-1, 4), np.array([s.seconds for s in samples], dtype=np.float64)


# Contention coefficients tried (a grid: the model is linear in the others once k is fixed).
_CONTENTION = tuple(i / 20 for i in range(41))


def _fit_contended(rows: Callable[[float], tuple[Matrix, Matrix]], contended: bool) -> tuple[Matrix, float]:
    """The coefficients and contention ``k`` with the least relative error on the training samples (k = 0
    only, when no sample saw another instance busy)."""
    best: tuple[float, Matrix, float] | None = None
    for k in _CONTENTION if contended else (0.0,):
        x, y = rows(k)
        w = _nnls_relative(x, y)
        err = float(np.sum(((x @ w) - y) ** 2 / y**2))
        if best is None or err < best[0]:
            best = (err, w, k)
    assert best is not None
    return best[1], best[2]


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> FitError:
    """Median and 90th percentile of |predicted - measured| / measured."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if len(m) == 0:
        return FitError(math.nan, math.nan, 0)
    rel = np.abs(p - m) / m
    return FitError(float(np.median(rel)), float(np.percentile(rel, 90)), len(m))


def _split(n: int, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, round(n * test_fraction))
    return sorted(int(i) for i in order[n_test:]), sorted(int(i) for i in order[:n_test])


def _check(samples: Sequence[PrefillSample] | Sequence[DecodeSample], what: str, need: int) -> None:
    if len(samples) < need:
        raise InvalidArgument(f"need at least {need} {what} samples to fit, got {len(samples)}")
    if any(not s.seconds > 0 or not math.isfinite(s.seconds) for s in samples):
        raise InvalidArgument(f"{what} samples must have finite seconds > 0")


def fit(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], *, base: CostModel | None = None,
        test_prefill: Sequence[PrefillSample] | None = None, test_decode: Sequence[DecodeSample] | None = None,
        test_fraction: float = 0.25, seed: int = 0) -> Fit:
    """Fit the prefill and decode coefficients (``base`` keeps the rest: KV size, bandwidth, latency).

    The error is measured on held-out samples: ``test_prefill``/``test_decode`` when given (samples of another
    live run), else a seeded random ``test_fraction`` of each list, which is then left out of the fit."""
    if not 0 < test_fraction < 1:
        raise InvalidArgument(f"test_fraction must be in (0, 1), got {test_fraction}")
    _check(prefill, "prefill", 5 if test_prefill is None else 4)
    _check(decode, "decode", 4 if test_decode is None else 3)
    if test_prefill is None:
        train, test = _split(len(prefill), test_fraction, seed)
        prefill, test_prefill = [prefill[i] for i in train], [prefill[i] for i in test]
    if test_decode is None:
        train, test = _split(len(decode), test_fraction, seed + 1)
        decode, test_decode = [decode[i] for i in train], [decode[i] for i in test]
    _check(test_prefill, "held-out prefill", 1)
    _check(test_decode, "held-out decode", 1)
    (a, b, c, e), kp = _fit_contended(lambda k: _prefill_rows(prefill, k), any(s.busy_others for s in prefill))
    (d0, d1, d2, r), kd = _fit_contended(lambda k: _decode_rows(decode, k), any(s.busy_others for s in decode))
    model = replace(base or CostModel(), prefill_base_s=float(a), prefill_per_token_s=float(b),
                    prefill_per_token2_s=float(c), prefill_per_cached_s=float(e), decode_base_s=float(d0),
                    decode_per_seq_s=float(d1), decode_per_context_s=float(d2), decode_per_request_s=float(r),
                    prefill_contention=kp, decode_contention=kd)
    return Fit(model,
               relative_errors([model.prefill_s(s.uncached, s.cached, s.busy_others) for s in test_prefill],
                               [s.seconds for s in test_prefill]),
               relative_errors([s.predicted(model) for s in test_decode], [s.seconds for s in test_decode]))
