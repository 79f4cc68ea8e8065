"""Triton kernels for FP8 linears with 128 x 128 block-scaled e4m3 weights (see `fp8_linear` for the math and
the torch references each matches).

- `fp8_matmul`: `out [m, n] = x [m, k] @ W^T`, W `[n, k]` e4m3 with one float32 scale per 128 x 128 block, the
  activations e4m3 with one scale per token and 128 channels. One program per (BLOCK_M rows, BLOCK_N columns)
  walks k in steps of 128: an FP8 `tl.dot` per step, scaled by the row's activation scale times the block's
  weight scale, float32 accumulation. Two ways in:
  * decode (m <= `QUANTIZE_INSIDE_ROWS`): the kernel reads the 16-bit activations and quantises each 128-channel
    group itself (one launch, not two; every program repeats it, which costs nothing next to its weight tile),
    and the tiles are narrow (BLOCK_N 16 or 32) so that even a small n gives every multiprocessor programs to
    stream the weights at full bandwidth;
  * prefill: the activations are quantised once by the experts' kernel (`triton_kernels.quantize_fp8`), then
    128 x 128 tiles.
  Optionally the product is added to `out` (the MLP's down projection adds to the routed experts' output).
- `fp8_head_matmul`: absorbed MLA's per-head products with kv_b_proj's FP8 weight (`q_nope @ W_UK`, the
  weighted latent @ `W_UV^T`), 16-bit activations: program (head, BLOCK_M output columns, BLOCK_N tokens)
  streams its slice of the head's weight, e4m3 -> 16-bit in registers (exact: e4m3 values fit in bf16), the
  block scales folded into the activations (where the depth runs along the weight's rows, W_UK) or into the
  product (where the output does, W_UV); a head's rows need not start on a block (448 rows per GLM head).

Shapes depend only on the inputs' shapes and nothing is read back to the host: CUDA-graph capturable. Offsets
that multiply a row index by a stride are computed in 64 bits (m * k passes 2**31 at long prefills).
"""

import torch
import triton
import triton.language as tl

from spmoe.layers.moe.experts.triton_kernels import quantize_fp8
from spmoe.layers.quantization.fp8 import FP8_GROUP, FP8_MAX

