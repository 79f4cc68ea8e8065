"""The engine over the paged cache on one GPU, bfloat16 with the Triton kernels: decode steps replayed from CUDA
graphs (one per batch size, captured when the engine is built, block tables padded to max_model_len) and
prompt steps of up to 320 tokens replayed from mixed-step graphs generate what the eager paged engine does
(the first step's 320 rows take the sparse MLA kernel's prefill tiles inside the graph)
(the next turn of a conversation too, whose uncached tokens one step computes), and what the dense reference
engine does, for contexts below and above index_topk over 1 to 5 blocks of the 8 a table holds, prompts
chunked by a small token budget; nothing is captured after the engine is warm. n = 4 choices of one prompt
fork from the first and get what each gets alone."""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.ranks import generate

from ..conftest import relative_error
from ..multigpu import requires_gpus
from .conftest import choices_and_alone
from .test_cuda_graphs import GRAPH_CONFIG

CONFIG = {**GRAPH_CONFIG, "index_topk": 64, "kv_lora_rank": 128}
PROMPT_LENS = (5, 40, 150, 300)  # the longer two attend more than index_topk positions
# the first step feeds 320 of the prompts' 495 tokens (the last prompt chunked): 320 rows of 8 heads take the
# prefill tiles of the sparse MLA kernel (from NUM_SMS_TARGET = 264 rows x head groups) and of the indexer
STEP_TOKENS = 320
# the mixed-step graphs for that budget, largest first
MIXED = (
    320,
    256,
    224,
    192,
    160,
    128,
    96,
    64,
    32,
    16,
)


def engines(folder: str) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.warmup import warm_up
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]
    # its next turn
    turn = prompts[2] + torch.randint(0, CONFIG["vocab_size"], (40,), generator=gen).tolist()
    out = {}
    for name, cache, graphs in (
        ("dense", KVCache.for_model(model, 4, 340), False),
        ("paged", PagedKVCache.for_model(model, 2**26), False),
        ("paged_graphs", PagedKVCache.for_model(model, 2**26), True),
    ):
        lines = []
        engine = Engine(
            model, cache, cuda_graphs=graphs, max_num_seqs=4, max_num_batched_tokens=STEP_TOKENS,
            max_model_len=512, log=lines.append,
        )  # fmt: skip
        warm_up(engine, lines.append)
        gen = generate(engine, prompts, 16, record_logits=True)
        out[name] = (gen.outputs, torch.cat(gen.logits), gen.stats["cuda_graph_batch_sizes"])
        out[name, "prompt replays"] = gen.stats["phases"]["prefill"]["replays"]
        m = engine.metrics()
        out[name, "counts"] = (
            engine.graph_captures(),
            m.compiles_after_ready,
            m.steps_compiling,
            m.steps,
        )
        out[name, "kernel compiles"] = m.kernel_compiles
        out[name, "log"] = lines
        out[name, "width"] = engine.runner.graphs.width if graphs else None
        # the next turn of prompt 2: its full blocks cached, 62 tokens to compute
        if name != "dense":
            hits = engine.metrics().prefix_cache_hits
            second = generate(engine, [turn], 16, record_logits=True)
            replays = second.stats["phases"]["prefill"]["replays"]
            out[name, "turn"] = (
                second.outputs,
                second.logits[0],
                replays,
                engine.metrics().prefix_cache_hits - hits,
            )
        if graphs:
            out["choices"] = choices_and_alone(engine, prompts[2], [7, 8, 9, 10], 16)
    return out


