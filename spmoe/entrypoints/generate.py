"""Generation on T local ranks: the job behind `spmoe generate` and `spmoe demo`."""

import sys
import time
from dataclasses import dataclass

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state, launch
from spmoe.engine.engine import Engine, Generation, check_prompts, check_speculation, per_prompt
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import build_paged_cache, check_paged_budget
from spmoe.engine.sampling import SamplingParams
from spmoe.entrypoints.jobs import DTYPES, gather_from_dp, split_for_dp


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 0  # MTP drafts per step; 0 = no speculation
    eos_token_ids: tuple[int, ...] | None = None  # None: the checkpoint's eos_token_id
    max_seqs: int | None = None  # KV cache slots; None: one per prompt
    max_model_len: int | None = None  # KV cache positions per sequence; None: what the longest prompt needs
    dtype: str = "float32"
    record_logits: bool = False  # return the logits row behind every generated token
    progress: bool = True  # rank 0 prints a progress line to stderr
    cuda_graphs: bool = False  # replay decode steps from CUDA graphs (engine/cuda_graphs.py)
    kv_cache: str = "paged"  # "paged" (sparse DSA attention) or "dense" (slots, dense attention: the reference)
    kv_cache_memory: float | None = None  # paged cache GiB per rank; None: see `build_paged_cache`
    gpu_memory_utilization: float | None = None  # paged cache as this share of free GPU memory (CUDA)
    kv_cache_dtype: str = "auto"  # paged cache: "auto" (the model dtype) or "fp8"
    max_num_batched_tokens: int = 8192  # tokens one step feeds; longer prompts are prefilled in chunks

    def cache_len(self, prompts: list[list[int]]) -> int:
        return self.max_model_len or max(map(len, prompts)) + self.max_new_tokens + self.num_speculative_tokens


def _rank_generate(model_dir: str, parallel: ParallelConfig, prompts: list[list[int]], opts: GenerateOptions):
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    model = load_model(model_dir, parallel, DTYPES[opts.dtype], state.device,
                       with_mtp=opts.num_speculative_tokens > 0)
    mine = split_for_dp(prompts, state.dp_rank, state.dp_size)  # this DP rank's prompts (maybe none)
    sampling = split_for_dp(per_prompt(opts.sampling, len(prompts)), state.dp_rank, state.dp_size)
    seqs = max(1, opts.max_seqs or len(mine))
    if opts.kv_cache == "dense":
        cache = KVCache.for_model(model, seqs, opts.cache_len(prompts))
    else:
        cache = build_paged_cache(model, opts.kv_cache_memory, opts.gpu_memory_utilization, opts.kv_cache_dtype,
                                  seqs, opts.cache_len(prompts))
    eos = model.cfg.eos_token_ids if opts.eos_token_ids is None else opts.eos_token_ids
    engine = Engine(model, cache, opts.num_speculative_tokens, opts.cuda_graphs, seqs, opts.max_num_batched_tokens,
                    opts.max_model_len)
    budget, began, last = len(mine) * opts.max_new_tokens, time.perf_counter(), [0.0]
    live_terminal = sys.stderr.isatty()

    def show(done: int, live: int) -> None:  # a line rewritten in place on a terminal, else one every 5 s
        now = time.perf_counter()
        if now - last[0] >= (0.5 if live_terminal else 5.0) or live == 0:
            last[0] = now
            print(f"{chr(13) if live_terminal else ''}generating: {done}/{budget} tokens, {live} live sequences, "
                  f"{done / (now - began):.1f} tokens/s", end="" if live_terminal and live else "\n",
                  file=sys.stderr, flush=True)

    gen = engine.generate(mine, opts.max_new_tokens, sampling, eos, opts.record_logits,
                          on_step=show if opts.progress and state.rank == 0 else None)
    outputs = gather_from_dp(gen.outputs, state.dp_size)
    logits = gather_from_dp(gen.logits, state.dp_size) if opts.record_logits else None
    if state.rank != 0:
        return None
    generated = sum(map(len, outputs))  # every DP rank's tokens; the ranks step together, so rank 0's clock
    gen.stats.update(generated_tokens=generated, tokens_per_s=generated / gen.stats["seconds"],
                     data_parallel_size=state.dp_size)
    return Generation(outputs, gen.stats, logits)


def run_generate(model_dir: str, parallel: ParallelConfig, prompts: list[list[int]], opts: GenerateOptions,
                 device: str = "cpu"):
    """-> rank 0's `Generation` (outputs, stats, optional logits); None on the other ranks under torchrun.
    Validates before starting any rank."""
    cfg = ModelConfig.from_file(model_dir)
    cfg.check_parallel(parallel)
    if opts.num_speculative_tokens and not cfg.num_nextn_predict_layers:
        raise ValueError(f"--speculative mtp needs an MTP layer; {model_dir} has num_nextn_predict_layers = 0")
    check_prompts(prompts, cfg.vocab_size, opts.max_new_tokens, opts.num_speculative_tokens, opts.cache_len(prompts))
    if opts.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {opts.max_num_batched_tokens}")
    if opts.kv_cache == "paged":
        check_paged_budget(cfg, opts.num_speculative_tokens > 0, DTYPES[opts.dtype], opts.kv_cache_dtype,
                           opts.kv_cache_memory, opts.gpu_memory_utilization, device,
                           max(map(len, prompts)) + opts.max_new_tokens + opts.num_speculative_tokens)
    elif (opts.kv_cache_memory, opts.gpu_memory_utilization, opts.kv_cache_dtype) != (None, None, "auto"):
        raise ValueError("--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged cache; "
                         "got them with --kv-cache dense")
    check_speculation(opts.sampling, opts.num_speculative_tokens)
    return launch(_rank_generate, parallel.world_size, model_dir, parallel, prompts, opts, config=parallel,
                  device=device)
