"""The plan scheduler without sockets: order, concurrency, retries, failure propagation, deadline."""

from __future__ import annotations

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.plans.state import PlanState

DIAMOND = {"a": [], "b": ["a"], "c": ["a"], "d": ["a"], "e": ["b", "c", "d"]}


def test_dependency_order_and_concurrency_limit() -> None:
    s = PlanState(DIAMOND, concurrency=2)
    assert s.start_ready(0) == ["a"]
    assert s.start_ready(0) == []
    s.mark_succeeded("a")
    assert s.start_ready(0) == ["b", "c"]  # the limit holds d back
    s.mark_succeeded("b")
    assert s.start_ready(0) == ["d"]
    s.mark_succeeded("c")
    assert s.start_ready(0) == []  # e waits for d
    s.mark_succeeded("d")
    assert s.start_ready(0) == ["e"]
    s.mark_succeeded("e")
    assert s.finished and s.succeeded_all


def test_cycles_and_unknown_dependencies_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="cycle"):
        PlanState({"a": ["c"], "b": ["a"], "c": ["b"], "d": []}, concurrency=1)
    with pytest.raises(InvalidArgument, match="unknown step"):
        PlanState({"a": ["zzz"]}, concurrency=1)
    with pytest.raises(InvalidArgument, match="itself"):
        PlanState({"a": ["a"]}, concurrency=1)
    with pytest.raises(InvalidArgument, match="concurrency"):
        PlanState({"a": []}, concurrency=0)


def test_retry_with_backoff_then_give_up_and_skip_dependents() -> None:
    s = PlanState(DIAMOND, concurrency=4, max_attempts=3, backoff=1.0, max_backoff=10.0)
    s.start_ready(0)
    assert s.mark_failed("a", retryable=True, now=0, deadline=None, reason="flaky")
    assert s.start_ready(0.5) == [] and s.next_wakeup() == 1.0
    assert s.start_ready(1.0) == ["a"]
    assert s.mark_failed("a", retryable=True, now=1.0, deadline=None, reason="flaky")  # backoff 2 s now
    assert s.start_ready(2.9) == [] and s.start_ready(3.0) == ["a"]
    assert not s.mark_failed("a", retryable=True, now=3.0, deadline=None, reason="flaky")  # 3 attempts: done
    assert s.finished and not s.succeeded_all
    assert {k: v.status for k, v in s.steps.items()} == {"a": "failed", "b": "skipped", "c": "skipped",
                                                         "d": "skipped", "e": "skipped"}


def test_non_retryable_failure_and_deadline() -> None:
    s = PlanState({"a": [], "b": []}, concurrency=1)
    s.start_ready(0)
    assert not s.mark_failed("a", retryable=False, now=0, deadline=None, reason="bad")
    # A retry that could not start before the deadline is not scheduled.
    s2 = PlanState({"a": []}, concurrency=1, backoff=5.0, max_backoff=10.0)
    s2.start_ready(0)
    assert not s2.mark_failed("a", retryable=True, now=0, deadline=3.0, reason="slow")
    s.expire()
    assert s.steps["b"].status == "skipped" and s.finished
