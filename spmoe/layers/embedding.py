"""Vocab-parallel embedding and LM head: each TP rank holds `vocab / t` rows of the table."""

import torch
import torch.nn.functional as F
from torch import nn

from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import all_gather_rows


class _VocabShard(nn.Module):
    """This rank's `[vocab / t, H]` rows of the table, starting at vocab id `start`."""

    tp_dim = 0

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        state = get_parallel_state()
        per_rank = vocab_size // state.tp_size
        self.start = per_rank * state.tp_rank
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[N]` -> PARTIAL `[N, H]`: rows of ids this rank does not own are zero."""
        local = ids - self.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        return F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * owned.unsqueeze(
            1
        )


class ParallelLMHead(_VocabShard):
    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """FULL `[N, H]` -> logits `[N, V]` in float32: local vocab columns, then one all-gather.
        `out`: a float32 `[N, V]` the logits are written into (a CUDA graph's output shared by
        every captured size), else a new tensor."""
        state = get_parallel_state()
        local = F.linear(x, self.weight)  # [N, V/t]
        vocab = state.tp_size * local.shape[1]
        if out is not None and tuple(out.shape) != (x.shape[0], vocab):
            raise ValueError(f"logits `out` must be [{x.shape[0]}, {vocab}], got {list(out.shape)}")
        if out is None:
            out = torch.empty(x.shape[0], vocab, dtype=torch.float32, device=x.device)
        if state.tp_size == 1:
            return out.copy_(local)
        # gathered as computed (bf16: half the bytes of float32; the widening in the copy is exact)
        gathered = all_gather_rows(local, state.tp_group)  # [t*N, V/t], rank blocks
        blocks = gathered.view(state.tp_size, *local.shape).permute(1, 0, 2)  # [N, t, V/t]
        out.view(x.shape[0], state.tp_size, local.shape[1]).copy_(blocks)
        return out
