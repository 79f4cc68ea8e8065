"""Routed experts, reference torch implementation: a loop over this rank's experts."""

import torch
import torch.nn.functional as F
from torch import nn


class TorchExperts(nn.Module):
    """Experts `[first, first + count)` of the global expert list.

    forward: x `[m, H]`, ids `[m, k]` (global expert ids, -1 = none), weights `[m, k]` -> `[m, H]`, the
    weighted sum over this rank's experts only (rows routed elsewhere contribute zero).
    """

    def __init__(self, first: int, count: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.first, self.count = first, count
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        local = ids - self.first
        for e in torch.unique(local[(local >= 0) & (local < self.count)]).tolist():
            rows, slot = torch.nonzero(local == e, as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out
