"""One CUDA graph per batch size and warm before ready, the parts that need no GPU (float32 on CPU,
the torch references): a decode step over block tables padded to the graphs' width (max_model_len)
with pad rows gives the logits of the same step over tables as wide as its longest sequence, and
writes no real block but its own rows; the engine counts the steps that compiled a kernel and what
compiled after it was marked ready; warming up runs its requests to the end and leaves the engine
empty; an engine built from the default options on CPU has no graphs; a kernel variant compiled is
named by its specialisations."""

import argparse

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.build import build_engine
from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
from spmoe.engine.engine import Engine
from spmoe.engine.request import Request
from spmoe.engine.runner.graphs import padded_tables, table_width
from spmoe.engine.runner.static_step import decode_hidden
from spmoe.engine.stats import KernelCompiles, describe_compile
from spmoe.engine.warmup import (
    warm_up,
    warmup_prompt_lengths,
    warmup_step_prompts,
    warmup_step_sizes,
    warmup_wide_steps,
)
from spmoe.entrypoints.engine_flags import add_engine_args, engine_args_from_cli
from spmoe.models.deepseek_v32.weights import load_model

from .conftest import ENGINE_CONFIG

# 1, 1, 2 and 3 blocks at the decode step; index_topk is 4: all but one score
CONTEXTS = (
    2,
    9,
    70,
    131,
)


