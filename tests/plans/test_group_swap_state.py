"""The group-swap protocol without sockets: prepare everywhere, commit, activate everywhere; or abort everywhere."""

from __future__ import annotations

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.weights.group import ABORT, ACTIVATE, PREPARE, GroupSwap, fetch_mode

RANKS = ("r0", "r1")


def run_ok(g: GroupSwap, now: float, action: str) -> None:
    sent = g.actions(now)
    assert sent == [(r, action) for r in RANKS]
    for r, a in sent:
        g.done(r, a, now, {"fetched": 1})


def test_all_prepare_then_all_activate() -> None:
    g = GroupSwap(RANKS, deadline=100.0, reserve=10.0)
    assert g.actions(0) == [("r0", PREPARE), ("r1", PREPARE)]
    assert g.actions(0) == []  # one action per rank in flight
    g.done("r0", PREPARE, 1)
    assert g.decision == "" and g.actions(1) == []  # r0 waits at the barrier: nothing touches live tensors
    g.done("r1", PREPARE, 2)
    assert g.decision == "commit"
    run_ok(g, 3, ACTIVATE)
    assert g.finished and g.status == "activated"
    assert {r: s["phase"] for r, s in g.report().items()} == {"r0": "active", "r1": "active"}


def test_a_failed_prepare_aborts_every_rank_including_the_prepared_ones() -> None:
    g = GroupSwap(RANKS, deadline=None)
    g.actions(0)
    g.done("r0", PREPARE, 1)
    g.failed("r1", PREPARE, retryable=False, message="NOT_FOUND: no such version", now=1)
    assert g.decision == "abort" and "r1" in g.reason and "NOT_FOUND" in g.reason
    assert sorted(g.actions(1)) == [("r0", ABORT), ("r1", ABORT)]  # r1 too: a late prepare of it is refused
    assert not g.finished
    g.done("r0", ABORT, 2)
    g.failed("r1", ABORT, retryable=True, message="UNAVAILABLE", now=2)  # aborts are best effort, sent once
    assert g.finished and g.status == "aborted" and g.actions(3) == []
    assert g.report()["r1"]["phase"] == "abort_failed"


def test_retryable_prepare_failures_are_retried_with_backoff_before_the_commit_point() -> None:
    g = GroupSwap(RANKS, deadline=100.0, reserve=10.0, max_attempts=3, backoff=1.0)
    g.actions(0)
    g.done("r0", PREPARE, 0)
    g.failed("r1", PREPARE, retryable=True, message="UNAVAILABLE", now=0)
    assert g.decision == "" and g.next_wakeup() == 1.0 and g.actions(0.5) == []
    assert g.actions(1.0) == [("r1", PREPARE)]
    g.failed("r1", PREPARE, retryable=True, message="UNAVAILABLE", now=1.0)
    assert g.next_wakeup() == 3.0  # doubled
    assert g.actions(3.0) == [("r1", PREPARE)]
    g.failed("r1", PREPARE, retryable=True, message="UNAVAILABLE", now=3.0)  # third attempt: give up
    assert g.decision == "abort"


def test_no_retry_that_could_not_finish_before_the_commit_point() -> None:
    g = GroupSwap(RANKS, deadline=10.0, reserve=5.0, backoff=1.0)
    g.actions(0)
    g.failed("r0", PREPARE, retryable=True, message="UNAVAILABLE", now=4.5)  # 4.5 + 1 >= 5
    assert g.decision == "abort"


def test_the_deadline_aborts_before_the_commit_point_and_late_prepares_do_not_commit() -> None:
    g = GroupSwap(RANKS, deadline=10.0, reserve=4.0)
    g.actions(0)
    g.done("r0", PREPARE, 1)
    assert g.next_wakeup() == 6.0  # the commit point
    assert g.actions(5.9) == []
    assert g.actions(6.0) == [("r0", ABORT)]  # r1's prepare is still in flight: its abort follows its answer
    assert g.decision == "abort" and "deadline" in g.reason
    g.done("r1", PREPARE, 6.5)  # prepared after the decision: aborted, never activated
    assert g.actions(6.5) == [("r1", ABORT)]
    g.done("r0", ABORT, 7)
    g.done("r1", ABORT, 7)
    assert g.status == "aborted"

    late = GroupSwap(RANKS, deadline=10.0, reserve=4.0)
    late.actions(0)
    late.done("r0", PREPARE, 1)
    late.done("r1", PREPARE, 7)  # every rank prepared, but past the commit point: no time to activate
    assert late.decision == "abort" and "too late" in late.reason


