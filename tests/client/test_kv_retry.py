"""The KV router's retry decision (``client.kv_route.next_attempt``), table-driven: which keys go round
again, when orphans become misses, when to stop, and the backoff."""

from __future__ import annotations

from typing import Any

import pytest

from tensorcast.client.kv_route import next_attempt
from tensorcast.errors import DeadlineExceeded, InvalidArgument, StaleFencingToken, Unavailable

OK = object()  # a home's answer


@pytest.mark.parametrize("groups, results, orphans, need_all, refreshed, todo, now_refreshed, retry", [
    # every home answered, no orphans: done
    ([[0, 1], [2]], [OK, OK], [], True, False, [], False, False),
    # a stale token and an unreachable home retry their keys; the answered group does not
    ([[0, 3], [1], [2]], [StaleFencingToken("x"), OK, Unavailable("y")], [], False, False, [0, 2, 3], False, True),
    # a slow home (deadline) is retried like an unreachable one
    ([[4]], [DeadlineExceeded("z")], [], False, False, [4], False, True),
    # orphans of a read: retried once, after the table is read again
    ([[0]], [OK], [1, 2], False, False, [1, 2], True, True),
    # ... and misses the second time
    ([[0]], [OK], [1, 2], False, True, [], True, False),
    # orphans of a write are retried until the hand-over timeout
    ([[0]], [OK], [2, 1], True, True, [1, 2], True, True),
])
def test_what_goes_round_again(groups: list[list[int]], results: list[Any], orphans: list[int], need_all: bool,
                               refreshed: bool, todo: list[int], now_refreshed: bool, retry: bool) -> None:
    step = next_attempt(groups, results, orphans, need_all=need_all, orphans_refreshed=refreshed, attempt=0,
                        left=1.0)
    assert step.todo == todo and step.orphans_refreshed == now_refreshed
    assert (step.backoff is not None) == retry


def test_out_of_time_returns_what_is_left_without_backoff() -> None:
    step = next_attempt([[0, 1]], [Unavailable("gone")], [], need_all=True, orphans_refreshed=False, attempt=3,
                        left=0.0)
    assert step.todo == [0, 1] and step.backoff is None


def test_backoff_doubles_up_to_a_cap() -> None:
    waits = [next_attempt([[0]], [Unavailable("x")], [], need_all=True, orphans_refreshed=False, attempt=a,
                          left=5.0).backoff for a in range(6)]
    assert waits == [0.02, 0.04, 0.08, 0.16, 0.25, 0.25]


def test_an_error_that_is_not_a_lost_home_is_raised() -> None:
    with pytest.raises(InvalidArgument, match="bad key"):
        next_attempt([[0], [1]], [Unavailable("x"), InvalidArgument("bad key")], [], need_all=False,
                     orphans_refreshed=False, attempt=0, left=1.0)
