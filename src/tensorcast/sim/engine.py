"""The discrete-event core: a simulated clock with its event heap, and simulated engine instances.

Owns: ``EventLoop`` (a heap of timestamped callbacks; time jumps from one event to the next, ties run in
the order they were scheduled, so a run is a pure function of its inputs), ``SimConfig`` (an instance's
shape and the cost model), ``SimRequest`` (one turn on one instance) and ``SimInstance``, an engine with
continuous batching as vLLM's default scheduler does it without chunked prefill: each iteration is either a
prefill of the waiting requests that fit (first come first served, prefills first) or one decode step of
every running request. A request's first token comes at the end of its prefill; a request with more output
then decodes one token per step until done. An iteration's duration is fixed when it starts: its cost, slowed
down by the other instances busy at that moment (``CostModel`` contention; ``busy_others``, set by
``sim.cluster``), plus the setup of each request that starts decoding in it.

KV: an instance's ``BlockCache`` (prefix caching by block). At admission the request's leading cached blocks
are reused; with a ``SharedStore`` the blocks after them that the store holds are loaded before the prefill
(one copy, ``CostModel.transfer_s``, which the iteration waits for, as this project's vLLM connector loads
pages before the forward pass); the rest of the prompt is computed. The prompt's blocks are published to
the store after the prefill, its output's after the request finishes (the connector saves full blocks in
the background; that traffic is not charged). Fed events by ``sim.cluster`` and ``sim.run``.

Does not own: routing, sessions or moves (``sim.run``, ``sim.cluster``) or the coefficients (``sim.cost``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tensorcast.errors import InvalidArgument
from tensorcast.records import InstanceInfo
from tensorcast.sim.cost import CostModel
from tensorcast.sim.kvcache import BlockCache, SharedStore, salt_keys
from tensorcast.workloads.turns import Turn

__all__ = ["EventLoop", "SimConfig", "SimInstance", "SimRequest"]


class EventLoop:
    """Simulated time: ``at(t, fn)`` runs ``fn`` when the clock reaches ``t``; ``run`` until no event is left."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        if when < self.now:
            raise InvalidArgument(f"event at {when} is in the past (now {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            self.events += 1
            fn()


@dataclass(frozen=True)
class SimConfig:
    """The simulated cluster: ``instances`` engines, each running at most ``max_batch`` requests, admitting
    at most ``max_prefill_tokens`` uncached tokens per prefill iteration (at least one request), holding
    ``kv_capacity_tokens`` of KV in blocks of ``block_tokens``; ``cost`` prices the work.

    ``prefix_sharing``: an instance's cached blocks serve any request whose prompt starts with them (vLLM's
    automatic prefix caching); False: only the session that left them there, and only while the session
    stays (an engine that keeps each session's KV for its next turn and drops it when the session goes
    elsewhere, as this project's transformers adaptor does). ``load_signal``: what ``list_instances()``
    reports as an instance's ``running`` — ``"engine"``: the requests in its batch; ``"sessions"``: the
    sessions whose KV it holds (a driver that keeps its own count, as the live benchmark's does)."""

    instances: int = 4
    max_batch: int = 16
    kv_capacity_tokens: int = 32768
    block_tokens: int = 16
    max_prefill_tokens: int = 16384
    cost: CostModel = field(default_factory=CostModel)
    prefix_sharing: bool = True
    load_signal: str = "engine"

    def __post_init__(self) -> None:
        if self.instances < 1 or self.max_batch < 1 or self.block_tokens < 1 or self.max_prefill_tokens < 1:
            raise InvalidArgument(f"bad sim config: instances={self.instances}, max_batch={self.max_batch}, "
                                  f"block_tokens={self.block_tokens}, max_prefill_tokens={self.max_prefill_tokens}")
        if self.kv_capacity_tokens < self.block_tokens:
            raise InvalidArgument(f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold at least one block")
        if self.load_signal not in ("engine", "sessions"):
            raise InvalidArgument(f"load_signal must be 'engine' or 'sessions', got {self.load_signal!r}")


@dataclass(eq=False)
class SimRequest:
    """One turn served by one instance. ``keys``: the prompt's whole blocks; ``extra_keys``: blocks the
    output fills that the session's next prompt reuses (cached when the request finishes); ``issued_s``: when
    the turn was issued (TTFT counts from there, including any wait for a move); ``salt``: the instance's own
    cache names the blocks ``salt_keys(keys, salt)`` (0: as the store does; see ``SimConfig.prefix_sharing``)."""

    turn: Turn
    keys: Sequence[int]
    extra_keys: Sequence[int]
    issued_s: float
    on_done: Callable[[SimRequest], None]
    salt: int = 0
    instance_id: str = ""
    private_blocks: int = 0
    local_hit_tokens: int = 0
    store_hit_tokens: int = 0
    first_token_s: float = -1.0
    done_s: float = -1.0
    generated: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.local_hit_tokens + self.store_hit_tokens

    @property
    def context_tokens(self) -> int:
        return self.turn.prompt_tokens + self.generated

    @property
    def cache_keys(self) -> Sequence[int]:
        """``keys`` as the instance's own cache names them."""
        return salt_keys(self.keys, self.salt)

    @property
    def extra_cache_keys(self) -> Sequence[int]:
        return salt_keys(self.extra_keys, self.salt)


class SimInstance:
    """A simulated engine: a waiting queue, a running batch, a block cache; optionally a shared store."""

    def __init__(self, instance_id: str, loop: EventLoop, config: SimConfig, store: SharedStore | None) -> None:
        self.instance_id = instance_id
        self.loop, self.config, self.cost, self.store = loop, config, config.cost, store
        self.cache = BlockCache(config.kv_capacity_tokens // config.block_tokens)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stepping = False  # an iteration is under way; the next starts when it ends
        self.prefilling = 0  # requests in the prefill iteration under way (vLLM counts them as running)
        # Other instances busy now (``sim.cluster`` sets it): they slow this one down (``CostModel`` contention).
        self.busy_others: Callable[[], float] = lambda: 0.0

    def info(self) -> InstanceInfo:
        """This instance's signals, as ``Client.list_instances()`` reports a real one's: ``running`` counts the
        requests being prefilled too, as vLLM's scheduler does (they hold KV and the engine is busy with them)."""
        return InstanceInfo(instance_id=self.instance_id, address=f"sim://{self.instance_id}",
                            home_worker=f"worker-{self.instance_id}", running=len(self.running) + self.prefilling,
                            waiting=len(self.waiting),
                            kv_tokens_used=self.cache.used_blocks * self.config.block_tokens,
                            kv_tokens_capacity=self.cache.capacity_blocks * self.config.block_tokens,
                            engine="sim")

    def submit(self, request: SimRequest) -> None:
        request.instance_id = self.instance_id
        whole = len(request.keys) * self.config.block_tokens
        total = request.turn.prompt_tokens + request.turn.output_tokens
        request.private_blocks = -(-max(0, total - whole) // self.config.block_tokens)
        if len(request.keys) + request.private_blocks > self.cache.capacity_blocks:
            raise InvalidArgument(f"{request.turn.request_id} needs {total} tokens of KV, more than an instance "
                                  f"holds ({self.cache.capacity_blocks * self.config.block_tokens})")
        self.waiting.append(request)
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        batch = self._admit()
        self.prefilling = len(batch)
        if batch:
            self.loop.at(self.loop.now + self._prefill_s(batch), lambda: self._prefill_done(batch))
        elif self.running:
            self.loop.at(self.loop.now + self._decode_s(), self._decode_done)
        self.stepping = bool(batch or self.running)

    def _admit(self) -> list[SimRequest]:
        """Waiting requests that start a prefill now: in arrival order while the batch and the KV have room (a
        request that does not fit holds back the ones behind it) and the iteration's token budget lasts."""
        batch: list[SimRequest] = []
        budget = self.config.max_prefill_tokens
        bt = self.config.block_tokens
        while self.waiting and len(self.running) + len(batch) < self.config.max_batch:
            request = self.waiting[0]
            prompt = request.turn.prompt_tokens
            own = request.cache_keys
            local = self.cache.match(own)
            stored = self.store.extend_match(request.keys, local) if self.store is not None else local
            hit = max(0, min(stored * bt, prompt - 1))  # an engine computes at least the prompt's last token
            if (batch and prompt - hit > budget) or not self.cache.fits(own, request.private_blocks):
                break
            self.waiting.popleft()
            request.local_hit_tokens = min(local * bt, hit)
            request.store_hit_tokens = hit - request.local_hit_tokens
            self.cache.acquire(own, request.private_blocks)
            budget -= prompt - hit
            batch.append(request)
        return batch

    def _prefill_s(self, batch: list[SimRequest]) -> float:
        """One iteration's prefills (one base cost for the iteration) with each request's call overhead and,
        with a shared store, its page lookup and store (the overheads are fitted for an instance alone), slowed
        down by the other instances busy as it starts; and the loads from the store before it."""
        compute = sum(self.cost.prefill_s(r.turn.prompt_tokens - r.hit_tokens, r.hit_tokens)
                      + self.cost.overhead_s(r.turn.prompt_tokens - r.hit_tokens, self.store is not None)
                      for r in batch)
        compute -= (len(batch) - 1) * self.cost.prefill_base_s
        loads = sum(self.cost.transfer_s(r.store_hit_tokens) for r in batch if r.store_hit_tokens)
        return compute * (1 + self.cost.prefill_contention * self.busy_others()) + loads

    def _decode_s(self) -> float:
        """One decode step of the running batch, with the setup of the requests that start decoding in it."""
        context = sum(r.context_tokens for r in self.running)
        starting = sum(1 for r in self.running if r.generated == 1)
        alone = self.cost.decode_step_s(len(self.running), context) + starting * self.cost.decode_per_request_s
        return alone * (1 + self.cost.decode_contention * self.busy_others())

    def _prefill_done(self, batch: list[SimRequest]) -> None:
        now = self.loop.now
        for request in batch:
            request.first_token_s = now
            request.generated = 1
            if self.store is not None:
                self.store.publish(request.keys)
            if request.generated >= request.turn.output_tokens:
                self._finish(request)
            else:
                self.running.append(request)
        self._step()

    def _decode_done(self) -> None:
        still: list[SimRequest] = []
        for request in self.running:
            request.generated += 1
            if request.generated >= request.turn.output_tokens:
                self._finish(request)
            else:
                still.append(request)
        self.running = still
        self._step()

    def _finish(self, request: SimRequest) -> None:
        request.done_s = self.loop.now
        self.cache.release(request.cache_keys, request.private_blocks, request.extra_cache_keys)
        if self.store is not None:
            self.store.publish(request.extra_keys)
        request.on_done(request)