def padded_tables_case(model):
    cache = PagedKVCache.for_model(model, 2**22)
    gen = torch.Generator().manual_seed(0)
    tables, first = [], 0
    for n in CONTEXTS:  # blocks for the prompt and the decoded token, in scattered order
        count = -(-(n + 1) // BLOCK_SIZE)
        tables.append(list(range(first + count - 1, first - 1, -1)))
        first += count + 1
    prompts = [torch.randint(0, ENGINE_CONFIG["vocab_size"], (n,), generator=gen) for n in CONTEXTS]
    next_ids = torch.randint(0, ENGINE_CONFIG["vocab_size"], (len(CONTEXTS),), generator=gen)
    with torch.no_grad():
        view = cache.view(tables, [0] * len(CONTEXTS), list(CONTEXTS))
        model.forward_hidden(torch.cat(prompts), view.positions, list(CONTEXTS), view)
        # tables as wide as the longest: 3
        view = cache.view(tables, list(CONTEXTS), [1] * len(CONTEXTS))
        per_width = model.compute_logits(
            model.forward_hidden(next_ids, view.positions, [1] * 4, view)
        )
        written = {name: t.clone() for name, t in vars(cache.layers[0]).items() if t is not None}

        # 4 pad rows; 16 blocks, as a graph for max_model_len 1000
        rows, width = (
            8,
            table_width(cache, 1000),
        )
        assert width == 16 and width > max(map(len, tables))
        padded = torch.from_numpy(padded_tables(tables, rows, width, cache.scratch_block))
        pad = rows - len(CONTEXTS)
        inputs = torch.tensor(
            [next_ids.tolist() + [0] * pad, list(range(rows)), list(CONTEXTS) + [0] * pad],
            dtype=torch.long,
        )
        graphed = model.compute_logits(decode_hidden(model, cache, inputs, padded))
    assert (
        padded[len(CONTEXTS) :].eq(cache.scratch_block).all()
        and padded[0, 1:].eq(cache.scratch_block).all()
    )
    torch.testing.assert_close(graphed[: len(CONTEXTS)], per_width, rtol=1e-5, atol=1e-6)
    real_rows = cache.num_blocks * BLOCK_SIZE  # the pad rows wrote the scratch block only
    for name, before in written.items():
        assert torch.equal(getattr(cache.layers[0], name)[:real_rows], before[:real_rows]), name


def compile_counting_case(model):
    """A kernel compiled during a step (simulated: the counter moves inside the model's forward) is
    counted in that step, and after `mark_ready` in `compiles_after_ready`; steps that compile
    nothing are not; the step counters start afresh at ready, the process's compile count does not;
    the log names each kernel compiled after ready, and only those."""
    KernelCompiles.names = []
    lines = []
    engine = Engine(model, PagedKVCache.for_model(model, 2**22), max_num_seqs=2, log=lines.append)
    compile_in = {2, 5}  # forward calls (1-based) that "compile"
    calls, fed = [0], {}

    def hook(_, args):
        calls[0] += 1
        if calls[0] in compile_in:
            KernelCompiles.names.append(f"_kernel_{calls[0]}")
            fed[calls[0]] = args[0].shape[0]  # the step's tokens, as the model sees them

    handle = model.model.register_forward_pre_hook(hook)
    try:
        engine.add_request(Request("a", [1, 2, 3], 3))
        engine.step(), engine.step()  # prefill, then a decode that compiles
        assert (engine.metrics().steps, engine.metrics().steps_compiling) == (2, 1)
        assert engine.metrics().compiles_after_ready == 0  # not marked ready yet
        engine.mark_ready()
        calls_at_ready = calls[0]
        engine.add_request(Request("b", [4, 5], 3))
        while engine.has_unfinished():
            engine.step()
    finally:
        handle.remove()
    m = engine.metrics()
    assert calls[0] >= 5 and m.steps == calls[0] - calls_at_ready  # steps since ready
    assert (m.steps_compiling, m.kernel_compiles, m.compiles_after_ready, m.graph_captures) == (
        1,
        2,
        1,
        0,
    )
    assert lines == [f"compiled after ready, in a step of {fed[5]} tokens: _kernel_5"], lines


def warm_up_case(model):
    KernelCompiles.names = []
    engine = Engine(
        model, PagedKVCache.for_model(model, 2**22), max_num_seqs=5, max_num_batched_tokens=24
    )
    lines, step_tokens = [], []
    hook = engine.model.model.register_forward_pre_hook(
        lambda _, args: step_tokens.append(args[0].shape[0])
    )
    try:
        done = warm_up(engine, lines.append, run_requests=True)
    finally:
        hook.remove()
    m = engine.metrics()
    assert (
        lines[0]
        == "warming up: 5 requests of 1-57 prompt tokens, then 11 steps of their own (1-17 tokens)"
    )
    assert lines[-1].startswith("warm: 0 kernel")
    sizes = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17]  # 2**k - 1, 2**k, 2**k + 1 up to the budget of 24
    assert warmup_step_sizes(24) == sizes
    # longer than a prompt
    assert warmup_step_prompts(17, 8) == [8, 8, 1] and warmup_step_prompts(16, 8) == [
        8,
        8,
    ]
    # each a step of its own, after the batch of requests
    assert step_tokens[-len(sizes) :] == sizes
    assert done["generated_tokens"] == 5 * 4 + len(sizes) and done["steps"] > 5 + len(sizes)
    short = Engine(
        model,
        PagedKVCache.for_model(model, 2**22),
        max_num_seqs=5,
        max_num_batched_tokens=24,
        max_model_len=12,
    )
    step_tokens.clear()
    hook = short.model.model.register_forward_pre_hook(
        lambda _, args: step_tokens.append(args[0].shape[0])
    )
    try:
        warm_up(short, run_requests=True)  # prompts of at most 11 tokens: steps of 15-17 take two
    finally:
        hook.remove()
    assert step_tokens[-len(sizes) :] == sizes and not short.has_unfinished()
    assert not engine.has_unfinished()
    assert (m.generated_tokens, m.steps) == (0, 0)  # the counters start at ready
    assert engine.scheduler.room.usage() == 0 and m.compiles_after_ready == 0
    assert engine.stats.phases["decode"].forwards == 0  # the statistics start afresh at ready
    assert (done["kernel_compiles"], done["graph_captures"]) == (0, 0)
    # the chunked prompt capped by the longest
    assert warmup_prompt_lengths(24, 40, 5) == [
        1,
        17,
        40,
        5,
        7,
    ]
    idle = Engine(model, PagedKVCache.for_model(model, 2**22), max_num_seqs=2)
    warm_up(idle)  # on CPU there is nothing to compile: no requests
    assert idle.metrics().steps == 0


