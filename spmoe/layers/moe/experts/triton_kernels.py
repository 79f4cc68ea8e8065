"""Triton kernels for the fused MoE: grouped GEMMs over this rank's experts, gate/up with
SiLU-and-mul fused, in bfloat16 or FP8 e4m3 with 128 x 128 weight blocks and per-token 128-channel
activation groups.

Pipeline for m rows and k routes per row (P = m * k (row, route) pairs), 5 launches at decode (7
with FP8), 9 (11) above `ONE_PROGRAM_PAIRS` pairs:

    align      count pairs per local expert; pad each expert's run to a multiple of BLOCK_M; place
               each local pair in its expert's run (one program for a few pairs, else 3 kernels +
               2 fills)
    quantize   FP8 only: x to e4m3 with one scale per 128 channels of a row
    gate_up    act[r, :] = silu(x[row] @ W_gate[e].T) * (x[row] @ W_up[e].T)      [R, I]
    quantize   FP8 only: act likewise
    zero       y32 = 0                                                            [m, H] float32
    down       y32[row, :] += weight[pair] * act[r, :] @ W_down[e].T  (float32 atomic add)
    cast       y = y32 in x's dtype                                               [m, H]

(Quantising the activation tiles inside the GEMMs instead was measured slower: every column
tile repeats it.)

The down projection adds each pair's output straight into its row of a float32 [m, H] sum, so no
[P, H] buffer of every route's output exists (2 * m * k * H bytes: 4.8 GB at m = 49152, H 6144,
top-8; the sum takes 4 * m * H). Float32 atomic adds are commutative but not associative: with at
most 2 local routes per row the result is the same on every run (0 + a is exact, a + b = b + a);
with 3 or more, their order can change the float32 sum's last bit between runs, and so, rarely, the
rounded output. A fixed order would need either that [P, H] buffer or one down pass per route slot
(reading the expert weights up to k times); we chose the bounded memory.

Every offset that is a product of a size by a row index (token, sorted row, expert) is computed in
int64: at H 6144, top-8 and I 2048, m * H passes 2**31 at m = 349526, the sorted activations' R * I
from m = 131072 (the [P, H] buffer passed it at m = 43691).

Shapes are static for a given m (R is an upper bound), there are no host syncs, so the path can be
captured in a CUDA graph. Programs whose block holds no pairs exit at once. The order of pairs
within an expert's run does not change any GEMM result: every row of a tile is
computed independently.
"""

import torch
import triton
import triton.language as tl

from spmoe.layers.quantization.fp8 import FP8_GROUP, FP8_MAX