@pytest.mark.gpu
@requires_gpus(1)
def test_paged_engine_graphs(tmp_path):
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, CONFIG, tmp_path, 1)
    got = spawn(engines, 1, str(tmp_path), device="cuda")[0]
    eager, graphed, dense = got["paged"], got["paged_graphs"], got["dense"]
    print({name: value for name, value in got.items() if isinstance(name, tuple)})
    assert graphed[0] == eager[0]
    # the prompts' two steps (320 rows; the last chunk beside the first tokens' decode rows) replayed graphs
    assert (got["paged_graphs", "prompt replays"], got["paged", "prompt replays"]) == (2, 0)
    assert graphed[2] == [1, 2, 4] and got["paged_graphs", "width"] == 8  # 512 positions
    captures, after_ready, _, _ = got["paged_graphs", "counts"]
    assert captures == 3 + len(MIXED), (
        "one graph per batch size and per mixed-step size, none while generating"
    )
    capture_lines = [
        line.split("graph of ")[1] for line in got["paged_graphs", "log"] if "capturing" in line
    ]
    steps = [f"the decode step for batch {b}" for b in (4, 2, 1)]
    steps += [f"a step of up to {n} tokens" for n in MIXED]
    assert capture_lines == [f"{step} ({i}/{len(steps)})" for i, step in enumerate(steps, 1)], (
        capture_lines
    )
    # Triton's hook counts what the first engine compiled
    assert got["dense", "kernel compiles"] > 0
    print("compiles or captures after ready:", after_ready)
    assert after_ready == 0
    assert relative_error(graphed[1], eager[1]) < 2e-2
    agree = sum(a == b for p, d in zip(eager[0], dense[0]) for a, b in zip(p, d)) / sum(
        map(len, dense[0])
    )
    assert agree >= 0.9, agree  # bf16: dense and sparse attention round differently

    # the next turn: its 62 new tokens in one mixed-step graph of 64 (eagerly without graphs), the same tokens
    (eager_turn, eager_logits, eager_replays, eager_hits), (turn, logits, replays, hits) = (
        got["paged", "turn"], got["paged_graphs", "turn"]
    )  # fmt: skip
    assert hits == eager_hits == 128 and (replays, eager_replays) == (1, 0), (
        hits,
        eager_hits,
        replays,
    )
    assert turn == eager_turn
    assert relative_error(logits, eager_logits) < 2e-2

    # n = 4 on CUDA with graphs: the choices fork (one prompt lookup), each draws its first token from the
    # prompt's last row as it does alone; later rows come from the shared blocks and a recomputed last block,
    # whose bf16 rounding may differ from the lone run's
    choices, alone, choice_logits, alone_logits, queries, _ = got["choices"]
    assert queries == PROMPT_LENS[2] and len({tuple(c) for c in choices}) == 4
    assert [c[0] for c in choices] == [a[0] for a in alone]
    # the prompt's last token's row, the same forward
    first, want = (
        choice_logits[:, 0],
        alone_logits[:, 0],
    )
    assert relative_error(first, want) < 1e-3
    same = sum(a == b for c, d in zip(choices, alone) for a, b in zip(c, d)) / (4 * 16)
    print("n = 4: tokens equal to the lone runs'", same)
    assert same >= 0.9, same


