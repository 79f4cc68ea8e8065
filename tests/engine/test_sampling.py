"""The batched sampler against references written here in plain Python, one row at a time: each
logits processor (penalties, logit_bias, min_tokens, temperature, min_p, top_k, top_p) on a batch
whose rows all have different settings; the seeded exponential race against its distribution (total
variation over many draws, across output positions and across seeds); seeds that fix a row's token
whatever else is in the batch; greedy rows equal to the plain argmax; logprobs and prompt logprobs
against log-probabilities computed here; non-finite rows flagged."""

import math
import random

import pytest
import torch
from msgspec.structs import replace

from spmoe.engine.request import SamplingParams
from spmoe.engine.sampling.noise import (
    MASK32,
    draw_tokens,
    exponential_noise,
    exponential_of,
    mix32,
    seed_keys,
)
from spmoe.engine.sampling.processors import apply_top_k_top_p
from spmoe.engine.sampling.sampler import Sampler, prompt_logprobs

V = 12
NEG = float("-inf")


def rand_logits(m: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, V, generator=torch.Generator().manual_seed(seed)) * 2


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) if v != NEG else 0.0 for v in row]
    return [e / sum(exps) for e in exps]


def reference_before_temperature(row, params, prompt, output, stop_ids, allowed=None):
    """One row's logits after the grammar mask, min_tokens, logit_bias and penalties, by the
    definitions."""
    out = list(row)
    if allowed is not None:
        out = [v if allowed[i] else NEG for i, v in enumerate(out)]
    if len(output) < params.min_tokens:
        out = [NEG if i in stop_ids else v for i, v in enumerate(out)]
    for token, bias in params.logit_bias:
        out[token] += bias
    for i in range(V):
        count = output.count(i)
        if params.repetition_penalty != 1 and (i in prompt or count):
            out[i] = (
                out[i] / params.repetition_penalty
                if out[i] > 0
                else out[i] * params.repetition_penalty
            )
        out[i] -= params.frequency_penalty * count
        out[i] -= params.presence_penalty * (count > 0)
    return out


def reference_distribution(row, params) -> list[float]:
    """The distribution drawn from: temperature (0 counts as 1), min_p, top_k, top_p, in that
    order."""
    t = params.temperature or 1.0
    probs = softmax([v / t for v in row])
    if params.min_p:
        probs = [p if p >= params.min_p * max(probs) else 0.0 for p in probs]
    if params.top_k:
        kth = sorted((p for p in probs), reverse=True)[params.top_k - 1]
        probs = [p if p >= kth else 0.0 for p in probs]
    probs = [p / sum(probs) for p in probs]
    if params.top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(V), key=lambda i: -probs[i]):
            if mass >= params.top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [p if i in kept else 0.0 for i, p in enumerate(probs)]
        probs = [p / sum(probs) for p in probs]
    return probs


ROWS = [  # (params, prompt, output so far, stop ids)
    (SamplingParams(), [1, 2], [3, 3, 4], (0,)),
    (SamplingParams(1.0, presence_penalty=1.5), [1, 2], [3, 3, 4], ()),
    (SamplingParams(0.7, frequency_penalty=0.8, seed=3), [5], [3, 3, 4, 3], ()),
    (SamplingParams(1.3, repetition_penalty=1.7, seed=4), [1, 2, 9], [3, 4], ()),
    (SamplingParams(0.0, repetition_penalty=0.6, presence_penalty=-1.0), [7], [8, 8], ()),
    (SamplingParams(1.0, logit_bias=((2, 5.0), (6, -100.0), (11, 0.5))), [1], [], ()),
    (SamplingParams(0.9, min_tokens=4, seed=8), [1], [2, 3], (0, 5)),
    (SamplingParams(0.9, min_tokens=2, seed=8), [1], [2, 3], (0, 5)),  # reached: nothing held back
    (SamplingParams(0.8, top_k=3, seed=9), [1], [], ()),
    (SamplingParams(1.1, top_p=0.6, seed=10), [1], [], ()),
    (SamplingParams(1.0, min_p=0.2, seed=11), [1], [], ()),
    (
        SamplingParams(0.6, top_k=5, top_p=0.7, min_p=0.05, frequency_penalty=0.3, seed=12),
        [2],
        [4, 4],
        (),
    ),
]


def loaded_sampler(rows=ROWS) -> tuple[Sampler, list[int]]:
    sampler = Sampler(len(rows) + 2, V)
    taken = [sampler.add(params, prompt, stops) for params, prompt, _, stops in rows]
    for row, (_, _, output, _) in zip(taken, rows):
        sampler.commit([row] * len(output), output)
    return sampler, taken


