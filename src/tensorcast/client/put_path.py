"""Which way a put's bytes go to the worker: one decision, pure, for ``client.puts`` to carry out.

Owns the choice among the put paths and the two turns a put may take on the way (the sizes that decide
them are here, with why):

==========================  ==================================================================================
path                        when
==========================  ==================================================================================
``INLINE``                  at most ``INLINE_PUT_BYTES`` in all: the bytes travel with ``PutBegin`` and the
                            worker hashes, stores and commits them (one round trip)
``HASH_WHILE_WRITING``      same host, at least ``HASH_WHILE_WRITING_BYTES`` not hashed yet: written into the
                            worker's shared memory while hashed on threads; digests with the commit
``HASH_FIRST``              same host otherwise: hashed first (the worker skips bytes it holds), then written
``STREAMED``                another host, or a ``/dev/shm`` this process cannot see: checksummed payloads
==========================  ==================================================================================

Turns (``after``): a worker that must make room answers ``HASH_WHILE_WRITING`` with ``digests_first`` (with
the digests it skips the bytes it holds already; the worker's side of that is ``pool.placement.
admit_digests_later``), and the put goes on as ``HASH_FIRST``; a same-host segment this process cannot open
(same host id, another container) turns a same-host path into ``STREAMED``. Also whether a copy or a hash
runs on the event loop or on a thread (``on_thread``). No I/O, no clock. Does not own: carrying the paths out
(``client.puts``) or what the worker decides (``worker.puts``).
"""

from __future__ import annotations

import enum

__all__ = ["HASH_WHILE_WRITING_BYTES", "INLINE_PUT_BYTES", "INLINE_WRITE_BYTES", "PutPath", "PutTurn", "after",
           "choose_put_path", "on_thread"]

# Puts of at most this many bytes send them with PutBegin (one round trip; the worker hashes them): below
# this, a round trip costs more than moving the bytes through the connection and hashing them on the worker.
INLINE_PUT_BYTES = 256 << 10
# Same-host writes and hashing of fewer bytes than this run on the event loop (a fraction of a millisecond
# each: a copy into pages faulted in already, BLAKE3 on several threads); a thread hop costs about as much.
INLINE_WRITE_BYTES = 4 << 20
# Same-host puts with at least this many bytes not hashed yet hash them while they write them (PutBegin's
# digests_later); below this, both run on the event loop one after the other (a thread hop costs more).
HASH_WHILE_WRITING_BYTES = INLINE_WRITE_BYTES


class PutPath(enum.Enum):
    INLINE = "inline"
    HASH_WHILE_WRITING = "hash-while-writing"
    HASH_FIRST = "hash-first"
    STREAMED = "streamed"


class PutTurn(enum.Enum):
    DIGESTS_FIRST = "digests-first"  # the worker must make room: it wants the digests before the bytes
    SHM_UNREACHABLE = "shm-unreachable"  # same host id, but its /dev/shm is not this process's


def choose_put_path(total_bytes: int, unhashed_bytes: int, same_host: bool) -> PutPath:
    """The path of a put of ``total_bytes``, ``unhashed_bytes`` of them without a digest yet, to a worker on
    this host (``same_host``: same host id and its shared memory reachable, as far as this process knows)."""
    if total_bytes < 0 or not 0 <= unhashed_bytes <= total_bytes:
        raise ValueError(f"put of {total_bytes} bytes with {unhashed_bytes} not hashed")
    if total_bytes <= INLINE_PUT_BYTES:
        return PutPath.INLINE
    if not same_host:
        return PutPath.STREAMED
    return PutPath.HASH_WHILE_WRITING if unhashed_bytes >= HASH_WHILE_WRITING_BYTES else PutPath.HASH_FIRST


def after(path: PutPath, turn: PutTurn) -> PutPath:
    """The path a put on ``path`` continues on after ``turn``; ``ValueError`` for a turn that cannot happen
    on that path (a bug in the caller: the worker answers ``digests_first`` only to ``digests_later``)."""
    if turn is PutTurn.DIGESTS_FIRST and path is PutPath.HASH_WHILE_WRITING:
        return PutPath.HASH_FIRST
    if turn is PutTurn.SHM_UNREACHABLE and path in (PutPath.HASH_WHILE_WRITING, PutPath.HASH_FIRST):
        return PutPath.STREAMED
    raise ValueError(f"a put on path {path.value} cannot take the turn {turn.value}")


def on_thread(nbytes: int) -> bool:
    """Whether a copy or a hash of ``nbytes`` runs on a thread (else on the event loop: a hop costs more)."""
    return nbytes >= INLINE_WRITE_BYTES
