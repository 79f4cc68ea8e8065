"""Sampling against its definition: temperature scaling, top-p's kept set (the token that crosses top_p
included), seeded draws against a distribution computed here by hand, and the finite flag that keeps a NaN
row from becoming token 0."""

import math

import pytest
import torch

from spmoe.engine.sampling import Sampler, SamplingParams, greedy, sampling_probs


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def top_p_by_hand(probs: list[float], top_p: float) -> list[float]:
    """Keep the most likely tokens, in order, until their mass reaches top_p; renormalise."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return [p / mass if i in kept else 0.0 for i, p in enumerate(probs)]


LOGITS = [1.5, -0.5, 3.0, 0.0, 2.0]


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0])
def test_temperature_divides_the_logits(temperature):
    got = sampling_probs(torch.tensor([LOGITS]), torch.tensor([temperature]), torch.tensor([1.0]))[0]
    want = softmax([v / temperature for v in LOGITS])
    assert got.tolist() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.4, [1]),  # 0.5 alone reaches 0.4
        (0.7, [1, 3]),  # 0.5 < 0.7; with 0.3 the mass crosses 0.7, and 0.3 is kept
        (0.79, [1, 3]),
        (0.9, [1, 3, 0]),  # 0.8 < 0.9; 0.15 crosses it
        (0.97, [1, 3, 0, 2]),
        (1.0, [1, 3, 0, 2]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p_including_the_crossing_token(top_p, kept):
    probs = [0.15, 0.5, 0.05, 0.3]  # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    got = sampling_probs(torch.tensor([[math.log(p) for p in probs]]), torch.tensor([1.0]), torch.tensor([top_p]))
    mass = sum(probs[i] for i in kept)
    want = [probs[i] / mass if i in kept else 0.0 for i in range(4)]
    assert got[0].tolist() == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx(top_p_by_hand(probs, top_p))  # the hand-written rule agrees with the table


@pytest.mark.parametrize("temperature, top_p", [(0.5, 1.0), (1.0, 1.0), (0.7, 0.8), (2.0, 0.6)])
def test_seeded_draws_follow_the_distribution(temperature, top_p):
    draws = 40000
    logits = torch.tensor([LOGITS]).expand(draws, -1)
    tokens, finite = Sampler(SamplingParams(temperature, top_p, seed=11))(logits)
    assert all(finite) and len(tokens) == draws
    want = top_p_by_hand(softmax([v / temperature for v in LOGITS]), top_p)
    freq = [tokens.count(i) / draws for i in range(len(LOGITS))]
    for f, p in zip(freq, want):
        if p == 0:
            assert f == 0  # a token top-p dropped is never drawn
        else:  # 6 standard deviations of a frequency over 40000 draws
            assert abs(f - p) < 6 * math.sqrt(p * (1 - p) / draws) + 1e-9, (freq, want)


def test_same_seed_same_draws_other_seed_other_draws():
    logits = torch.tensor([LOGITS]).expand(64, -1)
    first = Sampler(SamplingParams(1.0, 1.0, seed=3))(logits)[0]
    assert Sampler(SamplingParams(1.0, 1.0, seed=3))(logits)[0] == first
    assert Sampler(SamplingParams(1.0, 1.0, seed=4))(logits)[0] != first


def test_greedy_picks_the_argmax_and_flags_rows_that_are_not_finite():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.0, 2.0, 1.0], [nan, nan, nan], [5.0, nan, 1.0], [1.0, inf, 0.0], [3.0, 4.0, -inf]])
    tokens, finite = greedy(logits)
    assert finite == [True, False, False, False, False]
    assert tokens[0] == 1
    assert Sampler(SamplingParams())(logits)[1] == finite  # temperature 0 is greedy


def test_sampling_flags_rows_that_are_not_finite_instead_of_failing():
    logits = torch.tensor([[0.0, 2.0, 1.0], [float("nan")] * 3])
    tokens, finite = Sampler(SamplingParams(temperature=0.8, top_p=0.9))(logits)
    assert finite == [True, False] and len(tokens) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0 (0 = greedy), got -0.1"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0 (0 = greedy), got nan"),
        (dict(temperature=1.0, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(temperature=1.0, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(seed=-1), "seed must be in [0, 2**63), got -1"),
    ],
)
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