@triton.jit
def _gate_up_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    act_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    top_k,
    hidden: tl.constexpr,
    inter: tl.constexpr,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_am,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # expert * stride may pass 2**31
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    valid = pairs < num_pairs
    # token * stride passes 2**31 from 349526 rows
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    rows = rows.to(tl.int64)  # R * I passes 2**31 from m = 131072 at top-8, I 2048
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    # [BLOCK_K, BLOCK_N]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    col_ok = cols[None, :] < inter
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        if FP8:  # one scale per 128 channels of the row, one per 128 x 128 weight block
            a_s = tl.load(xs_ptr + tokens * stride_xsm + k0 // BLOCK_K, mask=valid, other=0.0)[
                :, None
            ]
            ws = ws_ptr + expert * stride_wse + k0 // BLOCK_K
            g_s = tl.load(ws + (pid_n * BLOCK_N // 128) * stride_wsn)
            u_s = tl.load(ws + ((inter + pid_n * BLOCK_N) // 128) * stride_wsn)
            acc_g += tl.dot(a, g) * (a_s * g_s)
            acc_u += tl.dot(a, u) * (a_s * u_s)
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(
        act_ptr + rows[:, None] * stride_am + cols[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok,
    )


@triton.jit
def _down_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    route_w_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    top_k,
    hidden: tl.constexpr,
    inter: tl.constexpr,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_ym,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y `[m, H]` float32 += each pair's route weight * act @ W_down[e].T, by atomic add (see the
    module doc)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    valid = pairs < num_pairs
    rows = rows.to(tl.int64)
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
    col_ok = cols[None, :] < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        if FP8:
            a_s = tl.load(as_ptr + rows * stride_asm + k0 // BLOCK_K, mask=valid, other=0.0)[
                :, None
            ]
            b_s = tl.load(
                ws_ptr + expert * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn + k0 // BLOCK_K
            )
            acc += tl.dot(a, b) * (a_s * b_s)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc *= tl.load(route_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.atomic_add(
        y_ptr + tokens[:, None] * stride_ym + cols[None, :],
        acc,
        mask=valid[:, None] & col_ok,
        sem="relaxed",
    )


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, first, count, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) - first
    tl.atomic_add(
        counts_ptr + expert, 1, mask=(offs < num_pairs) & (expert >= 0) & (expert < count)
    )


@triton.jit
def _blocks_kernel(
    counts_ptr,
    start_ptr,
    block_expert_ptr,
    num_blocks,
    count,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Each program recomputes the padded run ends (a few hundred experts) and labels
    BLOCK_B blocks."""
    experts = tl.arange(0, BLOCK_E)
    padded = (
        (tl.load(counts_ptr + experts, mask=experts < count, other=0) + BLOCK_M - 1)
        // BLOCK_M
        * BLOCK_M
    )
    end = tl.cumsum(padded, 0)
    tl.store(start_ptr + experts, end - padded, mask=(experts < count) & (tl.program_id(0) == 0))
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    # runs ending before
    before = tl.sum((end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    tl.store(
        block_expert_ptr + blocks, tl.where(before < count, before, -1), mask=blocks < num_blocks
    )


@triton.jit
def _place_kernel(
    ids_ptr, start_ptr, cursor_ptr, pairs_ptr, num_pairs, first, count, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) - first
    local = (offs < num_pairs) & (expert >= 0) & (expert < count)
    slot = tl.atomic_add(cursor_ptr + expert, 1, mask=local)
    tl.store(pairs_ptr + tl.load(start_ptr + expert, mask=local, other=0) + slot, offs, mask=local)


# 128-channel groups a program of `quantize_fp8` takes (of one row): 4 KiB of 16-bit input, where
# one group a program made 57,344 programs of 128 values for 1,024 rows of 7,168 channels
QUANTIZE_GROUPS = 16


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    groups,
    stride_x,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    MAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    inside = (group < groups)[:, None]
    offs = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    v = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), 1), 1e-10) / MAX  # [GROUPS]
    q = (v / scale[:, None]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * stride_q + offs, q, mask=inside)
    tl.store(s_ptr + row * stride_s + group, scale, mask=group < groups)


@triton.jit
def _align_one_program_kernel(
    ids_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    first,
    count,
    num_rows,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """`_count_kernel`, `_blocks_kernel` and `_place_kernel` in one program, for at most BLOCK_P
    pairs: the counts and each pair's place in its expert's run come from comparison matrices,
    nothing needs zeroing."""
    p = tl.arange(0, BLOCK_P)
    e = tl.arange(0, BLOCK_E)
    expert = (tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) - first).to(tl.int32)
    local = (p < num_pairs) & (expert >= 0) & (expert < count)
    expert = tl.where(local, expert, -1)
    mine = expert[:, None] == e[None, :]  # [P, E]
    padded = (tl.sum(mine.to(tl.int32), axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    # [P]: the start of the pair's run
    start = tl.sum(tl.where(mine, (end - padded)[None, :], 0), axis=1)
    # [P, P]: same expert, before it
    earlier = (expert[:, None] == expert[None, :]) & (p[None, :] < p[:, None])
    place = start + tl.sum(earlier.to(tl.int32), axis=1)
    for r0 in range(0, num_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(pairs_ptr + r, num_pairs, mask=r < num_rows)
    # every pad written before any pair lands (one program: the barrier orders the stores)
    tl.debug_barrier()
    tl.store(pairs_ptr + place, p, mask=local)
    for b0 in range(0, num_rows // BLOCK_M, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        # runs ending before
        before = tl.sum((end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(
            block_expert_ptr + b, tl.where(before < count, before, -1), mask=b < num_rows // BLOCK_M
        )


ONE_PROGRAM_PAIRS = 128  # up to this many (row, route) pairs, `align_pairs` runs as one program


def align_pairs(ids: torch.Tensor, first: int, count: int, block_m: int):
    """ids `[m, k]` global expert ids (-1 = none) -> (pairs `[R]`, block_expert `[R / block_m]`) for
    this rank's experts `[first, first + count)`.

    `pairs[r]`: the (row, route) pair `row * k + route` computed at sorted position r, or `m * k`
    for a pad position; each expert's pairs are contiguous and start at a multiple of `block_m`;
    `block_expert[b]` is the local expert of block b, -1 past the last one. R is a
    static upper bound.
    """
    num_pairs, device = ids.numel(), ids.device
    rows_max = triton.cdiv(num_pairs + min(count, num_pairs) * (block_m - 1), block_m) * block_m
    if num_pairs <= ONE_PROGRAM_PAIRS:
        pairs = torch.empty(rows_max, dtype=torch.int32, device=device)
        block_expert = torch.empty(rows_max // block_m, dtype=torch.int32, device=device)
        block_p, block_e = (
            max(16, triton.next_power_of_2(num_pairs)),
            max(16, triton.next_power_of_2(count)),
        )
        # 2.2 us at batch 1 on an H200; 1 warp took 2.8
        _align_one_program_kernel[(1,)](
            ids,
            pairs,
            block_expert,
            num_pairs,
            first,
            count,
            rows_max,
            BLOCK_M=block_m,
            BLOCK_P=block_p,
            BLOCK_E=block_e,
            BLOCK_R=256,
            BLOCK_B=64,
            num_warps=8,
        )
        return pairs, block_expert
    # pairs per expert, placement cursors
    counters = torch.zeros(2, count, dtype=torch.int32, device=device)
    start = torch.empty(count, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows_max // block_m, dtype=torch.int32, device=device)
    pairs = torch.full((rows_max,), num_pairs, dtype=torch.int32, device=device)
    grid = (triton.cdiv(max(num_pairs, 1), 1024),)
    _count_kernel[grid](ids, counters[0], num_pairs, first, count, BLOCK=1024)
    _blocks_kernel[(triton.cdiv(rows_max // block_m, 64),)](
        counters[0],
        start,
        block_expert,
        rows_max // block_m,
        count,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(count),
        BLOCK_B=64,
    )
    _place_kernel[grid](ids, start, counters[1], pairs, num_pairs, first, count, BLOCK=1024)
    return pairs, block_expert


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[m, K]` -> (FP8 e4m3 `[m, K]`, float32 scales `[m, K / 128]`) in one launch."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    groups = x.shape[1] // FP8_GROUP
    scale = torch.empty(x.shape[0], groups, dtype=torch.float32, device=x.device)
    _quantize_kernel[(x.shape[0], triton.cdiv(groups, QUANTIZE_GROUPS))](
        x,
        q,
        scale,
        groups,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        GROUP=FP8_GROUP,
        GROUPS=QUANTIZE_GROUPS,
        MAX=FP8_MAX,
    )
    return q, scale


def fused_moe(x, ids, weights, first, w13, w2, w13_scale=None, w2_scale=None, config=None):
    """x `[m, H]`, ids / weights `[m, k]` (global expert ids, -1 = none), this rank's experts
    `[first, first + E)`: w13 `[E, 2I, H]`, w2 `[E, H, I]` (FP8 with scales, or x's dtype) ->
    `[m, H]` in x's dtype. `config`: the tile sizes (`pick_config` by default)."""
    (m, k), (count, two_inter, hidden) = ids.shape, w13.shape
    inter, fp8 = two_inter // 2, w13.dtype == torch.float8_e4m3fn
    # rows may be strided (a view of a packed gather)
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    if m == 0:
        return torch.empty_like(x)
    cfg = config or pick_config(m * k, count, fp8)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pairs, block_expert = align_pairs(ids, first, count, bm)
    rows = pairs.shape[0]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    tiles = dict(FP8=fp8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"])
    xq, xs = quantize_fp8(x) if fp8 else (x, x)  # xs is unused without FP8
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(rows // bm, triton.cdiv(inter, bn))](
        xq,
        xs,
        w13,
        w13_scale if fp8 else w13,
        act,
        pairs,
        block_expert,
        m * k,
        k,
        hidden,
        inter,
        xq.stride(0),
        xs.stride(0),
        w13.stride(0),
        w13.stride(1),
        *_scale_strides(w13_scale),
        act.stride(0),
        **tiles,
        **launch,
    )
    aq, a_s = quantize_fp8(act) if fp8 else (act, act)
    # rows without a local pair stay 0
    y32 = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(rows // bm, triton.cdiv(hidden, bn))](
        aq,
        a_s,
        w2,
        w2_scale if fp8 else w2,
        y32,
        weights,
        pairs,
        block_expert,
        m * k,
        k,
        hidden,
        inter,
        aq.stride(0),
        a_s.stride(0),
        w2.stride(0),
        w2.stride(1),
        *_scale_strides(w2_scale),
        y32.stride(0),
        **tiles,
        **launch,
    )
    return y32.to(x.dtype)


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    return (scale.stride(0), scale.stride(1)) if scale is not None else (0, 0)


def pick_config(num_pairs: int, num_experts: int, fp8: bool) -> dict:
    """Tile sizes by the mean pairs per local expert, from `benchmarks/bench_experts.py --sweep` on
    an H200: small blocks that stream the weights at decode, large ones that reuse them at prefill.
    FP8 needs BLOCK_K = 128 (one activation scale per step) and BLOCK_N <= 128."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32 if fp8 else 64, BLOCK_K=128, num_warps=4, num_stages=5)
    if per_expert <= 64:
        return dict(
            BLOCK_M=32 if fp8 else 64,
            BLOCK_N=64 if fp8 else 128,
            BLOCK_K=128 if fp8 else 64,
            num_warps=4 if fp8 else 8,
            num_stages=4 if fp8 else 3,
        )
    if fp8 and per_expert <= 512:
        return dict(
            BLOCK_M=64,
            BLOCK_N=64 if per_expert <= 128 else 128,
            BLOCK_K=128,
            num_warps=4 if per_expert <= 128 else 8,
            num_stages=4 if per_expert <= 128 else 3,
        )
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128 if fp8 else 64, num_warps=8, num_stages=3)
