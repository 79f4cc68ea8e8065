"""SiLU-gated MLP: the dense layers' MLP and the MoE's shared experts."""

import torch
import torch.nn.functional as F
from torch import nn

from spmoe.layers.fused import use_fused
from spmoe.layers.linear import Linear, MergedLinear


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` `[m, I]`: one Triton kernel on CUDA (`fused_triton.silu_mul`), else
    this reference."""
    if use_fused(gate) and gate.dim() == 2:
        from spmoe.layers.fused_triton import silu_mul as fused_silu_mul

        return fused_silu_mul(gate, up)
    return F.silu(gate) * up


class MLP(nn.Module):
    """`[m, H] -> [m, H]`. TP-sharded (`tp_size > 1`): gate/up column-, down row-parallel, output
    PARTIAL. Replicated (`tp_size == 1`, used on SP layers): output complete."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int):
        super().__init__()
        # gate_proj and up_proj as one GEMM (the checkpoint keeps them apart)
        self.gate_up = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, tp_size
        )
        self.down_proj = Linear(intermediate_size, hidden_size, tp_dim=1, tp_size=tp_size)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x `[m, H]` -> the MLP's output `[m, H]`; given `out` `[m, H]`, `out` + the output,
        accumulated into `out` by the down projection's GEMM (no separate add)."""
        act = silu_mul(*self.gate_up(x).values())
        if out is None:
            return self.down_proj(act)
        return self.down_proj.add_to(out, act)