def test_each_processor_equals_its_definition_in_a_mixed_batch():
    sampler, taken = loaded_sampler()
    logits = rand_logits(len(ROWS))
    best, drawn, finite = sampler.process(logits, taken, [len(o) for _, _, o, _ in ROWS])
    assert finite.all()
    for j, (params, prompt, output, stops) in enumerate(ROWS):
        want = reference_before_temperature(logits[j].tolist(), params, prompt, output, stops)
        assert best[j].tolist() == pytest.approx(want, abs=1e-5), j
        got_probs = torch.softmax(drawn[j], -1).tolist()
        assert got_probs == pytest.approx(reference_distribution(want, params), abs=1e-6), j


def test_top_k_keeps_ties_at_the_kth_value():
    sampler = Sampler(1, V)
    row = sampler.add(SamplingParams(1.0, top_k=2), [0])
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0] + [0.0] * (V - 4)])
    _, drawn, _ = sampler.process(logits, [row], [0])
    assert (torch.isfinite(drawn[0]).nonzero().flatten().tolist()) == [0, 2, 3]


def test_top_p_keeps_ties_with_the_token_that_crosses_it():
    """p = e^3, e^2, e^2, e^2, 1 over their sum: token 0 holds 0.46 of the mass, so top_p 0.5 is
    crossed by a token of value 2; all three of them stay, whatever order a sort gives ties, and
    token 4 goes."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])
    mass = math.exp(3) / (math.exp(3) + 3 * math.exp(2) + 1)
    assert 0.4 < mass < 0.5
    got = apply_top_k_top_p(logits.clone(), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(got[0]).tolist() == [True, True, True, True, False]


def test_commit_counts_by_scatter_and_drafts_count_as_preceding_tokens():
    params = SamplingParams(1.0, frequency_penalty=1.0, presence_penalty=0.5, seed=2)
    sampler = Sampler(2, V)
    a, b = sampler.add(params, [1]), sampler.add(params, [1])
    sampler.commit([a, a, b], [4, 4, 5])
    logits = rand_logits(1)
    with_drafts, _, _ = sampler.process(logits, [a], [4], preceding=[[6, 4]])
    sampler.commit([a, a], [6, 4])
    committed, _, _ = sampler.process(logits, [a], [4])
    assert torch.equal(with_drafts, committed)
    want = reference_before_temperature(logits[0].tolist(), params, [1], [4, 4, 6, 4], ())
    assert committed[0].tolist() == pytest.approx(want, abs=1e-5)


def test_a_row_coming_back_recounts_its_output_and_a_released_row_is_clean():
    penalised = SamplingParams(1.0, repetition_penalty=2.0)
    sampler = Sampler(1, V)
    row = sampler.add(penalised, [1, 2], output=[3, 3])
    logits = rand_logits(1)
    got, _, _ = sampler.process(logits, [row], [2])
    assert got[0].tolist() == pytest.approx(
        reference_before_temperature(logits[0].tolist(), penalised, [1, 2], [3, 3], ())
    )
    sampler.release(row)
    row = sampler.add(SamplingParams(), [1])
    got, _, _ = sampler.process(logits, [row], [0])
    assert torch.equal(got, logits)


def test_greedy_rows_are_the_plain_argmax_bit_for_bit_beside_sampled_rows():
    logits = torch.randn(64, 1000, dtype=torch.float32)
    sampler = Sampler(64, 1000)
    rows = [
        sampler.add(SamplingParams() if i % 2 else SamplingParams(0.9, top_p=0.8, seed=i), [0])
        for i in range(64)
    ]
    got = sampler.sample(logits, rows, [5] * 64)
    argmax = logits.argmax(-1).tolist()
    assert [t for i, t in enumerate(got.token_ids) if i % 2] == [
        t for i, t in enumerate(argmax) if i % 2
    ]
    all_greedy = Sampler(64, 1000)
    rows = [all_greedy.add(SamplingParams(), [0]) for _ in range(64)]
    assert all_greedy.sample(logits, rows, [0] * 64).token_ids == argmax


def total_variation(draws: list[int], probs: list[float]) -> float:
    return 0.5 * sum(abs(draws.count(i) / len(draws) - p) for i, p in enumerate(probs))


@pytest.mark.parametrize(
    "params", [SamplingParams(1.0, seed=7), SamplingParams(0.6, top_k=6, top_p=0.9, seed=1)]
)
def test_seeded_draws_follow_the_distribution_across_output_positions(params):
    draws = 30000
    sampler = Sampler(1, V)
    row = sampler.add(params, [0])
    logits = rand_logits(1, seed=5).expand(draws, -1)
    got = sampler.sample(logits, [row] * draws, list(range(draws))).token_ids
    want = reference_distribution(logits[0].tolist(), params)
    # E[TV] is about 0.5 * sum sqrt(2 p (1 - p) / (pi draws)) < 0.006 here; 0.015 is far out in the
    # tail
    assert total_variation(got, want) < 0.015
    assert all(want[t] > 0 for t in set(got))  # nothing truncated away is ever drawn


def test_seeded_draws_follow_the_distribution_across_seeds():
    draws = 30000
    rng = random.Random(0)
    keys = torch.tensor([seed_keys(rng.randrange(2**63)) for _ in range(draws)])
    probs = softmax(rand_logits(1, seed=6)[0].tolist())
    race = torch.tensor(probs)[None, :] / exponential_noise(keys, torch.full((draws,), 3), V)
    assert total_variation(race.argmax(-1).tolist(), probs) < 0.015


def test_the_hash_is_the_same_on_python_ints_and_tensors_and_uniform_enough():
    values = [0, 1, 2**31, 2**32 - 1, 12345]
    assert mix32(torch.tensor(values)).tolist() == [mix32(v) for v in values]
    noise = exponential_noise(torch.tensor([seed_keys(0)]), torch.tensor([0]), 200000)[0]
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)  # Exp(1): mean 1, variance 1
    assert noise.var().item() == pytest.approx(1.0, abs=0.02)


def test_the_noise_is_positive_at_every_uniform_so_no_excluded_token_is_drawn():
    """Every value of the top 23 bits (the low 9 set, as high as bits go) gives noise in (0, 16.7)
    whose exp(-noise) is (v + 0.5) / 2**23; a noise of 0 would make an excluded token's ratio 0 / 0
    = NaN, which argmax takes. At seed 7, output indices 91, 116, 169 and 170 of 154880 tokens, a
    24-bit uniform rounded to 1.0 on an excluded token: top_k 1 must still draw the argmax there."""
    top = torch.arange(2**23, dtype=torch.int64)
    noise = exponential_of(top << 9 | 511)
    assert torch.isfinite(noise).all() and noise.min().item() > 0 and noise.max().item() < 16.7
    exact = (top.double() + 0.5) * 2.0**-23
    assert torch.allclose(torch.exp(-noise.double()), exact, rtol=1e-6, atol=0)
    vocab, indices = 154880, [91, 116, 169, 170]
    sampler = Sampler(4, vocab)
    row = sampler.add(SamplingParams(1.0, top_k=1, seed=7), [0])
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)).expand(4, -1)
    assert sampler.sample(logits, [row] * 4, indices).token_ids == [logits[0].argmax().item()] * 4


def test_draw_tokens_races_each_drawing_row_with_its_own_noise():
    """`draw_tokens` off CUDA (the torch reference) on a subset of rows in any order, one twice:
    each drawing row's token is the argmax of softmax / noise with the noise hashed here from Python
    ints, token by token."""
    vocab = 50
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)) * 2
    logits[1, 10:] = NEG
    at = torch.tensor([3, 1, 3, 0])
    seeds, index = [5, 2**63 - 1, 6, 0], [0, 2**32 - 1, 7, 2**32 + 3]
    keys = torch.tensor([seed_keys(seed) for seed in seeds])
    got = draw_tokens(logits, at, keys, torch.tensor(index)).tolist()
    for j, row in enumerate(at.tolist()):
        (k0, k1), i = seed_keys(seeds[j]), index[j] & MASK32
        a, b = mix32(k0 ^ i), mix32((k1 + i) & MASK32)
        noise = [
            -math.log(((mix32(mix32((t + a) & MASK32) ^ b) >> 9) + 0.5) / 2**23)
            for t in range(vocab)
        ]
        probs = softmax(logits[row].tolist())
        assert got[j] == max(range(vocab), key=lambda t: probs[t] / noise[t])


def test_a_seed_fixes_the_token_whatever_else_is_in_the_batch():
    logits = rand_logits(6, seed=9)
    params = SamplingParams(1.0, top_p=0.95, seed=42)
    alone = Sampler(1, V)
    row = alone.add(params, [0])
    by_index = [alone.sample(logits[:1], [row], [i]).token_ids[0] for i in range(40)]
    crowd = Sampler(8, V)
    others = [crowd.add(p, [0]) for p, *_ in ROWS[:5]]
    mine = crowd.add(params, [0])
    for i in range(40):
        batch = torch.cat([logits[1:3], logits[:1], logits[3:6]])
        got = crowd.sample(
            batch, others[:2] + [mine] + others[2:5], [i + 1, 0, i, 3, 2, 1]
        ).token_ids
        assert got[2] == by_index[i]
    other_seed = Sampler(1, V)
    row = other_seed.add(SamplingParams(1.0, top_p=0.95, seed=43), [0])
    assert [other_seed.sample(logits[:1], [row], [i]).token_ids[0] for i in range(40)] != by_index


def test_logprobs_are_those_of_the_distribution_drawn_from():
    rows = ROWS[:3] + [(SamplingParams(0.5, top_k=3, seed=1, logprobs=5), [0], [], ())]
    rows = [(replace(p, logprobs=p.logprobs or i), *rest) for i, (p, *rest) in enumerate(rows)]
    rows[1] = (replace(rows[1][0], logprobs=None), *rows[1][1:])
    sampler, taken = loaded_sampler(rows)
    logits = rand_logits(len(rows), seed=3)
    got = sampler.sample(logits, taken, [len(o) for _, _, o, _ in rows])
    for j, (params, prompt, output, stops) in enumerate(rows):
        if params.logprobs is None:
            assert got.logprobs[j] is None and got.top_logprobs[j] is None
            continue
        processed = reference_before_temperature(logits[j].tolist(), params, prompt, output, stops)
        probs = reference_distribution(processed, params)
        logp = [math.log(p) if p else NEG for p in probs]
        assert got.logprobs[j] == pytest.approx(logp[got.token_ids[j]], abs=1e-5)
        order = sorted(range(V), key=lambda i: -logp[i])[: params.logprobs]
        assert [v for _, v in got.top_logprobs[j]] == pytest.approx(
            [logp[i] for i in order], abs=1e-5
        )
        # the ids in order, except among excluded tokens (all -inf: any order)
        assert [t for t, v in got.top_logprobs[j] if v > NEG] == [i for i in order if logp[i] > NEG]
    # default settings at temperature 1: the model's own log-probabilities
    plain = Sampler(1, V)
    row = plain.add(SamplingParams(1.0, logprobs=0), [0])
    out = plain.sample(logits[:1], [row], [0])
    assert out.logprobs[0] == pytest.approx(
        math.log(softmax(logits[0].tolist())[out.token_ids[0]]), abs=1e-5
    )
    assert out.top_logprobs[0] == []


def test_logprobs_of_the_rows_that_asked_are_those_of_a_batch_where_every_row_asked():
    """Only the asking rows' log_softmax and topk are computed: interleaved with rows that did not
    ask, each gets what it gets when every row asks, bit for bit (the first k of the top 5), and the
    others get None."""
    vocab, wanted = 1000, [None, 3, None, 0, 5, None, 1]
    logits = torch.randn(len(wanted), vocab, generator=torch.Generator().manual_seed(8)) * 3
    settings = [
        SamplingParams(0.8 if i % 2 else 0.0, top_p=0.9, seed=i) for i in range(len(wanted))
    ]

    def sample(logprobs):
        sampler = Sampler(len(wanted), vocab)
        rows = [sampler.add(replace(p, logprobs=k), [0]) for p, k in zip(settings, logprobs)]
        return sampler.sample(logits, rows, list(range(len(wanted))))

    some, every = sample(wanted), sample([5] * len(wanted))
    assert some.token_ids == every.token_ids
    for j, k in enumerate(wanted):
        if k is None:
            assert some.logprobs[j] is None and some.top_logprobs[j] is None
        else:
            assert (
                some.logprobs[j] == every.logprobs[j]
                and some.top_logprobs[j] == every.top_logprobs[j][:k]
            )


def test_prompt_logprobs_are_the_raw_log_probabilities():
    logits = rand_logits(5, seed=4)
    next_ids = [3, 0, 11, 7, 7]
    got = prompt_logprobs(logits, torch.tensor(next_ids), 2)
    for j, (lp, top) in enumerate(got):
        logp = [math.log(p) for p in softmax(logits[j].tolist())]
        assert lp == pytest.approx(logp[next_ids[j]], abs=1e-5)
        order = sorted(range(V), key=lambda i: -logp[i])[:2]
        assert [t for t, _ in top] == order and [v for _, v in top] == pytest.approx(
            [logp[i] for i in order]
        )


def test_rows_that_are_not_finite_or_allow_nothing_are_flagged():
    sampler = Sampler(4, 40)
    rows = [
        sampler.add(SamplingParams(t, seed=1, frequency_penalty=0.5), [0])
        for t in (0.0, 1.0, 1.0, 0.0)
    ]
    logits = torch.randn(4, 40)
    logits[1, 3] = float("nan")
    logits[3, 0] = float("inf")
    logits[2] = float("-inf")  # no token allowed
    got = sampler.sample(logits, rows, [0] * 4)
    assert got.finite == [True, False, False, False]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=-1), "top_k must be >= 0 (0 = off), got -1"),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (
            dict(repetition_penalty=0.0),
            "repetition_penalty must be in [0.001, 1000] (1 = off), got 0.0",
        ),
        (
            dict(repetition_penalty=1e-39),
            "repetition_penalty must be in [0.001, 1000] (1 = off), got 1e-39",
        ),
        (
            dict(repetition_penalty=float("nan")),
            "repetition_penalty must be in [0.001, 1000] (1 = off), got nan",
        ),
        (
            dict(logit_bias=((3, 101.0),)),
            "logit_bias maps token ids >= 0 to biases in [-100, 100], got 3: 101.0",
        ),
        (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (dict(logprobs=21), "logprobs must be in [0, 20], got 21"),
    ],
)
def test_bad_parameters_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).check()
    assert str(info.value) == message


def test_the_sort_keeps_what_the_rule_keeps_on_the_kernel_tests_rows():
    """The CPU's top_k / top_p threshold (`top_k_top_p_threshold_by_sort`) against the float64 rule
    over the rows the kernel's GPU test uses (ties at the k-th value and at the crossing token, -inf
    masks, flat rows): the same tokens kept wherever no rounding can move the crossing."""
    from spmoe.engine.sampling.processors import top_k_top_p_threshold_by_sort

    from .test_top_k_top_p_gpu import MARGIN, kept_count, reference_threshold, rows_at

    rows = [(row, k, p) for row, k, p, exact in rows_at(1000) if exact]
    top_k = torch.tensor([k for _, k, _ in rows])
    top_p = torch.tensor([p for _, _, p in rows], dtype=torch.float32)
    by_sort = top_k_top_p_threshold_by_sort(torch.stack([r for r, _, _ in rows]), top_k, top_p)
    assert len(rows) > 20
    for j, (row, k, _) in enumerate(rows):
        want, margin = reference_threshold(row, k, top_p[j].item())
        assert margin >= MARGIN, (j, margin)
        assert kept_count(row, by_sort[j, 0].item()) == kept_count(row, want), j


def test_tiny_temperatures_are_greedy_and_huge_counts_are_stored():
    """A temperature below `GREEDY_BELOW` chooses the argmax, with greedy's logprobs (temperature
    1): dividing by it would overflow the logits (1e-50 rounded to 0 in the float32 column and drew
    at temperature 1); a top_k or min_tokens past int64 no longer fails the write into the row
    (which took the row and raised)."""
    logits = rand_logits(3, seed=4)
    sampler = Sampler(3, V)
    rows = [
        sampler.add(SamplingParams(1e-50, seed=1, logprobs=1), [0]),
        sampler.add(SamplingParams(1e-39, seed=2), [0]),
        sampler.add(SamplingParams(1.0, top_k=2**63, min_tokens=2**64, seed=3), [0]),
    ]
    got = sampler.sample(logits, rows, [0, 0, 0])
    assert got.token_ids[:2] == logits[:2].argmax(-1).tolist() and all(got.finite)
    assert abs(got.logprobs[0] - torch.log_softmax(logits[0], -1).max().item()) < 1e-6
    assert sampler.top_k[rows[2]].item() == V and sampler.min_tokens[rows[2]].item() == 2**62
    # and the clamped row draws what the same seed draws with no top_k and no min_tokens
    plain = Sampler(1, V)
    alone = plain.sample(logits[2:], [plain.add(SamplingParams(1.0, seed=3), [0])], [0])
    assert got.token_ids[2] == alone.token_ids[0]


def test_rows_run_out_and_come_back():
    sampler = Sampler(1, V)
    row = sampler.add(SamplingParams(), [0])
    with pytest.raises(RuntimeError, match="the sampler's 1 rows are all taken"):
        sampler.add(SamplingParams(), [0])
    sampler.release(row)
    with pytest.raises(ValueError, match="sampler rows \\[0\\] are not taken"):
        sampler.process(rand_logits(1), [row], [0])
