"""Every tunable of TensorCast: one named key, one default, one place.

Owns: the table: every key, grouped by process (``wire``, ``gs``, ``worker``, ``client``, ...), its default and
why it is there; which keys are sizes; and the machine's default host id. Values come, lowest priority first,
from the defaults below, a TOML file (``--config FILE`` or ``TENSORCAST_CONFIG``), environment variables
(``TENSORCAST_<SECTION>_<KEY>``, e.g. ``TENSORCAST_WORKER_MEMORY_CAPACITY=8GiB``) and command-line flags.
Sizes accept integers or strings with a unit (``512MiB``, ``4GB``). Unknown keys and bad values raise
``InvalidArgument`` naming the key. Does not own: how the sources are read, layered, coerced and checked
(``config_loading``), or acting on the configuration.
"""

from __future__ import annotations

import os
import socket
from typing import Annotated, Any

import msgspec

from tensorcast.config_loading import check_numbers, check_token, convert, layered, nest

__all__ = ["ClientConfig", "Config", "GSConfig", "KVConfig", "MetricsConfig", "TLSConfig", "TracingConfig",
           "TransportConfig", "WeightsConfig", "WireConfig", "WorkerConfig", "default_host_id"]


def default_host_id() -> str:
    """The machine's identity for same-host decisions (shared memory is only tried between equal ids)."""
    return socket.gethostname()


class WireConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Largest control message body accepted; anything larger is refused with ResourceExhausted.
    max_frame_bytes: int = 64 * 1024**2
    # Largest frame accepted before a connection has authenticated (a Hello is a few hundred bytes): no
    # memory is committed to an unauthenticated peer beyond this.
    max_handshake_bytes: int = 4096
    # Bytes this process may hold at once in frame bodies and payloads still being received into fresh
    # buffers (a receiver-chosen destination, such as a segment being filled, does not count); beyond it,
    # further such frames are refused with ResourceExhausted.
    receive_budget_bytes: int = 1024**3
    # Connections a server accepts at once; more are closed at accept.
    max_connections: int = 4096
    # Of those, connections that have not completed their handshake; at the cap the oldest is closed for a
    # new one, so sockets left silent (or re-opened as they are closed) cannot lock other peers out.
    max_unauthenticated: int = 256
    # Largest payload a peer may push without a receiver-chosen destination buffer.
    max_unsolicited_payload_bytes: int = 64 * 1024**2
    # Payloads are written in chunks of this size so flow control can pause the sender.
    send_chunk_bytes: int = 4 * 1024**2
    # A connection that has not completed its handshake by then is closed.
    handshake_timeout: float = 10.0
    # A control connection whose peer stops answering (its host died, or a network partition) is closed after
    # about this long, so that calls fail over instead of waiting out their deadlines: TCP keepalive probes
    # while idle, TCP_USER_TIMEOUT while data is unacknowledged. The peer's kernel answers for it, so a busy
    # peer is not mistaken for a dead one. 0 turns it off.
    dead_peer_timeout: float = 10.0
    connect_timeout: float = 10.0
    # Fault injection for tests: corrupt one chunk of each of the next N payloads this process sends.
    fault_corrupt_payload_chunks: int = 0


class GSConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 0
    # SQLite durability: FULL syncs the WAL on every commit (survives power loss); NORMAL survives
    # process crashes only.
    sqlite_synchronous: str = "FULL"
    # A worker is dead once no heartbeat arrived for this long.
    worker_liveness_timeout: float = 5.0
    # How often expired caller leases are turned into deletions.
    lease_reap_interval: float = 0.5
    # Read leases (gs.read_leases): how long a gateway holding an artifact's memory copy may answer look-ups
    # of its id itself, sparing same-host readers the trip to the store. A delete revokes them before it
    # returns; one holder that cannot be told holds the delete up for at most this long. 0: off.
    read_lease_seconds: float = 2.0
    # How long the store remembers a deleted artifact (why it is gone; that a restarting worker must drop
    # its copy rather than bring it back).
    tombstone_ttl: float = 7 * 24 * 3600.0
    # Most artifacts one ls request returns; callers page through the rest with the cursor.
    list_page_size: int = 1000
    # Shards of the KV-page key space (cluster-wide; every shard home and client learns it from here).
    kv_num_shards: int = 256
    # Longest shard lease a shard home may ask for.
    kv_max_lease_ttl: float = 60.0
    # The metadata on etcd instead of SQLite: its members' client URLs ("http://10.0.0.1:2379,..."). Then any
    # number of global-store processes may serve the same cluster at once.
    etcd_endpoints: str = ""
    # Where this cluster's keys live in etcd (clusters sharing one etcd use different prefixes).
    etcd_prefix: str = "/tensorcast/"
    # The SQLite database's largest size (0: what the disk allows). Full (or the disk full), writes fail with
    # ResourceExhausted (retryable: nothing of them is kept) while reads are still served.
    sqlite_max_bytes: int = 0
    # Per-page locations kept in the global store (PageIndexPut/Get): a benchmark switch only
    # (benchmarks/kv_pages.py measures what shard homes avoid); off, both are refused with InvalidArgument.
    page_index: bool = False
    # Its bounds: keys and bytes of keys per request (InvalidArgument beyond), entries and bytes in all, as
    # written since the store started (ResourceExhausted beyond).
    page_index_max_keys: int = 4096
    page_index_max_request_bytes: int = 1024**2
    page_index_max_entries: int = 100_000
    page_index_max_bytes: int = 16 * 1024**2


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 0
    # The data plane's port (worker-to-worker pulls, remote reads), on ``host``; 0 = a free port, reported in
    # list_workers()' data_address. Fix it when a firewall sits between hosts (docs/deployment.md).
    data_port: int = 0
    roles: tuple[str, ...] = ("basic", "gateway", "shard-home")
    # Bytes of tensor data the memory tier may hold; puts beyond it fail with ResourceExhausted.
    memory_capacity: int = 4 * 1024**3
    heartbeat_interval: float = 1.0
    # A put that was begun but neither committed nor aborted is reclaimed after this long.
    put_timeout: float = 600.0
    # Re-hash bytes that a same-host caller wrote into shared memory before accepting them.
    # Bytes that crossed a network are always verified. Off: such bytes are stored unchecked and checked
    # against their digest once, before anything deduplicates onto them or reads them (docs/architecture.md, Put).
    verify_local_puts: bool = False
    # While idle, check up to this many bytes of unchecked blobs per housekeeping pass (0.5 s), one core at low
    # priority, so that a later dedup or first read rarely waits for the check; 0 turns it off.
    verify_idle_bytes: int = 256 * 1024**2
    # Identity of the host for same-host (shared memory) decisions; tests fake several hosts with it.
    host_id: str = ""
    # Prefix of this worker's shared-memory segment names (under /dev/shm).
    shm_prefix: str = "tensorcast"
    # A directory this worker owns while it runs (a lock naming it, so a second worker on it is refused), where
    # it records its segments' prefix so that the next worker on it frees what a killed one left behind in
    # /dev/shm. "" = none. LocalCluster and `tensorcast up` give worker ID DATA_DIR/workers/ID.
    data_dir: str = ""
    # Directory of the disk tier ("" = no disk tier: durable/ha/cold puts are refused).
    disk_dir: str = ""
    disk_capacity: int = 64 * 1024**3
    # Pre-faulted shared memory kept ready (beyond memory_capacity) so that puts, transfers and checkpoint
    # reads into new segments pay no first-touch page faults (about as costly as the copy itself); built
    # while the worker is idle; 0 disables the stock. Size it to the largest burst expected (e.g. one
    # model's weights on an autoscaling host).
    prefault_bytes: int = 512 * 1024**2
    # The stock is mostly chunks of this size, out of which a batch of tensors (a checkpoint) is carved.
    prefault_chunk_bytes: int = 256 * 1024**2
    # The stock is built only after the worker has been idle this long: right after a load, the engine
    # that asked for it is starting up on the same CPUs.
    prefault_idle_seconds: float = 2.0
    # Bytes this worker may keep on its CUDA devices (prefetch(..., device="cuda:N"), handed to same-host
    # callers with CUDA IPC); 0 = limited only by the devices' memory. Ignored without CUDA.
    device_capacity: int = 0
    # Objects up to this size live in slab arenas of arena_bytes each instead of a segment each.
    small_object_bytes: int = 256 * 1024
    arena_bytes: int = 16 * 1024**2
    # Above the high watermark (fraction of memory_capacity) evictable replicas are evicted, LRU first,
    # until usage is under the low watermark.
    memory_high_watermark: float = 0.95
    memory_low_watermark: float = 0.85
    # How long the "cold" placement keeps its memory copy after the put (the disk copy stays).
    cold_memory_ttl: float = 60.0
    # How often a worker asks the global store which artifacts it holds have fewer copies on live workers than
    # their placement wants (a worker's loss, a restart that lost its memory, an evicted copy), and has other
    # workers pull copies of those it is the lowest-id live holder of; at most repair_parallel artifacts at once,
    # each copy given up after repair_timeout (or once its target stops heartbeating) and tried elsewhere.
    repair_interval: float = 2.0
    repair_parallel: int = 4
    repair_timeout: float = 600.0
    # Attempts per plan step (the first try included) for retryable failures, within the deadline.
    plan_max_attempts: int = 5
    # Fault injection for tests: corrupt the next N data-plane chunks this worker sends.
    fault_corrupt_chunks: int = 0


class WeightsConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Directories a worker's from_disk may register checkpoints from, besides its data dir (a path resolved
    # through its symlinks must lie under one; others are refused with PermissionDenied, before a byte is read).
    # Relative ones are the worker's working directory's. LocalCluster and `tensorcast up` add the directory
    # they were started from when this is left empty.
    allowed_roots: tuple[str, ...] = ()
    # A publisher checksums each tensor in chunks of about this many bytes (whole rows), so that a version
    # records which chunks changed since the previous one and a reader holding that one reads those only
    # (weights.delta). Smaller: finer deltas, a larger record (16 bytes of checksum per chunk at the publisher).
    delta_chunk_bytes: Annotated[int, msgspec.Meta(ge=1)] = 256 * 1024
    # Object storage (weights.object_store): the s3:// prefixes from_disk may register checkpoints from
    # ("s3://bucket" or "s3://bucket/models/"; a URL must start with one). Empty: none, every s3:// path is
    # refused with PermissionDenied (a worker reads with its own credentials, not the caller's).
    object_prefixes: tuple[str, ...] = ()
    # Where and as whom: empty fields follow the standard AWS environment and files (AWS_ENDPOINT_URL,
    # AWS_REGION, AWS_PROFILE, AWS_ACCESS_KEY_ID, ~/.aws/config, ...). anonymous: unsigned requests (public
    # buckets; also AWS_NO_SIGN_REQUEST=true).
    object_endpoint_url: str = ""
    object_region: str = ""
    object_profile: str = ""
    object_anonymous: bool = False
    # Ranged GETs in flight per load, and the bytes each asks for: an S3 connection carries ~50-100 MB/s, so a
    # link is filled by many at once (benchmarks/weights_load.py --s3 measures the knee).
    object_streams: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    object_chunk_bytes: Annotated[int, msgspec.Meta(ge=64 * 1024)] = 8 * 1024**2
    # Attempts of one ranged GET on throttling (503 SlowDown), server errors and connections reset mid-body,
    # with exponential backoff from object_backoff seconds (jittered, capped at 5 s); and each request's
    # connect/read timeout.
    object_attempts: Annotated[int, msgspec.Meta(ge=1)] = 6
    object_backoff: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    object_timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0


class TransportConfig(msgspec.Struct, frozen=True, kw_only=True):
    # The data plane between workers and to remote callers: "tcp" (parallel streams), or "inproc" (one
    # process only: unit tests).
    kind: str = "tcp"
    # Parallel TCP streams per transfer; 0 = automatic by size (1 below auto_streams_min_bytes).
    streams: int = 0
    max_streams: int = 4
    auto_streams_min_bytes: int = 32 * 1024**2
    # Retries of a transfer whose chunk failed its checksum or whose source failed, before trying
    # another replica.
    retries: int = 2
    # Data-plane connections a worker serves at once, in all and from one peer address; more are closed at
    # accept. Idle (authenticated) connections wait in one selector thread, not a thread each, and are
    # closed after idle_timeout seconds.
    max_connections: int = 512
    max_connections_per_peer: int = 256
    idle_timeout: float = 600.0
    # Connections that have not completed their handshake, at most; at the cap the oldest is closed for a new
    # one (silent sockets cannot lock authenticated peers out).
    max_unauthenticated: int = 64
    # A range being sent must move each chunk (4 MiB) within this long, or the connection is closed: a peer
    # that stops reading does not hold a sender thread.
    send_progress_timeout: float = 30.0


class KVConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Bytes of KV pages a shard home keeps (LRU beyond that: a miss, never wrong data).
    memory_capacity: int = 1024**3
    arena_bytes: int = 64 * 1024**2
    max_page_bytes: int = 4 * 1024**2
    # Default page TTL in seconds (pages are system-owned with a TTL unless a put gives one).
    page_ttl: float = 3600.0
    # Shard lease length and renewal period; a dead home's shards move within lease_ttl + renew_interval.
    lease_ttl: float = 3.0
    renew_interval: float = 1.0
    # A shard home stops serving a shard this long before its lease can run out at the global store (it
    # counts the lease from when it sent the request, which is already earlier; this covers its own clock
    # running slow and a delayed check). Must be under lease_ttl - renew_interval.
    lease_margin: float = 0.2
    # HRW candidates per shard that compete for its lease.
    candidates: int = 3
    # A client splits a batch so that one request carries at most this many page bytes.
    max_batch_bytes: int = 32 * 1024**2
    # A shard home refuses a request declaring more page bytes than this (before reserving anything).
    max_request_bytes: int = 64 * 1024**2
    # How long a KV call waits for its shards to settle on live homes (at start-up, after a home died)
    # before writes raise Unavailable (reads return misses); and how long one request to a home may take.
    handover_timeout: float = 10.0
    request_timeout: float = 5.0
    # Answer exists/present for pages of a same-host shard home from its shared-memory presence table, without
    # a round trip (docs/kv-pages.md); off: every lookup asks the home.
    same_host_exists: bool = True
    # Copies of every page: the shard's holder and its next replicas - 1 best-ranked shard homes, each put
    # acknowledged once all have it (2: a worker's kill -9 loses no acknowledged page; costs a copy per put).
    replicas: int = 1
    # A home that stops serving a shard keeps its pages this long for the next holder to pull (a hand-over)
    # before it drops them; one of the shard's best-ranked homes (kv.replicas of them) keeps them.
    handover_keep_seconds: float = 30.0
    # KV events (vLLM's KVEventBatch over ZeroMQ, docs/kv-engines.md): "" = off; else the endpoint this
    # shard home's PUB socket binds ("tcp://127.0.0.1:0": a free port, reported by list_workers() as
    # kv_events_url), the ROUTER endpoint answering replays ("" = none), and the topic of every message.
    events_endpoint: str = ""
    events_replay_endpoint: str = ""
    events_topic: str = "tensorcast"
    # Batches a replay can reach back (the publisher's buffer).
    events_buffer: int = 10_000
    # The stream is unauthenticated (vLLM's, which routers speak): it names the cached blocks' hashes, never
    # bytes. Off: endpoints must be loopback or ipc://; on: any interface (a trusted network only).
    events_allow_remote: bool = False


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Default deadline of a call, in seconds, when the caller gives none (None = wait forever).
    timeout: float | None = 300.0
    host_id: str = ""
    # Also verify the whole-tensor BLAKE3 digest of bytes read across a network (every chunk is always
    # checked against the sender's xxh3 checksum; this adds an end-to-end check at ~5 GB/s).
    verify_remote_reads: bool = False
    # Try shared memory when the worker reports the same host id.
    use_shared_memory: bool = True
    # Same-host puts write through mappings of the worker's segments kept from one put to the next (a copy
    # into pages already faulted in); one unused for this long is unmapped, since it also keeps the memory
    # of a segment the worker has freed meanwhile.
    write_maps_idle_seconds: float = 5.0
    # Same-host reads map the places a worker named for an artifact's tensors the first time, kept for this
    # many artifacts (0: ask the worker every time). The reads are reported to the worker afterwards, at most
    # every ``read_report_seconds``, for its least-recently-used order and metrics (client.read_maps).
    read_map_entries: int = 4096
    read_report_seconds: float = 0.25
    # A synchronous client looks artifacts up on the caller's own thread, over a connection of that thread's
    # to the gateway in use (client.thread_calls), instead of handing the call to its event-loop thread and
    # waiting for it there: two thread wake-ups fewer per lookup. Off: every call goes through the loop.
    thread_lookups: bool = True
    # A Distributed Checkpoint being loaded (integrations.torch_dcp) is marked with a key leased for this many
    # seconds, so that a writer's keep_last does not collect it meanwhile; a reader that dies leaves a mark that
    # lapses after this long.
    checkpoint_read_lease: float = 600.0


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Every process (global store, workers, instances) serves Prometheus metrics at http://HOST:PORT/metrics
    # (https with tls.enabled); the global store also serves the dashboard there (``/``). With a cluster token,
    # every HTTP request but /healthz must carry a credential of any role, or the secret
    # (``Authorization: Bearer CREDENTIAL``, or basic auth with it as the password).
    enabled: bool = True
    # "" = the process's own bind address (loopback unless configured otherwise).
    host: str = ""
    # 0 = a free port, reported by list_workers(), LocalCluster.metrics_urls and `tensorcast status --json`.
    port: int = 0
    # How often the dashboard page refreshes, in seconds.
    dashboard_refresh: float = 1.0
    # Without a cluster token, HTTP requests must name the server in their Host header: a loopback name, the
    # bound address, or one of these (a name that points here, e.g. "tc.internal"); others get 421, so a web
    # page re-pointed at 127.0.0.1 (DNS rebinding) cannot read the cluster. With a token, credentials decide.
    allowed_hosts: tuple[str, ...] = ()


