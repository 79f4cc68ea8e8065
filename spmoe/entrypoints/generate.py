"""Generation on T local ranks: the job behind `spmoe generate` and `spmoe demo`."""

import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state, launch
from spmoe.engine.cuda_graphs import deployment_problems
from spmoe.engine.engine import Engine, Generation, check_positions, check_prompts, check_speculation, per_prompt
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import check_paged_budget
from spmoe.engine.sampling import SamplingParams
from spmoe.entrypoints.cache_options import build_kv_cache
from spmoe.entrypoints.jobs import DTYPES, check_device, check_writable, gather_from_dp, split_for_dp


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 0  # MTP drafts per step; 0 = no speculation
    eos_token_ids: tuple[int, ...] | None = None  # None: the checkpoint's eos_token_id
    max_num_seqs: int | None = None  # sequences decoded at once; None: every prompt of this DP group
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
        if self.max_model_len is not None:
            return self.max_model_len
        return max(map(len, prompts)) + self.max_new_tokens + self.num_speculative_tokens

    def cache_slots(self, prompts_here: int) -> int:
        """Sequences decoded at once on a rank whose DP group takes `prompts_here` prompts (the slots of the dense
        cache; the default room of the paged cache on CPU)."""
        return max(1, self.max_num_seqs or prompts_here)


def rank_generate(model_dir: str, parallel: ParallelConfig, prompts: list[list[int]], opts: GenerateOptions):
    """The job on one rank (of a launch with the same TP and DP sizes as `parallel`) -> rank 0's `Generation`,
    None on the other ranks."""
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    model = load_model(model_dir, parallel, DTYPES[opts.dtype], state.device, with_mtp=opts.num_speculative_tokens > 0)
    mine = split_for_dp(prompts, state.dp_rank, state.dp_size)  # this DP rank's prompts (maybe none)
    sampling = split_for_dp(per_prompt(opts.sampling, len(prompts)), state.dp_rank, state.dp_size)
    seqs = opts.cache_slots(len(mine))
    cache = build_kv_cache(model, opts, seqs, opts.cache_len(prompts))
    eos = model.cfg.eos_token_ids if opts.eos_token_ids is None else opts.eos_token_ids
    engine = Engine(
        model,
        cache,
        opts.num_speculative_tokens,
        opts.cuda_graphs,
        seqs,
        opts.max_num_batched_tokens,
        opts.max_model_len,
    )
    budget, began, last = len(mine) * opts.max_new_tokens, time.perf_counter(), [0.0]
    prompt_tokens = sum(map(len, mine))
    live_terminal = sys.stderr.isatty()
    line_start = "\r\x1b[K" if live_terminal else ""  # on a terminal: back to the line's start, clear it

    def show(done: int, live: int, prefilled: int) -> None:  # rewritten in place on a terminal, else every 5 s
        now = time.perf_counter()
        if now - last[0] >= (0.5 if live_terminal else 5.0) or live == 0:
            last[0] = now
            prefill = f"prefilled {prefilled}/{prompt_tokens} prompt tokens, " if prefilled < prompt_tokens else ""
            print(
                f"{line_start}generating: {prefill}{done}/{budget} tokens, {live} live "
                f"sequences, {done / (now - began):.1f} tokens/s",
                end="" if live_terminal and live else "\n",
                file=sys.stderr,
                flush=True,
            )

    gen = engine.generate(
        mine,
        opts.max_new_tokens,
        sampling,
        eos,
        opts.record_logits,
        on_step=show if opts.progress and state.rank == 0 else None,
    )
    outputs = gather_from_dp(gen.outputs, state.dp_size)
    logits = gather_from_dp(gen.logits, state.dp_size) if opts.record_logits else None
    if state.rank != 0:
        return None
    generated = sum(map(len, outputs))  # every DP rank's tokens; the ranks step together, so rank 0's clock
    gen.stats.update(
        generated_tokens=generated, tokens_per_s=generated / gen.stats["seconds"], data_parallel_size=state.dp_size
    )
    return Generation(outputs, gen.stats, logits)


