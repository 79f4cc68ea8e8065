"""What `spmoe serve` runs on every rank (`serve_rank`): the model loaded, the engine built and
warmed up; then rank 0 runs the engine loop (`loop.py`) and the other ranks follow its plans. Before
any rank starts, the launcher settles serve's defaults and checks the options (`check_serve`)."""

import sys
from dataclasses import replace
from functools import partial

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state
from spmoe.engine.args import EngineArgs
from spmoe.engine.build import build_engine, load_model
from spmoe.engine.ranks import worker_loop
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.engine.warmup import warm_up
from spmoe.entrypoints.serve.engine.front_ends import FrontEndCommand
from spmoe.entrypoints.serve.engine.loop import EngineLoop
from spmoe.entrypoints.serve.wire import EngineFacts
from spmoe.entrypoints.tokenizer import load_tokenizer

# serve's defaults for what the command line leaves out (`for_model`, `default_max_num_waiting`). On
# CUDA, as vLLM's: 256 requests running at once per DP group and the model's whole context. On the
# CPU (the tests, the demo) small ones: there the paged cache without a size holds max_num_seqs x
# max_model_len tokens.
CUDA_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 8
# at most; also the length for a config that states no max_position_embeddings
CPU_MAX_MODEL_LEN = 2048
# max_num_waiting: this many per request that can run at once, so a burst still queues, and at least
# `MIN_MAX_NUM_WAITING`; one more waiting request gets QueueFull (503)
WAITING_PER_RUNNING = 4
MIN_MAX_NUM_WAITING = 64


def for_model(args: EngineArgs, cfg: ModelConfig) -> EngineArgs:
    """The engine options with serve's defaults settled for the model on `args.device` (settled
    too): on CUDA `CUDA_MAX_NUM_SEQS` requests at once and the model's max_position_embeddings; on
    the CPU `CPU_MAX_NUM_SEQS` and at most `CPU_MAX_MODEL_LEN`. An option the command line gives
    stays."""
    positions = cfg.max_position_embeddings or CPU_MAX_MODEL_LEN
    on_cuda = args.device == "cuda"
    return replace(
        args,
        max_num_seqs=args.max_num_seqs or (CUDA_MAX_NUM_SEQS if on_cuda else CPU_MAX_NUM_SEQS),
        max_model_len=args.max_model_len
        or (positions if on_cuda else min(CPU_MAX_MODEL_LEN, positions)),
    )


def default_max_num_waiting(args: EngineArgs) -> int:
    """--max-num-waiting's default for settled `args`: `WAITING_PER_RUNNING` per request that can
    run at once over all DP groups (rank 0's front end feeds every group), at least
    `MIN_MAX_NUM_WAITING`."""
    return max(MIN_MAX_NUM_WAITING, WAITING_PER_RUNNING * args.max_num_seqs * args.dp)


def check_serve(
    model_dir: str, args: EngineArgs, max_num_waiting: int | None = None
) -> tuple[EngineArgs, int]:
    """What can be checked before starting any rank: the engine options, serve's defaults settled
    (`for_model`), against the checkpoint (`EngineArgs.check`), and the queue's limit (None: its
    default, `default_max_num_waiting`). -> the settled options and queue limit, as `serve_rank`
    takes them."""
    cfg = args.model_config(model_dir)
    args = for_model(args, cfg)
    args.check(cfg, args.max_model_len)
    if max_num_waiting is None:
        max_num_waiting = default_max_num_waiting(args)
    if max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be >= 1, got {max_num_waiting}")
    return args, max_num_waiting


def serve_rank(
    model_dir: str,
    args: EngineArgs,
    max_num_waiting: int,
    front_end: FrontEndCommand,
    tokenizer_dir: str | None = None,
):
    """Run on every rank: load the model and build the engine, warm it up. Rank 0 then runs the
    engine loop for the front end processes `front_end` describes (`EngineLoop.run`: -> SIGTERM if
    that stopped it, else None); the other ranks run the worker loop and return None. `args` and
    `max_num_waiting`: settled (`check_serve`); `tokenizer_dir` (default `model_dir`): for
    grammars."""
    state = get_parallel_state()
    model = load_model(args, model_dir, state.device)
    # every rank compiles the grammars of structured-output requests itself, the same from the same
    # spec
    grammars = GrammarCompiler(
        partial(load_tokenizer, tokenizer_dir or model_dir), model.cfg.vocab_size
    )
    log = (
        (lambda line: print(f"spmoe serve: {line}", file=sys.stderr, flush=True))
        if state.rank == 0
        else None
    )
    engine = build_engine(args, model, args.max_num_seqs, args.max_model_len, grammars, log)
    warm_up(engine, log)  # before the front end starts: nothing compiles or captures after ready
    if state.rank != 0:
        worker_loop(engine)
        return None
    facts = EngineFacts(
        max_model_len=args.max_model_len,
        max_num_waiting=-(-max_num_waiting // front_end.count),
        vocab_size=model.cfg.vocab_size,
        eos_token_ids=tuple(model.cfg.eos_token_ids),
        num_speculative_tokens=engine.k,
    )
    return EngineLoop(engine, front_end, facts).run()
