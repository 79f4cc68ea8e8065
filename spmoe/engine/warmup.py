"""Warm before ready: what the engine compiles and captures before it takes requests, and the
counters that show nothing more is compiled or captured afterwards.

- `stats.KernelCompiles`: Triton kernel variants loaded in this process (a new specialisation
  compiled, or read from Triton's disk cache: either way a pause of milliseconds to seconds in the
  step that meets it).
- CUDA graphs are captured when the engine is built (`StepGraphs`: one per padded batch size of a
  decode step, one per padded token count of any other step up to 512); its `captures` counts them.
- `warm_up(engine)`: runs the engine over a few synthetic requests of lengths that take the step's
  kernels through the shapes serving meets (one-token and odd-length prompts, a prompt chunked by
  the token budget, decode steps of up to that many sequences, greedy and sampled), then steps of
  every size class on their own (`warmup_step_sizes`), then eager steps of many short prompts over
  block tables of every width up to index_topk (`warmup_wide_steps`), then resets the engine's
  statistics. Whatever it compiles is not compiled again; what it cannot foresee is counted.

Why the step sizes: a step that replays no graph (without graphs, or longer than the largest
mixed-step graph) runs its kernels eagerly over its N tokens, and Triton compiles a kernel again for
each new value of a `tl.constexpr` argument and for an integer argument that becomes 1 or a multiple
of 16 (its specialisation). The constexprs that vary between steps are derived from N (and the
step's block-table width, which grows with the longest context) by `next_power_of_2` or by
thresholds at powers of two: the MoE alignment's and router's blocks, the expert tiles by pairs per
expert, the indexer's and sparse MLA's decode or prefill tiles and split counts. A serving step's N
is a prompt chunk plus the decoding sequences, any number up to the token budget: the first requests
under load brought N the warm-up's batch had not (a 128-token prompt alone, 63 of them with one
decode token), and compiled then.
"""

import time

from spmoe.engine.cache.paged import BLOCK_SIZE
from spmoe.engine.ranks import run_to_completion
from spmoe.engine.request import Request, SamplingParams
from spmoe.engine.runner.static_step import MIXED_TOKENS
from spmoe.engine.stats import KernelCompiles

WARMUP_NEW_TOKENS = 4  # tokens each warm-up request generates: enough for every request to decode


MAX_WARMUP_REQUESTS = 64


def warmup_prompt_lengths(max_num_batched_tokens: int, longest: int, count: int) -> list[int]:
    """Prompt lengths of the warm-up requests (`count` of them, at least 3): one token, an odd
    length, one longer than the step's token budget (chunked), the rest short and distinct; none
    longer than `longest`."""
    lengths = [1, 17, max_num_batched_tokens + 33] + [5 + 2 * i for i in range(max(0, count - 3))]
    return [min(n, longest) for n in lengths[: max(3, count)]]