BLOCK = 128  # the weight block and activation group this module's kernels take
QUANTIZE_INSIDE_ROWS = 64  # up to this many rows the GEMM quantises its activations itself
NUM_SMS_TARGET = 264  # programs to aim for at decode (2 per H200 multiprocessor)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_om,
    QUANTIZE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < m, cols < n
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: W^T
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn  # one weight block row per tile (BLOCK_N | 128)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(k, BLOCK_K)):
        k_ok = offs_k < k - kb * BLOCK_K
        if QUANTIZE:  # 16-bit activations: quantise this 128-channel group of every row, as `quantize_fp8`
            xv = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x_scale = tl.maximum(tl.max(tl.abs(xv), 1), 1e-10) / FP8_MAX_
            a = (xv / x_scale[:, None]).to(tl.float8e4nv)
        else:
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x_scale = tl.load(xs_ptr + rows * stride_xsm + kb, mask=row_ok, other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w_scale = tl.load(ws_ptrs + kb)
        acc += tl.dot(a, b) * (x_scale[:, None] * w_scale)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def matmul_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `m` rows and `n` output columns. Decode (m <=
    `QUANTIZE_INSIDE_ROWS`): 16 rows (a tile covers m up to 16; 64 rows take 4 tiles, the weight tile re-read
    from L2) and the widest column tile that still makes `NUM_SMS_TARGET` programs; prefill: 128 x 128."""
    if m <= QUANTIZE_INSIDE_ROWS:
        block_m = 16 if m <= 16 else 32
        block_n = 32 if triton.cdiv(m, block_m) * triton.cdiv(n, 32) >= NUM_SMS_TARGET else 16
        return block_m, block_n, 4, 4
    return (64, 128, 4, 4) if m <= 256 else (128, 128, 8, 3)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """As `fp8_linear.fp8_linear_torch`: x `[m, k]` bf16 / fp16 (unit stride along k), weight `[n, k]` e4m3
    (contiguous rows), scale `[ceil(n / 128), ceil(k / 128)]` float32 -> `[m, n]` in x's dtype; given `out`
    `[m, n]` (unit stride along n), the product is added to it in place and `out` returned. tiles: (BLOCK_M,
    BLOCK_N, num_warps, num_stages), `matmul_tiles` by default (BLOCK_N must divide 128)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(
            f"fp8_matmul needs x [m, k] and weight [n, k] with unit-stride rows; got x {tuple(x.shape)} strides "
            f"{x.stride()}, weight {tuple(weight.shape)} strides {weight.stride()}"
        )
    accumulate = out is not None
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, num_warps, num_stages = tiles or matmul_tiles(m, n)
    quantize = m <= QUANTIZE_INSIDE_ROWS
    if quantize:
        xq, xs = x, x  # xs is not read
    else:
        padded = x if k % FP8_GROUP == 0 else torch.nn.functional.pad(x, (0, FP8_GROUP - k % FP8_GROUP))
        xq, xs = quantize_fp8(padded)  # zeros past k change no group's largest value
    _fp8_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        xq,
        xs,
        weight,
        scale,
        out,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        QUANTIZE=quantize,
        ACCUMULATE=accumulate,
        FP8_MAX_=FP8_MAX,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton.jit
def _fp8_head_matmul_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    n_tok,
    depth,
    width,
    rows_per_head,
    first_row,
    stride_xn,
    stride_xh,
    stride_wr,
    stride_wsr,
    stride_on,
    stride_oh,
    DEPTH_ALONG_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    head, pid_m, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tokens = (pid_t * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output columns of this head
    tok_ok, col_ok = tokens < n_tok, cols < width
    base_row = head.to(tl.int64) * rows_per_head + first_row  # the head's first weight row
    x_rows = x_ptr + head * stride_xh + tokens[:, None] * stride_xn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for first in range(0, depth, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        k_ok = k < depth
        x = tl.load(x_rows + k[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        if DEPTH_ALONG_ROWS:  # w[k, m] = W[base + k, m]: the scale varies along k, one block column per tile
            w_rows = base_row + k
            w = tl.load(
                w_ptr + w_rows[:, None] * stride_wr + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            s = tl.load(ws_ptr + (w_rows // 128) * stride_wsr + (pid_m * BLOCK_M) // 128, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        else:  # w[k, m] = W[base + m, k]: the scale varies along m, one block column per step
            w_rows = base_row + cols
            w = tl.load(
                w_ptr + w_rows[None, :] * stride_wr + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            s = tl.load(ws_ptr + (w_rows // 128) * stride_wsr + first // 128, mask=col_ok, other=0.0)
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty)) * s[None, :]
    tl.store(
        out_ptr + tokens[:, None] * stride_on + head * stride_oh + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=tok_ok[:, None] & col_ok[None, :],
    )


def fp8_head_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    rows_per_head: int,
    first_row: int,
    width: int,
    depth_along_rows: bool,
) -> torch.Tensor:
    """As `fp8_linear.fp8_head_matmul_torch`: x `[N, h, k]` bf16 / fp16 (unit-stride last dim), weight `[R, C]`
    e4m3 (contiguous), scale `[ceil(R / 128), ceil(C / 128)]` -> `[N, h, width]` in x's dtype. Head i multiplies
    by `w[i] [k, width]`, the part of W that starts at row `i * rows_per_head + first_row`: with
    `depth_along_rows`, `w[i][j, c] = W[row + j, c]` (W_UK, width = C), else `w[i][c, j] = W[row + j, c]`
    (W_UV^T, k = C)."""
    n, heads, depth = x.shape
    if x.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"fp8_head_matmul needs unit-stride rows: x strides {x.stride()}, weight strides {weight.stride()}"
        )
    out = torch.empty(n, heads, width, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n = 16 if n <= 16 else 64
    block_k = 64 if depth_along_rows else 128
    block_m = 64 if n > 16 else next((b for b in (64, 32) if heads * triton.cdiv(width, b) >= NUM_SMS_TARGET), 16)
    _fp8_head_matmul_kernel[(heads, triton.cdiv(width, block_m), triton.cdiv(n, block_n))](
        x,
        weight,
        scale,
        out,
        n,
        depth,
        width,
        rows_per_head,
        first_row,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        out.stride(1),
        DEPTH_ALONG_ROWS=depth_along_rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_M=block_m,
        num_warps=4,
        num_stages=3,
    )
    return out
