"""Triton kernels for FP8 linears with 128 x 128 block-scaled e4m3 weights (see `fp8_linear` for the
math and the torch references each matches).

- `fp8_matmul`: `out [m, n] = x [m, k] @ W^T`, W `[n, k]` e4m3 with one float32 scale per 128 x 128
  block, the activations e4m3 with one scale per token and 128 channels. Program (BLOCK_M rows,
  BLOCK_N columns, split s) walks its share of k in steps of 128: an FP8 `tl.dot` per step, scaled
  by the row's activation scale times the block's weight scale, float32 accumulation. The launch
  shape comes from `matmul_config`: a table of the shapes GLM-5.2 runs, keyed by (m bucket, n, k),
  else a rule from the same reasoning:
  * m <= `QUANTIZE_INSIDE_ROWS`: the kernel reads the 16-bit activations and quantises each
    128-channel group itself (one launch, not two; every program repeats it, which costs little next
    to its weight tile; on sm_90 Triton runs this 16-row dot as an f16 MMA, e4m3 ->
    f16 being exact);
  * more rows (decode at m 17-64 and prefill): the activations are quantised once by the experts'
    kernel (`triton_kernels.quantize_fp8`);
  * split-K: at decode a layer's weight is all the work, so every multiprocessor must stream a share
    of it; a narrow layer (q_a + kv_a: 2816 rows, 22 tiles of 128 columns; o_proj: 48 for 132 SMs)
    has too few column tiles, so k is cut into `split_k` ranges, each program writes float32 partial
    sums and `_sum_splits_kernel` adds them in a fixed order (deterministic, no atomics, no counters
    to reset: graph-safe).
  Optionally the product is added to `out` (the MLP's down projection adds to the routed
  experts' output).
- `fp8_head_matmul`: absorbed MLA's per-head products with kv_b_proj's FP8 weight (`q_nope @ W_UK`,
  the weighted latent @ `W_UV^T`), 16-bit activations: program (head, BLOCK_M output columns,
  BLOCK_N tokens) streams its slice of the head's weight, e4m3 -> 16-bit in registers (exact: e4m3
  values fit in bf16), the block scales folded into the activations (where the depth runs along the
  weight's rows, W_UK) or into the product (where the output does, W_UV); a head's rows need not
  start on a block (448 rows per GLM head).

Shapes depend only on the inputs' shapes and nothing is read back to the host: CUDA-graph
capturable. Offsets that multiply a row index by a stride are computed in 64 bits (m * k passes
2**31 at long prefills).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from spmoe.layers.moe.experts.triton_kernels import quantize_fp8
from spmoe.layers.quantization.fp8 import FP8_GROUP, FP8_MAX
from spmoe.layers.sparse_attention_triton import NUM_SMS_TARGET

BLOCK = 128  # the weight block and activation group this module's kernels take
QUANTIZE_INSIDE_ROWS = 16  # up to this many rows the GEMM quantises its activations itself


class MatmulConfig(NamedTuple):
    """One launch shape of `fp8_matmul`. block_n divides 128 (a tile's columns share one
    weight-scale row); split_k: how many k ranges (of whole 128-blocks) the columns' work
    is cut into."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


# decode buckets (upper bounds of m); larger m is prefill, bucket 0 in the table
M_BUCKETS = (
    16,
    32,
    64,
)

