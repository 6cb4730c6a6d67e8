"""Bindings: a stable set of caller tensors that weight versions are swapped into, in place.

Owns: ``AsyncBinding`` (``client.bind(model, tp=TP(rank, world), into=..., rules=...)``). The bound tensors
are the caller's own (a model's ``state_dict()``, a dict of engine parameters): their addresses never change.
A swap is two steps:
- **prepare(version)**: record the use of ``version`` (so collection keeps it), resolve it, work out which
  bound tensors change (a tensor whose source digest and slices equal what it holds is skipped: a delta
  version moves only what changed), fetch this rank's slices of those (``client.staging``) into staging.
  Live tensors are not touched; any failure leaves the binding as it was.
- **activate()**: copy staging into the bound tensors, under ``lock`` (an engine may hold it around forward
  passes so that a swap never lands mid-step). This is the only step that writes live tensors.
Both check a compare-and-swap on the active version (``expected``; ``VersionConflict`` when stale) through
the pure ``weights.swap_state.SwapState``. ``staging="mapped"`` (default) stages the pool's pages mapped
copy-on-write (no extra memory; their pages are mapped in while later groups are fetched, and activation
copies from them); ``"copy"`` stages private copies on the bound tensors' device, filled while later
groups are fetched (activation is then a same-device copy).
A bound tensor may also be composed of several version tensors concatenated along dim 0 (``sources``, for
engines with fused parameters such as ``qkv_proj``; rows past the parts, e.g. vocabulary padding, are kept).
Does not own: fetching (``client.staging``), use records (``client.uses``), group swaps (``plans.group_swap``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tensorcast.client.artifact import like_of
from tensorcast.client.publisher import ClientPort, list_versions, wait_newer
from tensorcast.client.staging import Job, Key, stage
from tensorcast.client.uses import UseRecords
from tensorcast.errors import InternalError, InvalidArgument, NotFound, SwapAborted, clip
from tensorcast.pool.segments import populate_read
from tensorcast.records import ArtifactInfo, SliceSpec, TensorMeta, WorkerInfo
from tensorcast.tensors import dtype_name, numpy_dtype
from tensorcast.views import TP, TPRules, sliced_shape
from tensorcast.weights.group import FETCH_MODES
from tensorcast.weights.rules import rules_for
from tensorcast.weights.swap_state import NOOP, READY, Staged, SwapState
from tensorcast.weights.versions import META_TENSORS, check_holder, check_model, check_version, version_key
from tensorcast.wire.messages import GetArtifact

__all__ = ["STAGING", "AsyncBinding", "SwapReport", "resolve_rules"]

STAGING = ("mapped", "copy")
log = logging.getLogger("tensorcast.weights")


@dataclass
class SwapReport:
    """What one prepare, activation or swap did."""

    version: int
    swap_id: str
    status: str  # prepared | activated | noop (already active) | ready (already prepared)
    changed: int = 0  # bound tensor parts fetched and copied
    unchanged: int = 0  # skipped: same content and slices as what they hold
    fetched_bytes: int = 0  # bytes brought to this host for the swap
    copied_bytes: int = 0  # bytes written into bound tensors
    path: str = ""  # local | via <worker> | remote
    prepare_s: float = 0.0
    activate_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Staging:
    swap_id: str
    version: int
    tensors: dict[Key, Any]  # part -> staged tensor (mapped pool pages, or a private copy)
    held: dict[Key, tuple[str, tuple[SliceSpec, ...]]]  # every part's identity once activated
    regions: dict[Key, tuple[int, int]]  # part -> (first row, rows) in a composed bound tensor
    report: SwapReport


def resolve_rules(rules: TPRules | Mapping[str, Any] | str | None, info: ArtifactInfo) -> TPRules:
    """``rules`` as a rule set: given, a model type's (``"qwen2"``), or the version's ``model_type``."""
    if isinstance(rules, TPRules):
        return rules
    if isinstance(rules, Mapping):
        return TPRules(rules)
    model_type = rules or info.meta.get("model_type", "")
    if not model_type:
        raise InvalidArgument("a tensor-parallel binding needs rules= (a rule set, {pattern: dim | 'replicated'}, "
                              "or a model type such as 'qwen2'): this version records no model_type")
    return rules_for(model_type, json.loads(info.meta.get("config", "{}")))


def _targets(into: Any) -> dict[str, Any]:
    state = into.state_dict() if callable(getattr(into, "state_dict", None)) else into
    if not isinstance(state, Mapping) or not state:
        raise InvalidArgument(f"into= takes a module or a non-empty {{name: tensor}} mapping, got {clip(into)}")
    return dict(state)


def _dtype(t: Any) -> str:
    return dtype_name(t.dtype)


def _populate(t: Any) -> None:
    """Fault in a mapped staging tensor's pages (a contiguous host tensor; others are left as they are)."""
    if isinstance(t, np.ndarray):
        if t.nbytes and t.flags.c_contiguous:
            populate_read(t.ctypes.data, t.nbytes)
    elif t.device.type == "cpu" and t.is_contiguous() and t.numel():
        populate_read(t.data_ptr(), t.numel() * t.element_size())


