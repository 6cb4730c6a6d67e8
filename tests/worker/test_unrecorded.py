"""The pure parts of settling copies a put stored whose record at the global store failed
(``worker.unrecorded``): when the store's answer is final, and whether any put could count on the copy."""

from __future__ import annotations

import pytest

from tensorcast.worker.unrecorded import may_drop, settle_after


@pytest.mark.parametrize(("deadline", "now", "after"), [
    (110.0, 100.0, 112.0),   # the commit could still start at the store until its deadline (+ clock margin)
    (90.0, 100.0, 102.0),    # its deadline passed already: from now (+ margin)
    (None, 100.0, 162.0),    # no deadline: a long grace
])
def test_the_store_s_answer_is_final_once_the_failed_commit_cannot_reach_it(deadline: float | None, now: float,
                                                                           after: float) -> None:
    assert settle_after(deadline, now) == after


@pytest.mark.parametrize(("committing", "in_flight", "pending", "droppable", "why"), [
    (0, {}, set(), True, "quiet"),
    (1, {}, set(), False, "a put in its local commit may not know its artifact yet"),
    (0, {"a": 1}, set(), False, "a put of it between its local and its store commit"),
    (0, {"b": 2}, set(), True, "puts of other artifacts do not count"),
    (0, {}, {"a"}, False, "a put of it begun: it would store nothing at its commit"),
    (0, {}, {"b"}, True, "another artifact's put begun"),
])
def test_a_copy_is_dropped_only_when_no_put_could_count_on_it(committing: int, in_flight: dict[str, int],
                                                              pending: set[str], droppable: bool, why: str) -> None:
    assert may_drop("a", committing, in_flight, pending) is droppable, why
