"""Decode attention per layer at GLM-5.2 widths on one GPU (TP 1: 64 heads, kv_lora 512, rope 64, indexer
32 heads x 128, index_topk 2048), bf16 weights, over contexts of 2k to 128k tokens for batches of 1 and 8
sequences (each decoding its token at the context's last position).

Per row: ms (CUDA-event median, replayed from a CUDA graph) of
- `scores`: the Triton indexer kernel over the paged indexer cache (ordering keys of every position);
- `top-k`: torch.topk of those keys and the rows of the best (`rows_of_best`);
- `mla`: the Triton absorbed sparse MLA over the selected rows;
- `roofline %`: the cache bytes these must read (every visible indexer key, then the selected latent + rope
  rows, each once per token) / 4.3 TB/s, against the sum of the three times;
- `paged layer`: the whole MLAttention forward over the paged cache (projections, indexer, top-k, sparse
  MLA, o_proj);
- `dense layer`: the same layer over today's dense KV cache (every cached latent decompressed through
  kv_b_proj, dense scores, the top-k as a mask), or OOM where it does not fit.
for the bf16 cache (kv-cache-dtype auto) and the FP8 cache. Then the indexer over a prefill: ms and TFLOP/s of
`indexer_order_keys` for 8192 tokens at positions 0 .. 8191 of one sequence (FLOPs: each token's visible
positions x 32 heads x 128 x 2), with the prefill tiles (the default's pick there) and with the decode tiles
(one token per program).

    python benchmarks/bench_sparse_attention.py [--contexts 2048 8192 32768 131072] [--batches 1 8]
    python benchmarks/bench_sparse_attention.py --sweep    # sparse MLA tile configs at a 32k context
    python benchmarks/bench_sparse_attention.py --prefill-sweep    # the same for 8192 tokens of a prefill
    python benchmarks/bench_sparse_attention.py --indexer-sweep    # indexer tile configs for that prefill
    python benchmarks/bench_sparse_attention.py --indexer-grid    # its programs per token tile, wide tables

`--indexer-grid`: ms of `indexer_order_keys(fill_past=False)` (the indexer of steps of up to 512 tokens, before
`topk_rows`) over block tables padded to a width, as the engine's CUDA graphs pad them to max_model_len, per
number of programs per token tile P: one per tile of the table (the grid before `indexer_programs`), the
default, and just enough for INDEXER_MIN_PROGRAMS in all; each with its grid (token tiles x P). Steps: 32 and
256 sequences at 1024 tokens, 31 at 1024 beside one at 128k, 64 at 1024 beside a 256-token prompt.
"""

import argparse

import torch
from bench_decode_step import parse_case
from bench_dp import GLM, random_weights
from timing import cuda_ms, graphed

from spmoe.config import ModelConfig
from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.runner.graphs import padded_tables
from spmoe.layers.attention import AttentionBatch, MLAttention
from spmoe.layers.paged_rows import quantize_index_vectors, write_index_key, write_latent
from spmoe.layers.rotary import Rotary
from spmoe.layers.sparse_attention import indexer_topk, rows_of_best, sparse_mla
from spmoe.layers.sparse_attention_triton import (
    INDEXER_DECODE_TILES,
    INDEXER_MIN_PROGRAMS,
    INDEXER_PREFILL_TILES,
    indexer_order_keys,
    indexer_programs,
    indexer_tiles,
)
from spmoe.layers.sparse_attention_triton import (
    sparse_mla as triton_sparse_mla,
)

HBM = 4.3e12
REPS = 20
SWEEP = [(h, k, w, 3) for h in (16, 32, 64) for k in (16, 32) for w in (4, 8)]
# prefill: 64 heads x 512 float32 accumulators per program need 8+ warps at 64 heads per tile
PREFILL_SWEEP = [
    (h, k, w, 2)
    for h in (16, 32, 64)
    for k in (16, 32, 64)
    for w in ((4, 8) if h < 64 else (8, 16))
]
PREFILL_TOKENS, PREFILL_CONTEXT = 8192, 32768
# the indexer's tiles (tokens per program, blocks per program, num_warps, num_stages) for a prefill of 8192 tokens
INDEXER_SWEEP = [(t, b, w, 3) for t in (2, 4, 8) for b in (4, 16) for w in (4, 8)]
# --indexer-grid's steps, as bench_decode_step's cases (`parse_case`)
GRID_STEPS = ("32x1024", "31x1024,1x131071", "256x1024", "64x1024,1x0+256")
# a power of 2 of blocks covering the step, or a max_model_len
GRID_WIDTHS = [
    "pow2",
    131072,
    1525184,
]


