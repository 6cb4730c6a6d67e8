"""What the TensorCast KV connector decides on vLLM's scheduler side: which pages to load, which to save.

Pure: requests, token ids, block ids and "how many leading pages are stored" come in; the number of
matched tokens and each step's transfers go out. No vLLM import, no client, no clock of its own (``now``
is passed in), so every rule is unit-tested on plain lists. ``vllm_connector`` does the I/O around it.

Rules:
- A page is one vLLM block (``page_size`` = the block size) of every layer. Its key is the chained hash of
  the tokens up to it (``kv.keys.PageKeyChain``), salted with the model and the KV layout, so that any
  instance of the same model finds it and a different model never does; or, given a ``chain`` per request,
  whatever names it (vLLM's own block hashes: ``vllm_block_keys.BlockHashChain``).
- Loads: the longest stored prefix beyond what vLLM already computed locally, in whole pages, and never the
  prompt's last token (vLLM must compute at least one token to sample from).
- Saves: every page whose tokens have all been computed by the end of the step, once per request, prompt
  and generated tokens alike (a later turn of the conversation starts with them); pages just loaded from
  TensorCast are not saved again.
- Hand-off (prefill/decode disaggregation): a producer's finished request returns ``kv_transfer_params``
  naming how many pages it stored; a consumer given those params waits (answers "not yet", ``None``) until
  that many pages are visible, at most ``handoff_timeout`` seconds, then takes what is there.
- Per request, ``kv_transfer_params={"tensorcast": {"load": False, "save": False}}`` opts out.

Does not own: the page bytes (``vllm_connector`` gathers and scatters blocks) or any vLLM object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tensorcast.errors import InvalidArgument
from tensorcast.kv.keys import KVLayout, PageKeyChain

__all__ = ["HANDOFF_PARAM", "ConnectorState", "StepTransfers", "Transfer"]

HANDOFF_PARAM = "tensorcast_pages"  # in kv_transfer_params: pages the producer stored for this prompt
_OPTIONS_PARAM = "tensorcast"  # in kv_transfer_params: {"load": bool, "save": bool}


@dataclass
class Transfer:
    """Pages ``keys[i]`` <-> block ``block_ids[i]`` of one request."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    first_page: int = 0  # the request's page that keys[0] names


@dataclass
class StepTransfers:
    """One step's work for the workers: loads before the forward pass, saves after it."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class KeyChain(Protocol):
    """A request's page keys as it grows (``kv.keys.PageKeyChain``, ``vllm_block_keys.BlockHashChain``)."""

    keys: list[str]

    def extend(self, tokens: Sequence[int]) -> list[str]: ...


@dataclass
class _Request:
    chain: KeyChain
    load: bool
    save: bool
    handoff_pages: int = 0  # pages a producer handed over (0: no hand-off)
    first_asked: float | None = None
    loadable_pages: int = 0  # full pages of the prompt before its last token
    local_pages: int = 0  # pages vLLM had computed itself when it asked
    matched_pages: int = 0  # pages (beyond local ones) that TensorCast will load
    pending_load: Transfer | None = None
    saved_pages: int = 0  # pages stored (or known stored) from the start of the request


