"""Choosing the next token from logits: greedy, or temperature with top-p, from a seeded generator.

Every TP rank holds the same logits (the LM head gathers them), so every rank samples the same token from
the same seed without any communication.

A logits row with a NaN or an infinity has no next token (torch's argmax would answer the first NaN's index,
0 when the whole row is NaN). So every choice comes with a per-row finite flag, computed on the device and
read back in the same host transfer as the token ids: the check costs no extra sync.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """logits `[m, V]` -> the argmax of each row, and whether each row is finite (one host transfer)."""
    picked = torch.stack([logits.argmax(-1), torch.isfinite(logits).all(-1).long()]).tolist()
    return picked[0], [bool(f) for f in picked[1]]


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits `[m, V]` (finite), temperature `[m]` (> 0), top_p `[m]` -> the distribution each row's token is
    drawn from, `[m, V]` float32: softmax(logits / temperature), restricted by top-p to the smallest set of most
    likely tokens whose mass reaches top_p (the token that crosses top_p included), renormalised. Each row has
    its own settings: one pass for a whole batch."""
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # the mass before it already reaches top_p (a row with top_p 1 keeps everything, rounding aside)
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]) & (top_p[:, None] < 1)
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = kept / kept.sum(-1, keepdim=True)
    return probs


# -- seeded noise: a function of (seed, output index, token id), so every draw is reproducible per position --

MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (xor-shift / multiply rounds), on a Python int or an int64 tensor holding values
    in [0, 2**32). The multipliers are below 2**31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def seed_keys(seed: int) -> tuple[int, int]:
    """A 63-bit seed -> two 32-bit keys for `exponential_noise`."""
    first = mix32((seed & MASK32) ^ mix32((seed >> 32) ^ 0x6A09E667))
    return first, mix32(first ^ 0xBB67AE85)


def exponential_noise(keys: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys `[m, 2]` int64 (`seed_keys` of each row's seed), index `[m]` int64 (the output index of the token
    each row chooses) -> `[m, vocab]` float32 Exp(1) noise, a function of (keys, index, token id) only.

    Two hash rounds per element, each keyed by a different mix of (seed, index): rows whose first keys happen
    to lie close together still get unrelated noise. The top 24 bits make a uniform u in (0, 1), exactly
    representable in float32; -log(u) is Exp(1)."""
    index = index & MASK32
    a = mix32(keys[:, 0] ^ index)[:, None]
    b = mix32((keys[:, 1] + index) & MASK32)[:, None]
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = mix32(mix32((ids + a) & MASK32) ^ b)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return -torch.log(uniform)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """logits `[m, V]` -> m token ids, and whether each row was finite. The token of a row that is not
        finite means nothing: the caller must not use it."""
        if self.params.greedy:
            return greedy(logits)
        logits = logits.float().cpu()  # the one host transfer
        finite = torch.isfinite(logits).all(-1)
        rows = len(logits)
        temperature, top_p = (torch.full((rows,), v) for v in (self.params.temperature, self.params.top_p))
        probs = sampling_probs(torch.where(finite[:, None], logits, 0.0), temperature, top_p)
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return tokens.tolist(), finite.tolist()
