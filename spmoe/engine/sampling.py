"""Choosing the next token from logits: greedy, or temperature with top-p, from a seeded generator.

Every TP rank holds the same logits (the LM head gathers them), so every rank samples the same token from
the same seed without any communication.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> list[int]:
        """logits `[m, V]` -> m token ids."""
        if self.params.greedy:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:  # keep the smallest set of most likely tokens whose mass reaches top_p
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.params.top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1).tolist()
