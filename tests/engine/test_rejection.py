"""The lossless speculative-sampling rule (`engine/sampling/rejection.py`), vectorised over 10^5 seeded sequences.

Worked examples of what a sequence commits (its accepted drafts, then the target's draw after them) under the
one-hot drafter's rule and the general one; then the distribution of the first two tokens a sequence
commits, drafted and verified as the engine does it (k = 2 drafts, a second step when the first draft is
rejected), against the exact joint distribution p(t1) p(t2 | t1) of a small target, by total-variation
distance within sampling error: for the one-hot drafter (the MTP layer's greedy drafts) and for a drafter
that samples from a general q, with targets truncated by top-k and top-p. A rule that accepts every draft in
the target's support fails the same bound, so the test can fail."""

import functools
import math

import pytest
import torch

from spmoe.engine.request import SamplingParams
from spmoe.engine.sampling.noise import exponential_noise, race, seed_keys
from spmoe.engine.sampling.rejection import accept_drafts, rejection_sample
from spmoe.engine.sampling.sampler import Sampler


@pytest.mark.parametrize(
    "drafts, choices, accepted, committed",
    [
        # fed [t, 5, 7, 9]: the target drew 5 after t, 7 after 5, 9 after 7 and 4 after 9 -> all 3 drafts and
        # the bonus token 4
        ([5, 7, 9], [5, 7, 9, 4], 3, [5, 7, 9, 4]),
        # the target drew 8 where 7 was drafted: 5 is accepted, 8 replaces 7, 9 is discarded although it equals
        # the target's draw at its position
        ([5, 7, 9], [5, 8, 9, 4], 1, [5, 8]),
        ([5, 7, 9], [6, 7, 9, 4], 0, [6]),  # the first draft is wrong: only the target's own token
        ([5, 7, 9], [5, 7, 2, 4], 2, [5, 7, 2]),  # the last draft is wrong
        (
            [5, -1, -1],
            [5, 2, 0, 0],
            1,
            [5, 2],
        ),  # one real draft (padding after it), accepted, plus the bonus
        ([5, -1, -1], [3, 2, 0, 0], 0, [3]),
        ([-1, -1, -1], [3, 0, 0, 0], 0, [3]),  # no drafts: the target's draw alone
        ([4, 4, -1], [4, 4, 4, 4], 2, [4, 4, 4]),  # repeated tokens; the padding never matches
    ],
)
def test_one_hot_acceptance_worked_examples(drafts, choices, accepted, committed):
    num = torch.tensor([sum(d >= 0 for d in drafts)])
    got = accept_drafts(torch.tensor([drafts]), num, torch.tensor([choices]))
    assert got.tolist() == [accepted]
    # what the row commits: its accepted drafts, then the target's draw
    kept = choices[: got.item() + 1]
    assert kept == committed and kept[:accepted] == drafts[:accepted]


def test_general_rule_worked_examples():
    """Distributions that leave the rule no chance, whatever the noise: a draft with p(x) >= q(x) is always
    kept, one with p(x) = 0 never; the draw at a rejection comes from max(0, p - q) (one-hot here, unlike p),
    the bonus from p_K. Three rows (K = 2, V = 4): both drafts kept and the bonus; the second rejected; the
    first rejected. Each commits its kept drafts, then the draw after them."""
    p, q = torch.full((3, 3, 4), 0.25), torch.zeros(3, 2, 4)
    # keeps 1
    p[0, 0], q[0, 0] = (
        torch.tensor([0.1, 0.6, 0.3, 0.0]),
        torch.tensor([0.0, 0.5, 0.5, 0.0]),
    )
    # keeps 2
    p[0, 1], q[0, 1] = (
        torch.tensor([0.2, 0.0, 0.8, 0.0]),
        torch.tensor([0.0, 0.0, 0.7, 0.3]),
    )
    p[0, 2] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # the bonus: 3
    p[1, 0], q[1, 0] = p[0, 0], q[0, 0]  # keeps 1
    # rejects 3: 2
    p[1, 1], q[1, 1] = (
        torch.tensor([0.4, 0.0, 0.6, 0.0]),
        torch.tensor([0.4, 0.0, 0.0, 0.6]),
    )
    # rejects 0: 3
    p[2, 0], q[2, 0] = (
        torch.tensor([0.0, 0.3, 0.0, 0.7]),
        torch.tensor([0.5, 0.5, 0.0, 0.0]),
    )
    q[2, 1] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    drafts = torch.tensor([[1, 2], [1, 3], [0, 1]])
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        noise = -torch.rand(3, 3, 4, generator=gen).log()  # Exp(1)
        accepted, tokens = rejection_sample(p, drafts, q, noise)
        assert accepted.tolist() == [2, 1, 0]
        assert [row[: a + 1] for row, a in zip(tokens.tolist(), accepted.tolist())] == [
            [1, 2, 3],
            [1, 2],
            [3],
        ]


