"""Generation on T local ranks: the job behind `spmoe generate` and `spmoe demo`."""

import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state, launch
from spmoe.engine.args import DTYPES, EngineArgs
from spmoe.engine.build import build_engine, load_model
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.engine import check_capacity, check_positions, per_prompt
from spmoe.engine.ranks import Generation, generate
from spmoe.engine.request import SamplingParams
from spmoe.engine.warmup import warm_up
from spmoe.entrypoints.jobs import check_writable, gather_from_dp, split_for_dp


@dataclass(frozen=True)
class GenerateOptions:
    """The job's own options; the engine's are `engine`."""

    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] | None = None  # None: the checkpoint's eos_token_id
    record_logits: bool = False  # return the logits row behind every generated token
    progress: bool = True  # rank 0 prints a progress line to stderr
    engine: EngineArgs = field(default_factory=EngineArgs)

    def cache_len(self, prompts: list[list[int]]) -> int:
        """KV cache positions per sequence: --max-model-len, else what the longest prompt needs."""
        if self.engine.max_model_len is not None:
            return self.engine.max_model_len
        return max(map(len, prompts)) + self.max_new_tokens + self.engine.drafts

    def cache_slots(self, prompts_here: int) -> int:
        """Sequences decoded at once on a rank whose DP group takes `prompts_here` prompts (the
        slots of the dense cache; the default room of the paged cache on CPU)."""
        return max(1, self.engine.max_num_seqs or prompts_here)


