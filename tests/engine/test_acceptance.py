"""Greedy acceptance of MTP drafts on worked examples: the drafts, the target's argmax after each fed token,
how many drafts are accepted, and the bonus token committed after them."""

import pytest

from spmoe.engine.speculative import accept_greedy


@pytest.mark.parametrize(
    "drafts, target_choices, accepted, committed",
    [
        # fed [t, 5, 7, 9]: the target chose 5 after t, 7 after 5, 9 after 7 and 4 after 9 -> all 3 drafts and the
        # bonus token 4
        ([5, 7, 9], [5, 7, 9, 4], 3, [5, 7, 9, 4]),
        # the target chose 8 where 7 was drafted: 5 is accepted, 8 replaces 7, 9 is discarded although it equals
        # the target's choice at its position
        ([5, 7, 9], [5, 8, 9, 4], 1, [5, 8]),
        ([5, 7, 9], [6, 7, 9, 4], 0, [6]),  # the first draft is wrong: only the target's own token
        ([5, 7, 9], [5, 7, 2, 4], 2, [5, 7, 2]),  # the last draft is wrong
        ([5], [5, 2], 1, [5, 2]),  # one draft, accepted, plus the bonus
        ([5], [3, 2], 0, [3]),
        ([4, 4], [4, 4, 4], 2, [4, 4, 4]),  # repeated tokens
    ],
)
def test_greedy_acceptance_worked_examples(drafts, target_choices, accepted, committed):
    assert accept_greedy(drafts, target_choices) == (accepted, committed)


def test_target_choices_must_cover_every_draft_and_the_bonus():
    with pytest.raises(ValueError) as info:
        accept_greedy([5, 7], [5, 7])
    assert str(info.value) == "2 drafts need 3 target choices, got 2"
