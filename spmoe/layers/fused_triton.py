"""Fused Triton kernels for the small per-token work of a decode step, each one launch where the
torch reference takes several (the references, which these match, are `RMSNorm`, `Rotary`, `Router`,
`PagedCacheView`'s latent write, `mlp.silu_mul` and the indexer's key path: `nn.LayerNorm`,
`Rotary`, `paged_rows.write_index_key`; `fused.use_fused` picks):

- `add_rms_norm`: residual add + RMSNorm, one program per row: reads x (and the residual), writes
  the normed row (and the new residual). The torch rounding is kept: the sum and the normed row are
  rounded to the input dtype before the weight multiplies them.
- `rope_`: rotates the rope part of q or k in place, one program per (token, block of heads).
  Interleaved pairs (x0, x1), (x2, x3)... land as the rotated evens then the rotated odds, as
  `Rotary.interleaved` does; half-split pairs (x_i, x_{i+d/2}) stay where they are. Products and
  sums are rounded to the dtype as torch rounds them (`_rotated`; on an H200, bf16, equal to torch
  in every element of 256 tokens x 4 heads).
- `index_key_to_cache`: the indexer's key, one program per token: LayerNorm (weight and bias), rope
  on its rope part (the pairs read from the row and normed where they are needed, so nothing is
  written twice), and the store into the token's paged-cache row; FP8 caches get the key times the
  Hadamard matrix (32 of its rows at a time) in e4m3 with one scale per key. Rounded as torch: the
  normed row to the dtype, then each rope product and sum; FP8 divides exactly (`div_rn`), as torch
  does. On an H200, bf16, 256 keys: every value equal to torch's, FP8 values too; the FP8 scales a
  last bit apart in 80-86% of keys (the Hadamard sum's order).
- `route`: the router after its logits GEMM, one program per row: sigmoid, + the correction bias,
  group top-k (top-2 sum per group, `topk_group` groups kept), top-k experts, the raw scores
  gathered, normalised and scaled; pad rows get id -1 and weight 0. Ties go to the lowest index
  (group or expert). It takes the logits as S partial sums `[m, S, E]` and adds them up first.
- `router_logit_sums`: the router's logits GEMM in float32 from 16-bit rows, for a few rows a Triton
  GEMV that leaves S partial sums over K-slices (many programs stream the float32 weight; `route`
  finishes the sum, so no reduction kernel and no float32 copy of x), else cuBLAS (S = 1).
- `write_mla_cache`: one program per token writes its MLA cache row from the kv_a projection:
  RMSNorm of the latent (`add_rms_norm`'s rounding), FP8 with one scale per 128 values when the
  cache is FP8, and the rope key rotated (interleaved, `rope_`'s rounding), at the token's slot.
- `silu_mul`: `silu(gate) * up`, each rounded to the dtype as torch rounds `F.silu(gate) * up`.

Row offsets (token, slot and cache row times a stride) are int64, so no tensor size reaches
a 32-bit limit.

Shapes depend only on the inputs' shapes and nothing is read back to the host, so each can be
captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from spmoe.layers.quantization.fp8 import FP8_GROUP, FP8_MAX


@triton.jit
def _rms_normed(x, w_ptr, cols, mask, size, eps):
    """RMSNorm of the row x (masked lanes 0) times the weight, float32; x * rstd is rounded to x's
    dtype first, as torch rounds it."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / size + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    return tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    normed = _rms_normed(x, w_ptr, cols, mask, size, eps)
    tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[m, size]` (rows may be strided), residual `[m, size]` or None, weight `[size]` -> (norm(x
    + residual) `[m, size]` in the dtype of weight * x, x + residual `[m, size]`; x itself when
    there is no residual)."""
    m, size = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, size, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = x
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        new_residual = torch.empty(m, size, dtype=x.dtype, device=x.device)
    if m:
        block = triton.next_power_of_2(size)
        _add_rms_norm_kernel[(m,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            x.stride(0),
            (residual if residual is not None else x).stride(0),
            out.stride(0),
            new_residual.stride(0),
            size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out, new_residual


@triton.jit
def _rotated(own, partner, cos, signed_sin, dtype: tl.constexpr):
    """One rope output from float32 values: `own * cos + partner * signed_sin` (first halves:
    partner = the second, signed_sin = -sin; second halves: partner = the first, + sin), in `dtype`.
    torch rounds every product and every sum to the tensor dtype, and so does this, in kernels
    launched with `enable_fp_fusion=False`: else the compiler, which does the rounded 16-bit
    products in 16 bits, fuses one with the sum into an FMA that rounds once (measured on an H200:
    14% of an indexer key's values a bf16 step off torch's)."""
    return (
        (own * cos).to(dtype).to(tl.float32) + (partner * signed_sin).to(dtype).to(tl.float32)
    ).to(dtype)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    heads,
    stride_n,
    stride_h,
    stride_cos,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = (h < heads) & (j < HALF)
    dtype = x_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + n * stride_cos + j).to(tl.float32)
    sin = tl.load(sin_ptr + n * stride_cos + j).to(tl.float32)
    base = x_ptr + n * stride_n + h * stride_h
    if INTERLEAVED:
        first = tl.load(base + 2 * j, mask=mask).to(tl.float32)
        second = tl.load(base + 2 * j + 1, mask=mask).to(tl.float32)
    else:
        first = tl.load(base + j, mask=mask).to(tl.float32)
        second = tl.load(base + j + HALF, mask=mask).to(tl.float32)
    out_first = _rotated(first, second, cos, -sin, dtype)
    out_second = _rotated(second, first, cos, sin, dtype)
    # every thread has read its pairs before any overwrites a position another still reads
    tl.debug_barrier()
    tl.store(base + j, out_first, mask=mask)
    tl.store(base + j + HALF, out_second, mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    """Rotates x `[N, heads, d]` (a view: the rope part of q or k; last dim contiguous) in place
    with cos / sin `[N, d / 2]`."""
    n_tok, heads, dim = x.shape
    if x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(
            f"rope_ needs a contiguous last dim and cos / sin of one layout; got x strides "
            f"{x.stride()}, cos {cos.stride()}, sin {sin.stride()}"
        )
    if n_tok == 0 or heads == 0:
        return
    block_h = min(16, triton.next_power_of_2(heads))
    # see _rotated
    _rope_kernel[(n_tok, triton.cdiv(heads, block_h))](
        x,
        cos,
        sin,
        heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HALF=dim // 2,
        INTERLEAVED=interleaved,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,
    )


@triton.jit
def _layer_norm_at(row_ptr, w_ptr, b_ptr, index, mean, rstd, dtype: tl.constexpr):
    """LayerNorm's output at `index` of a row whose mean and rstd are known, rounded to `dtype` as
    torch's output is, as float32."""
    x = tl.load(row_ptr + index).to(tl.float32)
    w = tl.load(w_ptr + index).to(tl.float32)
    b = tl.load(b_ptr + index).to(tl.float32)
    return (w * ((x - mean) * rstd) + b).to(dtype).to(tl.float32)


@triton.jit
def _index_key_at(
    row_ptr,
    w_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    i,
    mean,
    rstd,
    ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    dtype: tl.constexpr,
):
    """The indexer key's values at indices i (int32) of a row whose LayerNorm mean and rstd are
    known, in `dtype`: output i < ROPE is rope(own, partner) at frequency j of cos / sin
    (`[rope / 2]` of this token); output i >= ROPE is its own normed value."""
    HALF: tl.constexpr = ROPE // 2
    rotated = i < ROPE
    second = (i >= HALF).to(tl.int32)  # in the rope part: the second half of the outputs
    j = i % HALF
    if INTERLEAVED:  # pairs (2j, 2j + 1) -> outputs j and j + HALF
        own = tl.where(rotated, 2 * j + second, i)
        partner = 2 * j + 1 - second
    else:  # pairs (j, j + HALF) stay in place
        own = i
        partner = tl.where(second == 1, i - HALF, i + HALF)
    own_value = _layer_norm_at(row_ptr, w_ptr, b_ptr, own, mean, rstd, dtype)
    partner_value = _layer_norm_at(row_ptr, w_ptr, b_ptr, partner, mean, rstd, dtype)
    cos = tl.load(cos_ptr + j).to(tl.float32)
    sin = tl.load(sin_ptr + j).to(tl.float32)
    return tl.where(
        rotated,
        _rotated(own_value, partner_value, cos, tl.where(second == 1, sin, -sin), dtype),
        own_value.to(dtype),
    )


@triton.jit
def _index_key_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    key_ptr,
    scale_ptr,
    hadamard_ptr,
    stride_x,
    stride_cos,
    eps,
    DIM: tl.constexpr,
    ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    row, cos_row, sin_row = x_ptr + n * stride_x, cos_ptr + n * stride_cos, sin_ptr + n * stride_cos
    i = tl.arange(0, DIM)
    x = tl.load(row + i).to(tl.float32)
    mean = tl.sum(x, axis=0) / DIM
    rstd = tl.rsqrt(tl.sum((x - mean) * (x - mean), axis=0) / DIM + eps)
    slot = tl.load(slots_ptr + n).to(tl.int64)  # slot * DIM passes 2**31 from 16M cache rows
    if FP8:
        # key @ hadamard in float32, CHUNK rows of the matrix at a time, then one scale per key as
        # quantize_fp8_vectors: max |value| * (1 / FP8_MAX) (torch multiplies by the reciprocal),
        # values divided exactly
        value = tl.zeros([DIM], tl.float32)
        for start in tl.static_range(0, DIM, CHUNK):
            r = start + tl.arange(0, CHUNK)
            part = _index_key_at(
                row, w_ptr, b_ptr, cos_row, sin_row, r, mean, rstd, ROPE, INTERLEAVED, dtype
            )
            value += tl.sum(
                part.to(tl.float32)[:, None]
                * tl.load(hadamard_ptr + r[:, None] * DIM + i[None, :]),
                axis=0,
            )
        scale = tl.maximum(tl.max(tl.abs(value), axis=0), 1e-10) * (1.0 / FP8_MAX)
        tl.store(key_ptr + slot * DIM + i, tl.div_rn(value, scale).to(key_ptr.dtype.element_ty))
        tl.store(scale_ptr + slot, scale)
    else:
        key = _index_key_at(
            row, w_ptr, b_ptr, cos_row, sin_row, i, mean, rstd, ROPE, INTERLEAVED, dtype
        )
        tl.store(key_ptr + slot * DIM + i, key.to(key_ptr.dtype.element_ty))


def index_key_to_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    slots: torch.Tensor,
    keys: torch.Tensor,
    scales: torch.Tensor | None,
    hadamard: torch.Tensor | None,
) -> None:
    """The indexer's key of each new token, normed, rotated and written to its cache row in one
    launch: x `[N, d]` (wk of the input; rows may be strided), LayerNorm weight and bias `[d]`, cos
    / sin `[N, rope / 2]` (the rope part is the key's first `rope` values), slots `[N]` int64 ->
    `keys[slots[i]]` of keys `[R, d]`. An FP8 cache (`scales` `[R, 1]` float32 and `hadamard`
    `[d, d]` float32, else both None) takes the key times `hadamard`, quantised to e4m3 with one
    scale per key: `quantize_fp8_vectors(hadamard_rotate(key))`."""
    n_tok, dim = x.shape
    rope = 2 * cos.shape[1]
    if (
        x.stride(1) != 1
        or keys.stride() != (dim, 1)
        or cos.stride(1) != 1
        or sin.stride() != cos.stride()
        or dim & (dim - 1)
        or rope > dim
        or (scales is None) != (hadamard is None)
        or (hadamard is not None and hadamard.stride() != (dim, 1))
    ):
        raise ValueError(
            "index_key_to_cache needs unit-stride rows of a power-of-2 width d holding the rope "
            "part, cos / sin of one layout, and FP8 scales with a contiguous [d, d] hadamard or "
            f"neither; got x {tuple(x.shape)} strides {x.stride()}, cache rows strides "
            f"{keys.stride()}, rope {rope}, cos strides {cos.stride()}, sin {sin.stride()}, scales "
            f"{scales is not None}, hadamard "
            f"{None if hadamard is None else (tuple(hadamard.shape), hadamard.stride())}"
        )
    if n_tok == 0:
        return
    fp8 = scales is not None
    # see _rotated
    _index_key_kernel[(n_tok,)](
        x,
        weight,
        bias,
        cos,
        sin,
        slots,
        keys,
        scales if fp8 else keys,
        hadamard if fp8 else keys,
        x.stride(0),
        cos.stride(0),
        eps,
        DIM=dim,
        ROPE=rope,
        INTERLEAVED=interleaved,
        FP8=fp8,
        FP8_MAX=FP8_MAX,
        CHUNK=min(dim, 32),
        num_warps=4 if fp8 else 1,
        enable_fp_fusion=False,
    )


@triton.jit
def _router_kernel(
    sums_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    valid_rows,
    scale,
    stride_row,
    stride_split,
    EXPERTS: tl.constexpr,
    SPLITS: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    NORM: tl.constexpr,
    GROUPS_P: tl.constexpr,
    GROUP_P: tl.constexpr,
    K_P: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.arange(0, GROUPS_P)[:, None]
    i = tl.arange(0, GROUP_P)[None, :]
    expert = g * GROUP + i  # [GROUPS_P, GROUP_P]: expert ids laid out by group
    real = (g < N_GROUP) & (i < GROUP)
    logits = tl.zeros([GROUPS_P, GROUP_P], dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # in a fixed order: the same sum on every call
        logits += tl.load(
            sums_ptr + row.to(tl.int64) * stride_row + split * stride_split + expert,
            mask=real,
            other=0.0,
        )
    scores = tl.sigmoid(logits)
    choice = tl.where(
        real, scores + tl.load(bias_ptr + expert, mask=real, other=0.0), float("-inf")
    )
    if N_GROUP > 1:  # keep the TOPK_GROUP groups of the largest top-2 sums
        best = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == best[:, None], i, GROUP_P), axis=1)
        second = tl.max(tl.where(i == first[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(tl.arange(0, GROUPS_P) < N_GROUP, best + second, float("-inf"))
        groups = tl.arange(0, GROUPS_P)
        keep = groups < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top, groups, GROUPS_P), axis=0)
            keep = keep | (groups == pick)
            group_score = tl.where(groups == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slot = tl.arange(0, K_P)
    ids = tl.zeros([K_P], dtype=tl.int64)
    weights = tl.zeros([K_P], dtype=tl.float32)
    for k in tl.static_range(K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, EXPERTS), axis=1), axis=0)
        # a pad lane shares its number with the next group's first expert
        hit = (expert == pick) & real
        weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        ids = tl.where(slot == k, pick.to(tl.int64), ids)
        weights = tl.where(slot == k, weight, weights)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scale
    pad = row >= valid_rows
    out = row.to(tl.int64) * K + slot
    tl.store(ids_ptr + out, tl.where(pad, -1, ids), mask=slot < K)
    tl.store(w_ptr + out, tl.where(pad, 0.0, weights), mask=slot < K)


def route(
    sums: torch.Tensor,
    bias: torch.Tensor,
    valid_rows: int,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits as S partial sums `[m, S, E]` float32 (`router_logit_sums`), correction bias
    `[E]` -> (ids `[m, top_k]` int64, weights `[m, top_k]` float32); rows from `valid_rows` on get
    id -1 and weight 0."""
    m, splits, experts = sums.shape
    sums = sums if sums.stride(2) == 1 else sums.contiguous()
    ids = torch.empty(m, top_k, dtype=torch.int64, device=sums.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=sums.device)
    if m:
        group = experts // n_group
        # one warp: its reductions need no shared memory
        _router_kernel[(m,)](
            sums,
            bias.float(),
            ids,
            weights,
            valid_rows,
            scale,
            sums.stride(0),
            sums.stride(1),
            EXPERTS=experts,
            SPLITS=splits,
            N_GROUP=n_group,
            GROUP=group,
            TOPK_GROUP=topk_group,
            K=top_k,
            NORM=norm_topk_prob,
            GROUPS_P=triton.next_power_of_2(n_group),
            GROUP_P=triton.next_power_of_2(group),
            K_P=triton.next_power_of_2(top_k),
            num_warps=1,
        )
    return ids, weights


# at most this many rows take the Triton GEMV (`router_logit_sums`), more take cuBLAS
GEMV_ROWS = 32
GEMV_SLICE = 1024  # the K-slice one GEMV program sums


@triton.jit
def _router_gemv_kernel(
    x_ptr,
    w_ptr,
    sums_ptr,
    rows,
    experts,
    hidden,
    stride_x,
    stride_w,
    stride_row,
    stride_split,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(1)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < hidden
    w = tl.load(
        w_ptr + e[:, None].to(tl.int64) * stride_w + k[None, :],
        mask=(e[:, None] < experts) & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    for i in tl.static_range(BLOCK_M):  # unrolled: every row's load is in flight at once
        r = tl.program_id(2).to(tl.int64) * BLOCK_M + i
        x = tl.load(x_ptr + r * stride_x + k, mask=k_ok & (r < rows), other=0.0).to(tl.float32)
        tl.store(
            sums_ptr + r * stride_row + split * stride_split + e,
            tl.sum(w * x[None, :], axis=1),
            mask=(e < experts) & (r < rows),
        )


def router_logit_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[m, H]` (16-bit or float32), the router weight `[E, H]` float32 -> the float32 logits x @
    weight.T as S partial sums `[m, S, E]`, each over a K-slice of `GEMV_SLICE` (a Triton GEMV, for
    at most `GEMV_ROWS` rows), or S = 1 (a cuBLAS GEMM of x in float32)."""
    (m, hidden), experts = x.shape, weight.shape[0]
    if m > GEMV_ROWS:
        return torch.nn.functional.linear(x.float(), weight.float()).unsqueeze(1)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    splits = triton.cdiv(hidden, GEMV_SLICE)
    sums = torch.empty(m, splits, experts, dtype=torch.float32, device=x.device)
    if m:
        # >= ~100 programs for 64+ experts
        block_e = min(8, max(2, triton.next_power_of_2(experts) // 16))
        block_m = min(8, triton.next_power_of_2(m))
        _router_gemv_kernel[(triton.cdiv(experts, block_e), splits, triton.cdiv(m, block_m))](
            x,
            weight,
            sums,
            m,
            experts,
            hidden,
            x.stride(0),
            weight.stride(0),
            sums.stride(0),
            sums.stride(1),
            BLOCK_E=block_e,
            BLOCK_K=GEMV_SLICE,
            BLOCK_M=block_m,
            num_warps=4,
        )
    return sums


@triton.jit
def _mla_cache_write_kernel(
    kv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    latent_ptr,
    scale_ptr,
    rope_ptr,
    stride_kv,
    stride_cos,
    stride_latent,
    stride_scale,
    stride_rope,
    eps,
    LATENT: tl.constexpr,
    HALF: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)  # slot * row stride may pass 2**31 in a large cache
    c = tl.arange(0, BLOCK_C)
    c_ok = c < LATENT
    latent = tl.load(kv_ptr + n * stride_kv + c, mask=c_ok, other=0.0)
    normed = _rms_normed(latent, w_ptr, c, c_ok, LATENT, eps).to(latent.dtype)
    if FP8:  # one scale per GROUP values, as `quantize_fp8_groups`
        groups = tl.reshape(normed.to(tl.float32), (BLOCK_C // GROUP, GROUP))
        scale = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-10) / FP8_MAX
        scales = tl.broadcast_to(scale[:, None], (BLOCK_C // GROUP, GROUP))
        # IEEE division, as torch's
        values = tl.math.div_rn(groups, scales).to(latent_ptr.dtype.element_ty)
        cols = tl.reshape(c, (BLOCK_C // GROUP, GROUP))
        tl.store(latent_ptr + slot * stride_latent + cols, values, mask=cols < LATENT)
        g = tl.arange(0, BLOCK_C // GROUP)
        tl.store(scale_ptr + slot * stride_scale + g, scale, mask=g < LATENT // GROUP)
    else:
        tl.store(
            latent_ptr + slot * stride_latent + c, normed.to(latent_ptr.dtype.element_ty), mask=c_ok
        )
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    rope = kv_ptr + n * stride_kv + LATENT  # interleaved pairs (x0, x1), (x2, x3)...
    cos = tl.load(cos_ptr + n * stride_cos + j, mask=j_ok).to(tl.float32)
    sin = tl.load(sin_ptr + n * stride_cos + j, mask=j_ok).to(tl.float32)
    even = tl.load(rope + 2 * j, mask=j_ok).to(tl.float32)
    odd = tl.load(rope + 2 * j + 1, mask=j_ok).to(tl.float32)
    first = _rotated(even, odd, cos, -sin, rope_ptr.dtype.element_ty)
    second = _rotated(odd, even, cos, sin, rope_ptr.dtype.element_ty)
    # the rotated evens, then the rotated odds
    tl.store(rope_ptr + slot * stride_rope + j, first, mask=j_ok)
    tl.store(rope_ptr + slot * stride_rope + HALF + j, second, mask=j_ok)


def write_mla_cache(
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    latent: torch.Tensor,
    latent_scale: torch.Tensor | None,
    rope: torch.Tensor,
) -> None:
    """One token's MLA cache row per program. kv_a `[N, c + r]` (the kv_a projection: the latent,
    then the rope key; rows may be strided), the latent norm's weight `[c]` and eps, cos / sin
    `[N, r / 2]`, slots `[N]` int64 -> rows `slots` of latent `[R, c]` (the normed latent; FP8: its
    values, their scales in latent_scale `[R, c / 128]`) and rope `[R, r]` (the rope key rotated,
    interleaved pairs), in place."""
    n_tok, c, r = kv_a.shape[0], latent.shape[1], rope.shape[1]
    if (
        kv_a.stride(1) != 1
        or cos.stride(1) != 1
        or sin.stride() != cos.stride()
        or kv_a.shape[1] != c + r
    ):
        raise ValueError(
            f"write_mla_cache needs kv_a [N, {c} + {r}] with a contiguous last dim and cos / sin "
            f"of one layout; got kv_a {tuple(kv_a.shape)} strides {kv_a.stride()}, cos "
            f"{cos.stride()}, sin {sin.stride()}"
        )
    if n_tok == 0:
        return
    fp8 = latent_scale is not None
    block_c = triton.next_power_of_2(c)
    # see _rotated
    _mla_cache_write_kernel[(n_tok,)](
        kv_a,
        weight,
        cos,
        sin,
        slots,
        latent,
        latent_scale if fp8 else latent,
        rope,
        kv_a.stride(0),
        cos.stride(0),
        latent.stride(0),
        latent_scale.stride(0) if fp8 else 0,
        rope.stride(0),
        eps,
        LATENT=c,
        HALF=r // 2,
        FP8=fp8,
        BLOCK_C=block_c,
        BLOCK_HALF=triton.next_power_of_2(r // 2),
        GROUP=FP8_GROUP,
        FP8_MAX=FP8_MAX,
        num_warps=min(8, max(1, block_c // 256)),
        enable_fp_fusion=False,
    )


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, size, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # F.silu rounds to the dtype, then the product
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up `[m, I]` (rows may be strided) -> silu(gate) * up `[m, I]` in their dtype."""
    m, size = gate.shape
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    out = torch.empty(m, size, dtype=gate.dtype, device=gate.device)
    if m and size:
        block = min(1024, triton.next_power_of_2(size))
        _silu_mul_kernel[(m, triton.cdiv(size, block))](
            gate,
            up,
            out,
            gate.stride(0),
            up.stride(0),
            out.stride(0),
            size,
            BLOCK=block,
            num_warps=4,
        )
    return out
