"""The math of FP8 linears: weights as the checkpoints store them (e4m3 with one float32 scale per
128 x 128 block, value = stored * scale), activations quantised on the fly to e4m3 with one scale
per token and 128 channels (as the FP8 experts do), float32 accumulation.

Each operation has a torch reference (any device; the definition of the math, and what CPU runs) and
a Triton path on CUDA (`fp8_kernels`, imported only when used; `fused.use_fused` decides, as for the
other kernels):

- `fp8_linear`: `x [m, k] @ W^T` -> `[m, n]`, optionally added to an output;
- `fp8_head_matmul`: absorbed MLA's per-head products with kv_b_proj's FP8 weight (W_UK, W_UV),
  16-bit activations (the weight dequantised in registers);
- `quantize_blocks` / `dequantize_blocks`: a weight to its FP8 twin and back (benchmarks and tests
  write FP8 checkpoints with it; the loader's dequantising path is its inverse).
"""

import torch
import torch.nn.functional as F

from spmoe.layers.fused import use_fused
from spmoe.layers.quantization.fp8 import FP8_GROUP, FP8_MAX, dequantize, quantize_fp8_groups

# the weight block FP8 linears keep; other block sizes are dequantised on load
FP8_BLOCK = (
    128,
    128,
)


def block_grid(rows: int, cols: int, block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    """The shape of the scales of a `[rows, cols]` weight: one per (partial) block."""
    return -(-rows // block[0]), -(-cols // block[1])


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """FP8 `[R, C]` and its block scales `[ceil(R / b0), ceil(C / b1)]` -> float32 `[R, C]`."""
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * full[: weight.shape[0], : weight.shape[1]]


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, C]` -> (e4m3 `[R, C]`, float32 scales `[ceil(R / b0), ceil(C / b1)]`): each block scaled
    so that its largest value is the largest e4m3 value (an all-zero block gets scale 1)."""
    rows, cols = block_grid(*w.shape, block)
    padded = w.new_zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[: w.shape[0], : w.shape[1]] = w.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = blocks.abs().amax((1, 3)) / FP8_MAX
    scale = torch.where(scale > 0, scale, 1.0)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)
    return q[: w.shape[0], : w.shape[1]].contiguous(), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x `[..., k]`, weight `[n, k]` e4m3, scale `[ceil(n / 128), ceil(k / 128)]` float32 ->
    `[..., n]` in x's dtype; given `out` `[m, n]` (x 2-D), the product is added to it in place. On
    CUDA with 16-bit x: the Triton GEMV / GEMM (`fp8_kernels.fp8_matmul`); else
    `fp8_linear_torch`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if use_fused(x2) and x2.dtype in (torch.bfloat16, torch.float16):
        from spmoe.layers.quantization.fp8_kernels import fp8_matmul

        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = fp8_matmul(x2, weight, scale, out)
    else:
        y = fp8_linear_torch(x2, weight, scale, out)
    return y if out is not None else y.view(*lead, weight.shape[0])


def fp8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference `fp8_linear` (x `[m, k]`): x quantised as the kernel quantises it, both
    dequantised to float32, one matmul, the result in x's dtype."""
    k = x.shape[1]
    xq, x_scale = quantize_fp8_groups(F.pad(x, (0, -k % FP8_GROUP)))
    y = dequantize(xq, x_scale)[:, :k] @ dequantize_blocks(weight, scale).t()
    if out is None:
        return y.to(x.dtype)
    return out.add_(y.to(out.dtype))


def fp8_head_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    rows_per_head: int,
    first_row: int,
    width: int,
    depth_along_rows: bool,
) -> torch.Tensor:
    """x `[N, h, k]` 16-bit or float32, weight `[h * rows_per_head, C]` e4m3 with its block scales
    -> `[N, h, width]` in x's dtype: x[:, i] @ w[i] per head, w[i] the part of W from row
    `i * rows_per_head + first_row`: `w[i][j, c] = W[row + j, c]` with `depth_along_rows` (W_UK: k
    rows, width = C), else `w[i][c, j] = W[row + j, c]` (W_UV^T: k = C, width rows). On CUDA with
    16-bit x: `fp8_kernels.fp8_head_matmul`."""
    if use_fused(x) and x.dtype in (torch.bfloat16, torch.float16):
        from spmoe.layers.quantization.fp8_kernels import fp8_head_matmul as triton_fp8_head_matmul

        if x.stride(2) != 1:
            x = x.contiguous()
        return triton_fp8_head_matmul(
            x, weight, scale, rows_per_head, first_row, width, depth_along_rows
        )
    return fp8_head_matmul_torch(
        x, weight, scale, rows_per_head, first_row, width, depth_along_rows
    )


def fp8_head_matmul_torch(
    x, weight, scale, rows_per_head: int, first_row: int, width: int, depth_along_rows: bool
):
    """The reference `fp8_head_matmul`: the weight dequantised to float32, one batched GEMM
    over the heads."""
    heads, depth = x.shape[1], x.shape[2]
    per_head = dequantize_blocks(weight, scale).view(heads, rows_per_head, weight.shape[1])
    if depth_along_rows:
        w = per_head[:, first_row : first_row + depth]  # [h, k, C]
    else:
        w = per_head[:, first_row : first_row + width].transpose(1, 2)  # [h, C, width]
    return torch.bmm(x.float().transpose(0, 1), w).transpose(0, 1).to(x.dtype)
