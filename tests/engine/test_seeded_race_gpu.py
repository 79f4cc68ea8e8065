"""The Triton seeded race (`seeded_race_triton`) against the torch reference it replaces (`draw_tokens_by_torch`:
`exponential_noise` + `race` over the softmax). Its hash bits are `noise_bits`' bit for bit and its noise
`exponential_noise`'s within a few ulp (its log against torch's), positive at every one of the 2**23 uniforms.
The tokens it draws are the reference's over a matrix of rows (V 1000 and 154880; temperature-scaled logits, -inf
and float32-lowest masks, one-token rows, all-equal rows, an all -inf row, seeds and output indices near 0 and
2**32, batches 1 to 256, a subset `at` of the rows in any order, repeats included), except at near-ties, which
are counted and must be few; every token it draws is within a near-tie of the exact race winner, computed here in
float64; exact ties go to the first token. Its draws at many output indices of one small row follow the row's
softmax (total variation within sampling error). On CUDA, where the sampler draws with it; on the CPU too under
Triton's interpreter (`TRITON_INTERPRET=1` with triton installed, which CPU CI is not)."""

import math

import pytest
import torch

from spmoe.engine.request import SamplingParams
from spmoe.engine.sampling.noise import (
    draw_tokens_by_torch,
    exponential_noise,
    exponential_of,
    noise_bits,
    seed_keys,
)
from spmoe.engine.sampling.sampler import Sampler

from ..multigpu import kernel_devices, requires_gpus

pytestmark = pytest.mark.gpu

DEVICES = kernel_devices()
LOWEST = torch.finfo(torch.float32).min
NEAR = 1e-5  # a near-tie: the two largest ratios of a row within this (relative); float32 rounding is ~1e-6
MOST_NEAR_TIES = 2  # of all the rows of a test: each near-tie has odds of about 1e-6 on these rows
KEYS = [seed_keys(s) for s in (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 12345)] + [
    (0, 0),
    (2**32 - 1, 2**32 - 1),
]
# the kernel keeps the low 32 bits, as the reference
INDICES = [
    0,
    1,
    2**32 - 1,
    2**32,
    2**32 + 7,
    2**62,
    17,
]


def keys_and_indices(s: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`[s, 2]` keys and `[s]` output indices cycling through the edge cases (not in step: every pairing)."""
    keys = torch.tensor([KEYS[j % len(KEYS)] for j in range(s)], device=device)
    index = torch.tensor(
        [INDICES[j % len(INDICES)] ^ (j // len(INDICES)) for j in range(s)], device=device
    )
    return keys, index


def case_rows(vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """One row `[V]` per case."""
    randn = lambda scale: torch.randn(vocab, generator=gen) * scale
    # temperature-scaled: 0.05 gives logits of +-200
    rows = [randn(3.0) / t for t in (0.05, 0.5, 1.0, 2.0)]
    rows += [randn(2.0) + 100.0, randn(2.0) - 100.0]
    row = randn(5.0)  # what top_p leaves: the 50 largest
    rows.append(row.masked_fill(row < row.topk(min(50, vocab)).values[-1], float("-inf")))
    # masks: a grammar's at the float32 lowest
    for fill, share in (
        (float("-inf"), 0.9),
        (LOWEST, 0.99),
    ):
        row = randn(2.0)
        row[torch.randperm(vocab, generator=gen)[: int(vocab * share)]] = fill
        rows.append(row)
    for fill in (float("-inf"), LOWEST):  # one token allowed
        row = torch.full((vocab,), fill)
        row[vocab // 3] = -7.0
        rows.append(row)
    # all equal
    rows += [
        torch.zeros(vocab),
        torch.full((vocab,), LOWEST),
        torch.full((vocab,), 5.0),
    ]
    rows.append(torch.full((vocab,), float("-inf")))  # nothing allowed (`finite` flags it): token 0
    return rows


def exact_ratios(row: torch.Tensor, keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """softmax(row) / noise in float64 for one row `[V]` and its keys `[2]`, index `[]` -> `[V]`."""
    bits = noise_bits(keys[None], index[None], row.numel())[0]
    noise = -torch.log(((bits >> 9).double() + 0.5) * 2.0**-23)
    return torch.softmax(row.double(), dim=-1) / noise


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_hashes_the_reference_bits(device):
    from .seeded_race_probe import kernel_noise

    s, vocab = 3 * len(KEYS) * len(INDICES), 3000
    keys, index = keys_and_indices(s, device)
    bits, noise = kernel_noise(keys, index, vocab)
    assert torch.equal(bits, noise_bits(keys, index, vocab))
    want = exponential_noise(keys, index, vocab)
    ulps = (noise.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    assert ulps.max().item() <= 4 and (noise > 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_noise_at_every_uniform(device):
    """All 2**23 values of the top 23 bits (the low 9 bits set): the kernel's noise is positive (a 0 would draw
    excluded tokens) and `exponential_of`'s within a few ulp."""
    from .seeded_race_probe import kernel_exponential

    bits = torch.arange(2**23, dtype=torch.int64, device=device) << 9 | 511
    noise, want = kernel_exponential(bits), exponential_of(bits)
    ulps = (noise.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    assert ulps.max().item() <= 4 and (noise > 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1000, 154880])