V, K, N = 7, 2, 100_000


def drawn_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits `[m, V]` -> `[m, V]` float32: the distribution the sampler draws each row's token from with
    these settings (the softmax of `Sampler.process`'s second tensor), as the engine does with and without
    speculation."""
    sampler = Sampler(1, logits.shape[-1])
    row = sampler.add(params, [0])
    rows = logits.shape[0]
    return torch.softmax(sampler.process(logits, [row] * rows, [0] * rows)[1], dim=-1)


def processed(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits `[..., V]` -> the target's distribution: temperature 0.8, top-k and top-p."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    return drawn_probs(logits.reshape(-1, V), params).reshape(logits.shape)


@functools.cache
def seeded_noise() -> torch.Tensor:
    """`[N, K + 1, V]`: the Exp(1) noise of seeds 0 .. N-1 at output indices 0 .. K, as the engine draws it."""
    keys = torch.stack(seed_keys(torch.arange(N)), dim=1)  # the hash works on int64 tensors too
    return exponential_noise(
        keys.repeat_interleave(K + 1, 0), torch.arange(K + 1).repeat(N), V
    ).view(N, K + 1, V)


def two_tokens(rule: str, top_k: int, top_p: float) -> tuple[float, float, float, float]:
    """N sequences (seeds 0 .. N-1) draft K tokens and verify them once; a sequence that accepted no draft
    takes its second token in a second step (the target's draw at output index 1). -> (total-variation
    distance of the empirical (t1, t2) from p(t1) p(t2 | t1), its sampling-error bound, the empirical
    acceptance rate of the first draft, its exact value)."""
    gen = torch.Generator().manual_seed(11)
    target = processed(torch.randn(1 + V + V * V, V, generator=gen) * 1.5, top_k, top_p)
    # p(.), p(. | a), p(. | a, b)
    p0, p1, p2 = (
        target[0],
        target[1 : 1 + V],
        target[1 + V :].reshape(V, V, V),
    )
    noise = seeded_noise()
    # a deterministic drafter: the target's mode first, then the mode or its neighbour
    if rule == "one-hot":
        q0, q1 = torch.eye(V)[p0.argmax()], torch.eye(V)[(p1.argmax(-1) + torch.arange(V) % 2) % V]
    else:
        q = torch.softmax(torch.randn(1 + V, V, generator=gen) * 1.5, dim=-1)
        q0, q1 = q[0], q[1:]
    x1 = torch.multinomial(q0.expand(N, V), 1, replacement=True, generator=gen)[:, 0]
    x2 = torch.multinomial(q1[x1], 1, generator=gen)[:, 0]
    drafts = torch.stack([x1, x2], dim=1)
    probs = torch.stack([p0.expand(N, V), p1[x1], p2[x1, x2]], dim=1)  # [N, K + 1, V]
    if rule == "one-hot":
        tokens = race(probs, noise)
        accepted = accept_drafts(drafts, torch.full((N,), K), tokens)
    else:
        draft_probs = torch.stack([q0.expand(N, V), q1[x1]], dim=1)
        if rule == "accept-all":
            # u * 0 < p(x): every draft in the support is kept
            draft_probs = torch.zeros_like(draft_probs)
        accepted, tokens = rejection_sample(probs, drafts, draft_probs, noise)
    t1 = tokens[:, 0]
    second_step = race(p1[t1], noise[:, 1])  # the next step's draw at output index 1, after t1
    t2 = torch.where(accepted >= 1, tokens[:, 1], second_step)
    counts = torch.bincount(t1 * V + t2, minlength=V * V).double() / N
    exact = (p0[:, None] * p1).reshape(-1).double()
    tv = 0.5 * (counts - exact).abs().sum().item()
    # 0.5 * sum of each cell's standard deviation: about 1.25x the expected distance of an exact sampler
    bound = 2 * 0.5 * sum(math.sqrt(p * (1 - p) / N) for p in exact.tolist())
    first_rate = (accepted >= 1).double().mean().item()
    exact_rate = (torch.minimum(p0, q0).sum() if rule != "one-hot" else p0[q0.argmax()]).item()
    return tv, bound, first_rate, exact_rate


@pytest.mark.parametrize("rule", ["one-hot", "general"])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.8), (5, 0.9)])
def test_committed_tokens_follow_the_target_distribution(rule, top_k, top_p):
    tv, bound, rate, exact_rate = two_tokens(rule, top_k, top_p)
    assert tv < bound, (tv, bound)
    assert 0.05 < rate < 0.95  # drafts are both accepted and rejected
    # min(1, p/q) on average
    assert abs(rate - exact_rate) < 4 * math.sqrt(exact_rate * (1 - exact_rate) / N)


def test_a_rule_that_keeps_every_draft_fails_the_same_bound():
    tv, bound, _, _ = two_tokens("accept-all", 4, 1.0)
    assert tv > 3 * bound, (tv, bound)
