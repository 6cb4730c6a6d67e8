"""Optional OpenTelemetry spans, keyed by the trace id every TensorCast request already carries.

Owns: setting up a tracer for this process (``configure`` from ``TracingConfig``, or ``use_provider`` for a
caller's own provider), the mapping of a TensorCast trace id onto an OpenTelemetry one (the 16 hex digits,
zero-extended to 128 bits: search a trace viewer for ``0000000000000000<trace id>``), and ``span``: a span
that joins the caller's span when one is active in this task, else the remote parent whose span id came in
the request's envelope, else starts the trace. With no tracer (the default, or the ``tracing`` extra not
installed) ``span`` costs one check. Does not own: where spans are opened (RPCs, plan steps) or exporting
beyond the exporters named in the configuration.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from tensorcast.config import TracingConfig
from tensorcast.errors import InvalidArgument, TensorCastError

__all__ = ["active", "check_exporter", "configure", "current_span_id", "otel_trace_id", "provider", "span",
           "use_provider"]

EXPORTERS = ("", "otlp", "console", "file")

_tracer: Any = None
_roots = True  # whether this process may start traces (callers) or only continue them (cluster processes)
# The span id of the span active in this task (sent in request envelopes as the remote parent).
_current_span: contextvars.ContextVar[int] = contextvars.ContextVar("tensorcast_span", default=0)
# The trace id a new root span must get (read by the id generator below).
_root_trace: contextvars.ContextVar[int] = contextvars.ContextVar("tensorcast_root_trace", default=0)


def otel_trace_id(trace_id: str) -> int:
    """The 128-bit OpenTelemetry trace id of a TensorCast trace id (hex ids map to themselves)."""
    try:
        value = int(trace_id, 16)
    except ValueError:
        value = 0
    if not 0 < value < 1 << 128:
        import hashlib  # a caller-chosen trace id that is not hex: a stable hash of it

        value = int.from_bytes(hashlib.blake2b(trace_id.encode(), digest_size=16).digest(), "big") or 1
    return value


def current_span_id() -> int:
    return _current_span.get()


def active() -> bool:
    """Whether this process emits spans."""
    return _tracer is not None


def provider(exporter: Any, service: str, *, batch: bool = False) -> Any:
    """A ``TracerProvider`` exporting to ``exporter`` whose root spans take TensorCast's trace ids."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _TraceIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            return _root_trace.get() or super().generate_trace_id()

    out = TracerProvider(resource=Resource.create({"service.name": service, "process.pid": os.getpid()}),
                         id_generator=_TraceIds())
    out.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return out


def use_provider(tracer_provider: Any | None, *, roots: bool = True) -> None:
    """Emit this process's spans through ``tracer_provider`` (None: stop emitting). ``roots=False`` only
    continues traces that came in requests. The flag goes with the provider: a process that hosted a worker
    (whose ``configure`` said ``roots=False``) and then sets a caller's provider starts traces again."""
    global _tracer, _roots
    _tracer = None if tracer_provider is None else tracer_provider.get_tracer("tensorcast")
    _roots = roots


def check_exporter(config: TracingConfig) -> None:
    """``InvalidArgument`` for an unknown ``tracing.exporter`` (or ``file`` without ``tracing.file``)."""
    if config.exporter not in EXPORTERS:
        raise InvalidArgument(f"tracing.exporter must be one of {[e for e in EXPORTERS if e]} or empty, "
                              f"got {config.exporter!r}")
    if config.exporter == "file" and not config.file:
        raise InvalidArgument("tracing.exporter = file needs tracing.file (a path)")


def configure(config: TracingConfig, service: str, *, roots: bool = True) -> None:
    """Set up this process's tracer from the configuration (``tracing.exporter``). ``roots=False`` (the
    cluster's own processes) only continues traces that callers started, so that background work
    (heartbeats, lease renewals) emits no spans."""
    check_exporter(config)
    if not config.exporter:
        return  # nothing to emit: the process keeps whatever provider (and roots flag) it had
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise InvalidArgument("tracing.exporter is set but OpenTelemetry is not installed: "
                              "pip install 'tensorcast[tracing]'") from None
    if config.exporter == "file":
        use_provider(provider(_FileExporter(config.file), service), roots=roots)
    elif config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        use_provider(provider(ConsoleSpanExporter(), service, batch=True), roots=roots)
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise InvalidArgument("tracing.exporter = otlp needs opentelemetry-exporter-otlp-proto-http: "
                                  "pip install 'tensorcast[otlp]'") from None
        use_provider(provider(OTLPSpanExporter(), service, batch=True), roots=roots)


_NO_SPAN = contextlib.nullcontext()


def span(name: str, trace_id: str, parent_span_id: int = 0, kind: str = "internal",
         attributes: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[None]:
    """A span named ``name`` in the trace ``trace_id`` (a shared no-op without a tracer: every request opens
    one, so that case costs a check, not a generator)."""
    if _tracer is None or not trace_id:
        return _NO_SPAN
    return _span(_tracer, name, trace_id, parent_span_id, kind, attributes)


@contextlib.contextmanager
def _span(tracer: Any, name: str, trace_id: str, parent_span_id: int, kind: str,
          attributes: dict[str, Any] | None) -> Iterator[None]:
    from opentelemetry import trace

    tid = otel_trace_id(trace_id)
    active = trace.get_current_span().get_span_context()
    parent = None
    joined = active.is_valid and active.trace_id == tid
    if not joined and not parent_span_id and not _roots:
        yield  # background work of a cluster process: no trace of its own
        return
    if not joined and parent_span_id:
        remote = trace.SpanContext(trace_id=tid, span_id=parent_span_id, is_remote=True,
                                   trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
        parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    elif not (active.is_valid and active.trace_id == tid):
        parent = trace.set_span_in_context(trace.INVALID_SPAN)  # a new root, whatever this task ran before
    root = _root_trace.set(tid)
    try:
        with tracer.start_as_current_span(name, context=parent, kind=_KINDS[kind], attributes=attributes,
                                          record_exception=False, set_status_on_exception=False) as current:
            token = _current_span.set(current.get_span_context().span_id)
            try:
                yield
            except TensorCastError as exc:
                current.set_status(trace.Status(trace.StatusCode.ERROR, exc.message[:200]))
                current.set_attribute("tensorcast.error_code", exc.code)
                raise
            except BaseException as exc:
                current.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
                raise
            finally:
                _current_span.reset(token)
    finally:
        _root_trace.reset(root)


def _kinds() -> dict[str, Any]:
    try:
        from opentelemetry.trace import SpanKind
    except ImportError:
        return {}
    return {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT, "server": SpanKind.SERVER}


_KINDS = _kinds()


class _FileExporter:
    """Spans as JSON lines appended to one file (one ``write`` per span, so processes can share the file)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for s in spans:
            parent = s.parent.span_id if s.parent is not None else 0
            line = json.dumps({
                "name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
                "parent_span_id": f"{parent:016x}" if parent else "", "kind": s.kind.name,
                "service": s.resource.attributes.get("service.name", ""), "pid": os.getpid(),
                "start": s.start_time, "end": s.end_time, "status": s.status.status_code.name,
                "attributes": dict(s.attributes or {}),
            }) + "\n"
            with self._lock:
                os.write(self._fd, line.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
