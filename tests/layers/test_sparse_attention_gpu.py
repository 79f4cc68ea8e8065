"""The Triton sparse-attention kernels against their torch references at GLM-5.2 widths (64 heads, latent 512,
rope 64, indexer 32 x 128, index_topk 2048) in bfloat16 with a bf16 and an FP8 cache, on one CUDA GPU: decode
tokens and a prefill chunk over contexts below and above index_topk; a CUDA graph replay equal to the eager
call; the indexer's multi-token tiles over prefill chunks and tiles straddling sequences; the cache-row lookup
and the unsorted top-k behind the selection; the whole paged MLAttention against the dense path where DSA is dense
(contexts <= index_topk), and above index_topk with the fused kernels against their torch references; absorbed
MLA's per-head projections of a few tokens (`head_matmul`) against the batched GEMM, at 64 heads and TP shares of
them. `check_head_matmul` takes the device and dtype, so it also runs on CPU under the Triton interpreter
(float16: the interpreter's bf16 dot is not the GPU's). The indexer's grid over tables much wider than the
positions (programs walking several tiles of blocks), exact against the reference, on CUDA and on the CPU
under the interpreter (`kernel_devices`)."""

import pytest
import torch

from spmoe.config import ModelConfig
from spmoe.layers import fused
from spmoe.layers.paged_rows import (
    PagedLayerCache,
    quantize_index_vectors,
    write_index_key,
    write_latent,
)
from spmoe.layers.sparse_attention import (
    cache_rows_torch,
    head_matmul,
    head_matmul_torch,
    indexer_order_keys_torch,
    indexer_topk,
    rows_of_best,
    sparse_mla,
    sparse_mla_torch,
    visible_rows,
)

from ..multigpu import kernel_devices, requires_gpus

TOPK, BLOCK = 2048, 64
DEVICES = kernel_devices()
CONTEXTS = [700, 3000, 5000]  # three sequences
GLM = dict(
    model_type="glm_moe_dsa",
    vocab_size=64,
    hidden_size=1024,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_topk=TOPK,
    index_n_heads=32,
    index_head_dim=128,
    rms_norm_eps=1e-5,
)


