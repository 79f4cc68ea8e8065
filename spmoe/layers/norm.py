"""RMSNorm with the fused residual add. Norms never communicate: a partial sum is reduced by the
communicator (`spmoe.distributed.communicator.fused_allreduce_rms_norm`) before it is normed."""

import torch
from torch import nn


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