class ConnectorState:
    def __init__(self, layout: KVLayout, *, load: bool, save: bool, handoff_timeout: float,
                 chain: Callable[[str], KeyChain] | None = None) -> None:
        if handoff_timeout < 0:
            raise InvalidArgument("handoff_timeout must be >= 0")
        self.layout = layout
        self.page_size = layout.page_size
        self.load = load
        self.save = save
        self.handoff_timeout = handoff_timeout
        self.requests: dict[str, _Request] = {}
        self._chain = chain or (lambda req_id: PageKeyChain(layout))

    # ----------------------------------------------------------------- lookups
    def _request(self, req_id: str, params: Mapping[str, Any] | None) -> _Request:
        req = self.requests.get(req_id)
        if req is None:
            params = params or {}
            options = params.get(_OPTIONS_PARAM) or {}
            if not isinstance(options, Mapping):
                raise InvalidArgument(f"kv_transfer_params[{_OPTIONS_PARAM!r}] must be a mapping")
            handoff = params.get(HANDOFF_PARAM, 0)
            if not isinstance(handoff, int) or isinstance(handoff, bool) or handoff < 0:
                raise InvalidArgument(f"kv_transfer_params[{HANDOFF_PARAM!r}] must be a page count")
            req = _Request(self._chain(req_id), load=self.load and bool(options.get("load", True)),
                           save=self.save and bool(options.get("save", True)), handoff_pages=handoff)
            self.requests[req_id] = req
        return req

    def probe(self, req_id: str, prompt: Sequence[int], num_computed: int,
              params: Mapping[str, Any] | None) -> list[str]:
        """Keys whose presence decides the match: the loadable pages beyond vLLM's own ``num_computed``
        tokens (empty: nothing to ask)."""
        req = self._request(req_id, params)
        if not req.load:
            return []
        loadable = (len(prompt) - 1) // self.page_size  # the last token is always computed
        keys = req.chain.extend(prompt)[:loadable]
        req.loadable_pages = loadable
        req.local_pages = min(num_computed // self.page_size, loadable)
        return keys[req.local_pages:]

    def matched(self, req_id: str, present: int, now: float) -> int | None:
        """Tokens to load given ``present`` leading probed pages found, or ``None`` to be asked again later
        (a hand-off still arriving)."""
        req = self.requests[req_id]
        if req.handoff_pages:
            want = min(req.handoff_pages, req.loadable_pages)
            if req.first_asked is None:
                req.first_asked = now
            if req.local_pages + present < want and now - req.first_asked < self.handoff_timeout:
                return None
        req.matched_pages = present
        return present * self.page_size

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's from its start) and will treat ``num_external_tokens``
        as loaded: record the load for the next step."""
        req = self.requests.get(req_id)
        if req is None or num_external_tokens <= 0:
            return
        if num_external_tokens % self.page_size:
            raise InvalidArgument(f"vLLM asked for {num_external_tokens} external tokens, not whole pages of "
                                  f"{self.page_size}")
        n = num_external_tokens // self.page_size
        first = req.local_pages
        keys = req.chain.keys[first : first + n]
        blocks = list(block_ids[first : first + n])
        if len(keys) != n or len(blocks) != n:
            raise InvalidArgument(f"a load of {n} pages from page {first}: only {len(keys)} keys and "
                                  f"{len(blocks)} blocks")
        req.pending_load = Transfer(req_id, keys, blocks)
        req.saved_pages = max(req.saved_pages, first + n)  # loaded pages are stored already

    # ----------------------------------------------------------------- each step
    def step(self, scheduled: Sequence[tuple[str, Sequence[int], Sequence[int], int]]) -> StepTransfers:
        """The transfers of one step. ``scheduled``: for each request of the step, (id, its token ids so
        far, its block ids, tokens computed by the end of this step)."""
        out = StepTransfers()
        for req_id, tokens, block_ids, computed in scheduled:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.pending_load is not None:
                out.loads.append(req.pending_load)
                req.pending_load = None
            if not req.save:
                continue
            full = min(computed, len(tokens)) // self.page_size
            if full <= req.saved_pages:
                continue
            keys = req.chain.extend(tokens[: full * self.page_size])
            full = min(full, len(keys))  # keys named by the engine's hashes: only the blocks it has hashed
            if full <= req.saved_pages:
                continue
            blocks = list(block_ids[req.saved_pages : full])
            if len(blocks) == full - req.saved_pages:  # else: blocks not known here (yet); saved next step
                out.saves.append(Transfer(req_id, keys[req.saved_pages : full], blocks, req.saved_pages))
                req.saved_pages = full
        return out

    def parent_key(self, save: Transfer) -> str | None:
        """The key of the page before a save's first (None at the start of the request)."""
        req = self.requests.get(save.req_id)
        if req is None or save.first_page == 0 or len(req.chain.keys) < save.first_page:
            return None
        return req.chain.keys[save.first_page - 1]

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """Forget a finished request; a producer's answer carries the pages it stored (the hand-off)."""
        req = self.requests.pop(req_id, None)
        if req is None or not req.save or not req.saved_pages:
            return None
        return {HANDOFF_PARAM: req.saved_pages}
