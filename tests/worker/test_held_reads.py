"""A holder's read leases (``worker.held_reads``), on a clock the test moves: a record answers only while its
lease lasts, counted from before the request left and shortened by the margin; a revocation voids a grant still
on its way; the table is bounded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tensorcast import clock
from tensorcast.records import ArtifactInfo
from tensorcast.worker.held_reads import MARGIN, HeldReads


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def now() -> Iterator[Clock]:
    c = Clock()
    with clock.installed(c, c):
        yield c


def info(n: int) -> ArtifactInfo:
    return ArtifactInfo(id=f"tc-{n:032x}", tensors=(), nbytes=0)


def test_a_lease_answers_until_its_shortened_end_from_when_it_was_asked(now: Clock) -> None:
    held = HeldReads()
    asked = now.now
    now.now += 0.5  # the reply took this long: the lease started at the store meanwhile
    held.keep(info(1), 2.0, asked)
    assert held.answer(info(1).id) == info(1)
    now.now = asked + 2.0 * (1 - MARGIN) - 1e-6
    assert held.answer(info(1).id) == info(1)
    now.now = asked + 2.0 * (1 - MARGIN)
    assert held.answer(info(1).id) is None and len(held) == 0  # the store waits for the whole lease: we stop first
    held.keep(info(2), 0.0, now.now)  # not granted
    assert held.answer(info(2).id) is None


def test_a_revocation_voids_a_grant_it_overtook(now: Clock) -> None:
    held = HeldReads(longest=2.0)
    asked = now.now
    now.now += 0.1
    held.revoke([info(1).id])  # the store revoked before this grant's reply came in
    now.now += 0.1
    held.keep(info(1), 2.0, asked)
    assert held.answer(info(1).id) is None
    held.keep(info(1), 2.0, now.now)  # asked after the revocation: a grant of the store's since
    assert held.answer(info(1).id) == info(1)
    held.revoke((info(1).id,))
    assert held.answer(info(1).id) is None


def test_revocations_are_remembered_as_long_as_a_lease_and_records_are_bounded(now: Clock) -> None:
    held = HeldReads(capacity=2, longest=2.0)
    asked = now.now
    held.revoke([info(9).id])
    now.now += 2.5  # within the longest lease and a second: a grant asked before it is still void
    held.revoke([info(8).id])
    held.keep(info(9), 2.0, asked)
    assert held.answer(info(9).id) is None
    for n in (1, 2):
        held.keep(info(n), 2.0, now.now)
    held.answer(info(1).id)  # a use: 2 is now the least recent
    held.keep(info(3), 2.0, now.now)
    assert held.answer(info(2).id) is None and held.answer(info(1).id) == info(1) and held.answer(info(3).id)
