"""How configuration is read: the machinery under ``config``'s table of tunables.

Owns: sizes with units (``parse_size``: ``512MiB``, ``4GB``), the layering of the sources, lowest priority
first: a TOML file (``--config FILE`` or ``TENSORCAST_CONFIG``), environment variables
(``TENSORCAST_<SECTION>_<KEY>``; Kubernetes' service links among them are skipped) and overrides (command-line
flags, ``{"worker.memory_capacity": "1GiB"}``); turning the flat dotted keys into sections, each value coerced
to its default's type (strings from flags and the environment: booleans, numbers, ``none``, comma-separated
tuples); and the checks: unknown keys, values of the wrong type, floats that are not finite and >= 0, and the
cluster token (``check_token``), each an ``InvalidArgument`` naming the key. Does not own: which keys exist,
their defaults or which of them are sizes (``config``), or what any process does with them.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from tensorcast.credentials import Keyring
from tensorcast.errors import InvalidArgument

__all__ = ["check_numbers", "check_token", "convert", "layered", "nest", "parse_size"]

S = TypeVar("S", bound=msgspec.Struct)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(value: int | float | str, key: str = "size") -> int:
    """``"4GiB"`` -> 4294967296. Raises ``InvalidArgument`` naming ``key`` on garbage."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{key}: size must be a finite number >= 0, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"{key}: cannot parse size {value!r} (examples: 1048576, 512MiB, 4GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def check_token(token: str | None) -> None:
    """A cluster token is either absent (no authentication: processes bind loopback only), a non-blank secret
    or a well-formed credential. An empty one would silently turn authentication off, so it is refused."""
    if token is not None and not token.strip():
        raise InvalidArgument("the cluster token is empty or blank: set a secret in TENSORCAST_TOKEN (or --token), "
                              "or unset it to run without authentication (loopback only)")
    Keyring.from_token(token)


def layered(path: str | os.PathLike[str] | None, overrides: dict[str, Any] | None,
            sections: dict[str, type[msgspec.Struct]]) -> dict[str, Any]:
    """The flat dotted keys of TOML file < environment < ``overrides`` (``None`` values in them are left out)."""
    data: dict[str, Any] = {}
    path = path or os.environ.get("TENSORCAST_CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"config file {path}: {exc}") from exc
    flat = _flatten(data)
    for name, value in os.environ.items():
        if name.startswith("TENSORCAST_") and name != "TENSORCAST_CONFIG" and not _service_link(name, value):
            dotted = _env_to_key(name, sections)
            if dotted:
                flat[dotted] = value
    flat.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return flat


def nest(flat: dict[str, Any], sections: dict[str, type[msgspec.Struct]], size_keys: set[str]) -> dict[str, Any]:
    """``{"worker.memory_capacity": "1GiB"}`` -> ``{"worker": {"memory_capacity": 1073741824}}``; a key that is
    neither ``token`` nor a field of its section is refused."""
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        section, _, key = dotted.partition(".")
        if not key:
            if section != "token":
                raise InvalidArgument(f"unknown config key {dotted!r}")
            nested["token"] = value
            continue
        sub = sections.get(section)
        if sub is None or key not in sub.__struct_fields__:
            raise InvalidArgument(f"unknown config key {dotted!r}")
        nested.setdefault(section, {})[key] = _coerce(sub, key, value, dotted, size_keys)
    return nested


def convert(nested: dict[str, Any], cls: type[S]) -> S:
    try:
        return msgspec.convert(nested, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"invalid configuration: {exc}") from exc


def check_numbers(config: msgspec.Struct, sections: dict[str, type[msgspec.Struct]]) -> None:
    """Every float of every section is finite and >= 0 (timeouts, intervals, watermarks)."""
    for section in sections:
        for key, value in msgspec.structs.asdict(getattr(config, section)).items():
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{section}.{key}: expected a finite number >= 0, got {value!r}")


# Variables Kubernetes gives every pod for each Service of its namespace: a Service named "tensorcast-gs"
# yields TENSORCAST_GS_SERVICE_HOST, TENSORCAST_GS_PORT=tcp://10.0.0.7:7070, TENSORCAST_GS_PORT_7070_TCP_ADDR, ...
# They are not configuration, and must not stop a process in such a pod.
_SERVICE_LINK = re.compile(r"_SERVICE_(HOST|PORT)(_\w+)?|_PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?")


def _service_link(name: str, value: str) -> bool:
    return bool(_SERVICE_LINK.search(name) or (name.endswith("_PORT") and re.match(r"(tcp|udp|sctp)://", value)))


def _env_to_key(name: str, sections: dict[str, type[msgspec.Struct]]) -> str | None:
    rest = name[len("TENSORCAST_") :].lower()
    if rest == "token":
        return "token"
    for section in sections:
        if rest.startswith(section + "_"):
            return f"{section}.{rest[len(section) + 1 :]}"
    return None


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _coerce(struct: type[msgspec.Struct], key: str, value: Any, dotted: str, size_keys: set[str]) -> Any:
    if key in size_keys:
        return parse_size(value, dotted)
    if isinstance(value, str):
        default = getattr(struct(), key)
        if isinstance(default, tuple):  # roles, allowed hosts, allowed roots: comma-separated in flags and env
            return tuple(r.strip() for r in value.split(",") if r.strip())
        try:
            if isinstance(default, bool):
                if value.lower() not in {"1", "0", "true", "false", "yes", "no"}:
                    raise ValueError(value)
                return value.lower() in {"1", "true", "yes"}
            if isinstance(default, int):
                return int(value)
            if isinstance(default, float) or (default is None and key == "timeout"):
                return None if value.lower() in {"none", ""} else float(value)
        except ValueError as exc:
            raise InvalidArgument(f"{dotted}: cannot parse {value!r}") from exc
    return value
