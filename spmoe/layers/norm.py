"""RMSNorm with the fused residual add. Norms never communicate: a partial sum is reduced by the
communicator (`spmoe.distributed.communicator.fused_allreduce_rms_norm`) before it is normed.

On CUDA both run as one Triton kernel (`fused_triton.add_rms_norm`); the torch code here is
the reference."""

import torch
from torch import nn

from spmoe.layers.fused import use_fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[m, size] -> [m, size]`."""
        if use_fused(x) and x.dim() == 2:
            from spmoe.layers.fused_triton import add_rms_norm

            return add_rms_norm(x, None, self.weight, self.eps)[0]
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """Fused residual add: `(norm(x + residual), x + residual)`; with no residual yet,
        `(norm(x), x)`."""
        if use_fused(x) and x.dim() == 2:
            from spmoe.layers.fused_triton import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x
