"""The demo checkpoint's held-out text (Python standard-library files its training never saw,
shipped beside it) as token sequences, and the perplexity of logits over them; for the numerics
tests and `benchmarks/eval_mtp_serve.py`."""

import math

import torch

from spmoe.entrypoints.demo import HELDOUT


def heldout_sequences(count: int, length: int, offset: int = 0) -> list[list[int]]:
    """`count` consecutive token sequences of `length` bytes each (the tokenizer: byte b is token
    b), the first starting `offset` bytes into the held-out text. Raises ValueError when the text
    is too short."""
    text = HELDOUT.read_bytes()
    if offset + count * length > len(text):
        raise ValueError(
            f"the held-out text has {len(text)} bytes, {count} x {length} from {offset} asked"
        )
    return [list(text[offset + i * length : offset + (i + 1) * length]) for i in range(count)]


def token_logprobs(logits: torch.Tensor, seqs: list[list[int]]) -> torch.Tensor:
    """logits `[total tokens, V]` of the sequences `seqs` laid end to end -> the log-probability of
    every token after each sequence's first, `[total tokens - len(seqs)]` float64."""
    out = []
    for rows, seq in zip(logits.split([len(s) for s in seqs]), seqs):
        logp = torch.log_softmax(rows[:-1].double(), -1)
        out.append(logp.gather(1, torch.tensor(seq[1:]).unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def perplexity(logits: torch.Tensor, seqs: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of every token after each sequence's first."""
    return math.exp(-token_logprobs(logits, seqs).mean().item())
