"""The positions PG's agreement rounds compare (``mooncake._pg_position``), played
through the interleavings that decide which member leaves its operation. Pure Python:
no torch, no group."""

from mooncake._pg_position import Position, encode


def agree(members, epoch, completing=None):
    """One agreement round in the view of ``epoch``: every member gives its position;
    the round completes on ``completing`` (default: all). Returns who is behind."""
    completing = members if completing is None else completing
    furthest = max(m.mine() for m in members)
    behind = {}
    for i, m in enumerate(members):
        if m in completing:
            behind[i] = m.behind(furthest)
            m.agreed_in(epoch, furthest)
    return behind


def test_a_member_that_missed_an_operation_completed_elsewhere_is_behind():
    a, b = Position(1), Position(1)
    a.completed_one(1)  # b's copy of the same operation failed
    assert agree([a, b], 2) == {0: False, 1: True}


def test_a_round_completed_on_one_member_only_keeps_the_others_behind():
    # Seed 100 of the simulation: a completed operation 1 of view 1, b did not; in
    # view 2, a's agreement round completes and b's fails, and a's next operation
    # fails too. In view 3 b must still see that a is ahead.
    a, b = Position(1), Position(1)
    a.completed_one(1)
    assert agree([a, b], 2, completing=[a]) == {0: False}
    assert not b.needs_agreement(1) and b.needs_agreement(3)
    assert agree([a, b], 3) == {0: False, 1: True}


def test_the_first_operation_of_an_agreed_view_completed_elsewhere():
    a, b = Position(1), Position(1)
    assert agree([a, b], 2) == {0: False, 1: False}
    a.completed_one(2)  # b's copy failed
    assert agree([a, b], 3) == {0: False, 1: True}


def test_members_in_step_are_never_behind():
    members = [Position(1) for _ in range(3)]
    for epoch in range(2, 6):
        for m in members:
            m.completed_one(epoch - 1 if epoch > 2 else 1)
        assert not any(agree(members, epoch).values())


def test_a_rank_that_joined_again_is_not_behind_on_its_stale_position():
    # The joiner was in view 5 with one operation fewer than the others; they then
    # agreed in view 6 without it and run nothing since.
    stayed, joiner = Position(5), Position(5)
    stayed.completed_one(5)
    stayed.completed_one(5)
    joiner.completed_one(5)
    agree([stayed], 6)
    joiner.joined()
    assert joiner.needs_agreement(7)
    assert agree([stayed, joiner], 7) == {0: False, 1: False}
    # Both now give the same position.
    assert joiner.mine() == stayed.mine() == encode(5, 3)


def test_only_newcomers_agree_on_the_new_view():
    a, b = Position(0), Position(0)
    a.joined()
    b.joined()
    assert agree([a, b], 4) == {0: False, 1: False}
    a.completed_one(4)
    assert agree([a, b], 5) == {0: False, 1: True}


def test_an_operation_failed_for_good_counts_as_passed():
    # Seed 2924 of the simulation: a completed its third operation while b, stalled,
    # failed it for good and its caller moved on. At the next round b must not look
    # behind, or it would leave its fourth and meet a's fourth with its fifth.
    a, b = Position(1), Position(1)
    for _ in range(2):
        a.completed_one(1)
        b.completed_one(1)
    a.completed_one(1)
    b.passed_one()
    assert agree([a, b], 9) == {0: False, 1: False}


def test_a_newcomer_that_failed_an_operation_stays_new():
    p = Position(3)
    p.joined()
    p.passed_one()
    assert p.mine() == 0 and not p.behind(encode(7, 5))
