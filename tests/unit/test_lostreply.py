"""The decisions after a lost reply (celery_leases/_lostreply.py), without Redis."""

from __future__ import annotations

from celery_leases import _scripts
from celery_leases._lostreply import (
    POLICIES,
    GrantBook,
    grant_recovery,
    own_beat_win,
    release_recovered,
    requeue_recovered,
)


def test_a_lost_call_adopts_the_grants_its_own_entries_prove():
    decision = grant_recovery(
        [("a", "x"), ("b", "s")],
        {"a": [("x", 7)], "b": [("s", 5), ("s", 8)]},
        {"a": [("x", 7)], "b": [("s", 8)]},  # 5: another thread's shared lease on b
    )
    assert decision.adopt == [7, 8]
    assert decision.give_back == []


def test_a_grant_without_the_calls_id_is_never_adopted_nor_given_back():
    # issue 26, part 8: T is a sibling thread's (held, or released a moment ago)
    decision = grant_recovery([("a", "x")], {"a": [("x", 5)]}, {})
    assert decision.adopt is None
    assert decision.give_back == []


def test_an_own_grant_redis_no_longer_has_is_not_adopted():
    # its entry outlived it (it ran out, or a cleanup freed it): the entry goes, sent again
    decision = grant_recovery([("a", "x")], {"a": []}, {"a": [("x", 5)]})
    assert decision.adopt is None
    assert decision.give_back == [("a", "x", 5)]


def test_a_partial_grant_is_given_back():
    # all or nothing: one resource without its entry means the call did not grant them all
    decision = grant_recovery([("a", "x"), ("b", "x")], {"a": [("x", 5)]}, {"a": [("x", 5)]})
    assert decision.adopt is None
    assert decision.give_back == [("a", "x", 5)]


def test_min_replicas_gives_back_what_the_call_granted():
    decision = grant_recovery(
        [("a", "x")], {"a": [("x", 5), ("x", 6)]}, {"a": [("x", 5)]}, may_adopt=False
    )
    assert decision.adopt is None
    assert decision.give_back == [("a", "x", 5)]


def test_a_beat_run_recorded_as_won_by_this_replica_is_its_win_once():
    assert own_beat_win(False, 10, "me", "me", None)
    assert own_beat_win(False, 10, "me", "me", 9)
    assert not own_beat_win(False, 10, "me", "me", 10)  # counted already: sent then
    assert not own_beat_win(False, 10, "other", "me", None)
    assert own_beat_win(True, 10, "me", "me", 10)


def test_a_release_sent_again_reports_what_was_still_counted_held():
    assert release_recovered([False, True, False], [True, True, False]) == [True, True, False]


def test_a_requeue_is_read_back_from_the_claim_key():
    queued = "%queued/t1"
    assert requeue_recovered(f"5 {queued}", 5, "me", queued) is True
    assert requeue_recovered("5 me", 5, "me", queued) is None
    assert requeue_recovered(f"6 {queued}", 5, "me", queued) is False
    assert requeue_recovered(None, 5, "me", queued) is False


def test_the_book_waits_for_calls_in_flight_and_sees_calls_that_began_since():
    book = GrantBook()
    book.begin("o", ["k"])  # the lost call
    book.begin("o", ["k"])  # another thread's call, in flight
    book.lost("o", ["k"])
    assert book.quiet("o", ["k"]) is None
    book.hold("o", "k", 5)
    book.end("o", ["k"])
    seq = book.quiet("o", ["k"])
    assert seq is not None
    assert book.alone("o", ["k"])
    assert book.unchanged("o", ["k"], seq)
    book.begin("o", ["k"])  # a third call begins while the recovery reads
    assert not book.unchanged("o", ["k"], seq)
    book.end("o", ["k"])
    book.end("o", ["k"], recovered=True)
    assert book.held("o", "k") == {5}
    book.drop("o", "k", 5)
    assert book.held("o", "k") == set()


def test_a_grant_booked_with_its_end_is_held_and_no_longer_in_flight():
    # GrantBook.granted(..., ended=True) is hold() for each token and end() in one step
    book = GrantBook()
    book.begin("o", ["k", "j"])
    assert book.quiet("o", ["k"]) is None  # in flight
    book.granted("o", ["k", "j"], [7, 8], ended=True)
    assert book.quiet("o", ["k", "j"]) is not None
    assert book.held("o", "k") == {7}
    assert book.held("o", "j") == {8}
    book.begin("o", ["k"])
    book.granted("o", ["k"], [9], ended=False)  # booked, the call still in flight
    assert book.quiet("o", ["k"]) is None
    book.end("o", ["k"])
    assert book.held("o", "k") == {7, 9}


def test_every_script_has_a_policy_for_a_lost_reply():
    named = " ".join(POLICIES)
    assert [name for name in _scripts.ALL if name not in named] == []