def warmup_step_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of the warm-up's steps of their own: 2**k - 1, 2**k and 2**k + 1 for every 2**k
    up to the token budget (so each power-of-two bucket of N meets a multiple of 16 and an odd
    count, and N = 1 runs), none above the budget."""
    sizes, power = set(), 1
    while power <= max_num_batched_tokens:
        sizes.update((power - 1, power, power + 1))
        power *= 2
    return sorted(n for n in sizes if 1 <= n <= max_num_batched_tokens)


def warmup_step_prompts(tokens: int, longest: int) -> list[int]:
    """Prompt lengths that make one step of `tokens` tokens: as few prompts as fit
    `longest` each."""
    return [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])


def warmup_wide_steps(
    max_num_batched_tokens: int, max_num_seqs: int, widest: int, reserve: int
) -> list[list[int]]:
    """Prompt lengths of the warm-up's steps of short prompts, one step for each width of the block
    tables up to `widest` positions (w = 1, 2, ... blocks): prompts of w blocks less `reserve` (a
    sequence's room beyond its prompt: the drafts), as many as make the step longer than the largest
    mixed-step graph (so that it runs eagerly), within the token budget and `max_num_seqs`.

    The steps of their own are one prompt each, so their tables span as many positions as they
    have tokens; the first requests under load are many short prompts in one eager step (16 prompts
    of 128 tokens: 2048 tokens over tables of 2 blocks), and the attention's kernels take constexprs
    from the tables' width (the rows each program reads, while every position is selected: up to
    index_topk) that no step of one prompt brings together with that many tokens."""
    steps = []
    for blocks in range(1, widest // BLOCK_SIZE + 1):
        length = blocks * BLOCK_SIZE - reserve
        if length < 1:
            continue
        eager = -(-(MIXED_TOKENS[-1] + 1) // length)  # prompts past the largest mixed graph
        count = min(eager, max_num_seqs, max_num_batched_tokens // length)
        if count >= 1:
            steps.append([length] * count)
    return steps


def warm_up(engine, log=None, run_requests: bool | None = None) -> dict:
    """Run the warm-up requests through `engine` (on every rank of the job alike; `run_requests`
    None: only on CUDA, where there is something to compile), then mark it ready (its step
    statistics start afresh). `log(line)`: progress output. -> {"seconds", "steps",
    "generated_tokens"} of warming up, and {"kernel_compiles", "graph_captures"}: the counts once
    warm (graphs included, as they were captured when the engine was built)."""
    began = time.perf_counter()
    room = engine.scheduler.room
    new_tokens = min(WARMUP_NEW_TOKENS, room.max_tokens_per_sequence - 1 - engine.k)
    if run_requests is None:
        run_requests = engine.cache.device.type == "cuda"
    if run_requests and new_tokens > 0:
        lengths = warmup_prompt_lengths(
            engine.scheduler.max_num_batched_tokens,
            room.max_tokens_per_sequence - new_tokens - engine.k,
            min(room.max_num_seqs, MAX_WARMUP_REQUESTS),
        )
        # a prompt, its one new token and the drafts
        longest = room.max_tokens_per_sequence - 1 - engine.k
        steps = [
            warmup_step_prompts(n, longest)
            for n in warmup_step_sizes(engine.scheduler.max_num_batched_tokens)
        ]
        steps = [prompts for prompts in steps if len(prompts) <= room.max_num_seqs]  # each one step
        # tables no wider than the dense window, and room for each prompt's one new token
        widest = min(engine.model.cfg.index_topk, room.max_tokens_per_sequence - 1)
        wide = warmup_wide_steps(
            engine.scheduler.max_num_batched_tokens, room.max_num_seqs, widest, engine.k
        )
        if log is not None:
            log(
                f"warming up: {len(lengths)} requests of {min(lengths)}-{max(lengths)} prompt "
                f"tokens, then {len(steps)} steps of their own ({sum(steps[0])}-{sum(steps[-1])} "
                "tokens)"
                + (f", then {len(wide)} of short prompts over 1-{len(wide)} blocks" if wide else "")
            )
        steps += wide
        vocab = engine.model.cfg.vocab_size

        def request(i: int, n: int, max_new_tokens: int) -> Request:
            # greedy and sampled requests (top_p: its Triton kernel), with speculation too
            sampled = i % 2
            sampling = (
                SamplingParams(temperature=1.0, top_p=0.95, seed=i) if sampled else SamplingParams()
            )
            prompt = [(7 * i + 3 * j + 1) % vocab for j in range(n)]
            return Request(f"warmup-{i}", prompt, max_new_tokens, sampling)

        for i, n in enumerate(lengths):
            engine.add_request(request(i, n, new_tokens))
        run_to_completion(engine)
        i = len(lengths)
        for prompts in steps:  # one prefill step of sum(prompts) tokens each
            for n in prompts:
                engine.add_request(request(i, n, 1))
                i += 1
            run_to_completion(engine)
    warm = engine.metrics()
    engine.mark_ready()
    seconds = time.perf_counter() - began
    done = {
        "seconds": seconds,
        "steps": warm.steps,
        "generated_tokens": warm.generated_tokens,
        "kernel_compiles": len(KernelCompiles.names),
        "graph_captures": engine.graph_captures(),
    }
    if log is not None:
        log(
            f"warm: {done['kernel_compiles']} kernel variants compiled, {done['graph_captures']} "
            f"CUDA graphs captured; warm-up requests took {seconds:.1f} s"
        )
    return done
