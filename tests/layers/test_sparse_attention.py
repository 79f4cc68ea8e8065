"""Sparse absorbed attention over the paged cache against the dense path (float32, CPU), step by step over a
mixed batch of chunked prefills and decodes, contexts below and above index_topk, on an indexer ("full")
layer followed by an IndexShare "shared" layer; the FP8 cache within a stated tolerance; the exact
tie-breaking top-k; the FP8 round trip; the FP8 indexer's Hadamard rotation."""

import pytest
import torch

from spmoe.config import ModelConfig
from spmoe.engine.cache.blocks import BlockManager
from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache, cache_budget_bytes
from spmoe.engine.cache.slots import KVCache
from spmoe.layers.attention import AttentionBatch, MLAttention
from spmoe.layers.paged_rows import PagedLayerCache
from spmoe.layers.quantization.fp8 import (
    dequantize,
    hadamard_matrix,
    hadamard_rotate,
    quantize_fp8_vectors,
)
from spmoe.layers.rotary import Rotary
from spmoe.layers.sparse_attention import indexer_topk, order_keys, sparse_mla_torch, visible_rows

from ..conftest import relative_error

TOPK = 8
CONFIG = dict(
    model_type="glm_moe_dsa",
    vocab_size=96,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=12,
    num_hidden_layers=2,
    mlp_layer_types=["dense", "dense"],
    indexer_types=["full", "shared"],
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=24,
    kv_lora_rank=128,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    index_topk=TOPK,
    index_n_heads=4,
    index_head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
# per step: (sequence, new tokens) in batch order. Final contexts 5 (< topk), 40 and 70 (> topk, the last over
# two blocks). Step 0 prefills whole and partial prompts; steps 1-2 add chunks on top of cached contexts
# alongside decodes; steps 3-4 decode every sequence.
STEPS = [
    [(0, 3), (1, 20), (2, 40)],
    [(1, 17), (0, 1), (2, 27)],
    [(2, 1), (1, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1), (0, 1), (1, 1)],
]


def attention_layers(cfg: ModelConfig) -> list[MLAttention]:
    gen = torch.Generator().manual_seed(0)
    layers = [
        MLAttention(cfg, i, 1, has_indexer=cfg.layer_has_indexer(i))
        for i in range(cfg.num_hidden_layers)
    ]
    for layer in layers:
        for p in layer.parameters():
            with torch.no_grad():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 2 * p.shape[1] ** -0.5)
    return layers


