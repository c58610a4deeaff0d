"""Draft tokens from a sequence's own text (prompt lookup): where its last tokens occurred before, what followed.

A reply that repeats its prompt (an edited JSON or code block, an extraction, a quotation) is
mostly spans the prompt already holds; once the reply's last few tokens are found earlier, the
tokens that followed them there are a cheap guess at what comes next. The guess only ever
saves steps: speculation.py takes a draft token only where the sampler chose it.
"""

# The longest run of last tokens matched against earlier text, and the shortest that proposes: after a
# single matching token the tokens that followed it are seldom what comes next (on running text most
# such drafts are rejected, each a row computed for nothing: bench/speculation.py).
LONGEST_MATCH = 3
SHORTEST_MATCH = 2
# Earlier positions of the last token looked at, most recent first: a common token (a space, a
# comma) occurs thousands of times in a long prompt, and a step must not walk them all.
MOST_CANDIDATES = 64


class PromptLookup:
    """A sequence's prompt and reply so far, indexed by token, to propose what followed its last tokens before."""

    def __init__(self, input_ids: list[int]):
        self.history = list(input_ids)
        # Each token's positions in the history, ascending, but the last position (which has no follower yet).
        self._positions: dict[int, list[int]] = {}
        self._indexed = 0
        self._taken = 0

    def propose(self, taken_ids: list[int], most: int) -> list[int]:
        """Return up to `most` tokens that followed the latest earlier occurrence of the longest run (up to
        LONGEST_MATCH, at least SHORTEST_MATCH) of the history's last tokens, after adding the reply's new
        `taken_ids`; [] if none."""
        history = self.history
        history.extend(taken_ids[self._taken:])
        self._taken = len(taken_ids)
        for position in range(self._indexed, len(history) - 1):
            self._positions.setdefault(history[position], []).append(position)
        self._indexed = max(self._indexed, len(history) - 1)
        earlier = self._positions.get(history[-1]) if history and most > 0 else None
        if not earlier:
            return []
        best, best_length = -1, 0
        for position in reversed(earlier[-MOST_CANDIDATES:]):
            length = 1
            while (length < LONGEST_MATCH and position - length >= 0
                   and history[position - length] == history[-1 - length]):
                length += 1
            if length > best_length:
                best, best_length = position, length
                if length == LONGEST_MATCH:
                    break
        if best_length < SHORTEST_MATCH:
            return []
        return history[best + 1:best + 1 + most]
