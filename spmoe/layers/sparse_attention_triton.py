"""Triton kernels for DSA sparse attention over the paged cache (see `sparse_attention` for the math
and the cache layout); each matches its torch reference there.

- `indexer_order_keys`: tiles of (consecutive tokens, a run of cache blocks). Per block it reads the
  block's 64 indexer keys straight from the cache (FP8 or bf16), scores them against the query heads
  of every token of the tile with one `tl.dot` (`[64, d] x [d, tokens * heads]`), relu, weighted sum
  over each token's heads, times the key's scale, and writes the ordering keys (`order_keys`) of its
  64 positions for each token, -inf past the token's position. Blocks past every token of the tile
  are written -inf without a load, or (`fill_past=False`) not at all. A tile whose tokens belong to
  several sequences (other block tables) goes token by token. Decode steps take tiles of one token
  and one block; prefill chunks share each key load among 4 tokens (`INDEXER_PREFILL_TILES`).
  Program (token tile, j) takes the block tiles j, j + P, j + 2P, ... (P by the shape,
  `indexer_programs`): up to the table's end, or without `fill_past` up to its tokens' largest
  position, so tables as wide as max_model_len (CUDA graphs) cost programs by the GPU's size, not by
  the table's width.
- `topk_rows`: the indexer's top-k for a few tokens (decode), bounded by each token's own position,
  not by the block tables' width: one program per token. Up to k visible positions it writes their
  rows at once; past that, a radix select over the visible keys' 8 bytes (a 256-bin histogram per
  byte, from the top) finds the k-th largest key, and one more pass writes the rows of the keys at
  or above it. Keys past the position are never read, so the indexer need not write them
  (`indexer_order_keys(fill_past=False)`).
- `cache_rows`: one program per (token, 1024 columns): logical positions (decoded from the selected
  ordering keys, or every position up to the token's own) looked up in the block tables -> cache
  rows, -1 for none.
- `sparse_mla`: split-K flash decoding. Program (token, head block, split) walks its share of the
  token's selected rows in tiles: gathers the latent rows (dequantising FP8 per 128 values in
  registers) and the rope keys, scores `q_latent . latent + q_rope . rope`, keeps an online softmax,
  and accumulates the weighted latents; a second kernel merges the splits (with one split, as in a
  prefill, the kernel normalises and writes the output itself). The keys `[K, heads, 256]`
  are never formed.
- `head_matmul`: absorbed MLA's per-head projections of a few tokens (`q_nope @ W_UK`, the weighted
  latent @ `W_UV^T`). Program (head, block of output columns) streams its slice of the head's weight
  once, through `tl.dot` against all the tokens (padded to 16), float32 accumulation; enough column
  blocks to give every multiprocessor two programs, so the weights are read at full bandwidth and in
  one pass (no split-K).

Every offset that multiplies a token, sequence, head or cache-row index by a size is int64 (256
tokens x a 32k context of int64 ordering keys, or a cache of millions of rows, pass 2**31 elements).

Shapes depend only on the inputs' shapes and nothing is read back to the host, so all can be
captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from spmoe.layers.paged_rows import PagedLayerCache

NUM_SMS_TARGET = 264  # programs to aim for (2 per H200 multiprocessor)
LOG2_E = 1.4426950408889634  # the kernel's softmax uses exp2: exp(x) = exp2(x * log2(e))
# sparse_mla's tile configs (heads per tile, rows per tile, num_warps, num_stages), the fastest of
# benchmarks/bench_sparse_attention.py at GLM-5.2 widths (64 heads, latent 512, rope 64, 2048 rows)
# on an H200. Decode (--sweep, 1 and 8 tokens at a 32k context): 16 heads per tile, the rows split
# over programs. Prefill (--prefill-sweep, 8192 tokens): all 64 heads of a token in one tile, so
# each gathered row is read once per token, not once per 16 heads: 9.6 ms (244 TFLOP/s) with the
# bf16 cache and 11.7 ms (199 TFLOP/s) with the FP8 cache, against 23.7 ms (99 TFLOP/s, bf16) for
# the decode tiles at 2 stages.
DECODE_TILES = (16, 32, 4, 3)
PREFILL_TILES = (64, 64, 8, 2)
# indexer_order_keys' tile configs (tokens per program, cache blocks per program, num_warps,
# num_stages). Decode: one token per program and block, as many programs as blocks. Prefill (from
# INDEXER_TILE_MIN_TOKENS tokens): TOKENS tokens of a sequence share each key block they load (one
# [BLOCK, d] x [d, TOKENS * heads] dot) and a program walks BLOCKS blocks with its queries held;
# with fewer than INDEXER_MIN_PROGRAMS programs, one block each. Past NUM_SMS_TARGET tiles of blocks
# a program takes several tiles in turn (`indexer_programs`). Measured (--indexer-sweep, 8192 tokens
# at positions 0 .. 8191): 0.80 ms (343 TFLOP/s) with the bf16 cache and 0.60 ms with the FP8 cache,
# 8 tokens per tile the same within 1%, against 3.3 ms and 1.6 ms for the decode tiles.
INDEXER_DECODE_TILES = (1, 1, 4, 1)
INDEXER_PREFILL_TILES = (4, 16, 4, 3)
INDEXER_TILE_MIN_TOKENS = 64
INDEXER_MIN_PROGRAMS = 4 * NUM_SMS_TARGET


@triton.jit
def _order_key(score, position):
    """float32 scores and int positions (same shape) -> int64 ordering keys, as `order_keys`."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with +0.0
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    low = 2147483647 - position.to(tl.int64)  # 2**POSITION_BITS - 1 - position
    return (ordered.to(tl.int64) << 32) | low


