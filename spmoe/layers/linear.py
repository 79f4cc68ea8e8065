"""Linear layers whose weights are (possibly) a TP shard of the checkpoint's.

`tp_dim` tells the loader how to slice the checkpoint weight `[out, in]`: 0 = column-parallel (this rank's
output rows), 1 = row-parallel (this rank's input columns; the output is a PARTIAL sum), None = replicated.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp_dim: int | None = None, tp_size: int = 1):
        super().__init__()
        if tp_dim is not None:
            full = (out_features, in_features)[tp_dim]
            if full % tp_size:
                raise ValueError(f"cannot split {full} {'output' if tp_dim == 0 else 'input'} features of a linear "
                                 f"layer over {tp_size} TP ranks")
            if tp_dim == 0:
                out_features //= tp_size
            else:
                in_features //= tp_size
        self.tp_dim = tp_dim if tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
