"""DSA sparse attention over a paged MLA cache: the indexer's top-k and absorbed MLA over
the selected rows.

The cache is paged: rows `[R, w]` grouped in blocks of `block_size` rows; a sequence's logical
position p lives in row `block_tables[s, p // block_size] * block_size + p % block_size`. Per row
one attention layer keeps (`PagedLayerCache`) the normed latent `[c]` and the rotated rope key
`[r]`, and on indexer layers the indexer key `[d]`. In FP8 the latent is e4m3 with one float32 scale
per 128 values, the indexer key e4m3 with one scale per key, Hadamard-rotated (`hadamard_rotate`) as
the FP8 queries are; the rope key stays in the model dtype.

A step has N new tokens of S sequences; token i belongs to sequence `seq_index[i]`, sits at
`positions[i]`, and (its own row already written) attends that sequence's positions
`<= positions[i]`.

- `indexer_topk`: per token, `index[p] = k_scale[p] * sum_h weights[h] * relu(q[h] . k[p])` over its
  visible positions; the `topk` best, ties to the earliest position -> cache rows `[N, k]`, -1 where
  fewer exist. The rows come in no particular order: attention sums over them and an IndexShare
  layer reuses them as a set.
- `visible_rows`: every position a token sees -> cache rows; the selection itself when the block
  tables span at most `topk` positions, whatever the scores.
- `sparse_mla`: absorbed MLA. The query is already in latent space (`q_nope @ W_UK`); scores
  `scale * (q_latent . latent[row] + q_rope . rope[row])` over the selected rows only; softmax; the
  weighted sum of the latents `[N, h, c]` (the caller applies `W_UV`). Keys `[K, heads, qk_head]`
  are never formed.
- `head_matmul`: the per-head projections around it, `[N, h, k] x [h, k, m] -> [N, h, m]`
  (`q_nope @ W_UK`, the weighted latent @ `W_UV^T`): a batched GEMM; for a decode step's few tokens,
  with the fused kernels on, a Triton kernel that reads each head's weight once at full bandwidth.

The dispatchers run the torch versions over chunks of queries (`query_chunks`,
`TORCH_CHUNK_ELEMENTS`), so a CPU forward's working memory does not grow with its number of tokens
beyond that budget.

Each has a torch version (the reference; CPU and any device) and a Triton version on CUDA
(`sparse_attention_triton`, imported only when used), with the same signature; so has `cache_rows`,
the lookup of logical positions in the block tables behind `rows_of_best` and `visible_rows`.
"""

import torch

from spmoe.layers.fused import TRITON_INSTALLED, use_fused
from spmoe.layers.paged_rows import PagedLayerCache
from spmoe.layers.quantization.fp8 import dequantize

# positions are below 2**31; the low half of an ordering key holds 2**31 - 1 - position
POSITION_BITS = 31
# The torch paths (CPU, and any device without the Triton kernels) score at most this many values
# per step: they go over the queries in chunks sized so that a chunk's largest intermediates
# (scores, gathered keys) hold about this many elements (256 MiB of float32), whatever the number of
# tokens in the batch. Every query's result is computed on its own, so chunking changes no value.
TORCH_CHUNK_ELEMENTS = 1 << 26


# The Triton indexer of a prompt chunk (more tokens than `topk_rows` takes) writes every token's
# ordering key for every position of its table, int64, then takes their top-k: it goes over the
# queries in chunks of at most this many keys (512 MiB), as a chunk of 8,192 tokens at 128k
# positions would otherwise hold 8 GiB of keys.
TRITON_CHUNK_KEYS = 1 << 26


