"""Prompt lookup: the guess is what followed the latest earlier occurrence of the longest suffix."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference_service.sample.ngram_proposer import NgramProposer


def test_the_longest_suffix_wins_and_the_latest_occurrence_of_it():
    proposer = NgramProposer(max_ngram=3)
    #        [5 1 2] 3 | 1 2 4 | 9 ... 5 1 2 → the 3-gram [5 1 2] occurred once: 3 follows it
    assert proposer.propose([5, 1, 2, 3, 1, 2, 4, 9, 5, 1, 2], 2) == [3, 1]
    # only the 2-gram [1 2] recurs: its latest occurrence was followed by 4 9
    assert proposer.propose([5, 1, 2, 3, 1, 2, 4, 9, 6, 1, 2], 2) == [4, 9]


def test_a_guess_running_off_the_end_repeats_the_loop():
    proposer = NgramProposer()
    assert proposer.propose([7, 8, 7, 8, 7], 5) == [8, 7, 8, 7, 8]
    assert proposer.propose([4, 4, 4], 3) == [4, 4, 4]


def test_no_match_no_guess():
    proposer = NgramProposer(max_ngram=3, min_ngram=2)
    assert proposer.propose([1, 2, 3, 4, 1], 4) == []  # only a 1-gram recurs: below min_ngram
    assert proposer.propose([1], 4) == [] and proposer.propose([1, 2, 1], 0) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(max_ngram=1, min_ngram=2)


@given(st.lists(st.integers(0, 4), min_size=2, max_size=60), st.integers(1, 6))
def test_a_guess_continues_a_real_earlier_occurrence(tokens, max_tokens):
    """Whatever the sequence, a guess has the asked length, and its first token followed an earlier
    occurrence of the sequence's last n tokens for some n in range."""
    proposer = NgramProposer(max_ngram=3, min_ngram=1)
    guess = proposer.propose(tokens, max_tokens)
    if not guess:
        assert tokens[-1] not in tokens[:-1]  # even the last token alone never occurred before
        return
    assert len(guess) == max_tokens
    followers = {
        tokens[i + n]
        for n in range(1, 4)
        for i in range(len(tokens) - n)
        if tokens[i : i + n] == tokens[len(tokens) - n :]
    }
    assert guess[0] in followers