def test_kernel_draws_the_reference_tokens(device, vocab):
    from spmoe.engine.sampling.seeded_race_triton import seeded_race

    gen = torch.Generator().manual_seed(vocab)
    cases = case_rows(vocab, gen)
    # the interpreter is slow
    batches = (1, 3, 64, 256) if vocab < 10000 or device == "cuda" else (1, 16)
    near_ties = drawn = 0
    for batch in batches:
        # more rows than draw: `at` picks some, in any order, one twice
        m = max(batch, len(cases)) + 3
        logits = torch.stack(
            cases + [torch.randn(vocab, generator=gen) * 2 for _ in range(m - len(cases))]
        )
        at = torch.randperm(m, generator=gen)[:batch]
        if batch > 1:
            at[-1] = at[0]
        keys, index = keys_and_indices(batch, "cpu")
        on_device = [t.to(device) for t in (logits, at, keys, index)]
        got = seeded_race(*on_device).cpu()
        # the reference `[32, V]` at a time: its temporaries are large
        for lo in range(0, batch, 32):
            want = draw_tokens_by_torch(on_device[0], *(t[lo : lo + 32] for t in on_device[1:]))
            for j, w in zip(range(lo, lo + 32), want.cpu().tolist()):
                row = logits[at[j]]
                if (row == float("-inf")).all():
                    assert got[j].item() == w == 0
                    continue
                ratios = exact_ratios(row, keys[j], index[j])
                # the race's winner
                assert ratios[got[j]].item() >= (1 - NEAR) * ratios.max().item(), (
                    batch,
                    j,
                )
                # never an excluded token
                assert row[got[j]].item() > LOWEST or (row == LOWEST).all()
                near_ties += got[j].item() != w
                drawn += 1
    print(f"V {vocab} on {device}: {near_ties} near-ties in {drawn} draws")
    assert near_ties <= MOST_NEAR_TIES


def colliding_pairs(keys: torch.Tensor, index: torch.Tensor, vocab: int) -> list[tuple[int, int]]:
    """The pairs of tokens (first, second) whose top 23 hash bits, and so noise, are equal at (keys `[2]`, index)."""
    top = noise_bits(keys[None], index[None], vocab)[0] >> 9
    order = top.argsort(stable=True)
    same = (top[order[1:]] == top[order[:-1]]).nonzero()[:, 0].tolist()
    return [tuple(sorted((order[k].item(), order[k + 1].item()))) for k in same]


