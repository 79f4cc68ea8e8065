"""Where the fused Triton kernels (`fused_triton`: add + RMSNorm, rope in place, the router) replace their torch
references: on CUDA tensors, when triton imports. The references stay the definition of the math: CPU always
runs them, and a benchmark sets `ENABLED = False` to time them against the kernels in the same run."""

import importlib.util

import torch

ENABLED = True
_TRITON = importlib.util.find_spec("triton") is not None


def use_fused(t: torch.Tensor) -> bool:
    """Whether the fused kernel takes `t`: a CUDA tensor, triton installed, the kernels not switched off."""
    return ENABLED and _TRITON and t.is_cuda