def run_steps(
    cfg: ModelConfig, kv_cache_dtype: str = "auto"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step through both layers over a dense KVCache and over the paged cache -> per step (dense
    output, paged output) of the last layer, `[N, H]` each."""
    layers = attention_layers(cfg)
    dense = KVCache(
        cfg, {i: m.indexer is not None for i, m in enumerate(layers)}, 3, 80, torch.float32, "cpu"
    )
    paged = PagedKVCache(
        cfg,
        {i: m.indexer is not None for i, m in enumerate(layers)},
        10**7,
        torch.float32,
        "cpu",
        kv_cache_dtype,
    )
    blocks = BlockManager(paged.num_blocks, BLOCK_SIZE)
    blocks.allocate(99, 3 * BLOCK_SIZE)  # so that the sequences' blocks are not the first ones
    slots, cached, gen, results = (
        [dense.allocate() for _ in range(3)],
        [0, 0, 0],
        torch.Generator().manual_seed(1),
        [],
    )
    for step in STEPS:
        seqs, lens = [s for s, _ in step], [n for _, n in step]
        for s, n in step:
            blocks.grow(s, n) if s in blocks else blocks.allocate(s, n)
        x = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
        starts = [cached[s] for s in seqs]
        outs = []
        for view in (
            dense.view([slots[s] for s in seqs], starts, lens),
            paged.view([blocks.block_table(s) for s in seqs], starts, lens),
        ):
            batch = AttentionBatch(Rotary(cfg, view.positions, torch.float32), view.allowed, view)
            selected = None
            with torch.no_grad():
                for layer in layers:
                    out, selected = layer(x, batch, selected)
            outs.append(out)
        results.append(tuple(outs))
        for s, n in step:
            cached[s] += n
    return results


def test_paged_sparse_equals_dense():
    for i, (dense, paged) in enumerate(run_steps(ModelConfig.from_dict(CONFIG))):
        assert relative_error(paged, dense) < 1e-5, (i, relative_error(paged, dense))


def test_paged_sparse_equals_dense_with_deepseek_rope():
    cfg = ModelConfig.from_dict({**CONFIG, "model_type": "deepseek_v32"})  # half-split indexer rope
    for i, (dense, paged) in enumerate(run_steps(cfg)):
        assert relative_error(paged, dense) < 1e-5, (i, relative_error(paged, dense))


def test_fp8_cache_close_to_dense():
    """With index_topk above every context, every visible row is selected whatever the FP8 indexer scores, so
    the error is the FP8 latent's rounding alone: e4m3 keeps 3 mantissa bits (relative rounding <= 2**-4 per
    value), which leaves the attention output within 6% of the dense one here (measured: 3.3-4.6%)."""
    cfg = ModelConfig.from_dict({**CONFIG, "index_topk": 128})
    errors = [relative_error(paged, dense) for dense, paged in run_steps(cfg, "fp8")]
    assert max(errors) < 0.06, errors
    assert min(errors) > 1e-4, errors  # the FP8 rounding shows: the FP8 path really ran


def test_fp8_indexer_keeps_the_best_rows():
    """The FP8 indexer (FP8 queries and keys) against the same scores in float32, 64 tokens over 1000 random
    keys: of the exact top 64, at least 90% are picked on average."""
    gen = torch.Generator().manual_seed(2)
    q, keys, weights = (
        torch.randn(64, 4, 128, generator=gen),
        torch.randn(1024, 128, generator=gen),
        torch.rand(64, 4),
    )
    tables, seq_index, positions = (
        torch.arange(16, dtype=torch.int32)[None],
        torch.zeros(64, dtype=torch.long),
        torch.full((64,), 999),
    )
    exact = PagedLayerCache(torch.zeros(0, 1), None, torch.zeros(0, 1), keys, None)
    want = indexer_topk(q, weights, exact, tables, seq_index, positions, 64, 64)
    key8, key_scale = quantize_fp8_vectors(keys)
    q8, q_scale = quantize_fp8_vectors(q)
    fp8 = PagedLayerCache(torch.zeros(0, 1), None, torch.zeros(0, 1), key8, key_scale)
    got = indexer_topk(q8, weights * q_scale.squeeze(-1), fp8, tables, seq_index, positions, 64, 64)
    overlap = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want)) / want.numel()
    assert 0.9 <= overlap < 1, overlap  # below 1: the FP8 scores really differ


def test_hadamard_matrix_is_orthonormal_and_keeps_dot_products():
    for d in (1, 2, 16, 128):
        h = hadamard_matrix(d, torch.device("cpu"))
        assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-6) and torch.equal(h, h.T), d
        # Sylvester: row 0 all +
        assert torch.equal(h.abs(), torch.full((d, d), d**-0.5)) and (h[0] > 0).all(), d
    # built once
    assert hadamard_matrix(16, torch.device("cpu")) is hadamard_matrix(16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 4, 128, generator=gen), torch.randn(5, 1, 128, generator=gen).bfloat16()
    rotated = (hadamard_rotate(q) * hadamard_rotate(k)).sum(-1)
    assert rotated.dtype == torch.float32 and not torch.allclose(hadamard_rotate(q), q)
    assert torch.allclose(rotated, (q * k.float()).sum(-1), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="needs an order that is a power of 2, got 24"):
        hadamard_matrix(24, torch.device("cpu"))


def test_hadamard_rotation_cuts_fp8_indexer_error_of_shared_outlier_channels():
    """Queries and keys sharing 4 large channels (30-60x the others), as trained activations often do: FP8 scores
    of the rotated q and k err far less, relative to the scores' spread over keys, than FP8 scores of the raw
    ones (measured 0.29-0.37 against 0.92-1.08, seeds 0-3), and the FP8 indexer's top 64 keeps more of the exact
    top 64 (0.78-0.82 against 0.44-0.52)."""
    gen = torch.Generator().manual_seed(0)
    q, keys, weights = (
        torch.randn(64, 4, 128, generator=gen),
        torch.randn(1024, 128, generator=gen),
        torch.rand(64, 4),
    )
    channels, size = torch.randperm(128, generator=gen)[:4], 30 * (1 + torch.rand(4, generator=gen))
    q[..., channels] += size
    keys[:, channels] += size
    tables, seq_index, positions = (
        torch.arange(16, dtype=torch.int32)[None],
        torch.zeros(64, dtype=torch.long),
        torch.full((64,), 999),
    )
    exact = PagedLayerCache(torch.zeros(0, 1), None, torch.zeros(0, 1), keys, None)
    want = indexer_topk(q, weights, exact, tables, seq_index, positions, 64, 64)
    results = {}
    for rotate in (False, True):
        q_in, k_in = (hadamard_rotate(q), hadamard_rotate(keys)) if rotate else (q, keys)
        (q8, q_scale), (key8, key_scale) = quantize_fp8_vectors(q_in), quantize_fp8_vectors(k_in)
        scores = torch.einsum("nhd,ld->nhl", q, keys)
        fp8_scores = torch.einsum(
            "nhd,ld->nhl", dequantize(q8, q_scale), dequantize(key8, key_scale)
        )
        error = ((fp8_scores - scores).abs() / scores.std(-1, keepdim=True)).mean().item()
        fp8 = PagedLayerCache(torch.zeros(0, 1), None, torch.zeros(0, 1), key8, key_scale)
        got = indexer_topk(
            q8, weights * q_scale.squeeze(-1), fp8, tables, seq_index, positions, 64, 64
        )
        overlap = (
            sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want)) / want.numel()
        )
        results[rotate] = error, overlap
    (raw_error, raw_overlap), (rotated_error, rotated_overlap) = results[False], results[True]
    assert rotated_error < raw_error / 2 and rotated_overlap > raw_overlap + 0.2, results


def test_rows_of_ties_go_to_earliest_positions():
    """One sequence over two blocks (physical blocks 3 then 1): every key scores 0 except two ties of 1.0 at
    positions 70 and 5; positions beyond the query's are invisible. The top-k is unsorted: the selected rows are
    compared as sets, except where every position is kept (position order, -1 at the tail)."""
    cache = PagedLayerCache(
        torch.zeros(0, 1), None, torch.zeros(0, 1), torch.zeros(5 * 64, 2), None
    )
    tables = torch.tensor([[3, 1]], dtype=torch.int32)
    cache.index_key[3 * 64 + 5] = torch.tensor([1.0, 0.0])
    cache.index_key[1 * 64 + 70 - 64] = torch.tensor([1.0, 0.0])
    cache.index_key[3 * 64 + 9] = torch.tensor([-1.0, 0.0])  # relu -> 0, ties with the zeros
    q, weights = torch.tensor([[[1.0, 0.0]]]).repeat(2, 1, 1), torch.ones(2, 1)
    positions = torch.tensor([80, 6])
    seq_index = torch.zeros(2, dtype=torch.long)
    rows = indexer_topk(q, weights, cache, tables, seq_index, positions, 5, 64)
    assert sorted(rows[0].tolist()) == sorted(
        [3 * 64 + 5, 64 + 6, 3 * 64 + 0, 3 * 64 + 1, 3 * 64 + 2]
    )
    assert sorted(rows[1].tolist()) == sorted(
        [3 * 64 + 5, 3 * 64 + 0, 3 * 64 + 1, 3 * 64 + 2, 3 * 64 + 3]
    )
    rows = indexer_topk(q, weights, cache, tables, seq_index, positions, 10, 64)
    # 7 visible positions
    assert sorted(rows[1].tolist()) == [-1] * 3 + [3 * 64 + p for p in range(7)]
    rows = indexer_topk(q, weights, cache, tables, seq_index, positions, 200, 64)
    # topk above the table's 128 positions: all kept, in position order
    assert rows.shape == (
        2,
        128,
    )
    assert rows[1].tolist() == [3 * 64 + p for p in range(7)] + [-1] * 121
    assert (
        rows[0].tolist()
        == [3 * 64 + p for p in range(64)] + [64 + p for p in range(17)] + [-1] * 47
    )
    # the same, with no scores
    assert torch.equal(visible_rows(tables, seq_index, positions, 64), rows)


def test_order_keys_sorts_by_score_then_earliest():
    scores = torch.tensor(
        [[float("-inf"), -2.5, -0.0, 3.0, 0.0, 1e-30, -1e-30, 3.0, float("-inf")]]
    )
    assert order_keys(scores).sort(descending=True).indices[0].tolist() == [
        3,
        7,
        5,
        2,
        4,
        6,
        1,
        0,
        8,
    ]


def test_sparse_mla_softmax_is_safe():
    """Huge scores stay finite; a token with no selected row gets zeros, not NaN."""
    cache = PagedLayerCache(torch.randn(8, 4), None, torch.randn(8, 2), None, None)
    q = torch.full((2, 1, 4), 1e4)
    out = sparse_mla_torch(q, torch.zeros(2, 1, 2), cache, torch.tensor([[0, 3], [-1, -1]]), 1.0)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0
    assert torch.allclose(
        out[0, 0],
        cache.latent[0] if (cache.latent[0] - cache.latent[3]).sum() > 0 else cache.latent[3],
    )


def test_fp8_round_trip_error_bounds():
    """e4m3 rounds to 3 mantissa bits (relative error <= 2**-4) above its normal range; values below
    2**-6 of a group's largest (subnormals, and flushes to zero) err by at most 2**-9 of that largest."""
    from spmoe.layers.quantization.fp8 import quantize_fp8_groups

    x = torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]
    for (values, scale), group in ((quantize_fp8_groups(x), 128), (quantize_fp8_vectors(x), 512)):
        back = dequantize(values, scale)
        largest = (
            x.abs()
            .view(64, -1, group)
            .amax(-1, keepdim=True)
            .expand(-1, -1, group)
            .reshape(64, 512)
        )
        bound = torch.maximum(x.abs() * 2**-4, largest * 2**-9)
        assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
        assert (back - x).abs().max() > 0


