"""A small asyncio client for etcd v3: ranges, optimistic transactions, leases and watches over one gRPC
channel to every member of the cluster.

Owns: the channel (all members' addresses in one gRPC target, so that gRPC moves to another member when
one dies), retrying calls that failed because a member was unreachable or lost its leader (within a time
budget), and ``Txn``: read keys, decide, write only if nothing read changed meanwhile (compare on each
key's mod revision), else read again. Uses the generated etcd v3 stubs of ``aetcd`` (its client binds one
host:port; this binds the member list). Does not own: what the keys mean (``gs.etcd``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
from aetcd import rpc

from tensorcast.errors import InvalidArgument, Unavailable

__all__ = ["EtcdClient", "PrefixMirror", "Txn", "parse_endpoints", "prefix_end"]

log = logging.getLogger("tensorcast.etcd")
T = TypeVar("T")

# gRPC codes after which a call may be sent again: the member was unreachable, had no leader, or took too
# long (an election). Any other code is a real answer.
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
# etcd's limit on operations in one transaction (--max-txn-ops, default 128).
MAX_TXN_OPS = 128


def parse_endpoints(urls: str | list[str]) -> list[tuple[str, int]]:
    """``"http://10.0.0.1:2379,http://10.0.0.2:2379"`` (or a list) -> [(host, port)]."""
    items = [u.strip() for u in (urls.split(",") if isinstance(urls, str) else urls) if u.strip()]
    if not items:
        raise InvalidArgument("no etcd endpoints given")
    out = []
    for item in items:
        parts = urlsplit(item if "://" in item else f"http://{item}")
        if parts.scheme not in ("http", "") or not parts.hostname or parts.port is None:
            raise InvalidArgument(f"etcd endpoint {item!r}: expected http://HOST:PORT (TLS is not supported yet)")
        out.append((parts.hostname, parts.port))
    return out


def check_reachable(urls: str | list[str], timeout: float = 2.0) -> None:
    """``Unavailable`` in one line unless at least one endpoint accepts a TCP connection (a quick check
    before starting processes that would otherwise retry for ``gs.etcd_timeout``)."""
    errors = []
    for host, port in parse_endpoints(urls):
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return
        except OSError as exc:
            errors.append(f"{host}:{port} ({exc.strerror or exc})")
    raise Unavailable(f"no etcd endpoint accepts connections: {', '.join(errors)}")


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


def _target(endpoints: list[tuple[str, int]]) -> str:
    """One gRPC target naming every member. A single host name stays a name (``dns:``), which gRPC looks up
    again whenever its connections fail: a Kubernetes Service whose pods come back on new addresses, for
    one. A list of members is resolved now (a gRPC target names one host or a list of addresses)."""
    if len(endpoints) == 1:
        host, port = endpoints[0]
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return f"dns:///{host}:{port}"
    addrs: list[str] = []
    for host, port in endpoints:
        try:
            ips = [str(ipaddress.ip_address(host))]
        except ValueError:
            ips = sorted({str(a[4][0]) for a in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)})
        for ip in ips:
            addrs.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    scheme = "ipv6" if all(a.startswith("[") for a in addrs) else "ipv4"
    return f"{scheme}:{','.join(addrs)}"


@dataclass
class Txn:
    """What one attempt of an optimistic transaction read and wants to write."""

    client: EtcdClient
    reads: dict[bytes, int] = field(default_factory=dict)  # key -> mod revision (0: absent)
    puts: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)  # key -> (value, lease id)
    deletes: set[bytes] = field(default_factory=set)
    # Values already known (a cache, or ``prefetch``): key -> (mod revision, value or None). A stale one only
    # makes the commit fail and the decision run again on fresh reads.
    known: dict[bytes, tuple[int, bytes | None]] = field(default_factory=dict)

    async def get(self, key: bytes) -> bytes | None:
        """A key's value, checked again at commit (the commit fails if it changed)."""
        if key in self.puts:
            return self.puts[key][0]
        if key in self.deletes:
            return None
        if key in self.known:
            rev, value = self.known[key]
        else:
            kv = await self.client.get_kv(key)
            rev, value = (kv.mod_revision, bytes(kv.value)) if kv is not None else (0, None)
        self.reads.setdefault(key, rev)
        return value

    async def prefetch(self, keys: list[bytes]) -> None:
        """Read many keys in one round trip (what ``get`` then returns without asking again)."""
        missing = [k for k in keys if k not in self.known]
        for i in range(0, len(missing), MAX_TXN_OPS):
            self.known.update(await self.client.get_many(missing[i:i + MAX_TXN_OPS]))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.deletes.discard(key)
        self.puts[key] = (value, lease)

    def delete(self, key: bytes) -> None:
        self.puts.pop(key, None)
        self.deletes.add(key)