def filled_cache(kv_cache_dtype: str):
    """A one-layer paged cache holding CONTEXTS random tokens, blocks of each sequence scattered."""
    from spmoe.engine.cache.paged import PagedKVCache

    cfg = ModelConfig.from_dict(GLM)
    blocks = [-(-c // BLOCK) for c in CONTEXTS]
    cache = PagedKVCache(
        cfg, {0: True}, (sum(blocks) + 1) * BLOCK * 2000, torch.bfloat16, "cuda", kv_cache_dtype
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    order = torch.randperm(cache.num_blocks, device="cuda", generator=gen).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    view = cache.view(tables, [0] * len(CONTEXTS), CONTEXTS)
    n = sum(CONTEXTS)
    write_latent(
        view.layer(0),
        view.slot_mapping,
        torch.randn(n, 512, device="cuda", generator=gen).bfloat16(),
        torch.randn(n, 64, device="cuda", generator=gen).bfloat16(),
    )
    write_index_key(
        view.layer(0),
        view.slot_mapping,
        torch.randn(n, 128, device="cuda", generator=gen).bfloat16(),
    )
    return cache, tables


def step_view(cache, tables):
    """Decode tokens at each sequence's last position, then a 300-token chunk ending at sequence 2's end (enough
    tokens for `sparse_mla`'s prefill tiles)."""
    starts, lens = [c - 1 for c in CONTEXTS], [1, 1, 1]
    decode = cache.view(tables, starts, lens)
    chunk = cache.view(tables[2:], [CONTEXTS[2] - 300], [300])
    return decode, chunk


def scores_of(keys: torch.Tensor) -> torch.Tensor:
    high = (keys >> 32).int()
    return torch.where(high < 0, high ^ 0x7FFFFFFF, high).view(torch.float32)


def assert_same_keys(
    got: torch.Tensor, want: torch.Tensor, kv_cache_dtype: str, label=None
) -> None:
    """Ordering keys `[N, L]` of the Triton indexer against the reference: the same positions (low halves), the
    same hidden positions (keys of -inf, bit for bit), and visible scores within the dtype's tolerance."""
    assert got.shape == want.shape, (label, got.shape, want.shape)
    assert torch.equal(got & 0xFFFFFFFF, want & 0xFFFFFFFF), label
    visible = torch.isfinite(scores_of(want))
    assert torch.equal(torch.isfinite(scores_of(got)), visible), label
    assert torch.equal(got[~visible], want[~visible]), label
    err = (scores_of(got)[visible] - scores_of(want)[visible]).abs().max() / scores_of(want)[
        visible
    ].abs().max()
    # bf16: exact products, only the order of the fp32 sums differs; FP8: Hopper's FP8 MMA accumulates with
    # fewer bits than fp32 (measured 1e-4 of the largest score)
    assert err < (1e-3 if kv_cache_dtype == "fp8" else 1e-5), (label, err)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_kernels_match_torch(kv_cache_dtype):
    from spmoe.layers.sparse_attention_triton import DECODE_TILES, PREFILL_TILES, indexer_order_keys
    from spmoe.layers.sparse_attention_triton import sparse_mla as triton_sparse_mla

    cache, tables = filled_cache(kv_cache_dtype)
    rows = cache.layers[0]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for view in step_view(cache, tables):
        n = view.positions.shape[0]
        q = torch.randn(n, 32, 128, device="cuda", generator=gen).bfloat16()
        weights = torch.rand(n, 32, device="cuda", generator=gen)
        if kv_cache_dtype == "fp8":
            q, q_scale = quantize_index_vectors(q)
            weights = weights * q_scale.squeeze(-1)
        args = (q, weights, rows, view.block_tables, view.seq_index, view.positions, BLOCK)
        got, want = indexer_order_keys(*args), indexer_order_keys_torch(*args)
        assert_same_keys(got, want, kv_cache_dtype)
        selected = rows_of_best(got, TOPK, view.block_tables, view.seq_index, BLOCK)
        reference = rows_of_best(want, TOPK, view.block_tables, view.seq_index, BLOCK)
        # every visible row is selected: the same set, in the same order of scores
        short = view.positions < TOPK
        assert torch.equal(selected[short].sort(-1).values, reference[short].sort(-1).values)
        overlap = sum(
            len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(selected, reference)
        )
        assert (
            overlap >= (0.99 if kv_cache_dtype == "fp8" else 0.999) * (reference >= 0).sum().item()
        ), overlap / (reference >= 0).sum().item()
        # the dispatcher picks Triton on CUDA (for a few tokens, topk_rows: the same rows in another order)
        assert torch.equal(
            indexer_topk(*args[:6], TOPK, BLOCK).sort(-1).values, selected.sort(-1).values
        )

        q_latent = torch.randn(n, 64, 512, device="cuda", generator=gen).bfloat16() * 0.05
        q_rope = torch.randn(n, 64, 64, device="cuda", generator=gen).bfloat16() * 0.05
        want = sparse_mla_torch(q_latent, q_rope, rows, selected, 0.07)
        # the dispatcher's pick by shape (decode tiles for the 3 decode tokens, prefill tiles for the 300-token
        # chunk), then each tile config on each shape
        for tiles in (None, DECODE_TILES, PREFILL_TILES):
            got = (
                sparse_mla(q_latent, q_rope, rows, selected, 0.07)
                if tiles is None
                else triton_sparse_mla(q_latent, q_rope, rows, selected, 0.07, tiles)
            )
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, (tiles, err)  # bf16 probabilities in the second product

        def step():
            return sparse_mla(q_latent, q_rope, rows, indexer_topk(*args[:6], TOPK, BLOCK), 0.07)

        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        assert torch.equal(captured, eager)


@requires_gpus(1)
@pytest.mark.gpu
def test_selected_rows_match_torch():
    """torch.topk of the ordering keys, unsorted, is deterministic (the same rows in the same order, call after
    call) and picks the sorted top-k's set; the Triton cache-row lookup equals its torch reference, from selected
    keys, from all keys and for every visible position; tables of at most TOPK positions select every visible
    row, which `visible_rows` gives without scores."""
    from spmoe.layers.sparse_attention_triton import cache_rows

    cache, tables = filled_cache("auto")
    rows = cache.layers[0]
    gen = torch.Generator(device="cuda").manual_seed(2)
    short = cache.view(tables[:1], [CONTEXTS[0] - 2], [2])  # 11 blocks: 704 positions
    for view in (*step_view(cache, tables), short):
        n = view.positions.shape[0]
        q = torch.randn(n, 32, 128, device="cuda", generator=gen).bfloat16()
        weights = torch.rand(n, 32, device="cuda", generator=gen)
        keys = indexer_order_keys_torch(
            q, weights, rows, view.block_tables, view.seq_index, view.positions, BLOCK
        )
        tables_view = (view.block_tables, view.seq_index)
        if keys.shape[1] <= TOPK:
            assert torch.equal(
                visible_rows(*tables_view, view.positions, BLOCK),
                rows_of_best(keys, TOPK, *tables_view, BLOCK),
            )
            continue
        best = keys.topk(TOPK, dim=-1, sorted=False).values
        for _ in range(20):
            assert torch.equal(keys.topk(TOPK, dim=-1, sorted=False).values, best)
        assert torch.equal(best.sort(-1).values, keys.topk(TOPK, dim=-1).values.sort(-1).values)
        for selected, positions in ((best, None), (keys, None), (None, view.positions)):
            got = cache_rows(selected, *tables_view, positions, BLOCK)
            assert torch.equal(got, cache_rows_torch(selected, *tables_view, positions, BLOCK))
        assert (got >= 0).sum() == (view.positions + 1).sum()  # every visible position, once
        assert torch.equal(
            rows_of_best(keys, TOPK, *tables_view, BLOCK),
            cache_rows_torch(best, *tables_view, None, BLOCK),
        )


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("chunk_tokens", [None, 3])
def test_bounded_topk_over_padded_tables(kv_cache_dtype, chunk_tokens, monkeypatch):
    """Decode tokens over block tables padded far past their positions (as a CUDA graph's, to 12288
    positions): the indexer without the keys past each position gives the same keys up to it, and
    `topk_rows` the same rows as torch.topk of the fully written keys, at positions below, at and above
    TOPK (ties and scores of both signs included); the dispatcher too, in query chunks of
    `chunk_tokens` tokens' keys (the last one short) where a budget is set."""
    from spmoe.engine.runner.graphs import padded_tables
    from spmoe.layers import sparse_attention
    from spmoe.layers.sparse_attention_triton import indexer_order_keys, topk_rows

    cache, tables = filled_cache(kv_cache_dtype)
    rows = cache.layers[0]
    positions = [0, 63, 700 - 1, TOPK - 1, TOPK, 2999, 4999, 4999]
    seqs = [0, 0, 0, 1, 1, 1, 2, 2]
    padded = torch.from_numpy(
        padded_tables(tables, len(tables), 12288 // BLOCK, cache.scratch_block)
    ).cuda()
    seq_index = torch.tensor(seqs, device="cuda")
    pos = torch.tensor(positions, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(len(seqs), 32, 128, device="cuda", generator=gen).bfloat16()
    q[-1] = 0  # every score 0: ties throughout, broken by the earliest position
    weights = torch.randn(len(seqs), 32, device="cuda", generator=gen)  # both signs
    if kv_cache_dtype == "fp8":
        q, q_scale = quantize_index_vectors(q)
        weights = weights * q_scale.squeeze(-1)
    args = (q, weights, rows, padded, seq_index, pos, BLOCK)
    full = indexer_order_keys(*args)
    sparse = indexer_order_keys(*args, fill_past=False)
    visible = torch.arange(full.shape[1], device="cuda") <= pos[:, None]
    assert torch.equal(sparse[visible], full[visible])
    want = rows_of_best(full, TOPK, padded, seq_index, BLOCK)
    if chunk_tokens:
        monkeypatch.setattr(sparse_attention, "TRITON_CHUNK_KEYS", chunk_tokens * full.shape[1])
    for got in (
        topk_rows(sparse, TOPK, padded, seq_index, pos, BLOCK),
        indexer_topk(*args[:6], TOPK, BLOCK),
    ):
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert ((want >= 0).sum(-1) == torch.clamp(pos + 1, max=TOPK)).all()


GRID_BLOCK, GRID_TOPK = 16, 32  # the grid test's block size and top-k
# its tables' blocks and the programs per token tile it tries (None: the default by shape): the interpreter takes
# about 10 ms a program and 20 ms a block of keys, so there the tables are narrow and only 3 programs are tried
GRID_BLOCKS = {"cuda": 512, "cpu": 24}
GRID_PROGRAMS = {"cuda": (None, 1, 3), "cpu": (3,)}


def exact_indexer_case(n: int, blocks: int, device: str, kv_cache_dtype: str, gen: torch.Generator):
    """The indexer's inputs (q, weights, cache rows, tables, seq_index, positions) for n tokens of 4 sequences,
    each with a table of `blocks` scattered blocks of GRID_BLOCK: runs of 8 then of 3 tokens per sequence (tiles
    of 4 tokens of one sequence, and tiles straddling two), positions below 100 but for tokens n - 8 .. n - 5
    (from n = 64: sequence 1 at 40 .. 37 positions before the table's end) and the last token (sequence 0, at
    the table's next-to-last position). Integer queries and keys in [-3, 3], weights in eighths of both signs,
    scales powers of 2: every score is exact in float32 in any order of the sums, so keys compare bit for bit."""
    width = blocks * GRID_BLOCK
    cached = 4 * blocks + 1
    fp8 = kv_cache_dtype == "fp8"
    # the 16-bit cache: bf16, but float16 under the interpreter, whose bf16 dot is not the GPU's
    key_dtype = (
        torch.float8_e4m3fn if fp8 else torch.bfloat16 if device == "cuda" else torch.float16
    )
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=gen).float()  # noqa: E731
    rows = PagedLayerCache(
        None,
        None,
        None,
        ints(cached * GRID_BLOCK, 32).to(key_dtype).to(device),
        (2.0 ** torch.randint(-3, 4, (cached * GRID_BLOCK, 1), generator=gen)).to(device)
        if fp8
        else None,
    )
    tables = torch.randperm(cached, generator=gen)[: 4 * blocks].view(4, blocks).int()
    seq_index = torch.tensor([(i // (8 if i < n // 2 else 3)) % 4 for i in range(n)])
    positions = torch.randint(0, 100, (n,), generator=gen)
    if n >= 64:
        seq_index[n - 8 : n - 4] = 1
        positions[n - 8 : n - 4] = torch.arange(width - 40, width - 36)
    seq_index[-1], positions[-1] = 0, width - 2
    q = ints(n, 4, 32).to(key_dtype)
    weights = torch.randint(-8, 9, (n, 4), generator=gen) / 8
    return (
        tuple(x.to(device) for x in (q, weights))
        + (rows,)
        + tuple(x.to(device) for x in (tables, seq_index, positions))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_indexer_grid_over_wide_tables(device, kv_cache_dtype):
    """The indexer's grid of programs per token tile (`indexer_programs`, or 1 and 3) over tables much wider than
    most positions (as a CUDA graph's), each program walking several tiles of blocks where the tokens' positions
    need more tiles than there are programs: the keys equal the reference's bit for bit (exact scores), all of
    them with `fill_past`, those up to each token's position without; and `topk_rows` over the latter picks the
    reference's rows. Decode tiles (1, 5, 63 tokens) and prefill tiles (64, 320 tokens; one sequence or two)."""
    from spmoe.layers.sparse_attention_triton import indexer_order_keys, indexer_programs, topk_rows

    blocks = GRID_BLOCKS[device]
    # on CUDA the default grid loops too: decode tiles of 1 token, fewer programs than the last token's tiles
    assert device == "cpu" or indexer_programs(5, blocks) < blocks - 1
    gen = torch.Generator().manual_seed(5)
    for n in (1, 5, 63, 64, 320):
        args = (*exact_indexer_case(n, blocks, device, kv_cache_dtype, gen), GRID_BLOCK)
        q, weights, rows, tables, seq_index, positions, _ = args
        want = torch.cat(
            [
                indexer_order_keys_torch(
                    q[c], weights[c], rows, tables, seq_index[c], positions[c], GRID_BLOCK
                )
                for c in torch.arange(n, device=device).split(
                    64
                )  # [64, L, d] gathered keys at a time
            ]
        )
        visible = torch.arange(want.shape[1], device=device) <= positions[:, None]
        for programs in GRID_PROGRAMS[device]:
            label = (n, programs)
            full = indexer_order_keys(*args, fill_past=True, programs=programs)
            assert torch.equal(full, want), label
            sparse = indexer_order_keys(*args, fill_past=False, programs=programs)
            assert torch.equal(sparse[visible], want[visible]), label
        got = topk_rows(sparse, GRID_TOPK, tables, seq_index, positions, GRID_BLOCK)
        reference = rows_of_best(want, GRID_TOPK, tables, seq_index, GRID_BLOCK)
        assert torch.equal(got.sort(-1).values, reference.sort(-1).values), n
    with pytest.raises(ValueError, match="indexer programs per token tile must be in"):
        indexer_order_keys(*args, programs=0)


def bf16_attention_layer(cfg: ModelConfig):
    """A random bf16 MLAttention with an indexer, on CUDA."""
    from spmoe.layers.attention import MLAttention

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = MLAttention(cfg, 0, 1, has_indexer=True).bfloat16()
        for p in layer.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
            else:
                torch.nn.init.ones_(p)
    return layer


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_paged_indexer_above_topk_fused_matches_reference(kv_cache_dtype):
    """bf16 MLAttention over the paged cache, a 2500-token prefill then two decodes in 40-block tables (2560
    positions: the indexer scores and takes its top-k), with the fused kernels (the key's LayerNorm + rope + cache
    write, the FP8 query quantisation) against their torch references: the same rows selected (99%), outputs
    within 3e-2 (FP8: 6e-2). Both sides score with the same Triton kernel, but their inputs differ in last bits
    (RMSNorm, rope, FP8 rounding), so a row within rounding of the 2048th best may swap with another, which moves
    a decode token's output by a few percent. Measured on an H200: identical outputs and rows; with the key kernel
    compiled with FP fusion (a bf16 step off in 14% of a key's values) 2.0e-2 bf16, 4.4e-2 FP8."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.layers import fused
    from spmoe.layers.attention import AttentionBatch
    from spmoe.layers.rotary import Rotary

    cfg = ModelConfig.from_dict(GLM)
    layer = bf16_attention_layer(cfg)
    caches = {
        on: PagedKVCache(cfg, {0: True}, 2**28, torch.bfloat16, "cuda", kv_cache_dtype)
        for on in (True, False)
    }
    table, errors, overlaps = [list(range(40))], [], []
    for start, length in ((0, 2500), (2500, 1), (2501, 1)):
        x = torch.randn(length, cfg.hidden_size, device="cuda").bfloat16()
        outs, selections = [], []
        for on, cache in caches.items():
            fused.ENABLED = on
            try:
                view = cache.view(table, [start], [length])
                batch = AttentionBatch(
                    Rotary(cfg, view.positions, torch.bfloat16), view.allowed, view
                )
                with torch.no_grad():
                    out, selected = layer(x, batch, None)
            finally:
                fused.ENABLED = True
            outs.append(out.float())
            selections.append(selected)
        errors.append(((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item())
        got, want = selections
        assert got.shape == want.shape == (length, TOPK)
        overlaps.append(
            sum(len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(got, want))
            / (want >= 0).sum().item()
        )
    print(errors, overlaps)
    assert max(errors) < (3e-2 if kv_cache_dtype == "auto" else 6e-2) and min(overlaps) >= 0.99, (
        errors,
        overlaps,
    )


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_indexer_tiles_match_torch(kv_cache_dtype):
    """The indexer's tiles of several tokens against the reference: a 1000-token prefill chunk of one sequence
    at a start inside a block; a step whose tiles straddle sequences (other block tables, other positions)
    and end in a partial tile; 32 and 24 heads (padded to 32); each tile config, the default's pick first."""
    from spmoe.layers.sparse_attention_triton import (
        INDEXER_DECODE_TILES,
        INDEXER_PREFILL_TILES,
        indexer_order_keys,
    )

    cache, tables = filled_cache(kv_cache_dtype)
    rows = cache.layers[0]
    gen = torch.Generator(device="cuda").manual_seed(2)
    chunk = cache.view(tables[2:], [3100], [1000])
    # tokens 0-4 of sequence 0, 5-126 of sequence 1, 127-136 of sequence 2: tiles of 2, 4 and 8 tokens straddle
    mixed = cache.view(tables, [695, 1000, 4990], [5, 122, 10])
    for view, heads in ((chunk, 32), (mixed, 32), (mixed, 24)):
        n = view.positions.shape[0]
        q = torch.randn(n, heads, 128, device="cuda", generator=gen).bfloat16()
        weights = torch.rand(n, heads, device="cuda", generator=gen)
        if kv_cache_dtype == "fp8":
            q, q_scale = quantize_index_vectors(q)
            weights = weights * q_scale.squeeze(-1)
        args = (q, weights, rows, view.block_tables, view.seq_index, view.positions, BLOCK)
        want = indexer_order_keys_torch(*args)
        for tiles in (
            None,
            INDEXER_DECODE_TILES,
            INDEXER_PREFILL_TILES,
            (2, 5, 4, 2),
            (8, 3, 8, 3),
        ):
            assert_same_keys(
                indexer_order_keys(*args, tiles=tiles), want, kv_cache_dtype, (n, heads, tiles)
            )


@requires_gpus(1)
@pytest.mark.gpu
def test_paged_attention_layer_matches_dense_on_gpu():
    """bf16 MLAttention over the paged cache (Triton) against the dense path over the dense KV cache, a chunked
    prefill then decodes, all contexts <= index_topk (DSA is then exactly dense)."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.layers.attention import AttentionBatch
    from spmoe.layers.rotary import Rotary

    cfg = ModelConfig.from_dict(GLM)
    layer = bf16_attention_layer(cfg)
    dense = KVCache(cfg, {0: True}, 2, 1024, torch.bfloat16, "cuda")
    paged = PagedKVCache(cfg, {0: True}, 2**27, torch.bfloat16, "cuda")
    # room for 640 tokens each
    tables = [
        [5, 2, 9, 0, 11, 13, 15, 17, 19, 21],
        [7, 1, 3, 4, 6, 8, 10, 12, 14, 16],
    ]
    slots, errors = [dense.allocate() for _ in range(2)], []
    for starts, lens in (([0, 0], [600, 250]), ([600, 250], [1, 1]), ([601, 251], [1, 1])):
        x = torch.randn(sum(lens), cfg.hidden_size, device="cuda").bfloat16()
        outs = []
        for view in (dense.view(slots, starts, lens), paged.view(tables, starts, lens)):
            batch = AttentionBatch(Rotary(cfg, view.positions, torch.bfloat16), view.allowed, view)
            with torch.no_grad():
                outs.append(layer(x, batch, None)[0].float())
        errors.append(((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item())
    print(errors)
    assert max(errors) < 3e-2, errors


def check_head_matmul(device: str, dtype: torch.dtype):
    """The kernel on the views `_sparse_absorbed` hands it (q_nope of q `[N, h, 256]`; W_UK and W_UV^T of kv_b's
    weight `[h * 448, 512]`) against float32 math and the batched GEMM, within bf16 GEMM rounding (outputs of
    about unit size); `head_matmul` picks it up to 16 tokens, the batched GEMM above."""
    from spmoe.layers.sparse_attention_triton import HEAD_MATMUL_TOKENS
    from spmoe.layers.sparse_attention_triton import head_matmul as triton_head_matmul

    nope, v, c = 192, 256, 512
    gen = torch.Generator(device=device).manual_seed(7)
    for heads in (64, 32, 16, 8):  # TP 1, 2, 4, 8 at GLM-5.2's 64 heads
        weight = (torch.randn(heads * (nope + v), c, generator=gen, device=device) * c**-0.5).to(
            dtype
        )
        w_uk, w_uv = weight.view(heads, nope + v, c).split([nope, v], dim=1)
        for n_tok in (1, 3, 8, HEAD_MATMUL_TOKENS):
            q = torch.randn(n_tok, heads, nope + 64, generator=gen, device=device).to(dtype)
            latent = (
                torch.randn(n_tok, heads, c, generator=gen, device=device) * (c / nope) ** 0.5
            ).to(dtype)
            for x, w in ((q[..., :nope], w_uk), (latent, w_uv.transpose(1, 2))):
                got = triton_head_matmul(x, w)
                want = torch.einsum("nhk,hkm->nhm", x.float(), w.float())
                label = (heads, n_tok, tuple(w.shape))
                assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous(), label
                torch.testing.assert_close(
                    got.float(), want, rtol=1.6e-2, atol=1e-2, msg=lambda m: f"{label}: {m}"
                )
                torch.testing.assert_close(
                    got,
                    head_matmul_torch(x, w),
                    rtol=1.6e-2,
                    atol=1e-2,
                    msg=lambda m: f"{label}: {m}",
                )
                if device == "cuda":  # the dispatch: the kernel, unless the fused kernels are off
                    assert torch.equal(head_matmul(x, w), got), label
                    fused.ENABLED = False
                    try:
                        assert torch.equal(head_matmul(x, w), head_matmul_torch(x, w)), label
                    finally:
                        fused.ENABLED = True
    many = torch.randn(HEAD_MATMUL_TOKENS + 1, 8, nope, generator=gen, device=device).to(dtype)
    if device == "cuda":
        # more tokens: the GEMM
        assert torch.equal(head_matmul(many, w_uk), head_matmul_torch(many, w_uk))
    with pytest.raises(ValueError, match="head_matmul needs x"):
        triton_head_matmul(many, w_uk)
    assert triton_head_matmul(many[:0], w_uk).shape == (0, 8, c)


@requires_gpus(1)
@pytest.mark.gpu
def test_head_matmul_matches_torch():
    check_head_matmul("cuda", torch.bfloat16)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,context,kv_cache_dtype",
    [(1, 1024, "auto"), (48, 1024, "fp8"), (256, 4096, "auto"), (256, 4096, "fp8")],
)
def test_kernels_at_large_batch_and_context(batch, context, kv_cache_dtype):
    """The indexer, the cache-row lookup and sparse MLA against their torch references for `batch` sequences of
    `context` cached tokens (blocks scattered over the cache, tables as wide as the engine's CUDA graphs make
    them: a power of 2 of blocks): one decode token per sequence, and a 512-token prefill chunk of the last."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.layers.sparse_attention_triton import cache_rows, indexer_order_keys
    from spmoe.layers.sparse_attention_triton import sparse_mla as triton_sparse_mla

    cfg = ModelConfig.from_dict(GLM)
    used = -(-(context + 1) // BLOCK)
    width = 1 << (used - 1).bit_length()
    probe = PagedKVCache(cfg, {0: True}, 1 << 24, torch.bfloat16, "cuda", kv_cache_dtype)
    cache = PagedKVCache(
        cfg,
        {0: True},
        batch * used * BLOCK * probe.bytes_per_token,
        torch.bfloat16,
        "cuda",
        kv_cache_dtype,
    )
    del probe
    gen = torch.Generator(device="cuda").manual_seed(batch)
    order = torch.randperm(cache.num_blocks, device="cuda", generator=gen).tolist()
    tables = [
        order[i * used : (i + 1) * used] + [cache.scratch_block] * (width - used)
        for i in range(batch)
    ]
    fill = cache.view(tables, [0] * batch, [context] * batch)
    n = batch * context
    write_latent(
        fill.layer(0),
        fill.slot_mapping,
        torch.randn(n, 512, device="cuda", generator=gen).bfloat16(),
        torch.randn(n, 64, device="cuda", generator=gen).bfloat16(),
    )
    write_index_key(
        fill.layer(0),
        fill.slot_mapping,
        torch.randn(n, 128, device="cuda", generator=gen).bfloat16(),
    )
    del fill
    rows = cache.layers[0]
    for view in (
        cache.view(tables, [context - 1] * batch, [1] * batch),
        cache.view(tables[-1:], [context - 512], [512]),
    ):
        tokens = view.positions.shape[0]
        q = torch.randn(tokens, 32, 128, device="cuda", generator=gen).bfloat16()
        weights = torch.rand(tokens, 32, device="cuda", generator=gen)
        if kv_cache_dtype == "fp8":
            q, q_scale = quantize_index_vectors(q)
            weights = weights * q_scale.squeeze(-1)
        tables_view = (view.block_tables, view.seq_index)
        args = (q, weights, rows, *tables_view, view.positions, BLOCK)
        keys, want = indexer_order_keys(*args), indexer_order_keys_torch(*args)
        assert_same_keys(keys, want, kv_cache_dtype, (batch, context, tokens))
        best = keys.topk(TOPK, dim=-1, sorted=False).values
        for selected, positions in ((best, None), (None, view.positions)):
            assert torch.equal(
                cache_rows(selected, *tables_view, positions, BLOCK),
                cache_rows_torch(selected, *tables_view, positions, BLOCK),
            )
        chosen = rows_of_best(keys, TOPK, *tables_view, BLOCK)
        reference = rows_of_best(want, TOPK, *tables_view, BLOCK)
        overlap = sum(
            len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(chosen, reference)
        )
        assert (
            overlap >= (0.99 if kv_cache_dtype == "fp8" else 0.999) * (reference >= 0).sum().item()
        )
        q_latent = torch.randn(tokens, 64, 512, device="cuda", generator=gen).bfloat16() * 0.05
        q_rope = torch.randn(tokens, 64, 64, device="cuda", generator=gen).bfloat16() * 0.05
        want = sparse_mla_torch(q_latent, q_rope, rows, chosen, 0.07)
        got = triton_sparse_mla(q_latent, q_rope, rows, chosen, 0.07)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 2e-2, (batch, context, tokens, err)


@requires_gpus(1)
@pytest.mark.gpu
def test_prompt_indexer_in_query_chunks(monkeypatch):
    """A prompt chunk of more tokens than `topk_rows` takes goes through the Triton indexer in query
    chunks of at most `TRITON_CHUNK_KEYS` keys: with a budget of a few tokens' keys (many chunks, the
    last one short) it selects exactly the rows of the whole chunk's keys at once."""
    from spmoe.layers import sparse_attention
    from spmoe.layers.sparse_attention_triton import TOPK_ROWS_MAX_TOKENS, indexer_order_keys

    cache, tables = filled_cache("auto")
    n = TOPK_ROWS_MAX_TOKENS + 200
    view = cache.view(tables[2:], [CONTEXTS[2] - n], [n])
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(n, 32, 128, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(n, 32, device="cuda", generator=gen)
    args = (q, weights, cache.layers[0], view.block_tables, view.seq_index, view.positions)
    whole = rows_of_best(indexer_order_keys(*args, BLOCK), TOPK, *args[3:5], BLOCK)
    width = view.block_tables.shape[1] * BLOCK
    monkeypatch.setattr(sparse_attention, "TRITON_CHUNK_KEYS", 97 * width)
    chunked = indexer_topk(*args, TOPK, BLOCK)
    assert torch.equal(chunked.sort(-1).values, whole.sort(-1).values)
