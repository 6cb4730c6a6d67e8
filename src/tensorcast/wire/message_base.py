"""The bases of every message: ``Msg`` (a frozen, tagged msgspec Struct) and ``Request[Reply]`` (a request
declared with its reply type). Owns: resolving a request's declared reply. Does not own: the messages
(``wire.messages``, ``wire.kv_messages``) or the tables derived from them (``wire.protocol``).
"""

from __future__ import annotations

import sys
import typing
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

__all__ = ["Msg", "Request"]


class Msg(msgspec.Struct, frozen=True, tag=True, kw_only=True, omit_defaults=True):
    pass


R_co = TypeVar("R_co", covariant=True)
_REPLIES: dict[type, type] = {}


class Request(Msg, Generic[R_co], frozen=True):
    """A request whose reply is an ``R_co``, declared once with it: ``class GetArtifact(Request[ArtifactReply])``
    (``wire.protocol`` derives its tables from these declarations; ``Caller.call`` returns an ``R_co``).
    ``idempotent``: its effect is the same when it arrives twice, so a caller may send it again (to another
    gateway) when the connection was lost before the reply came."""

    idempotent: ClassVar[bool] = False

    @classmethod
    def reply_type(cls) -> type[Any]:
        """The type this request's reply must have (resolving a forward reference once)."""
        found = _REPLIES.get(cls)
        if found is None:
            found = _declared_reply(cls)
            _REPLIES[cls] = found
        return found


def _declared_reply(cls: type) -> type:
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                (arg,) = typing.get_args(base)
                if isinstance(arg, typing.ForwardRef):
                    arg = arg.__forward_arg__
                if isinstance(arg, str):
                    arg = vars(sys.modules[klass.__module__])[arg]
                assert isinstance(arg, type)
                return arg
    raise TypeError(f"{cls.__name__} declares no reply type (subclass Request[Reply])")
