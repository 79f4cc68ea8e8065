"""The context lookups (`runner/lookup.py`) on worked examples: the n-gram lookup's longest n-gram and
most recent occurrence, growing with the committed tokens; suffix decoding's most frequent continuation,
its probability floor and length bounds, its recent requests' outputs (oldest out first); the configs'
checks. And the hybrid's choice of source (`runner/speculator.py`: `SourceChoice`) on made-up
verifications."""

import pytest

from spmoe.engine.request import Request
from spmoe.engine.runner.lookup import NgramLookup, SuffixLookup
from spmoe.engine.runner.speculator import SourceChoice
from spmoe.engine.sequence import Part, PartResult, Role, Sequence
from spmoe.engine.speculation import NgramConfig, Speculation, SuffixConfig


def sequence(prompt: list[int], output: list[int] = ()) -> Sequence:
    seq = Sequence(Request("r", prompt, 100))
    seq.output = list(output)
    return seq


def test_ngram_takes_the_longest_ngram_and_its_most_recent_occurrence():
    lookup = NgramLookup(NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    #           0  1  2  3  4  5  6  7  8  9
    prompt = [1, 2, 3, 9, 2, 3, 8, 7, 2, 3]
    seq = sequence(prompt)
    # [2, 3] ends it; occurred at 1-2 (then 9) and 4-5 (then 8): the most recent wins
    assert lookup.propose(seq, 2) == [8, 7]
    # [9, 2, 3]: the 3-gram occurs once, after 3 → it beats the 2-gram's more recent occurrence
    seq.output = [9, 2, 3]
    assert lookup.propose(seq, 4) == [8, 7, 2, 3]
    seq.output += [5]  # 5 never occurred: no draft
    assert lookup.propose(seq, 3) == []


def test_ngram_respects_its_minimum_and_the_context_end():
    lookup = NgramLookup(NgramConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    assert lookup.propose(sequence([4, 5, 6, 5]), 3) == []  # only the 1-gram [5] recurs
    # the match runs into the end: fewer than k drafts
    assert lookup.propose(sequence([4, 5, 6, 4, 5]), 5) == [6, 4, 5]


def test_suffix_follows_the_most_frequent_continuation():
    config = SuffixConfig(max_tree_depth=24, max_spec_factor=4.0, min_token_prob=0.3)
    lookup = SuffixLookup(config)
    # [9, 1, 2] ends it and occurred 3 times: followed by 3 3 4 twice and by 5 once, so the path
    # takes 3 (2 of 3), then follows the two that agree
    prompt = [9, 1, 2, 3, 3, 4, 9, 1, 2, 3, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]
    assert lookup.propose(sequence(prompt), 6) == [3, 3, 4, 9, 1, 2]
    # a floor above 2/3 stops at once
    strict = SuffixLookup(SuffixConfig(max_spec_factor=4.0, min_token_prob=0.7))
    assert strict.propose(sequence(prompt), 6) == []


def test_suffix_bounds_the_draft_by_the_match():
    prompt = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2]
    # match [1, 2] (2 tokens): factor 1 allows 2 drafts, factor 2 allows 4
    assert SuffixLookup(SuffixConfig()).propose(sequence(prompt), 8) == [3, 4]
    assert SuffixLookup(SuffixConfig(max_spec_factor=2.0)).propose(sequence(prompt), 8) == [
        3,
        4,
        5,
        6,
    ]
    # the tree depth bounds match + drafts: depth 3 leaves 1 draft after the 2-token match
    shallow = SuffixLookup(SuffixConfig(max_tree_depth=3, max_spec_factor=2.0))
    assert shallow.propose(sequence(prompt), 8) == [3]


def test_suffix_reads_recent_requests_outputs_oldest_out_first():
    lookup = SuffixLookup(SuffixConfig(max_cached_requests=2, max_spec_factor=2.0))
    for output in ([10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]):
        lookup.finished(sequence([1], output))
    assert lookup.propose(sequence([5, 20, 21]), 4) == [22, 23]
    assert lookup.propose(sequence([5, 30, 31]), 4) == [32, 33]
    assert lookup.propose(sequence([5, 10, 11]), 4) == []  # the oldest went
    assert sorted(lookup.recent.texts) == [2, 3]
    off = SuffixLookup(SuffixConfig(max_cached_requests=0))
    off.finished(sequence([1], [20, 21, 22]))
    assert off.propose(sequence([5, 20, 21]), 4) == []


def test_lookups_index_committed_tokens_as_they_come():
    lookup = NgramLookup(NgramConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    seq = sequence([1, 2, 3])
    assert lookup.propose(seq, 2) == []
    seq.output = [4, 1, 2]
    assert lookup.propose(seq, 2) == [3, 4]
    lookup.finished(seq)
    assert seq not in lookup.own


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: NgramConfig(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min=4"),
        (lambda: NgramConfig(prompt_lookup_min=0, prompt_lookup_max=2), "1 <= prompt_lookup_min"),
        (lambda: SuffixConfig(max_tree_depth=1), "suffix_decoding_max_tree_depth must be >= 2"),
        (lambda: SuffixConfig(min_token_prob=1.5), "suffix_decoding_min_token_prob must be in"),
        (lambda: SuffixConfig(max_cached_requests=-1), "max_cached_requests must be >= 0"),
        (lambda: SuffixConfig(max_spec_factor=0), "max_spec_factor must be > 0"),
        (lambda: Speculation(num_speculative_tokens=2, mtp=False), "need a draft source"),
        (lambda: Speculation(num_speculative_tokens=-1), "integer >= 0, got -1"),
    ],
)
def test_malformed_configs_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def verified(seq, drafts, lookup_drafts, drawn, accepted) -> PartResult:
    part = Part(seq=seq, role=Role.DECODE, drafts=drafts, lookup_drafts=lookup_drafts)
    return PartResult(part=part, tokens=drawn, accepted=accepted)


def test_the_lookup_leads_while_it_is_right_more_often_than_mtp():
    choice, seq = SourceChoice(), sequence([1])
    assert choice.lookup_leads(seq)  # it starts ahead
    # the lookup led [5, 6, 7]; MTP's own choices under it were [5, 9, 9]; the target drew 5, 6, 8
    choice.remember(seq, [5, 6, 7], [5, 9, 9])
    choice.observe(verified(seq, [5, 6, 7], 3, [5, 6, 8], 2))
    assert choice.lookup_leads(seq)
    # then MTP led (its own choices are the drafts) and was right twice; the lookup's proposal missed
    for _ in range(3):
        choice.remember(seq, [4, 4], [1, 2, 3])
        choice.observe(verified(seq, [1, 2, 3], 0, [1, 2, 7], 2))
    assert not choice.lookup_leads(seq)
    # a step without a lookup proposal changes nothing
    before = {k: list(choice.state[seq][k]) for k in ("lookup", "mtp")}
    choice.remember(seq, [], [1, 2, 3])
    choice.observe(verified(seq, [1, 2, 3], 0, [0], 0))
    assert {k: choice.state[seq][k] for k in ("lookup", "mtp")} == before


def test_a_tie_goes_to_the_lookup_and_a_step_without_mtp_scores_the_lookup_alone():
    choice, seq = SourceChoice(), sequence([1])
    choice.lookup_leads(seq)  # the priors: lookup 1.5 / 2, MTP 1 / 2
    # MTP led and both proposals were verified: the lookup missed at once (0 of 1), MTP was right
    # at its first slot and wrong at its second (1 of 2): lookup 1.35 / 2.8, MTP 1.9 / 3.8
    choice.remember(seq, [9], [5, 6, 7])
    choice.observe(verified(seq, [5, 6, 7], 0, [5, 8], 1))
    assert choice.state[seq]["mtp"] == pytest.approx([1.9, 3.8])
    assert not choice.lookup_leads(seq)  # 0.48 < 0.5
    # the lookup filled every slot and MTP did not draft: only the lookup is scored (2 of 3 right):
    # 1.35 * 0.9 + 2 = 3.215 over 2.8 * 0.9 + 3 = 5.52, 0.58; MTP's 1.9 / 3.8 stays
    choice.remember(seq, [5, 6, 7], [])
    choice.observe(verified(seq, [5, 6, 7], 3, [5, 6, 8], 2))
    assert choice.state[seq]["mtp"] == pytest.approx([1.9, 3.8])
    assert choice.state[seq]["lookup"] == pytest.approx([3.215, 5.52])
    assert choice.lookup_leads(seq)
    # equal rates: the lookup leads (it costs no GPU time)
    choice.state[seq]["lookup"] = [1.9, 3.8]
    assert choice.lookup_leads(seq)
