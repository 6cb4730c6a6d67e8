"""TLS contexts from the ``tls`` configuration: one per process and purpose, made once.

Owns: the server context of the control RPC and the data plane (mutual TLS when ``tls.require_client_cert``),
the HTTP endpoint's (which never asks for a client certificate), the client context every outgoing
connection uses (the peer's certificate checked against ``tls.ca_file`` and the name dialled, or
``tls.server_name``), and turning what ``ssl`` reports about a failed handshake into a typed error. TLS 1.2
at least; the standard library's ``ssl`` only. Does not own: the sockets (``wire``, ``transport``, ``obs.http``).
"""

from __future__ import annotations

import functools
import ssl

from tensorcast.config import TLSConfig
from tensorcast.errors import InvalidArgument, TensorCastError, Unauthenticated, Unavailable

__all__ = ["client_context", "handshake_error", "http_context", "server_context", "server_hostname"]


def _base(purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _load_chain(ctx: ssl.SSLContext, cfg: TLSConfig) -> None:
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    except (OSError, ssl.SSLError) as exc:  # never the files' contents, only why
        raise InvalidArgument(f"tls.cert_file {cfg.cert_file!r} / tls.key_file {cfg.key_file!r}: cannot load the "
                              f"certificate and key ({type(exc).__name__}: {getattr(exc, 'strerror', '') or exc})") \
            from None


def _load_ca(ctx: ssl.SSLContext, cfg: TLSConfig, peers: ssl.Purpose) -> None:
    """The CAs that ``peers`` (servers, or clients) must chain to."""
    try:
        if cfg.ca_file:
            ctx.load_verify_locations(cafile=cfg.ca_file)
        else:
            ctx.load_default_certs(peers)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(f"tls.ca_file {cfg.ca_file!r}: cannot load the CA certificates "
                              f"({type(exc).__name__})") from None


def _check_server(cfg: TLSConfig) -> None:
    if not cfg.cert_file or not cfg.key_file:
        raise InvalidArgument("tls.enabled: a server needs tls.cert_file and tls.key_file")


@functools.lru_cache(maxsize=16)
def server_context(cfg: TLSConfig) -> ssl.SSLContext | None:
    """The context of the control RPC and data-plane servers; None without TLS."""
    if not cfg.enabled:
        return None
    _check_server(cfg)
    ctx = _base(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(ctx, cfg)
    if cfg.require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        _load_ca(ctx, cfg, ssl.Purpose.CLIENT_AUTH)
    return ctx


@functools.lru_cache(maxsize=16)
def http_context(cfg: TLSConfig) -> ssl.SSLContext | None:
    """The HTTP endpoint's context (no client certificate asked for); None without TLS."""
    if not cfg.enabled:
        return None
    _check_server(cfg)
    ctx = _base(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(ctx, cfg)
    return ctx


@functools.lru_cache(maxsize=16)
def client_context(cfg: TLSConfig) -> ssl.SSLContext | None:
    """The context of every connection a process opens; None without TLS. It checks the server's certificate
    (chain and name) and presents this process's own when it has one."""
    if not cfg.enabled:
        return None
    ctx = _base(ssl.PROTOCOL_TLS_CLIENT)  # verify_mode CERT_REQUIRED, check_hostname on
    _load_ca(ctx, cfg, ssl.Purpose.SERVER_AUTH)
    if cfg.cert_file:
        _load_chain(ctx, cfg)
    return ctx


def server_hostname(cfg: TLSConfig, host: str) -> str:
    """The name a server's certificate must carry when dialled at ``host``."""
    return cfg.server_name or host


def handshake_error(address: str, exc: BaseException) -> TensorCastError:
    """A failed TLS handshake with ``address`` as a typed error: a certificate that does not verify, or a peer
    that speaks no TLS, is ``Unauthenticated`` (trying again will not help); anything else ``Unavailable``."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return Unauthenticated(f"TLS with {address}: the server's certificate does not verify "
                               f"({exc.verify_message or exc.reason}; tls.ca_file, tls.server_name)")
    if isinstance(exc, ssl.SSLError):
        return Unauthenticated(f"TLS handshake with {address} failed ({exc.reason or type(exc).__name__}): does it "
                               "speak TLS, and accept this process's certificate? (tls.enabled, tls.cert_file)")
    return Unavailable(f"TLS handshake with {address} failed: {exc}")
