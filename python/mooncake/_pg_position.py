"""Where a rank stands in its group's sequence of collectives, as the agreement round
that opens each new view compares it (``MooncakeBackend._completed_elsewhere``).

Collectives pair up by their order in a view. When a rank dies inside one after its
data reached some survivors and not others, the first completed it and the rest did
not; running it again over the survivors would pair the first ones' next operation
with the others' retry. So every member of a new view gives its position to an
``agree_max`` first, and a member behind the furthest leaves its operation.

A position is encoded in 64 bits: the epoch of the view it counts from (23 bits) and
the number of the operation about to run in it (40 bits). Positions of different
epochs do not compare, except in the one case below.

The agreement round is itself a collective, and can complete on some members and fail
on others. So a member whose round completed does not start counting from the new
view straight away: until it completes an operation there, it gives the position the
round agreed on, which is what a member whose round failed still gives (or one behind
it). Once it completes one, every member's round had completed (the operation needed
them all), and a member that gives the agreed position while the furthest gives
"the second operation of the view we agreed in" is behind by that first operation.
(Counting from the new view at once, as this did before, lost the agreed position:
a member whose round failed then looked never behind, and ran again an operation
the others had completed.)

A rank that joins (or rejoins) the group gives 0: new to the sequence, never behind."""

_EPOCH_BITS = 23
_POSITION_BITS = 40
_NEW = 0


def encode(epoch, number):
    """The position of operation ``number`` (from 1) of the view of ``epoch``."""
    return ((epoch & ((1 << _EPOCH_BITS) - 1)) << _POSITION_BITS
            | min(number, (1 << _POSITION_BITS) - 1))


def _epoch_of(position):
    return position >> _POSITION_BITS


class Position:
    """One rank's place (see the module's text). ``counted_in`` is the epoch of the view
    it last agreed in or completed an operation in, ``completed`` how many it completed
    there since, and ``agreed`` the position it gives while ``completed`` is 0."""

    def __init__(self, epoch):
        self.counted_in = epoch
        self.completed = 0
        self.agreed = encode(epoch, 1)

    def needs_agreement(self, epoch):
        """Whether the view of ``epoch`` is new to this rank (no agreement or operation
        of it counted yet)."""
        return epoch != self.counted_in

    def mine(self):
        """The position to give the agreement round."""
        if self.completed == 0:
            return self.agreed
        return encode(self.counted_in, self.completed + 1)

    def behind(self, furthest):
        """Whether, the round having returned ``furthest``, this rank's operation was
        completed by another member (so it must leave it)."""
        mine = self.mine()
        if mine == _NEW or mine >= furthest:
            return False
        if _epoch_of(mine) == _epoch_of(furthest):
            return True
        # Giving the agreed position: another member completed the first operation of
        # the view we agreed in, which this rank failed.
        return self.completed == 0 and furthest == encode(self.counted_in, 2)

    def agreed_in(self, epoch, furthest):
        """The round of the view of ``epoch`` completed here with ``furthest``: this rank
        is now where the furthest was (left behind or not)."""
        self.counted_in = epoch
        self.completed = 0
        self.agreed = furthest if furthest != _NEW else encode(epoch, 1)

    def completed_one(self, epoch):
        """An operation completed in the view of ``epoch``."""
        if epoch == self.counted_in:
            self.completed += 1
        else:
            # Run in a view it entered on the way in (every member did, or the
            # operation would have failed): the view's first.
            self.counted_in = epoch
            self.completed = 1

    def passed_one(self):
        """An operation failed here for good (its error goes to the caller, who moves
        on): counted as passed, where the others either completed it or failed it too.
        Left uncounted, the next round would find this rank behind by it and have it
        leave its next operation instead, which then meets the others' one after."""
        if self.counted_in is not None:
            self.completed += 1

    def joined(self):
        """Admitted (again) by a view: new to the sequence."""
        self.counted_in = None
        self.completed = 0
        self.agreed = _NEW
