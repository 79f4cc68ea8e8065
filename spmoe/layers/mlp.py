"""SiLU-gated MLP: the dense layers' MLP and the MoE's shared experts."""

import torch
import torch.nn.functional as F
from torch import nn

from spmoe.layers.linear import Linear


class MLP(nn.Module):
    """`[m, H] -> [m, H]`. TP-sharded (`tp_size > 1`): gate/up column-, down row-parallel, output PARTIAL.
    Replicated (`tp_size == 1`, used on SP layers): output complete."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, tp_dim=0, tp_size=tp_size)
        self.up_proj = Linear(hidden_size, intermediate_size, tp_dim=0, tp_size=tp_size)
        self.down_proj = Linear(intermediate_size, hidden_size, tp_dim=1, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
