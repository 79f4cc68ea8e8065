"""Decode attention per layer at GLM-5.2 widths on one GPU (TP 1: 64 heads, kv_lora 512, rope 64, indexer
32 heads x 128, index_topk 2048), bf16 weights, over contexts of 2k to 128k tokens for batches of 1 and 8
sequences (each decoding its token at the context's last position).

Per row: ms (CUDA-event median, replayed from a CUDA graph) of
- `indexer`: the Triton indexer and the top-k over the paged indexer cache;
- `mla`: the Triton absorbed sparse MLA over the selected rows;
- `roofline %`: the cache bytes those two must read (every visible indexer key, then the selected latent +
  rope rows, each once per token) / 4.3 TB/s, against their measured time;
- `paged layer`: the whole MLAttention forward over the paged cache (projections, indexer, top-k, sparse
  MLA, o_proj);
- `dense layer`: the same layer over today's dense KV cache (every cached latent decompressed through
  kv_b_proj, dense scores, the top-k as a mask), or OOM where it does not fit.
for the bf16 cache (kv-cache-dtype auto) and the FP8 cache.

    python benchmarks/bench_sparse_attention.py [--contexts 2048 8192 32768 131072] [--batches 1 8]
"""

import argparse

import torch

from spmoe.config import ModelConfig
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import BLOCK_SIZE, PagedKVCache
from spmoe.layers.attention import AttentionBatch, MLAttention
from spmoe.layers.rotary import Rotary
from spmoe.layers.sparse_attention import indexer_topk, quantize_fp8_vectors, sparse_mla
from bench_dp import GLM, random_weights
from timing import cuda_ms, graphed

HBM = 4.3e12
REPS = 20


def fill(cache: PagedKVCache, tokens: int) -> None:
    """Random rows 0 .. tokens - 1 of layer 0, written through the cache's own write path in chunks."""
    gen, chunk = torch.Generator(device="cuda").manual_seed(0), 1 << 14
    for start in range(0, tokens, chunk):  # start is a multiple of BLOCK_SIZE: the chunk's blocks in order
        n = min(chunk, tokens - start)
        table = torch.arange(start // BLOCK_SIZE, -(-(start + n) // BLOCK_SIZE), dtype=torch.int32, device="cuda")
        view = cache.decode_view(table[None], torch.zeros(n, dtype=torch.long, device="cuda"),
                                 torch.arange(n, device="cuda"))
        view.write_latent(0, torch.randn(n, 512, device="cuda", generator=gen).bfloat16(),
                          torch.randn(n, 64, device="cuda", generator=gen).bfloat16())
        view.write_index_key(0, torch.randn(n, 128, device="cuda", generator=gen).bfloat16())


def timed(fn) -> float | None:
    """Median ms of fn replayed from a CUDA graph (run eagerly once first); None if it runs out of memory."""
    try:
        fn()
        return cuda_ms(graphed(fn), REPS, warmup=2)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def run(cfg: ModelConfig, layer: MLAttention, kv_cache_dtype: str, context: int, batch: int) -> str:
    blocks = -(-context // BLOCK_SIZE)
    probe = PagedKVCache(cfg, {0: True}, 10 ** 7, torch.bfloat16, "cuda", kv_cache_dtype)
    cache = PagedKVCache(cfg, {0: True}, batch * blocks * BLOCK_SIZE * probe.bytes_per_token, torch.bfloat16, "cuda",
                         kv_cache_dtype)
    fill(cache, batch * blocks * BLOCK_SIZE)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    positions = torch.full((batch,), context - 1, device="cuda")
    view = cache.decode_view(tables, torch.arange(batch, device="cuda"), positions)
    rows_cache = cache.layers[0]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, 32, 128, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(batch, 32, device="cuda", generator=gen)
    if kv_cache_dtype == "fp8":
        q, q_scale = quantize_fp8_vectors(q)
        weights = weights * q_scale.squeeze(-1)
    q_latent = torch.randn(batch, 64, 512, device="cuda", generator=gen).bfloat16() * 0.05
    q_rope = torch.randn(batch, 64, 64, device="cuda", generator=gen).bfloat16() * 0.05
    index_args = (q, weights, rows_cache, view.block_tables, view.seq_index, view.positions, cfg.index_topk,
                  BLOCK_SIZE)
    selected = indexer_topk(*index_args)
    t_index = timed(lambda: indexer_topk(*index_args))
    t_mla = timed(lambda: sparse_mla(q_latent, q_rope, rows_cache, selected, cfg.attention_scale))
    fp8 = kv_cache_dtype == "fp8"
    index_bytes = batch * context * (128 * (1 if fp8 else 2) + (4 if fp8 else 0))
    mla_bytes = batch * min(context, cfg.index_topk) * ((512 + 16 if fp8 else 1024) + 128)
    roofline = (index_bytes + mla_bytes) / HBM * 1e3 / (t_index + t_mla) * 100

    x = torch.randn(batch, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
    rotary = Rotary(cfg, positions, torch.bfloat16)
    with torch.no_grad():
        t_paged = timed(lambda: layer(x, AttentionBatch(rotary, view.allowed, view), None))
        del cache, view, rows_cache, selected
        t_dense = None
        if not fp8:
            try:
                dense = KVCache(cfg, {0: True}, batch, context, torch.bfloat16, "cuda")
                dense_view = dense.decode_view(torch.arange(batch, device="cuda"), positions)
                t_dense = timed(lambda: layer(x, AttentionBatch(rotary, dense_view.allowed, dense_view), None))
                del dense, dense_view
            except torch.OutOfMemoryError:
                pass
    torch.cuda.empty_cache()

    def ms(t):
        return "OOM" if t is None else f"{t:.3f}"

    return (f"{kv_cache_dtype:>5} {context:>7} {batch:>5} {ms(t_index):>8} {ms(t_mla):>8} {roofline:>10.1f} "
            f"{ms(t_paged):>11} {ms(t_dense) if not fp8 else '-':>11}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    cfg = ModelConfig.from_dict({**GLM, "num_hidden_layers": 1, "mlp_layer_types": ["sparse"],
                                 "indexer_types": ["full"]})
    with torch.device("cuda"):
        layer = MLAttention(cfg, 0, 1, has_indexer=True).bfloat16()
    random_weights(layer)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per layer per decode step")
    print(f"{'cache':>5} {'context':>7} {'batch':>5} {'indexer':>8} {'mla':>8} {'roofline %':>10} "
          f"{'paged layer':>11} {'dense layer':>11}")
    for kv_cache_dtype in ("auto", "fp8"):
        for context in args.contexts:
            for batch in args.batches:
                print(run(cfg, layer, kv_cache_dtype, context, batch), flush=True)


if __name__ == "__main__":
    main()