# (m bucket, n, k) -> config for GLM-5.2's FP8 linears at TP 1, chosen from first principles before
# the first sweep (benchmarks/bench_fp8_linear.py --sweep prints its fastest as entries of this
# table; figures in docs/performance-log/2026-12.md). At decode a program's k loop is bound by the
# latency of its loads more than by their size (the f0db0a2 kernel moved 2-4 KiB per 128-deep step
# and reached 1.1 TB/s), so the steps are wide: m <= 16 (activations quantised inside, one 16-row
# tile): 128 columns, 16 KiB of weight per step, 4 steps in flight; m 33-64 (activations quantised
# once, one 64-row tile): 64 columns, 8 KiB of weight and 8 KiB of activations (from L2) per step.
# Then k splits bring the programs to about 264 (2 per SM; 3 fit). The float32 partial sums (splits
# x m x n) are a few % of the weight's bytes at m <= 16; at m = 64 up to half for the 2048-deep
# layers, a few MiB that mostly stay in L2.
MATMUL_CONFIGS: dict[tuple[int, int, int], MatmulConfig] = {
    # x_proj (q_a + kv_a (+ indexer wk), 128-row padded parts): 42-44 column tiles at m 64
    (64, 2816, 6144): MatmulConfig(64, 64, 6, 4, 4),
    (64, 2688, 6144): MatmulConfig(64, 64, 6, 4, 4),
    # q_b_proj: 128 / 256 column tiles
    (16, 16384, 2048): MatmulConfig(16, 128, 2, 4, 4),
    (64, 16384, 2048): MatmulConfig(64, 64, 1, 4, 4),
    # shared experts' gate_up: 32 / 64 tiles
    (16, 4096, 6144): MatmulConfig(16, 128, 8, 4, 4),
    (64, 4096, 6144): MatmulConfig(64, 64, 4, 4, 4),
    # o_proj and dense down: 48 / 96 tiles
    (16, 6144, 16384): MatmulConfig(16, 128, 6, 4, 4),
    (64, 6144, 16384): MatmulConfig(64, 64, 3, 4, 4),
    (16, 6144, 12288): MatmulConfig(16, 128, 6, 4, 4),
    (64, 6144, 12288): MatmulConfig(64, 64, 3, 4, 4),
    # dense gate_up: 192 / 384 tiles (2 splits at m <= 16: 384 programs, one wave at 3 per SM)
    (16, 24576, 6144): MatmulConfig(16, 128, 2, 4, 4),
    (64, 24576, 6144): MatmulConfig(64, 64, 1, 4, 4),
    # TP 8's shapes (x_proj's, the indexer wq_b's and TP 1's shared down alike at any TP),
    # measured (one H100, `bench_fp8_linear.py --tp 8 --m 1 16 64 --sweep`, 2026-12-07): per
    # m <= 16 the least time of m = 1 and m = 16 together, per m <= 64 the fastest at 64. Fewer k
    # splits than the rule above gives: at these widths a split's partial sums and second pass cost
    # more than the loads it spreads.
    (16, 2816, 6144): MatmulConfig(16, 64, 6, 4, 4),
    (16, 2688, 6144): MatmulConfig(16, 64, 6, 4, 4),
    (16, 2048, 2048): MatmulConfig(16, 32, 4, 4, 4),
    (64, 2048, 2048): MatmulConfig(64, 64, 1, 4, 4),
    (16, 4096, 2048): MatmulConfig(16, 32, 1, 4, 4),
    (64, 4096, 2048): MatmulConfig(64, 64, 1, 4, 4),
    (16, 6144, 2048): MatmulConfig(16, 64, 1, 4, 4),
    (64, 6144, 2048): MatmulConfig(64, 64, 1, 4, 4),
    (16, 512, 6144): MatmulConfig(16, 32, 16, 4, 4),
    (64, 512, 6144): MatmulConfig(64, 64, 1, 4, 4),
    (16, 6144, 256): MatmulConfig(16, 64, 1, 4, 4),
    (16, 3072, 6144): MatmulConfig(16, 64, 6, 4, 4),
    (64, 3072, 6144): MatmulConfig(64, 64, 1, 4, 4),
    (16, 6144, 1536): MatmulConfig(16, 64, 1, 4, 4),
    (64, 6144, 1536): MatmulConfig(64, 64, 1, 4, 4),
}


def m_bucket(m: int) -> int:
    """The table's m bucket: the smallest of `M_BUCKETS` that holds m, 0 for prefill."""
    return next((b for b in M_BUCKETS if m <= b), 0)


def matmul_config(m: int, n: int, k: int) -> MatmulConfig:
    """The launch shape for `m` rows, `n` output columns and depth `k`: `MATMUL_CONFIGS` if it lists
    (bucket, n, k), else decode: one tile of all rows (16, 32 or 64), 128 columns at m <= 16 and 64
    above, and as many k splits as bring the programs near `NUM_SMS_TARGET` (`decode_split`);
    prefill: 128 x 128 tiles."""
    bucket = m_bucket(m)
    if (bucket, n, k) in MATMUL_CONFIGS:
        return MATMUL_CONFIGS[(bucket, n, k)]
    if bucket == 0:
        return MatmulConfig(64, 128, 1, 4, 4) if m <= 256 else MatmulConfig(128, 128, 1, 8, 3)
    block_n = 128 if bucket == 16 else 64
    return MatmulConfig(bucket, block_n, decode_split(triton.cdiv(n, block_n), k), 4, 4)