class TracingConfig(msgspec.Struct, frozen=True, kw_only=True):
    # OpenTelemetry spans for operations, RPCs and plan steps (needs the "tracing" extra): "" (off), "otlp"
    # (opentelemetry-exporter-otlp, configured by the standard OTEL_EXPORTER_OTLP_* variables), "console", or
    # "file" (one JSON object per span, appended to ``file``; for tests and offline inspection).
    exporter: str = ""
    file: str = ""


class TLSConfig(msgspec.Struct, frozen=True, kw_only=True):
    # TLS (the standard library's ssl, TLS 1.2 or later) on every port a process serves (control RPC, data plane,
    # HTTP) and on every connection it opens. Every process of a cluster and its callers must agree: a plain-text
    # peer of a TLS port is refused, and so is the reverse (docs/security.md).
    enabled: bool = False
    # This process's certificate chain and private key (PEM files). Servers need them; a caller presents them
    # when the servers require client certificates.
    cert_file: str = ""
    key_file: str = ""
    # The CA certificates (PEM) that peers' certificates must chain to; "" = the system's CAs.
    ca_file: str = ""
    # Mutual TLS: a control or data-plane connection whose peer presents no certificate signed by ca_file is
    # refused. The HTTP endpoint asks for none (probes and scrapers authenticate with a credential).
    require_client_cert: bool = False
    # The name every server's certificate is checked against (one name for the whole cluster, when servers are
    # dialled by IP address); "" = the host of the address dialled.
    server_name: str = ""


class Config(msgspec.Struct, frozen=True, kw_only=True):
    # The cluster secret, or a credential derived from it ("ROLE:HEX"; docs/security.md). None: no
    # authentication, and every process refuses to listen beyond loopback.
    token: str | None = None
    wire: WireConfig = WireConfig()
    gs: GSConfig = GSConfig()
    worker: WorkerConfig = WorkerConfig()
    weights: WeightsConfig = WeightsConfig()
    transport: TransportConfig = TransportConfig()
    kv: KVConfig = KVConfig()
    client: ClientConfig = ClientConfig()
    metrics: MetricsConfig = MetricsConfig()
    tracing: TracingConfig = TracingConfig()
    tls: TLSConfig = TLSConfig()

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> Config:
        """Defaults < TOML file < environment < ``overrides`` (``{"worker.memory_capacity": "1GiB"}``)."""
        return cls.from_flat(layered(path, overrides, _SECTIONS))

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> Config:
        config = convert(nest(flat, _SECTIONS, _SIZE_KEYS), cls)
        check_token(config.token)
        check_numbers(config, _SECTIONS)
        return config


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "wire": WireConfig,
    "gs": GSConfig,
    "worker": WorkerConfig,
    "weights": WeightsConfig,
    "transport": TransportConfig,
    "kv": KVConfig,
    "client": ClientConfig,
    "metrics": MetricsConfig,
    "tracing": TracingConfig,
    "tls": TLSConfig,
}
# Keys whose values are sizes (integers, or strings with a unit: parse_size), whichever section they are in.
_SIZE_KEYS = {
    "max_frame_bytes", "max_handshake_bytes", "receive_budget_bytes", "max_unsolicited_payload_bytes",
    "send_chunk_bytes", "memory_capacity", "disk_capacity", "prefault_bytes", "prefault_chunk_bytes", "device_capacity",
    "small_object_bytes", "arena_bytes", "verify_idle_bytes", "auto_streams_min_bytes", "max_page_bytes",
    "max_batch_bytes", "max_request_bytes", "sqlite_max_bytes", "page_index_max_request_bytes", "page_index_max_bytes",
    "delta_chunk_bytes",
}