def fill(cache: PagedKVCache, tokens: int) -> None:
    """Random rows 0 .. tokens - 1 of layer 0, written through the cache's own write path in chunks."""
    gen, chunk = torch.Generator(device="cuda").manual_seed(0), 1 << 14
    # start is a multiple of BLOCK_SIZE: the chunk's blocks in order
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        table = torch.arange(
            start // BLOCK_SIZE, -(-(start + n) // BLOCK_SIZE), dtype=torch.int32, device="cuda"
        )
        view = cache.decode_view(
            table[None],
            torch.zeros(n, dtype=torch.long, device="cuda"),
            torch.arange(n, device="cuda"),
        )
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


def timed(fn) -> float | None:
    """Median ms of fn replayed from a CUDA graph (run eagerly once first); None if it runs out of memory."""
    try:
        fn()
        return cuda_ms(graphed(fn), REPS, warmup=2)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def kernel_inputs(cfg: ModelConfig, kv_cache_dtype: str, context: int, batch: int):
    """A one-layer paged cache of `batch` sequences of `context` random tokens, their decode view, and random
    queries -> (cache, view, indexer q, indexer weights, q_latent, q_rope)."""
    blocks = -(-context // BLOCK_SIZE)
    probe = PagedKVCache(cfg, {0: True}, 10**7, torch.bfloat16, "cuda", kv_cache_dtype)
    cache = PagedKVCache(
        cfg,
        {0: True},
        batch * blocks * BLOCK_SIZE * probe.bytes_per_token,
        torch.bfloat16,
        "cuda",
        kv_cache_dtype,
    )
    fill(cache, batch * blocks * BLOCK_SIZE)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    positions = torch.full((batch,), context - 1, device="cuda")
    view = cache.decode_view(tables, torch.arange(batch, device="cuda"), positions)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, 32, 128, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(batch, 32, device="cuda", generator=gen)
    if kv_cache_dtype == "fp8":
        q, q_scale = quantize_index_vectors(q)
        weights = weights * q_scale.squeeze(-1)
    q_latent = torch.randn(batch, 64, 512, device="cuda", generator=gen).bfloat16() * 0.05
    q_rope = torch.randn(batch, 64, 64, device="cuda", generator=gen).bfloat16() * 0.05
    return cache, view, q, weights, q_latent, q_rope


def run(cfg: ModelConfig, layer: MLAttention, kv_cache_dtype: str, context: int, batch: int) -> str:
    cache, view, q, weights, q_latent, q_rope = kernel_inputs(cfg, kv_cache_dtype, context, batch)
    rows_cache, positions = cache.layers[0], view.positions
    keys_args = (
        q,
        weights,
        rows_cache,
        view.block_tables,
        view.seq_index,
        view.positions,
        BLOCK_SIZE,
    )
    keys = indexer_order_keys(*keys_args)
    selected = indexer_topk(*keys_args[:6], cfg.index_topk, BLOCK_SIZE)
    t_scores = timed(lambda: indexer_order_keys(*keys_args))
    t_topk = timed(
        lambda: rows_of_best(keys, cfg.index_topk, view.block_tables, view.seq_index, BLOCK_SIZE)
    )
    t_mla = timed(lambda: sparse_mla(q_latent, q_rope, rows_cache, selected, cfg.attention_scale))
    fp8 = kv_cache_dtype == "fp8"
    index_bytes = batch * context * (128 * (1 if fp8 else 2) + (4 if fp8 else 0))
    mla_bytes = batch * min(context, cfg.index_topk) * ((512 + 16 if fp8 else 1024) + 128)
    roofline = (index_bytes + mla_bytes) / HBM * 1e3 / (t_scores + t_topk + t_mla) * 100

    x = torch.randn(
        batch,
        cfg.hidden_size,
        device="cuda",
        generator=torch.Generator(device="cuda").manual_seed(2),
    )
    x = x.bfloat16()
    rotary = Rotary(cfg, positions, torch.bfloat16)
    with torch.no_grad():
        t_paged = timed(lambda: layer(x, AttentionBatch(rotary, view.allowed, view), None))
        del cache, view, rows_cache, selected, keys
        t_dense = None
        if not fp8:
            try:
                dense = KVCache(cfg, {0: True}, batch, context, torch.bfloat16, "cuda")
                dense_view = dense.decode_view(torch.arange(batch, device="cuda"), positions)
                t_dense = timed(
                    lambda: layer(x, AttentionBatch(rotary, dense_view.allowed, dense_view), None)
                )
                del dense, dense_view
            except torch.OutOfMemoryError:
                pass
    torch.cuda.empty_cache()

    def ms(t):
        return "OOM" if t is None else f"{t:.3f}"

    return (
        f"{kv_cache_dtype:>5} {context:>7} {batch:>5} {ms(t_scores):>7} {ms(t_topk):>7} {ms(t_mla):>7} "
        f"{roofline:>10.1f} {ms(t_paged):>11} {ms(t_dense) if not fp8 else '-':>11}"
    )


def sweep(cfg: ModelConfig) -> None:
    """ms of the sparse MLA kernel per tile config (heads per tile, rows per tile, num_warps) at a 32k context."""
    print(f"{'cache':>5} {'batch':>5} " + " ".join(f"{f'{h}/{k}/{w}':>9}" for h, k, w, _ in SWEEP))
    for kv_cache_dtype in ("auto", "fp8"):
        for batch in (1, 8):
            cache, view, q, weights, q_latent, q_rope = kernel_inputs(
                cfg, kv_cache_dtype, 32768, batch
            )
            selected = indexer_topk(
                q,
                weights,
                cache.layers[0],
                view.block_tables,
                view.seq_index,
                view.positions,
                cfg.index_topk,
                BLOCK_SIZE,
            )
            times = []
            for tiles in SWEEP:
                try:
                    t = timed(
                        lambda: triton_sparse_mla(
                            q_latent, q_rope, cache.layers[0], selected, 0.1, tiles
                        )
                    )
                    times.append(f"{t:>9.4f}")
                except Exception as e:  # a config that does not compile (registers, shared memory)
                    times.append(f"{type(e).__name__[:9]:>9}")
            print(f"{kv_cache_dtype:>5} {batch:>5} " + " ".join(times), flush=True)
            del cache, view
            torch.cuda.empty_cache()


def prefill_sweep(cfg: ModelConfig) -> None:
    """ms and TFLOP/s of the sparse MLA kernel per tile config (heads per tile, rows per tile, num_warps,
    num_stages) for PREFILL_TOKENS tokens, each over index_topk distinct random rows of a PREFILL_CONTEXT-token
    cache: the PREFILL_SWEEP grid at 2 stages with the bf16 cache, its 2 fastest at 1 and 3 stages, then the 4
    fastest of all with the FP8 cache. Ends with the config of the least bf16 + FP8 time."""
    n, topk = PREFILL_TOKENS, cfg.index_topk
    flops = n * 2 * 64 * topk * (512 + 64 + 512)
    gen = torch.Generator(device="cuda").manual_seed(3)
    selected = torch.rand(n, PREFILL_CONTEXT, device="cuda", generator=gen).topk(topk).indices
    q_latent = torch.randn(n, 64, 512, device="cuda", generator=gen).bfloat16() * 0.05
    q_rope = torch.randn(n, 64, 64, device="cuda", generator=gen).bfloat16() * 0.05
    print(f"{'cache':>5} {'tokens':>6} {'tiles h/k/warps/stages':>22} {'ms':>8} {'TFLOP/s':>8}")
    results = {}
    for kv_cache_dtype in ("auto", "fp8"):
        cache = kernel_inputs(cfg, kv_cache_dtype, PREFILL_CONTEXT, 1)[0]

        def time_configs(configs):
            for tiles in configs:
                try:
                    t = cuda_ms(
                        lambda: triton_sparse_mla(
                            q_latent, q_rope, cache.layers[0], selected, 0.1, tiles
                        ),
                        5,
                        warmup=1,
                    )
                except Exception as e:  # a config that does not compile (registers, shared memory)
                    print(
                        f"{kv_cache_dtype:>5} {n:>6} {'/'.join(map(str, tiles)):>22} {type(e).__name__}",
                        flush=True,
                    )
                    continue
                results[kv_cache_dtype, tiles] = t
                print(
                    f"{kv_cache_dtype:>5} {n:>6} {'/'.join(map(str, tiles)):>22} {t:>8.3f} {flops / t / 1e9:>8.1f}",
                    flush=True,
                )

        def fastest(count):
            timed_bf16 = [tiles for dtype, tiles in results if dtype == "auto"]
            return sorted(timed_bf16, key=lambda tiles: results["auto", tiles])[:count]

        if kv_cache_dtype == "auto":
            time_configs(PREFILL_SWEEP)
            time_configs([(*tiles[:3], s) for tiles in fastest(2) for s in (1, 3)])
        else:
            time_configs(fastest(4))
        del cache
        torch.cuda.empty_cache()
    both = [tiles for dtype, tiles in results if dtype == "fp8" and ("auto", tiles) in results]
    best = min(both, key=lambda tiles: results["auto", tiles] + results["fp8", tiles])
    print("best prefill tiles:", " ".join(map(str, best)))


def indexer_prefill(cfg: ModelConfig, configs: list, fp8_best: int = 0) -> None:
    """ms and TFLOP/s of `indexer_order_keys` for PREFILL_TOKENS tokens at positions 0 .. PREFILL_TOKENS - 1 of
    one sequence, per tile config with the bf16 cache, then with the FP8 cache the same configs (fp8_best = 0)
    or the fp8_best fastest of bf16."""
    n = PREFILL_TOKENS
    flops = 2 * cfg.index_n_heads * cfg.index_head_dim * n * (n + 1) / 2
    print(f"indexer over a prefill: {n} tokens at positions 0 .. {n - 1} of one sequence")
    print(
        f"{'cache':>5} {'tokens':>6} {'tiles tokens/blocks/warps/stages':>32} {'ms':>8} {'TFLOP/s':>8}"
    )
    results = {}
    for kv_cache_dtype in ("auto", "fp8"):
        cache, view, *_ = kernel_inputs(cfg, kv_cache_dtype, n, 1)
        view = cache.decode_view(
            view.block_tables,
            torch.zeros(n, dtype=torch.long, device="cuda"),
            torch.arange(n, device="cuda"),
        )
        gen = torch.Generator(device="cuda").manual_seed(4)
        q = torch.randn(
            n, cfg.index_n_heads, cfg.index_head_dim, device="cuda", generator=gen
        ).bfloat16()
        weights = torch.rand(n, cfg.index_n_heads, device="cuda", generator=gen)
        if kv_cache_dtype == "fp8":
            q, q_scale = quantize_index_vectors(q)
            weights = weights * q_scale.squeeze(-1)
        args = (
            q,
            weights,
            cache.layers[0],
            view.block_tables,
            view.seq_index,
            view.positions,
            BLOCK_SIZE,
        )
        bf16_times = sorted((t, tiles) for (dtype, tiles), t in results.items() if dtype == "auto")
        for tiles in (
            configs
            if kv_cache_dtype == "auto" or not fp8_best
            else [c for _, c in bf16_times[:fp8_best]]
        ):
            name = "/".join(map(str, tiles))
            try:
                t = cuda_ms(lambda: indexer_order_keys(*args, tiles=tiles), 5, warmup=1)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                print(f"{kv_cache_dtype:>5} {n:>6} {name:>32} {type(e).__name__}", flush=True)
                continue
            results[kv_cache_dtype, tiles] = t
            print(
                f"{kv_cache_dtype:>5} {n:>6} {name:>32} {t:>8.3f} {flops / t / 1e9:>8.1f}",
                flush=True,
            )
        del cache, view, args
        torch.cuda.empty_cache()
    if fp8_best:
        both = [tiles for dtype, tiles in results if dtype == "fp8" and ("auto", tiles) in results]
        best = min(both, key=lambda tiles: results["auto", tiles] + results["fp8", tiles])
        print("best indexer prefill tiles:", " ".join(map(str, best)))


def indexer_grid(cfg: ModelConfig) -> None:
    """ms of `indexer_order_keys(fill_past=False)` for each of GRID_STEPS over tables of each of GRID_WIDTHS, per
    programs per token tile (see the module docstring), with the bf16 and the FP8 cache."""
    print(
        "indexer over tables padded to a width: ms (CUDA graph) per programs per token tile P, grid T x P"
    )
    print(
        f"{'cache':>5} {'step':>18} {'width:blocks':>13} {'per tile':>22} {'default':>22} {'fewest':>22}"
    )
    used = lambda parts: sum(b * -(-(c + t) // BLOCK_SIZE) for b, c, t in parts)  # noqa: E731
    steps = {name: parse_case(name) for name in GRID_STEPS}
    most = max(used(parts) for parts in steps.values())
    for kv_cache_dtype in ("auto", "fp8"):
        cache = kernel_inputs(cfg, kv_cache_dtype, most * BLOCK_SIZE, 1)[0]
        gen = torch.Generator(device="cuda").manual_seed(5)
        for name, parts in steps.items():
            tables, seq_index, positions, first = [], [], [], 0
            for batch, context, tokens in parts:
                blocks = -(-(context + tokens) // BLOCK_SIZE)
                for _ in range(batch):
                    seq_index += [len(tables)] * tokens
                    positions += range(context, context + tokens)
                    tables.append(list(range(first, first + blocks)))
                    first += blocks
            n = len(positions)
            q = torch.randn(
                n, cfg.index_n_heads, cfg.index_head_dim, device="cuda", generator=gen
            ).bfloat16()
            weights = torch.rand(n, cfg.index_n_heads, device="cuda", generator=gen)
            if kv_cache_dtype == "fp8":
                q, q_scale = quantize_index_vectors(q)
                weights = weights * q_scale.squeeze(-1)
            step = (torch.tensor(seq_index, device="cuda"), torch.tensor(positions, device="cuda"))
            for width in GRID_WIDTHS:
                longest = max(len(t) for t in tables)
                blocks = (
                    1 << (longest - 1).bit_length() if width == "pow2" else -(-width // BLOCK_SIZE)
                )
                padded = torch.from_numpy(
                    padded_tables(tables, len(tables), blocks, cache.scratch_block)
                ).cuda()
                args = (q, weights, cache.layers[0], padded, *step, BLOCK_SIZE)
                tokens, per_tile = indexer_tiles(n, blocks)[:2]
                token_tiles, block_tiles = -(-n // tokens), -(-blocks // per_tile)
                cells = []
                for programs in (
                    block_tiles,
                    indexer_programs(token_tiles, block_tiles),
                    min(block_tiles, -(-INDEXER_MIN_PROGRAMS // token_tiles)),
                ):
                    t = timed(lambda: indexer_order_keys(*args, fill_past=False, programs=programs))
                    cells.append(f"{'OOM' if t is None else f'{t:.4f}'} ({token_tiles}x{programs})")
                print(
                    f"{kv_cache_dtype:>5} {name:>18} {f'{width}:{blocks}':>13} "
                    + " ".join(f"{c:>22}" for c in cells),
                    flush=True,
                )
        del cache
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--sweep", action="store_true", help="time the sparse MLA tile configs instead"
    )
    parser.add_argument(
        "--prefill-sweep",
        action="store_true",
        help="time the sparse MLA tile configs for a prefill of 8192 tokens instead",
    )
    parser.add_argument(
        "--indexer-sweep",
        action="store_true",
        help="time the indexer tile configs for a prefill of 8192 tokens instead",
    )
    parser.add_argument(
        "--indexer-grid",
        action="store_true",
        help="time the indexer's programs per token tile over tables padded to max_model_len instead",
    )
    args = parser.parse_args()
    cfg = ModelConfig.from_dict(
        {**GLM, "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "indexer_types": ["full"]}
    )
    with torch.device("cuda"):
        layer = MLAttention(cfg, 0, 1, has_indexer=True).bfloat16()
    random_weights(layer)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per layer per decode step"
    )
    if args.sweep:
        return sweep(cfg)
    if args.prefill_sweep:
        return prefill_sweep(cfg)
    if args.indexer_sweep:
        return indexer_prefill(cfg, INDEXER_SWEEP, fp8_best=4)
    if args.indexer_grid:
        return indexer_grid(cfg)
    print(
        f"{'cache':>5} {'context':>7} {'batch':>5} {'scores':>7} {'top-k':>7} {'mla':>7} {'roofline %':>10} "
        f"{'paged layer':>11} {'dense layer':>11}"
    )
    for kv_cache_dtype in ("auto", "fp8"):
        for context in args.contexts:
            for batch in args.batches:
                print(run(cfg, layer, kv_cache_dtype, context, batch), flush=True)
    indexer_prefill(cfg, [INDEXER_PREFILL_TILES, INDEXER_DECODE_TILES])


if __name__ == "__main__":
    main()