def test_activation_failures_are_retried_then_reported_as_partial() -> None:
    g = GroupSwap(RANKS, deadline=100.0, reserve=10.0, max_attempts=2, backoff=1.0)
    run_ok(g, 0, PREPARE)
    assert g.actions(1) == [("r0", ACTIVATE), ("r1", ACTIVATE)]
    g.done("r0", ACTIVATE, 1)
    g.failed("r1", ACTIVATE, retryable=True, message="UNAVAILABLE", now=1)
    assert g.actions(2) == [("r1", ACTIVATE)]  # committed: the activation is retried, never an abort
    g.failed("r1", ACTIVATE, retryable=True, message="UNAVAILABLE", now=2)
    assert g.finished and g.status == "partial" and g.report()["r1"]["phase"] == "failed"


def test_no_deadline_commits_whenever_all_are_prepared() -> None:
    g = GroupSwap(RANKS, deadline=None)
    run_ok(g, 0, PREPARE)
    run_ok(g, 10**9, ACTIVATE)
    assert g.status == "activated" and g.next_wakeup() is None


def test_bad_groups_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        GroupSwap((), deadline=None)
    with pytest.raises(InvalidArgument):
        GroupSwap(("a", "a"), deadline=None)
    with pytest.raises(InvalidArgument):
        GroupSwap(("a",), deadline=None, max_attempts=0)


def test_ranks_already_on_the_version_count_as_activated_and_get_no_activation() -> None:
    # Completing a partial swap: r0 activated last time, r1 did not. r0's prepare answers "noop".
    g = GroupSwap(RANKS, deadline=None)
    g.actions(0)
    g.done("r0", PREPARE, 1, {"status": "noop"})
    assert g.decision == ""  # r1 has not prepared yet
    g.done("r1", PREPARE, 2, {"status": "prepared"})
    assert g.decision == "commit"
    assert g.actions(3) == [("r1", ACTIVATE)]  # nothing staged on r0: activating there would be refused
    g.done("r1", ACTIVATE, 4)
    assert g.finished and g.status == "activated"


def test_a_repeated_swap_where_every_rank_is_on_the_version_is_activated_at_once() -> None:
    g = GroupSwap(RANKS, deadline=10.0, reserve=1.0)
    for r, a in g.actions(0):
        g.done(r, a, 0.5, {"status": "noop"})
    assert g.finished and g.status == "activated" and g.actions(1) == []


def test_an_abort_is_not_sent_to_a_rank_already_on_the_version() -> None:
    g = GroupSwap(RANKS, deadline=None)
    g.actions(0)
    g.done("r0", PREPARE, 1, {"status": "noop"})
    g.failed("r1", PREPARE, retryable=False, message="NOT_FOUND", now=1)
    assert g.decision == "abort" and g.actions(2) == [("r1", ABORT)]
    g.done("r1", ABORT, 3)
    assert g.finished and g.status == "aborted"


def test_fetch_mode_is_whole_only_when_every_rank_stages_through_one_worker() -> None:
    assert fetch_mode(RANKS, {"r0": "w1", "r1": "w1"}) == "whole"  # one engine on one host: pulled once
    assert fetch_mode(RANKS, {"r0": "w1", "r1": "w2"}) == "view"  # spread over hosts: each its slices
    assert fetch_mode(RANKS, {"r0": "w1"}) == "view"  # a rank that did not answer: no assumption
    assert fetch_mode(RANKS, {"r0": "w1", "r1": ""}) == "view"  # a rank with no worker on its host
    assert fetch_mode(("r0",), {"r0": "w1"}) == "whole"
    assert fetch_mode(RANKS, {"r0": "w1", "r1": "w1"}, "view") == "view"  # the caller's word wins
    assert fetch_mode(RANKS, {"r0": "w1", "r1": "w2"}, "whole") == "whole"