def query_chunks(n: int, per_query: int, budget: int | None = None):
    """Slices of `range(n)` (one empty slice when n is 0) holding at most `budget // per_query`
    queries each (at least one; budget None: `TORCH_CHUNK_ELEMENTS`): per_query is the elements one
    query's intermediates take."""
    size = max(1, (budget or TORCH_CHUNK_ELEMENTS) // max(1, per_query))
    return [slice(i, i + size) for i in range(0, n, size)] or [slice(0, 0)]


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Cache rows `[R, w]` at `index` `[...]` -> `[..., w]` (FP8 rows are gathered as bytes, as CPU
    torch cannot index FP8 tensors)."""
    if rows.dtype == torch.float8_e4m3fn:
        return rows.view(torch.uint8)[index].view(rows.dtype)
    return rows[index]


def use_triton(t: torch.Tensor, *dims: int) -> bool:
    """Whether the Triton kernels take `t` (on CUDA, 16-bit or FP8) with these widths (powers of 2,
    >= 16; an FP8 dot product needs >= 32)."""
    least = 32 if t.dtype == torch.float8_e4m3fn else 16
    return (
        t.is_cuda
        and t.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        and all(d >= least and d & (d - 1) == 0 for d in dims)
        and TRITON_INSTALLED
    )


# -- indexer -------------------------------------------------------------------------------------


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: PagedLayerCache,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    block_size: int,
) -> torch.Tensor:
    """q `[N, h, d]` (FP8 e4m3 when the cache is, else its dtype), weights `[N, h]` (float32 or q's
    16-bit dtype; unit stride over heads; every scale that differs between heads folded in, a
    positive factor common to all heads may be left out: it ranks the positions alike, up to
    rounding) -> selected cache rows `[N, min(topk, L)]` int64 (`rows_of_best`, in no particular
    order), -1 past the visible positions; L = max_blocks * block_size. On CUDA, for up to
    `TOPK_ROWS_MAX_TOKENS` tokens, the same rows from `topk_rows`, whose work follows each token's
    position, not L."""
    if use_triton(q, q.shape[2], block_size):
        from spmoe.layers.sparse_attention_triton import (
            TOPK_ROWS_MAX_TOKENS,
            indexer_order_keys,
            topk_rows,
        )

        width = block_tables.shape[1] * block_size
        # a decode step (tables maybe padded far past its tokens for a CUDA graph): a top-k bounded
        # by each token's position, and no keys written past it; else a prompt chunk's top-k
        bounded = q.shape[0] <= TOPK_ROWS_MAX_TOKENS and width > topk

        # in query chunks of at most TRITON_CHUNK_KEYS keys
        def chunk_rows(c: slice) -> torch.Tensor:
            step = (seq_index[c], positions[c], block_size)
            keys = indexer_order_keys(
                q[c], weights[c], cache, block_tables, *step, fill_past=not bounded
            )
            if bounded:
                return topk_rows(keys, topk, block_tables, *step)
            return rows_of_best(keys, topk, block_tables, seq_index[c], block_size)

        rows = [chunk_rows(c) for c in query_chunks(len(q), width, TRITON_CHUNK_KEYS)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)
    # in query chunks: the keys `[N, L]` and the scores `[N, h, L]` of the whole batch never exist
    # at once
    n, heads, dim = q.shape
    # gathered keys, scores, rows and keys
    per_query = block_tables.shape[1] * block_size * (dim + heads + 8)
    return torch.cat(
        [
            rows_of_best(
                indexer_order_keys_torch(
                    q[c], weights[c], cache, block_tables, seq_index[c], positions[c], block_size
                ),
                topk,
                block_tables,
                seq_index[c],
                block_size,
            )
            for c in query_chunks(n, per_query)
        ]
    )


def indexer_order_keys_torch(
    q, weights, cache: PagedLayerCache, block_tables, seq_index, positions, block_size: int
) -> torch.Tensor:
    """The reference indexer: -> ordering keys `[N, L]` int64 (`order_keys`) of every
    logical position."""
    rows = logical_rows(block_tables, block_size)[seq_index]  # [N, L]
    keys = gather_rows(cache.index_key, rows).float()  # [N, L, d]
    scores = torch.relu(torch.einsum("nhd,nld->nhl", q.float(), keys))
    index = torch.einsum("nh,nhl->nl", weights.float(), scores)
    if cache.index_scale is not None:
        index = index * cache.index_scale[rows].squeeze(-1)
    visible = torch.arange(rows.shape[1], device=q.device) <= positions[:, None]
    return order_keys(index.masked_fill(~visible, float("-inf")))


def logical_rows(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[S, max_blocks]` -> the cache row of every logical position `[S, max_blocks *
    block_size]` int64."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables.long()[:, :, None] * block_size + offsets).flatten(1)


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores `[N, L]` -> int64 keys `[N, L]`, ordered as (score, then the
    earlier position) are.

    The score's bits map to an int32 with the same order (negative floats: flip every bit but the
    sign; -0.0 first becomes +0.0 so that it ties with it), shifted to the high half; the low half
    is `2**31 - 1 - position`. torch.topk of the keys is then an exact top-k with ties to the
    earliest position, with no stable sort.
    """
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    positions = torch.arange(scores.shape[-1], device=scores.device)
    return (ordered << 32) | ((1 << POSITION_BITS) - 1 - positions)


# the largest key a score of -inf can have (at position 0): every finite score's key is larger
_NEG_INF_KEY_MAX = int(order_keys(torch.tensor([[float("-inf")]]))[0, 0])


def rows_of_best(
    keys: torch.Tensor,
    topk: int,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Ordering keys `[N, L]` -> cache rows `[N, min(topk, L)]` of the best positions in no
    particular order (the top-k is not sorted), -1 where the score was -inf (not visible). When L <=
    topk every position is kept, in position order (no top-k)."""
    best = keys if keys.shape[-1] <= topk else keys.topk(topk, dim=-1, sorted=False).values
    return cache_rows(best, block_tables, seq_index, None, block_size)


def visible_rows(
    block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The cache rows of every position `[N, max_blocks * block_size]` int64, -1 past each token's
    own position: what `rows_of_best` picks when the block tables span at most `topk` positions,
    with no scores at all."""
    return cache_rows(None, block_tables, seq_index, positions, block_size)


def cache_rows(
    best: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """Logical positions -> cache rows int64, -1 for none: of the ordering keys best `[N, k]` (-1
    where the score is -inf) -> `[N, k]`; best None: of every position, -1 past `positions` `[N]`
    -> `[N, L]`."""
    if block_tables.is_cuda and TRITON_INSTALLED:
        from spmoe.layers.sparse_attention_triton import cache_rows as triton_cache_rows

        return triton_cache_rows(best, block_tables, seq_index, positions, block_size)
    return cache_rows_torch(best, block_tables, seq_index, positions, block_size)


def cache_rows_torch(best, block_tables, seq_index, positions, block_size: int) -> torch.Tensor:
    """The reference `cache_rows`."""
    if best is None:
        rows = logical_rows(block_tables, block_size)[seq_index]  # [N, L]
        return torch.where(
            torch.arange(rows.shape[1], device=rows.device) <= positions[:, None], rows, -1
        )
    position = (1 << POSITION_BITS) - 1 - (best & ((1 << POSITION_BITS) - 1))
    blocks = block_tables.long()[seq_index].gather(1, position // block_size)
    return torch.where(best > _NEG_INF_KEY_MAX, blocks * block_size + position % block_size, -1)


# -- absorbed MLA --------------------------------------------------------------------------------


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: PagedLayerCache,
    rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_latent `[N, h, c]`, q_rope `[N, h, r]`, rows `[N, k]` (cache rows, -1 = none) -> the
    softmax-weighted sum of the selected latents `[N, h, c]` in q's dtype (zero for a token
    with no row)."""
    if use_triton(q_latent, q_latent.shape[2], q_rope.shape[2]):
        from spmoe.layers.sparse_attention_triton import sparse_mla as triton_sparse_mla

        return triton_sparse_mla(q_latent, q_rope, cache, rows, scale)
    (n, heads, latent_dim), k = q_latent.shape, rows.shape[1]
    # gathered latents and rope keys, scores, weights
    per_query = k * (latent_dim + q_rope.shape[2] + 2 * heads)
    chunks = query_chunks(n, per_query)
    if len(chunks) == 1:
        return sparse_mla_torch(q_latent, q_rope, cache, rows, scale)
    return torch.cat(
        [sparse_mla_torch(q_latent[c], q_rope[c], cache, rows[c], scale) for c in chunks]
    )


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[N, h, k]`, w `[h, k, m]` (views of a weight) -> `[N, h, m]`: x[:, i] @ w[i] for every
    head i, in x's dtype. Up to `HEAD_MATMUL_TOKENS` 16-bit tokens on CUDA with the fused kernels
    on: the Triton kernel."""
    if use_fused(x) and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype:
        from spmoe.layers.sparse_attention_triton import HEAD_MATMUL_TOKENS
        from spmoe.layers.sparse_attention_triton import head_matmul as triton_head_matmul

        if x.shape[0] <= HEAD_MATMUL_TOKENS and x.stride(2) == 1:
            return triton_head_matmul(x, w)
    return head_matmul_torch(x, w)


def head_matmul_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference `head_matmul`: one batched GEMM over the heads."""
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def sparse_mla_torch(q_latent, q_rope, cache: PagedLayerCache, rows, scale: float) -> torch.Tensor:
    """The reference `sparse_mla`, in float32."""
    safe = rows.clamp(min=0)
    group_scale = None if cache.latent_scale is None else cache.latent_scale[safe]
    latent = dequantize(gather_rows(cache.latent, safe), group_scale)  # [N, k, c]
    rope = cache.rope[safe].float()  # [N, k, r]
    scores = (
        torch.einsum("nhc,nkc->nhk", q_latent.float(), latent)
        + torch.einsum("nhr,nkr->nhk", q_rope.float(), rope)
    ) * scale
    scores = scores.masked_fill((rows < 0)[:, None, :], float("-inf"))
    # finite if all are -inf
    top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - top)  # [N, h, k], 0 where no row
    total = weights.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return (torch.einsum("nhk,nkc->nhc", weights, latent) / total).to(q_latent.dtype)