def speculating_engines(folder: str) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import run_to_completion
    from spmoe.engine.request import Request, SamplingParams
    from spmoe.engine.runner.graphs import draft_tokens
    from spmoe.engine.runner.static_step import decode_hidden
    from spmoe.engine.warmup import warm_up
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(
        folder, ParallelConfig(tensor_parallel_size=1), torch.bfloat16, "cuda", with_mtp=True
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist()
        for n in PROMPT_LENS[:3]
    ]
    out = {}
    for name, graphs in (("eager", False), ("graphs", True)):
        engine = Engine(
            model, PagedKVCache.for_model(model, 2**26), num_speculative_tokens=SPEC_K, cuda_graphs=graphs,
            max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512,
        )  # fmt: skip
        warm_up(engine, lambda line: None)
        greedy = generate(engine, prompts, 16, record_logits=True)
        sampled = generate(engine, prompts, 16, SamplingParams(temperature=1.0, seed=3))
        m = engine.metrics()
        out[name] = (greedy.outputs, torch.cat(greedy.logits), sampled.outputs)
        out[name, "speculative"] = (greedy.stats["speculative"], sampled.stats["speculative"])
        out[name, "counts"] = (engine.graph_captures(), m.compiles_after_ready)
    # a replayed step of a sequence that goes on (a stopping one's one-token steps all write the scratch block,
    # whose rows every pad and stopping sequence shares: their drafts are dropped), again, replayed and eagerly
    # over the graph's own inputs
    engine.add_request(Request("replay check", prompts[0], 40))
    for _ in range(4):  # its prompt, then decode steps
        engine.step()
    graphs = engine.runner.graphs
    captured = graphs.replayed
    size = captured.size
    with torch.no_grad():
        captured.graph.replay()
        replayed = captured.logits.clone()
        hidden = decode_hidden(model, graphs.cache, captured.inputs, captured.block_tables)
        eager = model.compute_logits(hidden)
        captured.draft.graph.replay()
        drafts = captured.draft.drafts.clone()
        *split, forced = captured.draft.inputs.split(
            [size * (1 + SPEC_K), size, size, size, size * SPEC_K]
        )
        eager_drafts = draft_tokens(
            model, graphs.cache, captured.inputs, captured.block_tables, captured.hidden,
            *split, forced.view(size, SPEC_K),
        )  # fmt: skip
    out["replay logit error"] = relative_error(replayed, eager)
    out["replay drafts"] = (size, drafts.tolist(), eager_drafts.tolist())
    run_to_completion(engine)
    return out


SPEC_K = 2


@pytest.mark.gpu
@requires_gpus(1)
def test_speculative_decode_in_graphs(tmp_path):
    """MTP speculation (k = 2) with the verification and draft steps replayed from CUDA graphs generates what
    the eager speculating engine does (greedy: the same tokens; seeded sampling: nearly all the same, bf16 over
    padded shapes), two graphs per batch size, and a replay equals the same step run eagerly."""
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, {**CONFIG, "num_nextn_predict_layers": 1}, tmp_path, 1)
    got = spawn(speculating_engines, 1, str(tmp_path), device="cuda")[0]
    print(
        {name: value for name, value in got.items() if isinstance(name, tuple) or "replay" in name}
    )
    eager, graphed = got["eager"], got["graphs"]
    assert graphed[0] == eager[0], "greedy tokens differ between eager and replayed speculation"
    assert relative_error(graphed[1], eager[1]) < 2e-2
    same = sum(a == b for p, q in zip(eager[2], graphed[2]) for a, b in zip(p, q)) / sum(
        map(len, eager[2])
    )
    assert same >= 0.9, same
    captures, _ = got["graphs", "counts"]
    assert captures == 11, (
        "a target and a drafter graph per batch size (1, 2, 4), a mixed-step graph per size"
    )
    for spec in got["graphs", "speculative"]:
        assert spec["verify_steps"] > 0
    assert got["replay logit error"] < 1e-3, got["replay logit error"]
    size, drafts, eager_drafts = got["replay drafts"]
    assert size == 1 and drafts == eager_drafts


def fraction_budgets(folder: str) -> dict:
    from spmoe.engine.cache.paged import build_paged_cache
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), torch.bfloat16, "cuda")
    out = {"fits": build_paged_cache(model, None, 0.001, "auto", 4, 512).capacity_tokens}
    try:
        build_paged_cache(model, None, 0.001, "auto", 4, 10**9)
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.gpu
@requires_gpus(1)
def test_a_share_of_free_memory_must_hold_the_longest_sequence(tmp_path):
    """The budget known only once the weights are loaded (a share of the free memory) gets the same one-line
    error as --kv-cache-memory's when a sequence of max_model_len positions cannot fit it."""
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, CONFIG, tmp_path, 1)
    got = spawn(fraction_budgets, 1, str(tmp_path), device="cuda")[0]
    assert got["fits"] >= 512, got
    error = got.get("error", "")
    assert error.startswith(
        "a sequence needs 1000000000 KV cache positions (prompt, new tokens and drafts); --gpu-memory-utilization "
        "0.001 ("
    ) and error.endswith(
        "tokens in all: raise --gpu-memory-utilization or ask for fewer positions with --max-model-len"
    ), got