@triton.jit
def _index_block(
    q,
    weights,
    position,
    k_ptr,
    ks_ptr,
    table_ptr,
    block,
    HAS_SCALE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Ordering keys `[BLOCK, TOKENS]` of logical block `block` of one sequence (its block table row
    at `table_ptr`) for TOKENS of its tokens: q `[TOKENS * BLOCK_H, DIM]` (row t * BLOCK_H + h:
    token t's head h, zero for padded heads), weights `[TOKENS * BLOCK_H]`, positions `[TOKENS]`.
    Rows past every position are masked loads (they read nothing); each token's positions past its
    own get -inf."""
    offsets = block * BLOCK + tl.arange(0, BLOCK)  # logical positions of this block
    seen = offsets <= tl.max(position)
    physical = tl.load(table_ptr + block).to(tl.int64)
    rows = physical * BLOCK + tl.arange(0, BLOCK)
    # [BLOCK, DIM]
    keys = tl.load(
        k_ptr + rows[:, None] * DIM + tl.arange(0, DIM)[None, :], mask=seen[:, None], other=0.0
    )
    scores = tl.maximum(tl.dot(keys, tl.trans(q)), 0.0)  # [BLOCK, TOKENS * BLOCK_H] float32
    # [BLOCK, TOKENS]
    index = tl.sum(tl.reshape(scores * weights[None, :], (BLOCK, TOKENS, BLOCK_H)), axis=2)
    if HAS_SCALE:
        index *= tl.load(ks_ptr + rows, mask=seen, other=1.0)[:, None]
    index = tl.where(offsets[:, None] <= position[None, :], index, float("-inf"))
    return _order_key(index, tl.broadcast_to(offsets[:, None], (BLOCK, TOKENS)))


@triton.jit
def _index_tokens(
    q,
    weights,
    token,
    position,
    write,
    k_ptr,
    ks_ptr,
    table_ptr,
    out_ptr,
    stride_out,
    first_block,
    end_block,
    HAS_SCALE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FILL_PAST: tl.constexpr,
):
    """Writes the ordering keys of blocks first_block .. end_block - 1 for TOKENS tokens `[TOKENS]`
    of one sequence (those where `write`), as `_index_block`; blocks past every position are -inf
    without a load (FILL_PAST), or not written at all."""
    live_end = tl.minimum(end_block, tl.max(position) // BLOCK + 1)
    for block in range(first_block, live_end):
        keys = _index_block(
            q,
            weights,
            position,
            k_ptr,
            ks_ptr,
            table_ptr,
            block,
            HAS_SCALE=HAS_SCALE,
            DIM=DIM,
            BLOCK=BLOCK,
            TOKENS=TOKENS,
            BLOCK_H=BLOCK_H,
        )
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        tl.store(
            out_ptr + token[None, :] * stride_out + offsets[:, None], keys, mask=write[None, :]
        )
    if FILL_PAST:
        past = tl.full([BLOCK, TOKENS], float("-inf"), tl.float32)
        for block in range(tl.maximum(first_block, live_end), end_block):
            offsets = tl.broadcast_to(
                (block * BLOCK + tl.arange(0, BLOCK))[:, None], (BLOCK, TOKENS)
            )
            tl.store(
                out_ptr + token[None, :] * stride_out + offsets,
                _order_key(past, offsets),
                mask=write[None, :],
            )


@triton.jit
def _index_tiles(
    q,
    weights,
    token,
    position,
    write,
    k_ptr,
    ks_ptr,
    table_ptr,
    out_ptr,
    stride_out,
    first_tile,
    tile_step,
    max_blocks,
    HAS_SCALE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FILL_PAST: tl.constexpr,
):
    """`_index_tokens` over the tiles of BLOCKS blocks first_tile, first_tile + tile_step, ...: up
    to the table's last (FILL_PAST), or to the tile holding the largest of the tokens' positions
    (the loop's bound is read from device memory, so a program past every position runs no iteration
    and nothing goes to the host)."""
    end_tile = tl.cdiv(max_blocks, BLOCKS)
    if not FILL_PAST:
        end_tile = tl.minimum(end_tile, (tl.max(position) // (BLOCK * BLOCKS) + 1).to(tl.int32))
    for tile in range(first_tile, end_tile, tile_step):
        first_block = tile * BLOCKS
        _index_tokens(
            q,
            weights,
            token,
            position,
            write,
            k_ptr,
            ks_ptr,
            table_ptr,
            out_ptr,
            stride_out,
            first_block,
            tl.minimum(first_block + BLOCKS, max_blocks),
            HAS_SCALE=HAS_SCALE,
            DIM=DIM,
            BLOCK=BLOCK,
            TOKENS=TOKENS,
            BLOCK_H=BLOCK_H,
            FILL_PAST=FILL_PAST,
        )


# tile_step unspecialised: its value follows the shape (1, a multiple of 16 or another), and each
# class would be one more compile of the kernel, for no gain in a loop's step
@triton.jit(do_not_specialize=["tile_step"])
def _indexer_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    out_ptr,
    n,
    heads,
    max_blocks,
    tile_step,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_tab,
    stride_out,
    HAS_SCALE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCKS: tl.constexpr,
    FILL_PAST: tl.constexpr,
):
    first_token = tl.program_id(0).to(tl.int64) * TOKENS
    first_tile = tl.program_id(1)  # this program's tiles: first_tile, first_tile + tile_step, ...
    token = first_token + tl.arange(0, TOKENS)
    write = token < n
    # the last tile's padding repeats its last token (computed, not written)
    clamped = tl.minimum(token, n - 1)
    seq = tl.load(seq_ptr + clamped).to(tl.int64)  # seq * table stride, as every row offset: int64
    position = tl.load(pos_ptr + clamped)
    if not FILL_PAST:
        if first_tile * BLOCKS * BLOCK > tl.max(position):
            return  # every tile of this program is past every token's position: no query load
    if tl.min(seq) == tl.max(seq):  # one sequence: one key load per block for the whole tile
        r = tl.arange(0, TOKENS * BLOCK_H)  # row r: token r // BLOCK_H, head r % BLOCK_H
        row_token, row_head = tl.minimum(first_token + r // BLOCK_H, n - 1), r % BLOCK_H
        q = tl.load(
            q_ptr
            + row_token[:, None] * stride_qn
            + row_head[:, None] * stride_qh
            + tl.arange(0, DIM)[None, :],
            mask=(row_head < heads)[:, None],
            other=0.0,
        )
        weights = tl.load(
            w_ptr + row_token * stride_wn + row_head, mask=row_head < heads, other=0.0
        )
        _index_tiles(
            q,
            weights,
            token,
            position,
            write,
            k_ptr,
            ks_ptr,
            tables_ptr + tl.min(seq) * stride_tab,
            out_ptr,
            stride_out,
            first_tile,
            tile_step,
            max_blocks,
            HAS_SCALE=HAS_SCALE,
            DIM=DIM,
            BLOCK=BLOCK,
            TOKENS=TOKENS,
            BLOCKS=BLOCKS,
            BLOCK_H=BLOCK_H,
            FILL_PAST=FILL_PAST,
        )
    else:  # the tile straddles sequences: token by token
        h = tl.arange(0, BLOCK_H)
        for t in range(TOKENS):
            one = tl.minimum(first_token + t, n - 1) + tl.arange(0, 1)  # [1]
            # [BLOCK_H, DIM]
            q = tl.load(
                q_ptr
                + one[:, None] * stride_qn
                + h[:, None] * stride_qh
                + tl.arange(0, DIM)[None, :],
                mask=(h < heads)[:, None],
                other=0.0,
            )
            weights = tl.load(w_ptr + one * stride_wn + h, mask=h < heads, other=0.0)
            _index_tiles(
                q,
                weights,
                one,
                tl.load(pos_ptr + one),
                first_token + t + tl.arange(0, 1) < n,
                k_ptr,
                ks_ptr,
                tables_ptr + tl.max(tl.load(seq_ptr + one)).to(tl.int64) * stride_tab,
                out_ptr,
                stride_out,
                first_tile,
                tile_step,
                max_blocks,
                HAS_SCALE=HAS_SCALE,
                DIM=DIM,
                BLOCK=BLOCK,
                TOKENS=1,
                BLOCKS=BLOCKS,
                BLOCK_H=BLOCK_H,
                FILL_PAST=FILL_PAST,
            )


def indexer_tiles(n: int, max_blocks: int) -> tuple[int, int, int, int]:
    """The indexer's tiles for n tokens over tables of max_blocks blocks: `INDEXER_DECODE_TILES`
    below `INDEXER_TILE_MIN_TOKENS` tokens, else `INDEXER_PREFILL_TILES` (with one block per tile
    while that leaves fewer than `INDEXER_MIN_PROGRAMS` tiles)."""
    tiles = INDEXER_DECODE_TILES if n < INDEXER_TILE_MIN_TOKENS else INDEXER_PREFILL_TILES
    tokens, blocks = tiles[:2]
    if triton.cdiv(n, tokens) * triton.cdiv(max_blocks, blocks) < INDEXER_MIN_PROGRAMS:
        return (tokens, 1, *tiles[2:])
    return tiles


def indexer_programs(token_tiles: int, block_tiles: int) -> int:
    """The indexer's programs per tile of tokens (the grid's second dimension) for `token_tiles`
    tiles of tokens over tables of `block_tiles` tiles of blocks: at least `NUM_SMS_TARGET`, so that
    one sequence much longer than the others of its step still spreads its keys over every
    multiprocessor (at 128k positions each of its programs takes 8 decode tiles), and at least
    `INDEXER_MIN_PROGRAMS` in all; never more than the tiles there are (so up to NUM_SMS_TARGET
    tiles, one program per tile, the loop taken once).

    A function of the shapes alone, never of the positions: the tiles a step needs follow its
    positions, which live on the device; reading them would stall the host at every layer and could
    not be captured, and a CUDA graph replays the grid of its capture at every context (the engine's
    graphs take tables as wide as max_model_len). Each program instead walks its tiles up to its
    tokens' largest position, a bound it loads itself, and the programs past every position return
    at once. 32 decode tokens take 8,448 programs at any width, where a program per tile of the
    table took 65,536 at 128k positions and 762,592 at 1.5 M."""
    return min(block_tiles, max(NUM_SMS_TARGET, triton.cdiv(INDEXER_MIN_PROGRAMS, token_tiles)))


def indexer_order_keys(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: PagedLayerCache,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    tiles: tuple[int, int, int, int] | None = None,
    fill_past: bool = True,
    programs: int | None = None,
) -> torch.Tensor:
    """As `indexer_order_keys_torch`: q `[N, h, d]`, weights `[N, h]` float32 -> keys
    `[N, max_blocks * B]` (not `fill_past`: the keys past each token's position are left unwritten,
    for `topk_rows`). tiles: (tokens per tile, cache blocks per tile, num_warps, num_stages), by
    default `indexer_tiles`. programs: programs per tile of tokens, each taking every programs-th
    tile of blocks; by default `indexer_programs` of the shape."""
    n, heads, dim = q.shape
    max_blocks = block_tables.shape[1]
    out = torch.empty(n, max_blocks * block_size, dtype=torch.int64, device=q.device)
    if n == 0:
        return out
    if q.stride(2) != 1 or cache.index_key.stride(0) != dim:
        raise ValueError(
            f"the indexer kernel needs unit-stride rows: q strides {q.stride()}, cache rows "
            f"{cache.index_key.stride()} for dim {dim}"
        )
    tokens, blocks, num_warps, num_stages = tiles or indexer_tiles(n, max_blocks)
    token_tiles, block_tiles = triton.cdiv(n, tokens), triton.cdiv(max_blocks, blocks)
    if programs is None:
        programs = indexer_programs(token_tiles, block_tiles)
    elif not 0 < programs <= block_tiles:
        raise ValueError(
            f"indexer programs per token tile must be in [1, {block_tiles}], got {programs}"
        )
    has_scale = cache.index_scale is not None
    _indexer_kernel[(token_tiles, programs)](
        q,
        weights,
        cache.index_key,
        cache.index_scale if has_scale else weights,
        block_tables,
        seq_index,
        positions,
        out,
        n,
        heads,
        max_blocks,
        programs,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        block_tables.stride(0),
        out.stride(0),
        HAS_SCALE=has_scale,
        DIM=dim,
        BLOCK=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        TOKENS=tokens,
        BLOCKS=blocks,
        FILL_PAST=fill_past,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# topk_rows runs one program per token: it takes decode steps up to the largest graph's rows, 256
# sequences of 1 + 7 tokens (speculation's drafts are rows too)
TOPK_ROWS_MAX_TOKENS = 2048
TOPK_TILE = 1024  # keys per load in topk_rows


@triton.jit
def _topk_rows_kernel(
    keys_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    out_ptr,
    stride_keys,
    stride_tab,
    stride_out,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    visible = (tl.load(pos_ptr + token) + 1).to(tl.int32)  # positions < 2**31 (POSITION_BITS)
    table = tables_ptr + tl.load(seq_ptr + token) * stride_tab
    keys_row = keys_ptr + token * stride_keys
    out_row = out_ptr + token * stride_out
    lane = tl.arange(0, TILE)
    if visible <= K:  # every visible position, then -1
        for first in range(0, K, TILE):
            column = first + lane
            seen = column < visible
            block = tl.load(table + column // BLOCK_SIZE, mask=seen, other=0).to(tl.int64)
            rows = tl.where(seen, block * BLOCK_SIZE + column % BLOCK_SIZE, -1)
            tl.store(out_row + column, rows, mask=column < K)
    else:
        # Radix select of the K-th largest key among the visible ones, a byte at a time from the
        # top. Bins 1 .. 256 count the keys that match the bytes chosen so far, by their next byte
        # (the top byte with its sign bit flipped, so that bins follow the signed order); bin 0
        # takes the rest.
        bins = tl.arange(0, 512)
        threshold = tl.zeros([1], tl.int64)  # the chosen bytes, the others 0
        wanted = tl.full([1], K, tl.int32)  # how many keys of the matching ones still to take
        for byte in tl.static_range(8):
            shift = 56 - 8 * byte
            counts = tl.zeros([512], tl.int32)
            for first in range(0, visible, TILE):
                column = first + lane
                key = tl.load(keys_row + column, mask=column < visible, other=0)
                digit = (key >> shift) & 255
                if byte == 0:
                    digit = digit ^ 128
                    match = column < visible
                else:
                    match = (column < visible) & (
                        (key >> (shift + 8)) == (threshold >> (shift + 8))
                    )
                counts += tl.histogram(tl.where(match, digit + 1, 0).to(tl.int32), 512)
            at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # keys in bins >= b
            chosen = tl.max(tl.where((at_or_above >= wanted) & (bins > 0), bins, 0))
            wanted -= tl.sum(tl.where(bins > chosen, counts, 0))
            value = chosen - 1
            if byte == 0:
                value = value ^ 128
            threshold = threshold | (value.to(tl.int64) << shift)
        # the K keys at or above the threshold (keys are distinct: each holds its position), rows of
        # finite scores
        none = _order_key(tl.full([TILE], float("-inf"), tl.float32), tl.zeros([TILE], tl.int64))
        written = tl.zeros([1], tl.int32)
        for first in range(0, visible, TILE):
            column = first + lane
            key = tl.load(keys_row + column, mask=column < visible, other=0)
            take = (column < visible) & (key >= threshold)
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            block = tl.load(table + column // BLOCK_SIZE, mask=take, other=0).to(tl.int64)
            rows = tl.where(key > none, block * BLOCK_SIZE + column % BLOCK_SIZE, -1)
            tl.store(out_row + slot, rows, mask=take)
            written += tl.sum(take.to(tl.int32))


def topk_rows(
    keys: torch.Tensor,
    topk: int,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """As `rows_of_best(keys, topk, ...)` for keys `[N, L]` (L > topk) of which only those up to
    each token's position are read -> cache rows `[N, topk]` int64 in no particular order, -1 past
    the visible positions (and for keys of -inf scores). Work per token grows with its
    position, not with L."""
    n, width = keys.shape
    if width <= topk or keys.stride(1) != 1:
        raise ValueError(
            f"topk_rows needs unit-stride keys wider than topk {topk}, got {tuple(keys.shape)}"
        )
    out = torch.empty(n, topk, dtype=torch.int64, device=keys.device)
    if n == 0:
        return out
    _topk_rows_kernel[(n,)](
        keys,
        block_tables,
        seq_index,
        positions,
        out,
        keys.stride(0),
        block_tables.stride(0),
        out.stride(0),
        K=topk,
        BLOCK_SIZE=block_size,
        TILE=TOPK_TILE,
        num_warps=4,
    )
    return out


@triton.jit
def _cache_rows_kernel(
    best_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    out_ptr,
    width,
    stride_best,
    stride_tab,
    stride_out,
    FROM_KEYS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = column < width
    if FROM_KEYS:
        key = tl.load(best_ptr + token * stride_best + column, mask=inside, other=0)
        position = 2147483647 - (key & 2147483647)  # as _order_key wrote it
        # a key above the largest one a -inf score makes (at position 0) has a finite score
        valid = key > _order_key(
            tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.int64)
        )
    else:
        position = column.to(tl.int64)
        valid = position <= tl.load(pos_ptr + token)
    seq = tl.load(seq_ptr + token).to(tl.int64)
    block = tl.load(
        tables_ptr + seq * stride_tab + position // BLOCK_SIZE, mask=inside & valid, other=0
    )
    rows = block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE
    tl.store(out_ptr + token * stride_out + column, tl.where(valid, rows, -1), mask=inside)


def cache_rows(
    best: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """As `cache_rows_torch`, in one launch: best `[N, k]` int64 ordering keys (or None: every
    position) -> cache rows `[N, k]` (`[N, max_blocks * B]`) int64."""
    n = seq_index.shape[0]
    width = block_tables.shape[1] * block_size if best is None else best.shape[1]
    out = torch.empty(n, width, dtype=torch.int64, device=seq_index.device)
    if n == 0 or width == 0:
        return out
    if best is not None and best.stride(1) != 1:
        raise ValueError(f"cache_rows needs unit-stride ordering keys, got strides {best.stride()}")
    keys = out if best is None else best  # not read without keys
    block = min(1024, triton.next_power_of_2(width))
    _cache_rows_kernel[(n, triton.cdiv(width, block))](
        keys,
        block_tables,
        seq_index,
        seq_index if positions is None else positions,
        out,
        width,
        keys.stride(0),
        block_tables.stride(0),
        out.stride(0),
        FROM_KEYS=best is not None,
        BLOCK_SIZE=block_size,
        BLOCK=block,
        num_warps=4,
    )
    return out


@triton.jit
def _sparse_mla_kernel(
    ql_ptr,
    qr_ptr,
    lat_ptr,
    lat_scale_ptr,
    rope_ptr,
    rows_ptr,
    acc_ptr,
    stats_ptr,
    out_ptr,
    heads,
    topk,
    scale_log2,
    stride_qln,
    stride_qlh,
    stride_qrn,
    stride_qrh,
    stride_rows,
    stride_on,
    stride_oh,
    FP8: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    ROWS_PER_SPLIT: tl.constexpr,
):
    token, head_block, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    c, r = tl.arange(0, LATENT), tl.arange(0, ROPE)
    # [BLOCK_H, LATENT]
    q_lat = tl.load(
        ql_ptr + token * stride_qln + h[:, None] * stride_qlh + c[None, :],
        mask=h[:, None] < heads,
        other=0.0,
    )
    # [BLOCK_H, ROPE]
    q_rope = tl.load(
        qr_ptr + token * stride_qrn + h[:, None] * stride_qrh + r[None, :],
        mask=h[:, None] < heads,
        other=0.0,
    )
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    first = split * ROWS_PER_SPLIT
    for offset in range(0, ROWS_PER_SPLIT, BLOCK_K):
        k = first + offset + tl.arange(0, BLOCK_K)
        row = tl.load(rows_ptr + token * stride_rows + k, mask=k < topk, other=-1)
        valid = row >= 0
        row = tl.where(valid, row, 0).to(tl.int64)
        latent = tl.load(
            lat_ptr + row[:, None] * LATENT + c[None, :], mask=valid[:, None], other=0.0
        )
        if FP8:  # one scale per GROUP values: scale the [BLOCK_K, groups, GROUP] view
            g = tl.arange(0, LATENT // GROUP)
            # [BLOCK_K, groups]
            group_scale = tl.load(
                lat_scale_ptr + row[:, None] * (LATENT // GROUP) + g[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            latent = (
                tl.reshape(latent.to(tl.float32), (BLOCK_K, LATENT // GROUP, GROUP))
                * group_scale[:, :, None]
            )
            latent = tl.reshape(latent, (BLOCK_K, LATENT)).to(q_lat.dtype)
        rope = tl.load(rope_ptr + row[:, None] * ROPE + r[None, :], mask=valid[:, None], other=0.0)
        # [BLOCK_H, BLOCK_K]
        scores = tl.dot(q_lat, tl.trans(latent)) + tl.dot(q_rope, tl.trans(rope))
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # no row yet: keep exp2 finite
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(best - shift)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
        best = new_best
    if SPLITS == 1:  # nothing to merge: normalise here (no row at all: zeros, as the merge gives)
        out = acc / tl.maximum(total, 1.1754943508222875e-38)[:, None]
        tl.store(
            out_ptr + token * stride_on + h[:, None] * stride_oh + c[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h[:, None] < heads,
        )
    else:
        base = (token * heads + h) * SPLITS + split  # [BLOCK_H]
        tl.store(acc_ptr + base[:, None] * LATENT + c[None, :], acc, mask=h[:, None] < heads)
        tl.store(stats_ptr + base * 2, best, mask=h < heads)
        tl.store(stats_ptr + base * 2 + 1, total, mask=h < heads)


@triton.jit
def _merge_splits_kernel(
    acc_ptr,
    stats_ptr,
    out_ptr,
    stride_on,
    stride_oh,
    heads,
    LATENT: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s, c = tl.arange(0, SPLITS_P2), tl.arange(0, LATENT)
    base = (token * heads + head) * SPLITS + s
    best = tl.load(stats_ptr + base * 2, mask=s < SPLITS, other=float("-inf"))
    total = tl.load(stats_ptr + base * 2 + 1, mask=s < SPLITS, other=0.0)
    top = tl.max(best, axis=0)
    weight = tl.where(
        best == float("-inf"), 0.0, tl.exp2(best - tl.where(top == float("-inf"), 0.0, top))
    )
    acc = tl.load(
        acc_ptr + base[:, None] * LATENT + c[None, :], mask=(s < SPLITS)[:, None], other=0.0
    )
    # no row at all: zeros
    denominator = tl.maximum(tl.sum(weight * total, axis=0), 1.1754943508222875e-38)
    out = tl.sum(acc * weight[:, None], axis=0) / denominator
    tl.store(out_ptr + token * stride_on + head * stride_oh + c, out.to(out_ptr.dtype.element_ty))


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: PagedLayerCache,
    rows: torch.Tensor,
    scale: float,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """As `sparse_mla_torch`: q_latent `[N, h, c]`, q_rope `[N, h, r]` (bf16 / fp16),
    rows `[N, k]` int64
    -> `[N, h, c]` in q's dtype. tiles: (heads per tile, rows per tile, num_warps, num_stages), by
    default chosen by the shape: `DECODE_TILES` while the decode tiles leave programs to fill with
    splits of the rows (N * ceil(h / 16) < NUM_SMS_TARGET), else `PREFILL_TILES`; see those for the
    measured numbers."""
    n, heads, latent_dim = q_latent.shape
    rope_dim, topk = q_rope.shape[2], rows.shape[1]
    if tiles is None:
        tiles = (
            DECODE_TILES
            if n * triton.cdiv(heads, DECODE_TILES[0]) < NUM_SMS_TARGET
            else PREFILL_TILES
        )
    block_h, block_k, num_warps, num_stages = tiles
    out = torch.empty(n, heads, latent_dim, dtype=q_latent.dtype, device=q_latent.device)
    if n == 0:
        return out
    if q_latent.stride(2) != 1 or q_rope.stride(2) != 1 or rows.stride(1) != 1:
        raise ValueError(
            f"the sparse MLA kernel needs unit-stride last dims: q_latent {q_latent.stride()}, "
            f"q_rope {q_rope.stride()}, rows {rows.stride()}"
        )
    head_blocks = triton.cdiv(heads, block_h)
    tiles = triton.cdiv(max(topk, 1), block_k)
    splits = max(1, min(tiles, triton.cdiv(NUM_SMS_TARGET, n * head_blocks)))
    rows_per_split = triton.cdiv(tiles, splits) * block_k
    splits = triton.cdiv(max(topk, 1), rows_per_split)
    # one split (a prefill: tokens enough to fill the GPU) writes the output itself; more go through
    # the merge
    acc = (
        torch.empty(n, heads, splits, latent_dim, dtype=torch.float32, device=q_latent.device)
        if splits > 1
        else out
    )
    stats = (
        torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q_latent.device)
        if splits > 1
        else out
    )
    fp8 = cache.latent_scale is not None
    _sparse_mla_kernel[(n, head_blocks, splits)](
        q_latent,
        q_rope,
        cache.latent,
        cache.latent_scale if fp8 else cache.rope,
        cache.rope,
        rows,
        acc,
        stats,
        out,
        heads,
        topk,
        scale * LOG2_E,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        rows.stride(0),
        out.stride(0),
        out.stride(1),
        FP8=fp8,
        LATENT=latent_dim,
        ROPE=rope_dim,
        GROUP=latent_dim // cache.latent_scale.shape[1] if fp8 else 1,
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        SPLITS=splits,
        ROWS_PER_SPLIT=rows_per_split,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(n, heads)](
            acc,
            stats,
            out,
            out.stride(0),
            out.stride(1),
            heads,
            LATENT=latent_dim,
            SPLITS=splits,
            SPLITS_P2=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out


# head_matmul's tile of tokens: the rows of one tl.dot, and the most tokens it takes
HEAD_MATMUL_TOKENS = 16


@triton.jit
def _head_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_tok,
    depth,
    width,
    stride_xn,
    stride_xh,
    stride_wh,
    stride_wk,
    stride_wm,
    stride_on,
    stride_oh,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    head, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.arange(0, BLOCK_N)
    x_rows = x_ptr + head * stride_xh + tokens[:, None] * stride_xn  # [BLOCK_N, 1]
    w_cols = w_ptr + head * stride_wh + cols[None, :] * stride_wm  # [1, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for first in range(0, depth, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_rows + k[None, :], mask=(tokens[:, None] < n_tok) & (k[None, :] < depth), other=0.0
        )
        w = tl.load(
            w_cols + k[:, None] * stride_wk,
            mask=(k[:, None] < depth) & (cols[None, :] < width),
            other=0.0,
        )
        acc = tl.dot(x, w, acc)
    tl.store(
        out_ptr + tokens[:, None] * stride_on + head * stride_oh + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(tokens[:, None] < n_tok) & (cols[None, :] < width),
    )


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """As `head_matmul_torch`: x `[N, h, k]` (N <= `HEAD_MATMUL_TOKENS`, unit-stride last dim), w
    `[h, k, m]` (any strides: a view of kv_b_proj's weight, transposed or not), both bf16 / fp16 ->
    `[N, h, m]` contiguous in x's dtype. Column blocks of 64, 32 or 16: the widest that still makes
    `NUM_SMS_TARGET` programs."""
    n, heads, depth = x.shape
    width = w.shape[2]
    if (
        n > HEAD_MATMUL_TOKENS
        or x.stride(2) != 1
        or w.shape[:2] != (heads, depth)
        or w.dtype != x.dtype
    ):
        raise ValueError(
            f"head_matmul needs x [N <= {HEAD_MATMUL_TOKENS}, h, k] with a unit-stride last dim "
            f"and w [h, k, m] of its dtype; got x {tuple(x.shape)} strides {x.stride()} {x.dtype}, "
            f"w {tuple(w.shape)} {w.dtype}"
        )
    out = torch.empty(n, heads, width, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_m = next((b for b in (64, 32) if heads * triton.cdiv(width, b) >= NUM_SMS_TARGET), 16)
    block_k = 128 if w.stride(1) == 1 else 64  # 256 or 128 contiguous bytes per weight row
    _head_matmul_kernel[(heads, triton.cdiv(width, block_m))](
        x,
        w,
        out,
        n,
        depth,
        width,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_N=HEAD_MATMUL_TOKENS,
        BLOCK_K=block_k,
        BLOCK_M=block_m,
        num_warps=4,
        num_stages=3,
    )
    return out