def graph_default_case(model):
    """The engine gets the options' graphs (`EngineArgs.use_cuda_graphs`): off on CPU by default,
    and the runner captures nothing without them."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_cli(parser.parse_args([]))
    # the default settles off on CPU
    assert args.cuda_graphs is False and not args.use_cuda_graphs(model)
    engine = build_engine(args, model, 2, 64)
    assert engine.runner.graphs is None and engine.graph_captures() == 0


CASES = (padded_tables_case, compile_counting_case, warm_up_case, graph_default_case)


def run_cases(folder: str) -> dict:
    """Every case in this one rank -> {name: None, or the failure's text}."""
    import traceback

    model, out = load_model(folder, ParallelConfig()), {}
    for case in CASES:
        try:
            case(model)
            out[case.__name__] = None
        except Exception:  # noqa: BLE001 - reported by the test below, with its traceback
            out[case.__name__] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def results(engine_checkpoint) -> dict:
    return spawn(run_cases, 1, engine_checkpoint)[0]


@pytest.mark.parametrize("case", [c.__name__ for c in CASES])
def test_case(results, case):
    assert results[case] is None, results[case]


def test_a_compiled_variant_is_named_by_its_specialisations():
    """The log line of a kernel compiled after ready names its constexprs and its arguments'
    specialisations (from the keywords Triton 3.6's post-compile hook passes: argument paths
    into the kernel's parameters), not Triton's `repr`, which names none; without those
    keywords, the `repr`."""
    jit = argparse.Namespace(arg_names=["best_ptr", "width", "stride", "FROM_KEYS", "BLOCK"])
    fn = argparse.Namespace(name="_cache_rows_kernel", jit_function=jit)
    compiled = {
        "constants": {(3,): True, (4,): 128, (2,): 1},
        "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}],
    }
    got = describe_compile({"fn": fn, "compile": compiled, "repr": "_cache_rows_kernel[]("})
    assert got == (
        "_cache_rows_kernel(FROM_KEYS=True, BLOCK=128, stride=1, "
        "best_ptr: tt.divisibility=16, width: tt.divisibility=16)"
    )
    assert describe_compile({"fn": fn, "repr": "kernel[num_warps=4]"}) == "kernel[num_warps=4]"
    assert describe_compile({}) == "a Triton kernel"
    odd = {"constants": {(9,): 1}, "configs": [{}]}  # an argument past the kernel's parameters
    assert describe_compile({"fn": fn, "compile": odd, "repr": "k[]"}) == "k[]"


def test_wide_steps_span_every_table_width_with_many_tokens():
    """A step of short prompts for each width of the block tables up to the widest (w blocks: the
    prompts and their reserve fill exactly w), past the largest mixed-step graph (512 tokens) where
    max_num_seqs and the token budget allow it."""
    steps = warmup_wide_steps(8192, 256, 2048, 0)
    assert len(steps) == 32
    assert steps[0] == [64] * 9 and steps[1] == [128] * 5  # 576 and 640 tokens
    assert steps[7] == [512] * 2 and steps[8] == [576] and steps[31] == [2048]
    assert warmup_wide_steps(8192, 256, 200, 3) == [[61] * 9, [125] * 5, [189] * 3]
    assert warmup_wide_steps(8192, 4, 128, 0) == [[64] * 4, [128] * 4]  # at most 4 sequences
    assert warmup_wide_steps(1000, 256, 640, 0)[7:] == [[512], [576], [640]]  # the budget
    assert warmup_wide_steps(8192, 256, 63, 0) == []  # no whole block