class AsyncBinding:
    """Bound tensors of one model (and one tensor-parallel rank) that versions are swapped into in place."""

    def __init__(self, client: ClientPort, model: str, into: Any, *, tp: TP | None = None,
                 rules: TPRules | Mapping[str, Any] | str | None = None,
                 sources: Mapping[str, Sequence[str]] | None = None, staging: str = "mapped",
                 holder: str | None = None, lease_ttl: float = 30.0, via: WorkerInfo | None = None) -> None:
        if staging not in STAGING:
            raise InvalidArgument(f"staging must be one of {STAGING}, got {clip(staging)}")
        self.client, self.model, self.tp, self.rules = client, check_model(model), tp, rules
        self.targets = _targets(into)
        self.like = like_of(self.targets)
        self.sources = {t: tuple(sources.get(t, (t,))) if sources else (t,) for t in self.targets}
        unknown = sorted(set(sources or {}) - set(self.targets))
        if unknown or any(not s for s in self.sources.values()):
            raise InvalidArgument(f"sources= names tensors that are not bound, or none: {unknown[:5]}")
        self.staging_mode = staging
        self.holder = check_holder(holder or f"b{uuid.uuid4().hex[:12]}")
        self.via = via
        self.lock = threading.RLock()  # held while activation writes the bound tensors
        self.state = SwapState()
        self.uses = UseRecords(client, self.model, self.holder, lease_ttl)
        self.held: dict[Key, tuple[str, tuple[SliceSpec, ...]]] = {}
        self.last_report: SwapReport | None = None
        self._staged: _Staging | None = None
        self._preparing = 0
        self._busy = asyncio.Lock()  # one prepare at a time
        self._keeper: asyncio.Task[None] | None = None
        self._settling: asyncio.Future[None] | None = None
        self._closed = False

    @classmethod
    async def create(cls, client: ClientPort, model: str, into: Any, **kw: Any) -> AsyncBinding:
        """A binding that stages through a worker on this host when there is one (``via``)."""
        workers = [w for w in await client.list_workers() if w.alive and client.locality.same_host(w.host_id)]
        workers.sort(key=lambda w: w.address != client.caller.address)  # the gateway first, if it is here
        binding = cls(client, model, into, via=workers[0] if workers else None, **kw)
        binding._keeper = asyncio.ensure_future(binding._keep())
        return binding

    # ----------------------------------------------------------------- queries
    @property
    def tensors(self) -> dict[str, Any]:
        """The bound tensors (the caller's own objects: their addresses never change)."""
        return self.targets

    @property
    def active_version(self) -> int | None:
        return self.state.active or None

    def status(self) -> dict[str, Any]:
        staged = self.state.staged
        return {"model": self.model, "holder": self.holder, "active_version": self.state.active or None,
                "staged": None if staged is None else {"swap_id": staged.swap_id, "version": staged.version},
                "tp": None if self.tp is None else [self.tp.rank, self.tp.world_size],
                "uses": sorted(self.uses.ids), "via": self.via.worker_id if self.via else ""}

    async def wait_newer(self, timeout: float | None = None) -> int | None:
        """The newest version above the active one once it exists; None after ``timeout`` seconds."""
        return await wait_newer(self.client.caller, self.model, self.state.active or None, timeout)

    # ----------------------------------------------------------------- swapping
    async def swap(self, version: int | None = None, *, expected: int | None = None,
                   timeout: float | None = None, fetch: str = "view") -> SwapReport:
        """Prepare then activate ``version`` (default: the newest). ``expected``: the version that must be
        active (0: none; None: no check), else ``VersionConflict`` and nothing changes. ``fetch``: see
        ``prepare``."""
        report = await self.prepare(version, expected=expected, timeout=timeout, fetch=fetch)
        if report.status == NOOP:
            return report
        return await self.activate(report.swap_id, expected=expected)

    async def prepare(self, version: int | None = None, *, expected: int | None = None, swap_id: str | None = None,
                      timeout: float | None = None, fetch: str = "view") -> SwapReport:
        """Fetch ``version``'s slices of the tensors that change into staging; live tensors are untouched.
        ``fetch``: how a version held on another host comes to this one through ``via``: ``"view"`` (only
        this rank's slices), or ``"whole"`` (the whole version, once for every rank on this host; right when
        all of an engine's ranks are here, as a group swap decides; ``view`` all the same for a binding that
        binds only some of the version's tensors)."""
        if self._closed:
            raise InvalidArgument("binding is closed")
        if fetch not in FETCH_MODES:
            raise InvalidArgument(f"fetch must be one of {FETCH_MODES}, got {clip(fetch)}")
        ctx = self.client.caller.context(timeout)
        if version is None:
            version = max(await list_versions(self.client.caller, self.model, ctx), default=None)
            if version is None:
                raise NotFound(f"no version of {self.model} is published")
        version, swap_id = check_version(version), swap_id or uuid.uuid4().hex
        async with self._busy:
            decision = self.state.begin_prepare(swap_id, version, expected, time.time())
            if decision == NOOP:
                return self._report(SwapReport(version, swap_id, NOOP))
            if decision == READY and self._staged is not None:
                return self._staged.report
            self._preparing = version
            try:
                staged = await self._prepare(version, swap_id, ctx, fetch == "whole")
                self.state.prepared(swap_id, version, time.time())
            except BaseException:
                self._preparing = 0
                await self._settle_uses()
                raise
            self._preparing = 0
            self._staged = staged  # a swap it replaced (``replaced``) is dropped with its staging
            await self._settle_uses()
            return self._report(staged.report)

    async def _prepare(self, version: int, swap_id: str, ctx: Any, whole: bool) -> _Staging:
        t0 = time.perf_counter()
        await self.uses.hold(version, ctx)  # before resolving: collection keeps it from now on
        key = version_key(self.model, version)
        info = (await self.client.caller.call(GetArtifact(key_or_id=key), ctx)).artifact
        jobs, held, regions = self._plan(info, version)
        report = SwapReport(version, swap_id, "prepared", changed=len(jobs), unchanged=len(held) - len(jobs))
        tensors: dict[Key, Any] = {}

        def absorb(group: dict[Key, Any]) -> None:
            if self.staging_mode == "mapped":
                for src in group.values():  # while the next group is fetched: activation then only copies
                    _populate(src)
                tensors.update(group)
            else:
                tensors.update({k: self._private_copy(k, src) for k, src in group.items()})

        meta = {"binding": self.model, **({"tp": f"{self.tp.rank}/{self.tp.world_size}"} if self.tp else {})}
        # Whole only for a binding of every tensor (a pipeline stage's binding would pull the other stages').
        bound = {s for ss in self.sources.values() for s in ss}
        whole = whole and bound >= {t.name for t in info.tensors} - META_TENSORS
        stats = await stage(self.client, info, jobs, like=self.like, via=self.via, meta=meta, ctx=ctx, absorb=absorb,
                            whole=whole)
        report.fetched_bytes, report.path = stats.fetched_bytes, stats.path
        report.prepare_s = time.perf_counter() - t0
        return _Staging(swap_id, version, tensors, held, regions, report)

    def _plan(self, info: ArtifactInfo, version: int) -> tuple[list[Job], dict[Key, tuple[str, tuple[SliceSpec, ...]]],
                                                                 dict[Key, tuple[int, int]]]:
        """The parts to fetch (those whose content or slices differ from what they hold), every part's
        identity once this version is active, and the rows each part of a composed tensor fills. Checks
        names, dtypes and shapes first."""
        metas = {t.name: t for t in info.tensors}
        rule_set = resolve_rules(self.rules, info) if self.tp is not None else None
        jobs: list[Job] = []
        held: dict[Key, tuple[str, tuple[SliceSpec, ...]]] = {}
        regions: dict[Key, tuple[int, int]] = {}
        for target, sources in self.sources.items():
            rows = 0
            for source in sources:
                meta = metas.get(source)
                if meta is None:
                    raise InvalidArgument(f"version {version} of {self.model} has no tensor {clip(source)} "
                                          f"(bound as {clip(target)})")
                specs = rule_set.slices(source, meta.shape, self.tp) if rule_set is not None and self.tp else ()
                shape = sliced_shape(meta.shape, specs)
                self._check_part(target, meta, shape, rows, len(sources) > 1)
                key = (target, source)
                held[key] = (meta.digest, specs)
                regions[key] = (rows, shape[0] if shape else 0)
                if self.held.get(key) != held[key]:
                    nbytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(meta.dtype).itemsize
                    jobs.append(Job(key, source, specs, nbytes))
                rows += shape[0] if shape else 0
        return jobs, held, regions

    def _check_part(self, target: str, meta: TensorMeta, shape: tuple[int, ...], offset: int, composed: bool) -> None:
        dst = self.targets[target]
        dshape = tuple(int(s) for s in dst.shape)
        if _dtype(dst) != meta.dtype:
            raise InvalidArgument(f"{clip(target)}: bound dtype {_dtype(dst)} != {meta.name!r}'s {meta.dtype}")
        fits = (dshape[1:] == shape[1:] and offset + shape[0] <= dshape[0]) if composed and shape else dshape == shape
        if not fits:
            raise InvalidArgument(f"{clip(target)}: bound shape {dshape} cannot take {meta.name!r}'s slice of shape "
                                  f"{shape}{f' at row {offset}' if composed else ''}")

    def _private_copy(self, key: Key, src: Any) -> Any:
        """Copy-mode staging: a private copy on the bound tensor's device (filled while the next group is
        fetched; activation is then a same-device copy)."""
        if self.like == "torch":
            return src.new_empty(tuple(src.shape), device=self.targets[key[0]].device).copy_(src)
        return np.array(src, copy=True)

    async def activate(self, swap_id: str | None = None, *, expected: int | None = None) -> SwapReport:
        """Copy the staged swap into the bound tensors (under ``lock``); CAS on ``expected`` first."""
        staged = self.state.begin_activate(swap_id or "", expected, time.time())
        if staged is None:
            return self._report(SwapReport(self.state.active, swap_id or "", NOOP))
        staging = self._staged
        if staging is None or staging.swap_id != staged.swap_id:
            raise InternalError(f"swap {staged.swap_id} is staged but its tensors are gone")
        # Parts it skipped as unchanged must still hold what they held when it was prepared (another swap
        # activated meanwhile would make the skip wrong): then it is stale, and refused.
        if any(k not in staging.tensors and self.held.get(k) != ident for k, ident in staging.held.items()):
            await self.abort(staged.swap_id)
            raise SwapAborted(f"swap {staged.swap_id} was prepared against tensors another swap has changed since; "
                              "prepare it again")
        # Shielded: a caller that gives up (a deadline) does not stop an activation halfway.
        return await asyncio.shield(self._apply(staged, staging))

    async def _apply(self, staged: Staged, staging: _Staging) -> SwapReport:
        t0 = time.perf_counter()
        try:
            copied = await asyncio.to_thread(self._copy, staging)
        except BaseException:
            self.state.activation_failed()
            self.held.clear()  # the bound tensors hold a mix: the next swap copies everything again
            self._staged = None
            raise
        self.state.activated(staged)
        self.held = dict(staging.held)
        self._staged = None
        staging.report.status, staging.report.copied_bytes = "activated", copied
        staging.report.activate_s = time.perf_counter() - t0
        self._settling = asyncio.ensure_future(self._settle_uses())  # the old version's record: off the critical path
        return self._report(staging.report)

    def _copy(self, staging: _Staging) -> int:
        copied = 0
        with self.lock:
            for key, src in staging.tensors.items():
                dst = self.targets[key[0]]
                if len(self.sources[key[0]]) > 1:  # a composed tensor: this part's rows
                    first, rows = staging.regions[key]
                    dst = dst.narrow(0, first, rows) if self.like == "torch" else dst[first : first + rows]
                if self.like == "torch":
                    dst.copy_(src)
                else:
                    np.copyto(dst, np.asarray(src))
                copied += int(src.nbytes)
        return copied

    async def abort(self, swap_id: str | None = None) -> None:
        """Drop the staged swap (``swap_id``; None: whatever is staged) and refuse it from now on."""
        self.state.abort(swap_id or "")
        if self._staged is not None and (not swap_id or self._staged.swap_id == swap_id):
            self._staged = None
        await self._settle_uses()

    # ----------------------------------------------------------------- leases and housekeeping
    async def _settle_uses(self) -> None:
        staged = self.state.staged
        needed = {self.state.active, self._preparing, staged.version if staged else 0} - {0}
        await self.uses.keep_only(needed)

    async def _keep(self) -> None:
        """Renew use records; free a staged swap nobody decided on."""
        while True:
            await asyncio.sleep(self.uses.ttl / 3)
            try:
                if self.state.expire(time.time()) is not None:
                    self._staged = None
                    await self._settle_uses()
                await self.uses.renew()
            except Exception:  # never let housekeeping die: the leases would lapse silently
                log.exception("weight binding %s of %s: housekeeping failed", self.holder, self.model)

    def _report(self, report: SwapReport) -> SwapReport:
        self.last_report = report
        return report

    async def close(self) -> None:
        """Stop renewing and release this binding's use records (the bound tensors stay as they are)."""
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        self._staged = None
        self.state.abort("")
        await self.uses.keep_only(())
