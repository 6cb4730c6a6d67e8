from __future__ import annotations

import pytest

from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.wire.frames import CHECKSUMS, HEADER, pack_header, parse_header


def test_header_roundtrip_and_limits() -> None:
    raw = pack_header(123, 1 << 40)
    assert len(raw) == HEADER.size == 16
    assert tuple(parse_header(raw, 1000)) == (0, 123, 1 << 40)
    assert parse_header(pack_header(5, 9, CHECKSUMS), 1000) == (CHECKSUMS, 5, 9)
    with pytest.raises(InvalidArgument, match="flags"):
        parse_header(raw[:3] + b"\x80" + raw[4:], 1000)
    with pytest.raises(ResourceExhausted):
        parse_header(pack_header(1001, 0), 1000)
    with pytest.raises(InvalidArgument, match="magic"):
        parse_header(b"XX" + raw[2:], 1000)
    with pytest.raises(InvalidArgument, match="version"):
        parse_header(raw[:2] + b"\x09" + raw[3:], 1000)
