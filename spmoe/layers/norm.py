"""RMSNorm with the fused residual add, and its all-reduce variant for PARTIAL inputs."""

import torch
from torch import nn

from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import all_reduce


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[m, size] -> [m, size]`."""
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """Fused residual add: `(norm(x + residual), x + residual)`; with no residual yet, `(norm(x), x)`."""
        if residual is not None:
            x = x + residual
        return self(x), x


def fused_allreduce_rms_norm(partial: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    """PARTIAL `[N, H]` + FULL residual -> (normed, new residual), both FULL `[N, H]`.

    Reduces the partial sum over the TP group exactly once, then the fused add + RMSNorm (residual None: the
    reduced tensor is the residual). Never called on an SP layer, whose tensors are already complete.
    """
    state = get_parallel_state()
    if state.tp_size > 1:
        partial = all_reduce(partial, state.tp_group)
    return norm.add_norm(partial, residual)
