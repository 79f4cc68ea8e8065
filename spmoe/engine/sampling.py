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


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits `[m, V]` (finite) -> the distribution a token is drawn from, `[m, V]` float32: softmax(logits /
    temperature), restricted by top-p to the smallest set of most likely tokens whose mass reaches top_p (the
    token that crosses top_p included), renormalised."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # the mass before it already reaches top_p
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = kept / kept.sum(-1, keepdim=True)
    return probs


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
        probs = sampling_probs(torch.where(finite[:, None], logits, 0.0), self.params)
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return tokens.tolist(), finite.tolist()