def decode_split(tiles: int, k: int) -> int:
    """The k splits that bring `tiles` output tiles nearest `NUM_SMS_TARGET` programs, each split at
    least 2 blocks of 128 deep."""
    return max(1, min(round(NUM_SMS_TARGET / tiles), triton.cdiv(k, BLOCK) // 2))


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
    blocks_per_split,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_om,
    stride_os,
    QUANTIZE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out: the `[m, n]` output, or with split-K the float32 partials `[splits, m, n]` (stride_os
    apart; 0 without split-K)."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < m, cols < n
    first = pid_s * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(k, BLOCK_K))
    x_ptrs = x_ptr + rows[:, None] * stride_xm + first * BLOCK_K + offs_k[None, :]
    # [BLOCK_K, BLOCK_N]: W^T
    w_ptrs = w_ptr + cols[None, :] * stride_wn + first * BLOCK_K + offs_k[:, None]
    # one weight block row per tile (BLOCK_N | 128)
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        k_ok = offs_k < k - kb * BLOCK_K
        # 16-bit activations: quantise this 128-channel group of every row, as `quantize_fp8`
        if QUANTIZE:
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
    out_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr,
    out_ptr,
    m,
    n,
    splits,
    stride_ps,
    stride_om,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out `[m, n]` (+)= the sum over s of part `[splits, m, n]` float32 (rows of n, splits
    stride_ps = m * n apart), s in order."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    part_ptrs = part_ptr + rows[:, None] * n + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(splits):
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
        part_ptrs += stride_ps
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """As `fp8_linear.fp8_linear_torch`: x `[m, k]` bf16 / fp16 (unit stride along k), weight
    `[n, k]` e4m3 (contiguous rows), scale `[ceil(n / 128), ceil(k / 128)]` float32 -> `[m, n]` in
    x's dtype; given `out` `[m, n]` (unit stride along n), the product is added to it in place and
    `out` returned. config: the launch shape, `matmul_config` by default (block_n must
    divide 128)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(
            "fp8_matmul needs x [m, k] and weight [n, k] with unit-stride rows; got x "
            f"{tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} strides "
            f"{weight.stride()}"
        )
    accumulate = out is not None
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or matmul_config(m, n, k)
    if BLOCK % cfg.block_n or cfg.split_k < 1:
        raise ValueError(f"fp8_matmul needs block_n dividing {BLOCK} and split_k >= 1; got {cfg}")
    quantize = m <= QUANTIZE_INSIDE_ROWS
    if quantize:
        xq, xs = x, x  # xs is not read
    else:
        padded = (
            x if k % FP8_GROUP == 0 else torch.nn.functional.pad(x, (0, FP8_GROUP - k % FP8_GROUP))
        )
        xq, xs = quantize_fp8(padded)  # zeros past k change no group's largest value
    k_blocks = triton.cdiv(k, BLOCK)
    per_split = triton.cdiv(k_blocks, cfg.split_k)
    splits = triton.cdiv(k_blocks, per_split)  # no empty split
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _fp8_matmul_kernel[grid](
        xq,
        xs,
        weight,
        scale,
        target,
        m,
        n,
        k,
        per_split,
        xq.stride(0),
        xs.stride(0),
        weight.stride(0),
        scale.stride(0),
        target.stride(-2),
        target.stride(0) if splits > 1 else 0,
        QUANTIZE=quantize,
        ACCUMULATE=accumulate and splits == 1,
        FP8_MAX_=FP8_MAX,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        sum_m, sum_n = min(16, max(2, triton.next_power_of_2(m))), 256
        _sum_splits_kernel[(triton.cdiv(m, sum_m), triton.cdiv(n, sum_n))](
            target,
            out,
            m,
            n,
            splits,
            target.stride(0),
            out.stride(0),
            ACCUMULATE=accumulate,
            BLOCK_M=sum_m,
            BLOCK_N=sum_n,
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
        # w[k, m] = W[base + k, m]: the scale varies along k, one block column per tile
        if DEPTH_ALONG_ROWS:
            w_rows = base_row + k
            w = tl.load(
                w_ptr + w_rows[:, None] * stride_wr + cols[None, :],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            s = tl.load(
                ws_ptr + (w_rows // 128) * stride_wsr + (pid_m * BLOCK_M) // 128,
                mask=k_ok,
                other=0.0,
            )
            x = (x.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        else:  # w[k, m] = W[base + m, k]: the scale varies along m, one block column per step
            w_rows = base_row + cols
            w = tl.load(
                w_ptr + w_rows[None, :] * stride_wr + k[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            s = tl.load(
                ws_ptr + (w_rows // 128) * stride_wsr + first // 128, mask=col_ok, other=0.0
            )
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
    """As `fp8_linear.fp8_head_matmul_torch`: x `[N, h, k]` bf16 / fp16 (unit-stride last dim),
    weight `[R, C]` e4m3 (contiguous), scale `[ceil(R / 128), ceil(C / 128)]` -> `[N, h, width]` in
    x's dtype. Head i multiplies by `w[i] [k, width]`, the part of W that starts at row
    `i * rows_per_head + first_row`: with `depth_along_rows`, `w[i][j, c] = W[row + j, c]` (W_UK,
    width = C), else `w[i][c, j] = W[row + j, c]` (W_UV^T, k = C)."""
    n, heads, depth = x.shape
    if x.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"fp8_head_matmul needs unit-stride rows: x strides {x.stride()}, weight strides "
            f"{weight.stride()}"
        )
    out = torch.empty(n, heads, width, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n = 16 if n <= 16 else 64
    block_k = 64 if depth_along_rows else 128
    block_m = (
        64
        if n > 16
        else next((b for b in (64, 32) if heads * triton.cdiv(width, b) >= NUM_SMS_TARGET), 16)
    )
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
