"""The Prometheus metrics of one TensorCast process: names, labels, buckets, and how they are recorded.

Owns: the process's metric registry, the event metrics that code paths record (RPCs served and sent, puts,
gets, transfers, KV page operations, plan steps, shard-lease renewals), the state gauges that a role
reports when it is scraped (``add_source``: pool bytes by tier and state, leases held, ...) and turning
recording off (``set_enabled(False)``: every call here becomes a cheap no-op). Does not own: serving them
(``obs.http``) or deciding what happens in the code that records them.

Names follow Prometheus conventions: ``tensorcast_`` prefix, base units (``_bytes``, ``_seconds``), counters
end in ``_total``. ``docs/metrics.md`` lists every series.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorcast.obs.families import Counter, Histogram

__all__ = ["REGISTRY", "Sample", "add_source", "blob_verified", "enabled", "exposition", "kv_pages",
           "operation", "plan_step", "remove_source", "rpc_sent", "rpc_served", "set_enabled", "shard_renewal"]

REGISTRY = CollectorRegistry(auto_describe=False)

# Latency buckets from 100 µs (a same-host map) to 60 s (a checkpoint load).
_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)

_RPC_SERVED = Counter("tensorcast_rpc_served", "Requests this process served, by message type and outcome "
                      "(ok or the error code).", ["method", "outcome"])
_RPC_SERVED_SECONDS = Histogram("tensorcast_rpc_served_seconds", "Time to serve a request, by message type.",
                                ["method"], _SECONDS)
_RPC_SENT = Counter("tensorcast_rpc_sent", "Requests this process sent, by message type, peer kind (gs, worker, "
                    "instance) and outcome.", ["method", "peer", "outcome"])
_RPC_SENT_SECONDS = Histogram("tensorcast_rpc_sent_seconds", "Round-trip time of requests this process sent, by "
                              "message type and peer kind (peer=\"gs\": global-store request latency).",
                              ["method", "peer"], _SECONDS)
_OPS = Counter("tensorcast_operations", "Puts, gets and transfers a worker carried out, by kind, path and outcome.",
               ["op", "path", "outcome"])
_OP_BYTES = Counter("tensorcast_operation_bytes", "Tensor bytes of those operations (logical bytes: a put that "
                    "deduplicated still counts its size).", ["op", "path"])
_OP_SECONDS = Histogram("tensorcast_operation_seconds", "Duration of those operations on the worker.",
                        ["op", "path"], _SECONDS)
_KV_PAGES = Counter("tensorcast_kv_pages", "KV pages a shard home answered for, by operation (get, put, exists) "
                    "and result (hit, miss, stored).", ["op", "result"])
_KV_RENEWAL_LAG = Histogram("tensorcast_kv_lease_renewal_lag_seconds", "Time between a shard home's successive "
                            "lease renewals beyond its loop period, kv.renew_interval / 2 (0 when on time).", [],
                            (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0))
_PLAN_STEPS = Counter("tensorcast_plan_steps", "Plan step attempts a gateway ran, by operation and outcome "
                      "(succeeded, retryable_error, failed).", ["op", "outcome"])
_PLAN_STEP_SECONDS = Histogram("tensorcast_plan_step_seconds", "Duration of one attempt of a plan step.", ["op"],
                               _SECONDS)
_VERIFIED = Counter("tensorcast_blob_verifications", "Blobs a same-host caller wrote (and stated the digest of) that "
                    "a worker checked against their digest, by why (dedup, read, idle) and result (ok, mismatch).",
                    ["reason", "result"])
for _family in (_RPC_SERVED, _RPC_SERVED_SECONDS, _RPC_SENT, _RPC_SENT_SECONDS, _OPS, _OP_BYTES, _OP_SECONDS,
                _KV_PAGES, _KV_RENEWAL_LAG, _PLAN_STEPS, _PLAN_STEP_SECONDS, _VERIFIED):
    REGISTRY.register(_family)

_enabled = True


def set_enabled(on: bool) -> None:
    """Turn recording on or off for this process (``metrics.enabled``)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def rpc_served(method: str, outcome: str, seconds: float) -> None:
    if _enabled:
        _RPC_SERVED.inc((method, outcome))
        _RPC_SERVED_SECONDS.observe((method,), seconds)