def test_cache_sizes_and_budget_errors():
    cfg = ModelConfig.from_dict(CONFIG)
    per_token = {"auto": 2 * (128 + 8) * 4 + 16 * 4, "fp8": 2 * (128 + 4 + 8 * 4) + 16 + 4}
    for dtype, want in per_token.items():
        cache = PagedKVCache(
            cfg, {0: True, 1: False}, want * BLOCK_SIZE * 3 + 5, torch.float32, "cpu", dtype
        )
        assert cache.bytes_per_token == want, dtype
        assert cache.num_blocks == 3 and cache.capacity_tokens == 3 * BLOCK_SIZE
        assert cache.layers[0].latent.shape[0] == 4 * BLOCK_SIZE  # 3 blocks + the scratch block
    with pytest.raises(
        ValueError,
        match=f"needs at least {per_token['auto'] * 64} bytes for one block of each of 2 layers, got 100",
    ):
        PagedKVCache(cfg, {0: True, 1: False}, 100, torch.float32, "cpu")
    with pytest.raises(ValueError, match="kv_lora_rank 16 is not a multiple of 128"):
        PagedKVCache(
            ModelConfig.from_dict({**CONFIG, "kv_lora_rank": 16}),
            {0: True},
            10**6,
            torch.float32,
            "cpu",
            "fp8",
        )
    with pytest.raises(
        ValueError,
        match="Hadamard-rotates the indexer keys, which needs a power-of-2 width; "
        "index_head_dim 24 is not a power of 2",
    ):
        PagedKVCache(
            ModelConfig.from_dict({**CONFIG, "index_head_dim": 24}),
            {0: True},
            10**6,
            torch.float32,
            "cpu",
            "fp8",
        )
    PagedKVCache(
        ModelConfig.from_dict({**CONFIG, "index_head_dim": 24}),
        {0: True},
        10**6,
        torch.float32,
        "cpu",
    )
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        PagedKVCache(cfg, {0: True}, 10**6, torch.float32, "cpu", "int8")
    cache = PagedKVCache(cfg, {0: True}, 10**6, torch.float32, "cpu")
    with pytest.raises(ValueError, match="sequence 1 needs 65 positions; its 1 blocks hold 64"):
        cache.view([[0], [1]], [3, 60], [1, 5])