class EtcdClient:
    def __init__(self, endpoints: str | list[str], *, call_timeout: float = 2.0, retry_budget: float = 15.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.call_timeout = call_timeout
        self.retry_budget = retry_budget
        self._channel: grpc.aio.Channel | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        self.last_revision = 0  # of the last committed transaction

    async def open(self) -> None:
        # pick_first: one member at a time; when it fails, the channel reconnects to the next one.
        self._channel = grpc.aio.insecure_channel(_target(self.endpoints), options=[
            ("grpc.lb_policy_name", "pick_first"), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.keepalive_time_ms", 5000),
            ("grpc.keepalive_timeout_ms", 2000), ("grpc.keepalive_permit_without_calls", 1)])
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` until it answers, while a member is unreachable or electing a leader (within the budget)."""
        deadline = time.monotonic() + self.retry_budget
        delay = 0.05
        while True:
            try:
                return await fn()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY:
                    raise Unavailable(f"etcd {what}: {exc.code().name}: {exc.details()}") from None
                if time.monotonic() + delay > deadline:
                    raise Unavailable(f"etcd {what}: no member answered within {self.retry_budget}s "
                                      f"({exc.code().name}: {exc.details()})") from None
                log.info("etcd %s: %s, retrying", what, exc.code().name)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def ping(self) -> None:
        """One linearizable read, not retried: ``Unavailable`` unless a member with a leader answers within
        ``call_timeout`` (readiness: the cluster can serve reads and writes right now)."""
        try:
            await self._kv.Range(rpc.RangeRequest(key=b"\0", limit=1), timeout=self.call_timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"etcd: {exc.code().name}: {exc.details()}") from None

    # ----------------------------------------------------------------- key-value
    async def get_kv(self, key: bytes) -> Any:
        reply = await self._call("get", lambda: self._kv.Range(rpc.RangeRequest(key=key),
                                                               timeout=self.call_timeout))
        return reply.kvs[0] if reply.kvs else None

    async def get(self, key: bytes) -> bytes | None:
        kv = await self.get_kv(key)
        return None if kv is None else bytes(kv.value)

    async def get_many(self, keys: list[bytes]) -> dict[bytes, tuple[int, bytes | None]]:
        """(mod revision, value or None) of each key, read in one transaction."""
        req = rpc.TxnRequest(success=[rpc.RequestOp(request_range=rpc.RangeRequest(key=k)) for k in keys])
        reply = await self._call("get many", lambda: self._kv.Txn(req, timeout=self.call_timeout))
        out: dict[bytes, tuple[int, bytes | None]] = {}
        for key, resp in zip(keys, reply.responses, strict=True):
            kvs = resp.response_range.kvs
            out[key] = (int(kvs[0].mod_revision), bytes(kvs[0].value)) if kvs else (0, None)
        return out

    async def range(self, start: bytes, end: bytes, limit: int = 0, keys_only: bool = False,
                    count_only: bool = False) -> tuple[list[Any], int, int]:
        """(key-values in key order, count of all in the range, store revision)."""
        req = rpc.RangeRequest(key=start, range_end=end, limit=limit, keys_only=keys_only, count_only=count_only,
                               sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY)
        reply = await self._call("range", lambda: self._kv.Range(req, timeout=self.call_timeout))
        return list(reply.kvs), int(reply.count), int(reply.header.revision)

    async def prefix(self, prefix: bytes, limit: int = 0) -> list[Any]:
        return (await self.range(prefix, prefix_end(prefix), limit))[0]

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write a key; returns the revision it was written at."""
        reply = await self._call("put", lambda: self._kv.Put(rpc.PutRequest(key=key, value=value, lease=lease),
                                                             timeout=self.call_timeout))
        return int(reply.header.revision)

    async def delete_prefix(self, prefix: bytes) -> None:
        req = rpc.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix))
        await self._call("delete", lambda: self._kv.DeleteRange(req, timeout=self.call_timeout))

    async def atomically(self, decide: Callable[[Txn], Awaitable[T]], attempts: int = 64,
                         known: Mapping[bytes, tuple[int, bytes | None]] | None = None) -> T:
        """Run ``decide`` (which reads through the ``Txn`` and records writes), then commit the writes if no
        key it read changed meanwhile; else run it again on fresh values. ``known`` seeds the first attempt's
        reads (a cache: no round trip when it is current). Writes beyond etcd's op limit are refused (callers
        batch). ``last_revision`` is then the revision the writes were committed at."""
        for attempt in range(attempts):
            txn = Txn(self, known=dict(known or {}) if attempt == 0 else {})
            result = await decide(txn)
            if not txn.puts and not txn.deletes:
                return result
            ops = len(txn.puts) + len(txn.deletes)
            if ops + len(txn.reads) > MAX_TXN_OPS:
                raise InvalidArgument(f"an etcd transaction of {ops} writes and {len(txn.reads)} checks exceeds "
                                      f"etcd's limit of {MAX_TXN_OPS} operations")
            compare = [rpc.Compare(key=k, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=rev)
                       for k, rev in txn.reads.items()]
            success = [rpc.RequestOp(request_put=rpc.PutRequest(key=k, value=v, lease=lease))
                       for k, (v, lease) in txn.puts.items()]
            success += [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k)) for k in txn.deletes]
            req = rpc.TxnRequest(compare=compare, success=success)

            def send(req: Any = req) -> Awaitable[Any]:
                return self._kv.Txn(req, timeout=self.call_timeout)  # type: ignore[no-any-return]

            reply = await self._call("txn", send)
            if reply.succeeded:
                self.last_revision = int(reply.header.revision)
                return result
        raise Unavailable(f"etcd transaction still contended after {attempts} attempts")

    # ----------------------------------------------------------------- leases
    async def grant(self, ttl: float) -> int:
        reply = await self._call("lease grant", lambda: self._lease.LeaseGrant(
            rpc.LeaseGrantRequest(TTL=max(1, round(ttl))), timeout=self.call_timeout))
        return int(reply.ID)

    async def keepalive(self, lease: int) -> bool:
        """Refresh a lease once; False when it has expired (its keys are gone)."""
        async def once() -> int:
            call = self._lease.LeaseKeepAlive(timeout=self.call_timeout)
            await call.write(rpc.LeaseKeepAliveRequest(ID=lease))
            reply = await call.read()
            await call.done_writing()
            call.cancel()
            return int(reply.TTL)

        return await self._call("lease keepalive", once) > 0

    async def revoke(self, lease: int) -> None:
        with contextlib.suppress(Unavailable):  # else it expires by itself
            await self._call("lease revoke", lambda: self._lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease),
                                                                             timeout=self.call_timeout))

    # ----------------------------------------------------------------- watches
    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, list[Any]]]:
        """(revision, events) batches for keys under ``prefix`` from ``start_revision`` on, following the
        cluster across member failures; ends only when cancelled. If the revision was compacted meanwhile it
        raises ``Unavailable`` (the caller reads the prefix again)."""
        revision = start_revision
        while True:
            req = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=prefix, range_end=prefix_end(prefix), start_revision=revision, progress_notify=True))
            # "hasleader": a member cut off from its cluster's leader ends the watch instead of going quiet,
            # so the mirror moves to a member that still hears about changes.
            call = self._watch.Watch(metadata=(("hasleader", "true"),))
            try:
                await call.write(req)
                while True:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
                    if reply.compact_revision:
                        raise Unavailable(f"etcd watch from revision {revision}: compacted to "
                                          f"{reply.compact_revision}")
                    if reply.canceled:
                        break
                    if reply.events:
                        revision = int(reply.header.revision) + 1
                        yield int(reply.header.revision), list(reply.events)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY:
                    raise Unavailable(f"etcd watch: {exc.code().name}: {exc.details()}") from None
                await asyncio.sleep(0.1)
            finally:
                call.cancel()


class PrefixMirror:
    """The keys under a prefix, kept in this process's memory by an etcd watch: reading them costs no round
    trip. Changes other processes make arrive within a watch round trip; this process's own writes are
    ``note``d at once (with the revision they were committed at, so that an older event never undoes them).
    After a compaction or a long outage the prefix is read again."""

    def __init__(self, client: EtcdClient, prefix: bytes) -> None:
        self.client = client
        self.prefix = prefix
        self.items: dict[bytes, tuple[int, bytes]] = {}  # key without the prefix -> (mod revision, value)
        self._deleted: dict[bytes, int] = {}  # key -> revision it was deleted at (an older put is stale)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        revision = await self._load()
        self._task = asyncio.ensure_future(self._follow(revision + 1))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _load(self) -> int:
        kvs, _count, revision = await self.client.range(self.prefix, prefix_end(self.prefix))
        self.items = {bytes(kv.key[len(self.prefix):]): (int(kv.mod_revision), bytes(kv.value)) for kv in kvs}
        self._deleted.clear()
        return revision

    def note(self, key: bytes, revision: int, value: bytes | None) -> None:
        """``key`` (without the prefix) was written (``value``) or deleted (None) at ``revision``."""
        cur = self.items.get(key, (self._deleted.get(key, 0), b""))[0]
        if revision < cur:
            return
        if value is None:
            self.items.pop(key, None)
            self._deleted[key] = revision
        else:
            self.items[key] = (revision, value)
            self._deleted.pop(key, None)

    async def _follow(self, revision: int) -> None:
        while True:
            try:
                async for at, events in self.client.watch_prefix(self.prefix, revision):
                    for ev in events:
                        key = bytes(ev.kv.key[len(self.prefix):])
                        self.note(key, int(ev.kv.mod_revision), None if ev.type == 1 else bytes(ev.kv.value))
                    revision = at + 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # compacted, or etcd unreachable past the budget: read it all again
                log.warning("following %r: %s; reading it again", self.prefix, exc)
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    revision = await self._load() + 1