def rpc_sent(method: str, peer: str, outcome: str, seconds: float) -> None:
    if _enabled:
        _RPC_SENT.inc((method, peer, outcome))
        _RPC_SENT_SECONDS.observe((method, peer), seconds)


def operation(op: str, path: str, nbytes: int, seconds: float, outcome: str = "ok") -> None:
    """One put (path: shm or network), get (map, or network: a range its data server sent) or transfer
    (fetch, view) done by a worker; failures are counted under their error code, with no bytes or duration."""
    if _enabled:
        _OPS.inc((op, path, outcome))
        if outcome == "ok":
            _OP_BYTES.inc((op, path), nbytes)
            _OP_SECONDS.observe((op, path), seconds)


def kept_maps(reads: int, nbytes: int) -> None:
    """Gets a same-host caller served from places it kept (``client.read_maps``), reported after the fact: they
    count as gets (path ``map-kept``) with their bytes, and no duration (the worker did no work)."""
    if _enabled:
        _OPS.inc(("get", "map-kept", "ok"), reads)
        _OP_BYTES.inc(("get", "map-kept"), nbytes)


def kv_pages(op: str, hits: int, misses: int = 0) -> None:
    """Pages found (or stored) and missed by one KV request."""
    if _enabled:
        if hits:
            _KV_PAGES.inc((op, "stored" if op == "put" else "hit"), hits)
        if misses:
            _KV_PAGES.inc((op, "miss"), misses)


def shard_renewal(lag: float) -> None:
    """How much later than its loop period a shard home renewed its leases (negative: on time)."""
    if _enabled:
        _KV_RENEWAL_LAG.observe((), max(0.0, lag))


def blob_verified(reason: str, ok: bool) -> None:
    """A blob's bytes checked against its digest (``worker.trust``): ``ok`` False, a mismatch (it was dropped)."""
    if _enabled:
        _VERIFIED.inc((reason, "ok" if ok else "mismatch"))


def plan_step(op: str, outcome: str, seconds: float) -> None:
    if _enabled:
        _PLAN_STEPS.inc((op, outcome))
        _PLAN_STEP_SECONDS.observe((op,), seconds)


# ----------------------------------------------------------------- state read when scraped
@dataclass(frozen=True)
class Sample:
    """One series a source reports: a gauge unless ``counter`` (then ``name`` is given without ``_total``)."""

    name: str
    help: str
    labels: dict[str, str]
    value: float
    counter: bool = False


Source = Callable[[], Iterable[Sample]]


class _Sources(Collector):
    """The state gauges: each role registers a function that reads its state when Prometheus scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, Source] = {}
        self._handles = itertools.count()

    def add(self, source: Source) -> int:
        with self._lock:
            handle = next(self._handles)
            self._sources[handle] = source
            return handle

    def remove(self, handle: int) -> None:
        with self._lock:
            self._sources.pop(handle, None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources.values())
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for source in sources:
            for s in source():
                fam = families.get(s.name)
                if fam is None:
                    cls = CounterMetricFamily if s.counter else GaugeMetricFamily
                    fam = families[s.name] = cls(s.name, s.help, labels=sorted(s.labels))
                fam.add_metric([s.labels[k] for k in sorted(s.labels)], s.value)
        yield from families.values()


_SOURCES = _Sources()
REGISTRY.register(_SOURCES)
_START = time.time()


def _process_source() -> Iterable[Sample]:
    yield Sample("tensorcast_process_start_time_seconds", "When this process started (Unix time).", {}, _START)


_SOURCES.add(_process_source)


def add_source(source: Source) -> int:
    """Report ``source()``'s samples at every scrape; returns a handle for ``remove_source``."""
    return _SOURCES.add(source)


def remove_source(handle: int) -> None:
    _SOURCES.remove(handle)


def exposition() -> bytes:
    """The text format Prometheus scrapes."""
    return generate_latest(REGISTRY)