def test_glm5_fp8_bytes_per_token():
    """GLM-5.2 in bf16 with an FP8 cache: 656 B per token on a shared layer, 656 + 132 on an indexer layer."""
    cfg = ModelConfig.from_dict(
        {**CONFIG, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
    )
    for layers, want in (({0: False}, 656), ({0: True}, 656 + 132)):
        assert (
            PagedKVCache(cfg, layers, 10**6, torch.bfloat16, "cpu", "fp8").bytes_per_token == want
        )


def test_cache_budget():
    assert cache_budget_bytes("cpu", gib=1.5) == 3 * 2**29
    with pytest.raises(
        ValueError,
        match="exactly one of GiB or a fraction of free memory, got gib=1, memory_fraction=0.5",
    ):
        cache_budget_bytes("cpu", gib=1, memory_fraction=0.5)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"must be a finite number of GiB > 0, got {bad}"):
            cache_budget_bytes("cpu", gib=bad)
    with pytest.raises(
        ValueError, match="needs a CUDA device and a fraction in \\(0, 1\\], got 0.9 on cpu"
    ):
        cache_budget_bytes("cpu", memory_fraction=0.9)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_torch_paths_in_query_chunks_equal_one_chunk(monkeypatch, kv_cache_dtype):
    """With a score budget of a few values, the torch paths (the dense path's scores and indexer, the paged
    indexer's top-k and sparse MLA) go over the queries one at a time. The paged path's outputs equal the one
    chunk run's bit for bit; the dense path's within float32 rounding (a CPU GEMM of one query row sums in another
    order than one of many: 4e-7 of the largest value measured), the same keys selected."""
    import spmoe.layers.attention as attention
    import spmoe.layers.sparse_attention as sparse_attention

    cfg = ModelConfig.from_dict(CONFIG)
    whole = run_steps(cfg, kv_cache_dtype)
    chunk_counts = []

    def counted(n, per_query):
        chunks = sparse_attention.query_chunks.__wrapped__(n, per_query)
        chunk_counts.append(len(chunks))
        return chunks

    counted.__wrapped__ = sparse_attention.query_chunks
    monkeypatch.setattr(sparse_attention, "TORCH_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(sparse_attention, "query_chunks", counted)
    monkeypatch.setattr(attention, "query_chunks", counted)
    chunked = run_steps(cfg, kv_cache_dtype)
    # one query per chunk
    assert max(chunk_counts) == max(sum(n for _, n in step) for step in STEPS)
    for i, ((dense, paged), (dense_chunked, paged_chunked)) in enumerate(zip(whole, chunked)):
        assert relative_error(dense_chunked, dense) < 2e-6, (
            i,
            relative_error(dense_chunked, dense),
        )
        assert torch.equal(paged_chunked, paged), i
