"""What the engine options (`EngineArgs`) build, on every rank: the model, the KV cache, the engine
(with its channel to the other ranks: `ranks.channel`)."""

import torch

from spmoe.config import ParallelConfig
from spmoe.engine.args import EngineArgs
from spmoe.engine.cache.paged import PagedKVCache, build_paged_cache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.engine import Engine
from spmoe.engine.ranks import channel
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.engine.speculation import Speculation
from spmoe.models.deepseek_v32 import weights


def describe(args: EngineArgs, parallel: ParallelConfig) -> str:
    """One line for the start of a job: the layout, speculation, dtype and device."""
    sp = "on" if parallel.use_sequence_parallel_moe else "off"
    graphs = ""
    if args.cuda_graphs:
        graphs = ", CUDA graphs"
    elif args.cuda_graphs is None and not args.enforce_eager and args.device == "cuda":
        graphs = ", CUDA graphs where they apply"
    return (
        f"tp={args.tp}, dp={args.dp}, sequence-parallel MoE {sp} (--sp {args.sp}, scope "
        f"{args.sp_scope}), {drafting(args.speculation)}"
        f"{args.dtype} on {args.device}{graphs}"
        f"{', dummy weights' if args.load_format == 'dummy' else ''}"
        f"{', SIMULATED RANK (rank 0 alone; measurement only)' if args.simulate_rank else ''}"
    )


def drafting(speculation: Speculation) -> str:
    """`MTP with 3 drafts, `, `ngram with 8 drafts, `, `MTP + suffix with 8 drafts,
    `, or nothing."""
    if not speculation.num_speculative_tokens:
        return ""
    sources = [s for s in ("MTP" if speculation.mtp else None, speculation.lookup_name) if s]
    return f"{' + '.join(sources)} with {speculation.num_speculative_tokens} drafts, "


def load_model(args: EngineArgs, model_dir: str, device: torch.device):
    """This rank's model: the checkpoint's weights, or random ones (`--load-format dummy`), under
    `--hf-overrides`."""
    return weights.load_model(
        model_dir,
        args.parallel_config(),
        args.torch_dtype,
        device,
        with_mtp=args.speculation.mtp_drafts > 0,
        load_format=args.load_format,
        overrides=args.hf_overrides,
    )


def build_kv_cache(
    args: EngineArgs, model, max_num_seqs: int, max_len: int
) -> KVCache | PagedKVCache:
    """Dense: one slot of `max_len` positions for each of `max_num_seqs` sequences; or paged
    (`build_paged_cache`: on CPU without a size, room for `max_num_seqs` x `max_len` tokens; on
    CUDA, room for at least one sequence of `max_len`)."""
    if args.kv_cache == "dense":
        return KVCache.for_model(model, max_num_seqs, max_len)
    return build_paged_cache(
        model,
        args.kv_cache_memory,
        args.gpu_memory_utilization,
        args.kv_cache_dtype,
        max_num_seqs,
        max_len,
    )


def cache_room(cache: KVCache | PagedKVCache, longest: int) -> float:
    """How many sequences of `longest` positions `cache` holds at once (vLLM's "maximum
    concurrency")."""
    if isinstance(cache, KVCache):
        return cache.max_seqs if longest <= cache.max_len else 0
    return cache.capacity_tokens / longest


def build_engine(
    args: EngineArgs,
    model,
    max_num_seqs: int,
    cache_len: int,
    grammars: GrammarCompiler | None = None,
    log=None,
) -> Engine:
    """The engine over a new KV cache for `max_num_seqs` sequences of `cache_len` positions (the
    dense cache's slots; the paged cache's default room on CPU; without --max-model-len, the longest
    sequence, which sets the width of the graphs' block tables), its CUDA graphs captured
    (`log(line)`: progress), keeping in step with the other ranks; `grammars`: for structured-output
    requests. `warmup.warm_up` then makes it ready."""
    cache = build_kv_cache(args, model, max_num_seqs, cache_len)
    if log is not None:
        longest = args.max_model_len or cache_len
        log(f"{cache.describe()}; {cache_room(cache, longest):.3g} sequences of {longest} tokens")
    return Engine(
        model,
        cache,
        speculation=args.speculation,
        cuda_graphs=args.use_cuda_graphs(model),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # the graphs' block tables: as wide as the job's longest sequence
        max_model_len=args.max_model_len or cache_len,
        enable_prefix_caching=args.prefix_caching,
        grammars=grammars,
        log=log,
        ranks=channel(),
    )
