"""Reproducible draws without per-row generators: a sampled row draws its token by an exponential
race, token = argmax_i p_i / E_i with E_i ~ Exp(1), which picks token i with probability exactly
p_i; the E_i are computed from (the request's seed, the output index of the token being chosen, i)
by an integer hash. So a request's tokens depend on its seed and logits only, and every TP rank
draws the same token without communicating. On CUDA one Triton kernel hashes the noise in registers
and races in the same pass (`draw_tokens`)."""

import torch

from spmoe.layers.fused import use_fused

MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (xor-shift / multiply rounds), on a Python int or an int64 tensor
    holding values in [0, 2**32). The multipliers are below 2**31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def seed_keys(seed: int) -> tuple[int, int]:
    """A 63-bit seed -> two 32-bit keys for `exponential_noise`."""
    first = mix32((seed & MASK32) ^ mix32((seed >> 32) ^ 0x6A09E667))
    return first, mix32(first ^ 0xBB67AE85)


def noise_bits(keys: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys `[m, 2]` int64 (`seed_keys` of each row's seed), index `[m]` int64 (the output index of
    the token each row chooses) -> `[m, vocab]` int64: 32 hash bits per token, a function of (keys,
    index, token id) only.

    Two hash rounds per element, each keyed by a different mix of (seed, index): rows whose first
    keys happen to lie close together still get unrelated noise."""
    index = index & MASK32
    a = mix32(keys[:, 0] ^ index)[:, None]
    b = mix32((keys[:, 1] + index) & MASK32)[:, None]
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    return mix32(mix32((ids + a) & MASK32) ^ b)


def exponential_of(bits: torch.Tensor) -> torch.Tensor:
    """Hash bits (int64 in [0, 2**32)) -> float32 Exp(1) noise of the same shape, in (0, 16.7).

    The top 23 bits v make u = (v + 0.5) / 2**23 in (0, 1), exactly: 2v + 1 < 2**24 fits float32's
    significand (24 bits would not: v + 0.5 then rounds, and the largest v to u = 1, noise -0.0, and
    a ratio 0 / -0.0 = NaN that argmax takes, drawing an excluded token). -log(u) is
    Exp(1), never 0."""
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(uniform)


def exponential_noise(keys: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys `[m, 2]`, index `[m]` (as for `noise_bits`) -> `[m, vocab]` float32 Exp(1) noise: the
    exponential of each token's hash bits."""
    return exponential_of(noise_bits(keys, index, vocab))


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs `[..., V]`, noise `[..., V]` Exp(1) -> `[...]` int64: argmax probs / noise, a
    draw from probs."""
    return (probs / noise).argmax(-1)


def draw_tokens(
    logits: torch.Tensor, at: torch.Tensor, keys: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """logits `[m, V]` float32; at `[s]` int64: the rows that draw; keys `[s, 2]` and index `[s]` of
    each drawing row (as for `noise_bits`) -> `[s]` int64: its token, raced over
    softmax(logits[at[j]]) with its noise. On CUDA with triton one kernel that hashes the noise in
    registers (`seeded_race_triton`: the same noise, the same token but at near-ties of the two
    largest ratios); elsewhere `draw_tokens_by_torch`."""
    if use_fused(logits):
        from spmoe.engine.sampling.seeded_race_triton import seeded_race

        return seeded_race(logits, at, keys, index)
    return draw_tokens_by_torch(logits, at, keys, index)


def draw_tokens_by_torch(
    logits: torch.Tensor, at: torch.Tensor, keys: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """`draw_tokens` by `exponential_noise` and `race` (the reference): `[s, V]` noise and
    probabilities."""
    return race(torch.softmax(logits[at], dim=-1), exponential_noise(keys, index, logits.shape[1]))
