"""Draft tokens from a sequence's own text (service/engine/drafts.py) and their share of a step's rows
(service/engine/speculation.py)."""

from service.engine.drafts import LONGEST_REST, MOST_CANDIDATES, PromptLookup
from service.engine.speculation import share_rows


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_last_three_are_proposed():
    # 7 9 occurs three times, but only twice after 5, as the history's last three tokens are.
    lookup = PromptLookup([5, 7, 9, 1, 2, 3, 8, 7, 9, 4, 5, 7, 9, 6, 6, 5, 7], 8)
    assert lookup.propose([9], 3) == [6, 6, 5]


def test_one_or_two_matching_tokens_propose_nothing():
    assert PromptLookup([3, 1, 4, 3, 2, 6, 0, 3], 8).propose([], 2) == []
    assert PromptLookup([8, 3, 1, 4, 8, 3, 2, 6, 0, 8, 3], 8).propose([], 2) == []


def test_a_proposal_stops_at_the_history_end_and_at_most():
    lookup = PromptLookup([1, 2, 3, 1, 2, 3], 8)
    assert lookup.propose([], 8) == [1, 2, 3]
    assert lookup.propose([], 1) == [1]
    assert lookup.propose([], 0) == []
    assert PromptLookup([5, 5, 5, 5], 8).propose([], 4) == [5]


def test_no_proposal_where_the_last_tokens_never_occurred_before():
    assert PromptLookup([1, 2, 3], 8).propose([], 4) == []
    assert PromptLookup([], 8).propose([], 4) == []


def test_the_reply_is_indexed_as_it_grows():
    lookup = PromptLookup([10, 11, 12], 8)
    assert lookup.propose([13], 2) == []
    assert lookup.propose([13, 10, 11, 12], 2) == [13, 10]
    # The reply's own earlier tokens count as the prompt's do.
    assert lookup.propose([13, 10, 11, 12, 40, 41, 42, 9, 40, 41, 42], 3) == [9, 40, 41]


def test_a_common_token_is_looked_up_among_its_latest_occurrences_only():
    # The one match lies before the last MOST_CANDIDATES occurrences of the last token, or just within them.
    assert PromptLookup([1, 2, 0, 55] + [3, 0] * MOST_CANDIDATES + [1, 2, 0], 8).propose([], 1) == []
    assert PromptLookup([1, 2, 0, 55] + [3, 0] * (MOST_CANDIDATES - 1) + [1, 2, 0], 8).propose([], 1) == [55]


def test_rows_are_shared_evenly_among_the_sequences_that_propose():
    proposals = [[1, 2, 3, 4], [], [5, 6, 7], [8]]
    assert share_rows(proposals, 7) == [[1, 2, 3], [], [5, 6], [8]]
    assert share_rows(proposals, 2) == [[1], [], [5], []]
    assert share_rows(proposals, 0) == [[], [], [], []]


def test_drafts_shrink_after_a_miss_and_grow_back_while_taken_whole():
    """A missed draft limits the next to one past its taken part; a draft taken whole doubles it, up to the setting."""
    text = list(range(20)) * 2  # every 3-token tail of the second copy matches the first
    lookup = PromptLookup(text[:23], 8)
    assert len(lookup.propose([], 8)) == 8
    lookup.judged(8, 0)
    assert lookup.propose([], 8) == []  # a step's rest after a draft rejected whole
    assert len(lookup.propose([], 8)) == 1
    lookup.judged(1, 1)
    assert len(lookup.propose([], 8)) == 2
    lookup.judged(2, 2)
    lookup.judged(4, 4)
    assert lookup.limit == 8
    lookup.judged(8, 8)
    assert lookup.limit == 8
    lookup.judged(8, 3)
    assert len(lookup.propose([], 8)) == 4
    lookup.judged(0, 0)
    assert lookup.limit == 4


def test_drafts_rejected_whole_in_a_row_rest_twice_as_long_each_time_until_a_token_is_taken():
    """Where drafts keep missing (a sampled story), the sequence drafts ever more rarely, up to one step in
    LONGEST_REST + 1; a draft token taken ends the doubling, so repeating text drafts again at once."""
    lookup = PromptLookup(list(range(20)) * 2, 8)

    def rest_after_a_whole_miss() -> int:
        lookup.judged(1, 0)
        steps = 0
        while not lookup.propose([], 8):
            steps += 1
        return steps

    assert [rest_after_a_whole_miss() for _ in range(7)] == [1, 2, 4, 8, LONGEST_REST, LONGEST_REST, LONGEST_REST]
    lookup.judged(1, 1)
    assert rest_after_a_whole_miss() == 1