def rank_generate(model_dir: str, prompts: list[list[int]], opts: GenerateOptions):
    """The job on one rank (of a launch with the TP and DP sizes of `opts.engine`) -> rank 0's
    `Generation`, None on the other ranks."""
    state, args = get_parallel_state(), opts.engine
    model = load_model(args, model_dir, state.device)
    # this DP rank's prompts (maybe none)
    mine = split_for_dp(prompts, state.dp_rank, state.dp_size)
    sampling = split_for_dp(per_prompt(opts.sampling, len(prompts)), state.dp_rank, state.dp_size)
    log = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if opts.progress and state.rank == 0
        else None
    )
    engine = build_engine(
        args, model, opts.cache_slots(len(mine)), opts.cache_len(prompts), log=log
    )
    warm_up(engine, log)
    eos = model.cfg.eos_token_ids if opts.eos_token_ids is None else opts.eos_token_ids
    budget, began, last = len(mine) * opts.max_new_tokens, time.perf_counter(), [0.0]
    prompt_tokens = sum(map(len, mine))
    live_terminal = sys.stderr.isatty()
    # on a terminal: back to the line's start, clear it
    line_start = "\r\x1b[K" if live_terminal else ""

    def show(
        done: int, live: int, prefilled: int
    ) -> None:  # rewritten in place on a terminal, else every 5 s
        now = time.perf_counter()
        if now - last[0] >= (0.5 if live_terminal else 5.0) or live == 0:
            last[0] = now
            prefill = (
                f"prefilled {prefilled}/{prompt_tokens} prompt tokens, "
                if prefilled < prompt_tokens
                else ""
            )
            print(
                f"{line_start}generating: {prefill}{done}/{budget} tokens, {live} live "
                f"sequences, {done / (now - began):.1f} tokens/s",
                end="" if live_terminal and live else "\n",
                file=sys.stderr,
                flush=True,
            )

    gen = generate(
        engine,
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
    # every DP rank's tokens; the ranks step together, so rank 0's clock
    generated = sum(map(len, outputs))
    gen.stats.update(
        generated_tokens=generated,
        tokens_per_s=generated / gen.stats["seconds"],
        data_parallel_size=state.dp_size,
    )
    return Generation(outputs, gen.stats, logits)


def check_generate(
    cfg: ModelConfig,
    prompts: list[list[int]],
    opts: GenerateOptions,
    outputs: dict[str, str] | None = None,
) -> None:
    """Every check of a generate job, before any rank starts or any weight loads: the engine options
    against the checkpoint (`EngineArgs.check`), the output paths (`outputs`: option name -> path
    the caller will write), the eos ids, the prompts against the KV cache and
    `max_position_embeddings`, and the KV cache against the memory available."""
    args = opts.engine
    opts.sampling.check()
    drafts, cache_len = args.drafts, opts.cache_len(prompts)
    longest = max(map(len, prompts)) + opts.max_new_tokens + drafts
    args.check(cfg, longest)
    for option, path in (outputs or {}).items():
        check_writable(path, option)
    for eos in opts.eos_token_ids or ():
        if not 0 <= eos < cfg.vocab_size:
            raise ValueError(
                f"--eos-id {eos} is not a token id: expected an int in [0, {cfg.vocab_size})"
            )
    check_prompts(prompts, cfg.vocab_size, opts.max_new_tokens, drafts, cache_len)
    check_positions(
        longest,
        cfg.max_position_embeddings,
        f"the longest prompt ({max(map(len, prompts))} tokens) with {opts.max_new_tokens} new "
        f"tokens and {drafts} speculative tokens",
    )
    if args.kv_cache == "paged" and (args.device == "cuda" or args.kv_cache_memory is not None):
        # sized from the free GPU memory, or a budget the user chose (checked by `EngineArgs.check`)
        return
    # the dense cache, and on CPU the default paged cache, which holds what the slot cache would
    slots = opts.cache_slots(math.ceil(len(prompts) / args.dp))
    check_kv_cache_memory(
        cfg, drafts > 0, slots, cache_len, args.dtype, args.device, args.tp * args.dp
    )


def check_prompts(
    prompts: list[list[int]], vocab_size: int, max_new_tokens: int, drafts: int, max_len: int
) -> None:
    """Raise a one-line ValueError unless every prompt is a non-empty list of token ids in
    [0, `vocab_size`) that fits the KV cache with its new tokens and drafts."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        ids = isinstance(prompt, list) and prompt
        if not ids or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in prompt
        ):
            raise ValueError(
                f"prompt {i} must be a non-empty list of token ids in [0, {vocab_size}), "
                f"got {str(prompt)[:60]}"
            )
        check_capacity(f"prompt {i}", len(prompt), max_new_tokens, drafts, max_len)


def check_kv_cache_memory(
    cfg: ModelConfig,
    with_mtp: bool,
    slots: int,
    max_len: int,
    dtype: str,
    device: str,
    world_size: int,
) -> None:
    """Raise if the KV cache alone cannot fit, before anything is allocated. Each rank holds a whole
    cache.

    CPU: the ranks on this machine (all of them when spawned; LOCAL_WORLD_SIZE under torchrun) share
    the memory, so their caches together are compared with MemAvailable (/proc/meminfo). CUDA: one
    rank per GPU; its cache is compared with the GPU's total memory, which can be read without
    creating a CUDA context in this process (the free memory cannot); the weights are not counted,
    so this is a bound, not a promise."""
    layers = {
        i: cfg.layer_has_indexer(i)
        for i in range(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0))
    }
    per_rank = KVCache.size_bytes(cfg, layers, slots, max_len, DTYPES[dtype])
    if device == "cuda":
        ranks, available, where = (
            1,
            torch.cuda.get_device_properties(0).total_memory,
            "one GPU's total memory",
        )
    else:
        ranks = (
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "WORLD_SIZE" in os.environ else world_size
        )
        available, where = _cpu_memory_available(), "MemAvailable"
    if per_rank * ranks > available:
        raise ValueError(
            f"the KV cache needs {per_rank * ranks / 2**30:.1f} GiB ({ranks} rank(s) x {slots + 1} "
            f"slots, 1 of them scratch, x {max_len} positions x "
            f"{per_rank // ((slots + 1) * max_len)} B per token), more than {where}, "
            f"{available / 2**30:.1f} GiB: lower --max-model-len or --max-num-seqs"
        )


def _cpu_memory_available() -> int:
    """Bytes of memory available to new allocations: MemAvailable from /proc/meminfo (Linux), else
    the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_generate(model_dir: str, prompts: list[list[int]], opts: GenerateOptions):
    """-> rank 0's `Generation` (outputs, stats, optional logits); None on the other ranks under
    torchrun. Validates before starting any rank."""
    check_generate(opts.engine.model_config(model_dir), prompts, opts)
    parallel = opts.engine.parallel_config()
    return launch(
        rank_generate,
        parallel.world_size,
        model_dir,
        prompts,
        opts,
        config=parallel,
        device=opts.engine.device,
    )
