"""Replaying a Mooncake-format request trace as sessions of turns with real prefix reuse.

The format (Mooncake's published traces): one JSON object per line with ``timestamp`` (ms), ``input_length``
and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the prompt; equal ids at equal
positions mean an equal prefix. No trace path is built in: callers pass one (``--trace PATH``).

Owns: parsing (``parse_records``, ``read_trace`` — the only I/O here), grouping requests into sessions
(``group_sessions``), turning blocks into token ids (``block_token_ids``: a pure function of the hash id, so
equal ids give equal tokens and real engines see the trace's prefix reuse) and building ``Session``s
(``replay``, ``load_trace``).

Sessions. Requests are taken in timestamp order (file order on ties). A session's open end is the hash ids
of its last request's *whole* blocks (``input_length // 512`` of them: the last, partial block gets another
id once later tokens fill it). A request continues the session whose open end is the longest prefix of its
own hash ids, provided that prefix is at least one block long, shorter than the request (a continuation adds
at least one block: the previous output and the new message) and held by no other session's requests so far
(a prefix several sessions hold, such as a common system prompt, says nothing about which conversation a
request belongs to). Otherwise the request starts a new session. Requests that share nothing are never
merged.

Scaling (``scale``, for CPU engines): a block becomes ``round(512 * scale)`` tokens (at least 1), lengths
are multiplied by ``scale`` (output at least 1); the prompt keeps one block per hash id, the last one
possibly partial. Times are not scaled.

Does not own: drawn workloads (``workloads.agent``) or pacing the replay (a driver uses ``arrival_s``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.workloads.turns import Session, TokenIds, Turn

__all__ = ["BLOCK_TOKENS", "TraceRecord", "block_token_ids", "group_sessions", "load_trace", "parse_records",
           "read_trace", "replay"]

BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _record(obj: Any, where: str) -> TraceRecord:
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {clip(obj)}")
    try:
        ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    except KeyError as exc:
        raise InvalidArgument(f"{where}: missing field {exc.args[0]!r}") from None
    ok_ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (n_in, n_out))
    ok_ids = isinstance(ids, list) and all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids)
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not ok_ints or not ok_ids:
        raise InvalidArgument(f"{where}: timestamp must be a number, lengths and hash_ids non-negative "
                              f"integers, got {clip(obj)}")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids))


def parse_records(lines: Iterable[str], limit: int | None = None, source: str = "trace") -> list[TraceRecord]:
    """The records of JSONL ``lines`` (blank lines skipped), the first ``limit`` of them if given."""
    if limit is not None and limit < 0:
        raise InvalidArgument(f"limit must be >= 0, got {limit}")
    out: list[TraceRecord] = []
    for lineno, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{source}:{lineno}: not JSON ({exc.msg})") from None
        out.append(_record(obj, f"{source}:{lineno}"))
    return out


def read_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRecord]:
    """Read a trace file's records (the first ``limit`` if given)."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_records(f, limit, source=os.fspath(path))
    except FileNotFoundError:
        raise NotFound(f"no trace file at {clip(os.fspath(path))}") from None


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    owner: int = -1  # the first session whose requests hold this prefix
    shared: bool = False  # requests of several sessions hold it (a common system prompt)
    open_end: bool = False  # the owner's last request's whole blocks end here


def group_sessions(records: Sequence[TraceRecord], block_tokens: int = BLOCK_TOKENS) -> list[list[int]]:
    """Indices into ``records`` of each session's requests, in arrival order; sessions ordered by their first
    request (the rule is in the module docstring)."""
    order = sorted(range(len(records)), key=lambda i: records[i].timestamp_ms)
    root = _Node()
    sessions: list[list[int]] = []
    for i in order:
        ids = records[i].hash_ids
        node, found = root, None
        for depth, h in enumerate(ids, 1):  # the deepest open end on this request's path, shorter than it
            nxt = node.children.get(h)
            if nxt is None:
                break
            node = nxt
            if node.open_end and not node.shared and depth < len(ids):
                found = node
        if found is None:
            sid = len(sessions)
            sessions.append([i])
        else:
            sid, found.open_end = found.owner, False
            sessions[sid].append(i)
        end = root
        for h in ids[:records[i].input_length // block_tokens]:
            end = end.children.setdefault(h, _Node())
            end.shared = end.shared or end.owner not in (-1, sid)
            end.owner = sid if end.owner == -1 else end.owner
        end.open_end = end is not root
    return sessions


def block_token_ids(hash_id: int, n: int, vocab_size: int) -> TokenIds:
    """``n`` token ids for the block named ``hash_id``: a fixed function of the id (SplitMix64 of the id and
    the position), so equal ids give equal tokens in every run and process."""
    x = np.arange(n, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64((hash_id * _GOLDEN + 1) & _MASK64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab_size)).astype(np.int32)


def _prompt(rec: TraceRecord, bt: int, scale: float, vocab_size: int) -> TokenIds:
    n = len(rec.hash_ids)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    length = min(n * bt, max((n - 1) * bt + 1, round(rec.input_length * scale)))
    tokens = np.concatenate([block_token_ids(h, bt, vocab_size) for h in rec.hash_ids])[:length]
    tokens.flags.writeable = False
    return tokens


def _shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def replay(records: Sequence[TraceRecord], *, scale: float = 1.0, vocab_size: int = 32000,
           block_tokens: int = BLOCK_TOKENS, session_prefix: str = "trace") -> list[Session]:
    """The trace's sessions, each turn carrying its arrival time (seconds after the first request)."""
    if scale <= 0 or vocab_size < 2 or block_tokens < 1:
        raise InvalidArgument(f"bad replay settings: scale={scale}, vocab_size={vocab_size}, "
                              f"block_tokens={block_tokens}")
    bt = max(1, round(block_tokens * scale))
    t0 = min((r.timestamp_ms for r in records), default=0.0)
    out: list[Session] = []
    for k, members in enumerate(group_sessions(records, block_tokens)):
        sid = f"{session_prefix}-{k:05d}"
        turns: list[Turn] = []
        for t, i in enumerate(members):
            rec = records[i]
            prompt = _prompt(rec, bt, scale, vocab_size)
            arrival = (rec.timestamp_ms - t0) / 1000.0
            if t == 0:
                gap, new = 0.0, len(prompt)
            else:
                prev = records[members[t - 1]]
                gap = arrival - (prev.timestamp_ms - t0) / 1000.0
                new = max(0, len(prompt) - _shared_blocks(prev.hash_ids, rec.hash_ids) * bt)
            out_tokens = max(1, round(rec.output_length * scale))
            turns.append(Turn(sid, t, gap, prompt, new, out_tokens, arrival_s=arrival))
        out.append(Session(sid, tuple(turns)))
    return out


def load_trace(path: str | os.PathLike[str], *, scale: float = 1.0, limit: int | None = None,
               vocab_size: int = 32000, block_tokens: int = BLOCK_TOKENS) -> list[Session]:
    """Read a Mooncake-format trace (the first ``limit`` requests if given) and replay it as sessions."""
    return replay(read_trace(path, limit), scale=scale, vocab_size=vocab_size, block_tokens=block_tokens)
