"""FP8 (e4m3) quantisation, shared by the experts, the attention's FP8 cache and indexer, and the
fused kernels: the group size and range, per-group and per-vector quantisation, dequantisation, and
the Hadamard rotation the FP8 indexer applies before quantising. Plain torch (the references); the
Triton kernels import their constants from here, so nothing here imports them."""

from functools import cache

import torch

# activation channels per FP8 scale (per token), as the FP8 checkpoints' kernels expect
FP8_GROUP = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[m, K]` -> (FP8 e4m3 `[m, K]`, float32 scales `[m, K / 128]`): one scale per 128
    channels of a row."""
    groups = x.float().view(x.shape[0], -1, FP8_GROUP)
    scale = groups.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    return (groups / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale


def quantize_fp8_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., d]` -> (FP8 e4m3 `[..., d]`, float32 scales `[..., 1]`): one scale per vector. (The
    indexer runs it through `paged_rows.quantize_index_vectors`, which takes a Triton
    kernel on CUDA.)"""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows `[..., w]` (and their scales `[..., w / g]`, or None) -> float32 `[..., w]`."""
    if scale is None:
        return values.float()
    groups = values.float().unflatten(-1, (scale.shape[-1], -1))
    return (groups * scale.unsqueeze(-1)).flatten(-2)


@cache
def hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order d (a power of 2) over sqrt(d): float32 `[d, d]`,
    orthonormal and symmetric; built once per (d, device), on the device (no host copy)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard matrix needs an order that is a power of 2, got {d}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h * d**-0.5


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` -> float32 `x @ hadamard_matrix(d)` `[..., d]`: what the FP8 indexer does to its
    queries and keys before `quantize_fp8_vectors`.

    The rotation is orthogonal, so q . k is unchanged in exact arithmetic; what it changes is where
    the FP8 rounding goes. Trained models' activations often carry a few large channels shared by
    every token. Unrotated, each rounds by up to 2**-4 of its size (all but the largest, which the
    per-vector scale makes exact), an error along the very channels q is large in, which swamps the
    small differences between keys. Rotated, every value is of similar size and the rounding errors
    point in all d directions, only ~1/sqrt(d) of them along q. (DeepSeek-V3.2's indexer rotates
    likewise before FP8; the full-precision path skips it, as it would change nothing. On vectors
    without outliers, Gaussian-like, it neither helps nor hurts.) In float32, as the quantizer works
    in float32 anyway and 1/sqrt(d) is not exact in bf16 for odd powers of 2.
    """
    return x.float() @ hadamard_matrix(x.shape[-1], x.device)
