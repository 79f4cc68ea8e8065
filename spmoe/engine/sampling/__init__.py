"""Choosing tokens: logits processors, the sampler, rejection of drafts, grammars, their kernels."""
