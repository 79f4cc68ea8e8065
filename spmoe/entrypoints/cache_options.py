"""The KV cache options that `spmoe generate` and `spmoe serve` share: on the command line, and the cache they
build."""

from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import DEFAULT_GPU_MEMORY_UTILIZATION, KV_CACHE_DTYPES, PagedKVCache, build_paged_cache


def add_kv_cache_args(p, cpu_default: str) -> None:
    """The KV cache options `generate` and `serve` share; `cpu_default` says what the paged cache holds on CPU
    without --kv-cache-memory."""
    p.add_argument(
        "--kv-cache",
        choices=["paged", "dense"],
        default="paged",
        help="paged (default): blocks of 64 tokens handed out as sequences grow, sparse DSA attention; "
        "dense: one slot of --max-model-len positions per sequence, dense attention (the reference)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        metavar="GIB",
        help=f"paged cache size in GiB per rank (default: on CUDA --gpu-memory-utilization "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION}; on CPU {cpu_default})",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="paged cache as this share of the GPU memory free once the weights are loaded (CUDA)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="paged cache: auto (the model dtype, default) or fp8 (the latent in e4m3 with a scale per 128 "
        "values, the indexer key in e4m3 with one scale)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens one step feeds (default 8192): decode tokens first, then prompts in chunks",
    )


def kv_cache_options(args) -> dict:
    return {
        "kv_cache": args.kv_cache,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }


def build_kv_cache(model, opts, max_num_seqs: int, max_len: int) -> KVCache | PagedKVCache:
    """The cache that `opts` (fields as `kv_cache_options` names them) asks for: dense, one slot of `max_len`
    positions for each of `max_num_seqs` sequences; or paged (`build_paged_cache`: on CPU without a size, room
    for `max_num_seqs` x `max_len` tokens)."""
    if opts.kv_cache == "dense":
        return KVCache.for_model(model, max_num_seqs, max_len)
    return build_paged_cache(
        model, opts.kv_cache_memory, opts.gpu_memory_utilization, opts.kv_cache_dtype, max_num_seqs, max_len
    )
