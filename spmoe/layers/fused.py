"""Where the fused Triton kernels (`fused_triton`: add + RMSNorm, rope in place, the router, the MLA
cache-row write, silu * up, the indexer key's write; the FP8 quantisation of indexer queries; the
sampler's top_k / top_p threshold, `engine.top_k_top_p_triton`, and its seeded race,
`engine.seeded_race_triton`; the simulated rank's seeded routing, `moe.seeded_triton`) replace their
torch references: on CUDA tensors, when triton imports. The references stay the definition of the
math: CPU always runs them, and a benchmark sets `ENABLED = False` to time them against the kernels
in the same run."""

import importlib.util

import torch

ENABLED = True
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def use_fused(t: torch.Tensor) -> bool:
    """Whether the fused kernel takes `t`: a CUDA tensor, triton installed, the kernels not
    switched off."""
    return ENABLED and TRITON_INSTALLED and t.is_cuda
