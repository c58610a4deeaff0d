"""Draft tokens from a sequence's own text (prompt lookup): where its last tokens occurred before, what followed.

A reply that repeats its prompt (an edited JSON or code block, an extraction, a quotation) is
mostly spans the prompt already holds; once the reply's last few tokens are found earlier, the
tokens that followed them there are a cheap guess at what comes next. The guess only ever
saves steps: speculation.py takes a draft token only where the sampler chose it.
"""

# The last tokens that must occur earlier, in order, for what followed them to be proposed: after one
# or two matching tokens the tokens that followed are seldom what comes next in text that is not a
# copy (a sampled story's drafts after two were nearly all rejected, each a row computed for nothing:
# bench/speculation.py), after three mostly right.
MATCH_TOKENS = 3
# Earlier positions of the last token looked at, most recent first: a common token (a space, a
# comma) occurs thousands of times in a long prompt, and a step must not walk them all.
MOST_CANDIDATES = 64
# The most steps a sequence rests from drafting after drafts rejected whole: each such draft doubles its
# rest (1, 2, 4, ...), any token taken from a draft ends the doubling.
LONGEST_REST = 16


class PromptLookup:
    """A sequence's prompt and reply so far, indexed by token, to propose what followed its last tokens before,
    and how many tokens its drafts may hold now (`limit`, see `judged`)."""

    def __init__(self, input_ids: list[int], limit: int):
        self.history = list(input_ids)
        self.most = self.limit = limit
        # Each token's positions in the history, ascending, but the last position (which has no follower yet).
        self._positions: dict[int, list[int]] = {}
        self._indexed = 0
        self._taken = 0
        # Steps left without drafts, and the rest the next draft rejected whole would start.
        self._resting = 0
        self._rest = 0

    def propose(self, taken_ids: list[int], most: int) -> list[int]:
        """Return up to `most` tokens that followed the latest earlier occurrence of the history's last
        MATCH_TOKENS tokens, after adding the reply's new `taken_ids`; [] if none."""
        history = self.history
        history.extend(taken_ids[self._taken:])
        self._taken = len(taken_ids)
        for position in range(self._indexed, len(history) - 1):
            self._positions.setdefault(history[position], []).append(position)
        self._indexed = max(self._indexed, len(history) - 1)
        most = min(most, self.limit)
        if self._resting:
            self._resting -= 1
            return []
        if len(history) < MATCH_TOKENS or most <= 0:
            return []
        last = history[-MATCH_TOKENS:]
        for position in reversed(self._positions.get(history[-1], [])[-MOST_CANDIDATES:]):
            if position >= MATCH_TOKENS - 1 and history[position - MATCH_TOKENS + 1:position + 1] == last:
                return history[position + 1:position + 1 + most]
        return []

    def judged(self, proposed: int, accepted: int) -> None:
        """Size the next drafts by how this one fared: twice as long after a draft taken whole (up to the
        setting), one past its taken part after a miss; after a draft rejected whole, no drafts for a
        rest that doubles with each such draft in a row (up to LONGEST_REST steps). Where the text stops
        repeating (a sampled story), steps then seldom compute a row for nothing; where it goes on
        repeating (an edited block), a run's drafts grow back to full length within a few steps."""
        if not proposed:
            return
        self.limit = min(self.most, 2 * self.limit) if accepted == proposed else accepted + 1
        if accepted:
            self._rest = 0
        else:
            self._rest = min(LONGEST_REST, 2 * self._rest or 1)
            self._resting = self._rest
