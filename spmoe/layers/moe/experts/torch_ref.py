"""Routed experts, reference torch implementation: a loop over this rank's experts. Any device;
float32, bfloat16, and FP8 checkpoints dequantised on load."""

import torch
import torch.nn.functional as F

from spmoe.layers.moe.experts.base import Experts


class TorchExperts(Experts):
    name = "torch"
    syncs_host = True  # loops over the experts present in the batch

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[m, H]`, ids / weights `[m, k]` -> `[m, H]`, the weighted sum over this
        rank's experts."""
        out = torch.zeros_like(x)
        local = self.local_ids(ids)
        for e in torch.unique(local[local >= 0]).tolist():
            rows, slot = torch.nonzero(local == e, as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, slot, None].to(
                x.dtype
            )
            out.index_add_(0, rows, y)
        return out