@pytest.mark.parametrize("device", DEVICES)
def test_exact_ties_go_to_the_first_token(device):
    """Rows allowing two tokens of equal logit whose noise is equal too (their top 23 hash bits collide): the
    ratios tie exactly, and the kernel, as torch's argmax, draws the first of the two. Eight pairs at one index
    (about 1400 collide among 154880 tokens), and one whose tokens lie a multiple of the kernel's block apart
    (the same lane: its running best meets both), found by trying indices."""
    from spmoe.engine.sampling.seeded_race_triton import BLOCK, seeded_race

    vocab = 154880
    keys = torch.tensor(KEYS[0])
    found = colliding_pairs(keys, torch.tensor(0), vocab)
    cases = [(0, pair) for pair in found[:: len(found) // 8][:8]]
    for i in range(1, 200):
        lane = [
            (a, b)
            for a, b in colliding_pairs(keys, torch.tensor(i), vocab)
            if (b - a) % BLOCK.value == 0
        ]
        if lane:
            cases.append((i, lane[0]))
            break
    assert len(cases) == 9, cases
    logits = torch.full((len(cases), vocab), float("-inf"))
    for row, (_, pair) in enumerate(cases):
        logits[row, list(pair)] = 2.5
    at, index = torch.arange(len(cases)), torch.tensor([i for i, _ in cases])
    keys = keys.expand(len(cases), 2)
    got = seeded_race(*(t.to(device) for t in (logits, at, keys, index))).tolist()
    assert (
        got
        == [first for _, (first, _) in cases]
        == draw_tokens_by_torch(logits, at, keys, index).tolist()
    )


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_draws_follow_the_softmax(device):
    """One row of 8 tokens (two excluded) drawn at n output indices: the frequencies against the softmax."""
    from spmoe.engine.sampling.seeded_race_triton import seeded_race

    logits = torch.tensor([[1.0, 2.0, 0.5, float("-inf"), 1.5, -1.0, LOWEST, 0.0]], device=device)
    n = 200_000 if device == "cuda" else 2000
    keys = torch.tensor([seed_keys(99)], device=device).expand(n, 2)
    at = torch.zeros(n, dtype=torch.int64, device=device)
    got = seeded_race(logits, at, keys, torch.arange(n, device=device)).cpu()
    probs = torch.softmax(logits[0].double().cpu(), dim=-1)
    freq = torch.bincount(got, minlength=8).double() / n
    tv = 0.5 * (freq - probs).abs().sum().item()
    # E[TV] = sum over tokens of sqrt(p (1 - p) / (2 pi n)); its spread is a third of that: 3x is far in the tail
    expected = sum(math.sqrt(p * (1 - p) / (2 * math.pi * n)) for p in probs.tolist())
    assert tv < 3 * expected, (tv, expected)
    assert freq[3].item() == freq[6].item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_takes_no_rows_one_token_rows_and_refuses_bad_input(device):
    from spmoe.engine.sampling.seeded_race_triton import seeded_race

    keys, index = keys_and_indices(2, device)
    at = torch.tensor([1, 0], device=device)
    assert seeded_race(torch.randn(2, 1, device=device), at, keys, index).tolist() == [0, 0]
    none = torch.zeros(0, dtype=torch.int64, device=device)
    assert seeded_race(torch.randn(2, 8, device=device), none, keys[:0], none).shape == (0,)
    with pytest.raises(ValueError, match="float32 logits"):
        seeded_race(torch.zeros(2, 8, dtype=torch.float16, device=device), at, keys, index)
    with pytest.raises(ValueError, match=r"keys \[s, 2\]"):
        seeded_race(torch.zeros(2, 8, device=device), at, keys[:1], index)


@requires_gpus(1)
def test_the_cuda_sampler_draws_with_the_kernel(monkeypatch):
    """Sampled rows on CUDA go through the kernel, once per step, and draw what the CPU sampler draws."""
    from spmoe.engine.sampling import seeded_race_triton

    calls = []
    kernel = seeded_race_triton.seeded_race

    def counted(logits, at, keys, index):
        calls.append(at.tolist())
        return kernel(logits, at, keys, index)

    monkeypatch.setattr(seeded_race_triton, "seeded_race", counted)
    vocab = 154880
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3
    settings = [
        SamplingParams(),
        SamplingParams(1.0, seed=1),
        SamplingParams(0.7, top_p=0.9, seed=2),
    ] * 2

    def sample_on(device):
        sampler = Sampler(6, vocab, device)
        rows = [sampler.add(p, [0]) for p in settings]
        return sampler.sample(logits.to(device), rows, [0, 5, 9, 2**32 - 1, 7, 8]).token_ids

    assert sample_on("cuda") == sample_on("cpu")
    assert calls == [[1, 2, 4, 5]]