def check_generate(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    prompts: list[list[int]],
    opts: GenerateOptions,
    device: str = "cpu",
    outputs: dict[str, str] | None = None,
) -> None:
    """Every check of a generate job, before any rank starts or any weight loads: the parallel layout and the
    device, the output paths (`outputs`: option name -> path the caller will write), every numeric option,
    the option combinations, the prompts against the KV cache and `max_position_embeddings`, and the KV cache
    against the memory available."""
    cfg.check_parallel(parallel)
    check_device(device, parallel.world_size)
    for option, path in (outputs or {}).items():
        check_writable(path, option)
    drafts = opts.num_speculative_tokens
    if drafts < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {drafts}")
    if drafts and not cfg.num_nextn_predict_layers:
        raise ValueError("--speculative mtp needs an MTP layer; the checkpoint has num_nextn_predict_layers = 0")
    check_speculation(opts.sampling, drafts)
    if opts.cuda_graphs:
        problems = deployment_problems(device, parallel.data_parallel_size, parallel.ep_backend)
        problems += ["no speculative decoding (it runs eagerly)"] if drafts else []
        if problems:
            raise ValueError("--cuda-graphs needs " + "; ".join(problems))
    for name, value in (("--max-num-seqs", opts.max_num_seqs), ("--max-model-len", opts.max_model_len)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for eos in opts.eos_token_ids or ():
        if not 0 <= eos < cfg.vocab_size:
            raise ValueError(f"--eos-id {eos} is not a token id: expected an int in [0, {cfg.vocab_size})")
    cache_len = opts.cache_len(prompts)
    check_prompts(prompts, cfg.vocab_size, opts.max_new_tokens, drafts, cache_len)
    longest = max(map(len, prompts)) + opts.max_new_tokens + drafts
    check_positions(
        longest,
        cfg.max_position_embeddings,
        f"the longest prompt ({max(map(len, prompts))} tokens) with {opts.max_new_tokens} new tokens "
        f"and {drafts} speculative tokens",
    )
    check_positions(cache_len, cfg.max_position_embeddings, "--max-model-len")
    if opts.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {opts.max_num_batched_tokens}")
    if opts.kv_cache == "paged":
        check_paged_budget(
            cfg,
            drafts > 0,
            DTYPES[opts.dtype],
            opts.kv_cache_dtype,
            opts.kv_cache_memory,
            opts.gpu_memory_utilization,
            device,
            longest,
        )
        if device == "cuda" or opts.kv_cache_memory is not None:
            return  # sized from the free GPU memory, or a budget the user chose
        # on CPU the default paged cache holds what the slot cache would: the same memory check applies
    elif (opts.kv_cache_memory, opts.gpu_memory_utilization, opts.kv_cache_dtype) != (None, None, "auto"):
        raise ValueError(
            "--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged cache; "
            "got them with --kv-cache dense"
        )
    slots = opts.cache_slots(math.ceil(len(prompts) / parallel.data_parallel_size))
    check_kv_cache_memory(cfg, drafts > 0, slots, cache_len, opts.dtype, device, parallel.world_size)


def check_kv_cache_memory(
    cfg: ModelConfig, with_mtp: bool, slots: int, max_len: int, dtype: str, device: str, world_size: int
) -> None:
    """Raise if the KV cache alone cannot fit, before anything is allocated. Each rank holds a whole cache.

    CPU: the ranks on this machine (all of them when spawned; LOCAL_WORLD_SIZE under torchrun) share the
    memory, so their caches together are compared with MemAvailable (/proc/meminfo). CUDA: one rank per GPU;
    its cache is compared with the GPU's total memory, which can be read without creating a CUDA context in
    this process (the free memory cannot); the weights are not counted, so this is a bound, not a promise."""
    layers = {
        i: cfg.layer_has_indexer(i)
        for i in range(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0))
    }
    per_rank = KVCache.size_bytes(cfg, layers, slots, max_len, DTYPES[dtype])
    if device == "cuda":
        ranks, available, where = 1, torch.cuda.get_device_properties(0).total_memory, "one GPU's total memory"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "WORLD_SIZE" in os.environ else world_size
        available, where = _cpu_memory_available(), "MemAvailable"
    if per_rank * ranks > available:
        raise ValueError(
            f"the KV cache needs {per_rank * ranks / 2**30:.1f} GiB ({ranks} rank(s) x {slots + 1} "
            f"slots, 1 of them scratch, x {max_len} positions x {per_rank // ((slots + 1) * max_len)} B "
            f"per token), more than {where}, {available / 2**30:.1f} GiB: lower --max-model-len or "
            f"--max-num-seqs"
        )


def _cpu_memory_available() -> int:
    """Bytes of memory available to new allocations: MemAvailable from /proc/meminfo (Linux), else the free
    physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_generate(
    model_dir: str, parallel: ParallelConfig, prompts: list[list[int]], opts: GenerateOptions, device: str = "cpu"
):
    """-> rank 0's `Generation` (outputs, stats, optional logits); None on the other ranks under torchrun.
    Validates before starting any rank."""
    check_generate(ModelConfig.from_file(model_dir), parallel, prompts, opts, device)
    return launch(
        rank_generate, parallel.world_size, model_dir, parallel, prompts, opts, config=parallel, device=device
    )
