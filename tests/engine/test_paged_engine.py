"""The engine over the paged cache (sparse DSA attention, chunked prefill, blocks grown per step) against the
engine over the dense slot cache (the reference), float32 on CPU: the same tokens and logits within tolerance
for contexts below and above index_topk, prompts chunked by a small token budget, at TP 1, 2 and 3 with SP
off, on and all, with MTP speculation and with the hybrid (MTP + n-gram lookup: no greedy token
changes), and under DP 2; preemption when the blocks run out (every sequence
still gets exactly its tokens); the FP8 cache's greedy tokens against the full-precision cache's.

One spawned group per layout runs every case; the comparisons happen here.
"""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.engine.ranks import channel, generate
from spmoe.entrypoints.jobs import split_for_dp

from ..conftest import relative_error
from .conftest import ENGINE_CONFIG

# index_topk is 4: the first prompt's context stays below it for its first steps, the others go far above it
# and over several blocks of 64; a budget of 24 tokens prefills the long prompts in chunks beside decodes
PROMPT_LENS = (2, 9, 70, 131)
MAX_NEW = 6
BUDGET = 24
CASES = {"plain": (0, None), "mtp": (2, False), "hybrid": (2, True)}  # name -> (k, n-gram lookup)
LAYOUTS = {
    1: [("off", "moe")],
    2: [("off", "moe"), ("on", "moe"), ("on", "all")],
    3: [("on", "moe")],
}


def prompts_of(lens, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, ENGINE_CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in lens
    ]


def paged_and_dense(folder: str, modes: list[tuple[str, str]]) -> dict:
    """-> {(sp, scope, case, cache): (outputs, logits `[tokens, V]`, stats)} for this rank's DP share."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.speculation import NgramConfig, Speculation
    from spmoe.models.deepseek_v32.weights import load_model

    state, results = get_parallel_state(), {}
    prompts = split_for_dp(prompts_of(PROMPT_LENS), state.dp_rank, state.dp_size)
    for sp, scope in modes:
        parallel = ParallelConfig(
            tensor_parallel_size=state.tp_size,
            data_parallel_size=state.dp_size,
            sp=sp,
            sp_scope=scope,
        )
        model = load_model(folder, parallel, with_mtp=True)
        for case, (k, lookup) in CASES.items():
            ngram = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=2) if lookup else None
            speculation = Speculation(num_speculative_tokens=k, lookup=ngram)
            for name in ("dense", "paged"):
                cache = (
                    KVCache.for_model(model, len(prompts), max(PROMPT_LENS) + MAX_NEW + k)
                    if name == "dense"
                    else PagedKVCache.for_model(model, 2**22)
                )
                engine = Engine(
                    model,
                    cache,
                    max_num_batched_tokens=BUDGET,
                    ranks=channel(),
                    speculation=speculation,
                )
                gen = generate(engine, prompts, MAX_NEW, record_logits=True)
                results[sp, scope, case, name] = (gen.outputs, torch.cat(gen.logits), gen.stats)
    return results


def check_layout(ranks: list[dict], label: str) -> None:
    for rank, got in enumerate(ranks):
        for (sp, scope, case, name), (outputs, logits, stats) in got.items():
            if name == "dense":
                continue
            want_outputs, want_logits, _ = got[sp, scope, case, "dense"]
            where = f"{label} rank {rank} SP {sp}/{scope} {case}"
            assert outputs == want_outputs, where
            assert relative_error(logits, want_logits) < 1e-4, where
            assert (
                stats["kv_cache"]["kind"] == "paged" and stats["kv_cache"]["blocks_in_use"] == 0
            ), where
            # the budget chunked the prompts
            assert stats["phases"]["prefill"]["forwards"] > 1, where


@pytest.mark.parametrize("tp", sorted(LAYOUTS))
def test_paged_engine_equals_dense(tp, engine_checkpoint):
    ranks = spawn(paged_and_dense, tp, engine_checkpoint, LAYOUTS[tp])
    check_layout(ranks, f"TP {tp}")
    assert all(rank.keys() == ranks[0].keys() for rank in ranks)
    for key, (outputs, _, _) in ranks[0].items():
        assert all(rank[key][0] == outputs for rank in ranks[1:]), f"TP {tp} {key}: ranks disagree"
    check_speculation(ranks, LAYOUTS[tp][0])


def check_speculation(ranks: list[dict], layout: tuple[str, str]) -> None:
    """MTP and the hybrid (MTP + n-gram) change no greedy token; the lookup led drafts."""
    for got in ranks:
        plain = got[(*layout, "plain", "paged")]
        for case in ("mtp", "hybrid"):
            spec = got[(*layout, case, "paged")]
            assert spec[0] == plain[0] and spec[2]["speculative"]["verify_steps"] > 0, case
        assert got[(*layout, "hybrid", "paged")][2]["speculative"]["by_source"]["ngram"]["chosen"]


def test_paged_engine_equals_dense_dp2(engine_checkpoint):
    ranks = spawn(
        paged_and_dense,
        2,
        engine_checkpoint,
        [("off", "moe")],
        config=ParallelConfig(tensor_parallel_size=1, data_parallel_size=2),
    )
    check_layout(ranks, "DP 2")
    check_speculation(ranks, ("off", "moe"))
    assert (
        ranks[0][("off", "moe", "plain", "paged")][0]
        != ranks[1][("off", "moe", "plain", "paged")][0]
    )


def preemption(folder: str) -> dict:
    """Three sequences in a 3-block cache: each fits a block when admitted, then all grow past it. -> the dense
    engine's and the paged engine's outputs and logits, with the paged engine's stats (and the preemptions its
    metrics report)."""
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), with_mtp=True)
    prompts, out = prompts_of((58, 59, 60), seed=1), {}
    for k in (0, 2):
        dense_engine = Engine(model, KVCache.for_model(model, 3, 60 + 12 + k), k)
        dense = generate(dense_engine, prompts, 12, record_logits=True)
        one_block = PagedKVCache.for_model(model, 2**20).bytes_per_token * BLOCK_SIZE
        engine = Engine(
            model, PagedKVCache.for_model(model, 3 * one_block), k, max_num_batched_tokens=64
        )
        paged = generate(engine, prompts, 12, record_logits=True)
        paged.stats["metrics_preemptions"] = engine.metrics().preemptions  # what /metrics shows
        out[k] = (
            dense.outputs,
            torch.cat(dense.logits),
            paged.outputs,
            torch.cat(paged.logits),
            paged.stats,
        )
    return out


def test_preemption_recomputes_and_loses_nothing(engine_checkpoint):
    for k, (want, want_logits, got, logits, stats) in spawn(preemption, 1, engine_checkpoint)[
        0
    ].items():
        assert stats["kv_cache"]["num_blocks"] == 3 and stats["preemptions"] > 0, (
            k,
            stats["preemptions"],
        )
        assert stats["metrics_preemptions"] == stats["preemptions"], k
        assert got == want and [len(o) for o in got] == [12] * 3, k
        assert relative_error(logits, want_logits) < 1e-4, k
        assert (
            stats["kv_cache"]["blocks_in_use"] == 0 and stats["kv_cache"]["peak_blocks_in_use"] == 3
        )


def request_tables(folder: str) -> list[dict[str, int]]:
    """Requests through a paged engine with MTP and the prefix cache in a cache small enough to preempt:
    four finish, one is aborted after a few steps, one is aborted before it is ever scheduled. -> the
    engine's request tables before any request, after each step, and once idle."""
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.request import Request
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1), with_mtp=True)
    one_block = PagedKVCache.for_model(model, 2**20).bytes_per_token * BLOCK_SIZE
    engine = Engine(
        model,
        PagedKVCache.for_model(model, 4 * one_block),
        2,
        max_num_seqs=3,
        max_num_batched_tokens=64,
    )
    seen = [engine.metrics().request_tables]
    prompts = prompts_of((58, 59, 60, 61, 30, 20), seed=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, 12))
    engine.abort("r5")
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort("r4")
        seen.append(engine.metrics().request_tables)
    seen.append({**engine.metrics().request_tables, "preemptions": engine.metrics().preemptions})
    return seen


def test_the_request_tables_empty_once_idle(engine_checkpoint):
    """Every table the engine keeps per request or sequence (the scheduler's requests, the blocks'
    tables, reservations and memos) has entries while requests run and none once they all ended:
    finished, preempted and recomputed, aborted while running or while waiting."""
    seen = spawn(request_tables, 1, engine_checkpoint)[0]
    before, during, idle = seen[0], seen[1:-1], seen[-1]
    assert set(before) >= {"scheduler_requests", "block_tables", "block_hash_chains"}, before
    assert all(v == 0 for v in before.values()), before
    assert max(t["scheduler_requests"] for t in during) >= 3, during
    assert max(t["block_tables"] for t in during) >= 3, during
    assert idle.pop("preemptions") > 0
    assert idle == dict.fromkeys(before, 0), idle


def progress_of_a_chunked_prompt(folder: str) -> list[tuple[int, int, int]]:
    """-> what `generate` reports after each step for one 40-token prompt fed 16 tokens a step."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1))
    steps = []
    engine = Engine(model, PagedKVCache.for_model(model, 2**20), max_num_batched_tokens=16)
    generate(engine, prompts_of((40,)), 3, on_step=lambda *progress: steps.append(progress))
    return steps


def test_generate_reports_the_prompt_tokens_prefilled(engine_checkpoint):
    """Progress output can show a long prefill: (generated tokens, live sequences, prompt tokens cached) per step,
    the prompt in chunks of 16, the first token with the last chunk."""
    steps = spawn(progress_of_a_chunked_prompt, 1, engine_checkpoint)[0]
    assert steps == [(0, 1, 16), (0, 1, 32), (1, 1, 40), (2, 1, 40), (3, 0, 40)], steps


# FP8 scales the latent per 128
FP8_CONFIG = {
    **ENGINE_CONFIG,
    "kv_lora_rank": 128,
    "index_topk": 16,
}


def fp8_against_full(folder: str) -> dict:
    """-> greedy tokens of the engine over the full-precision and the FP8 paged cache, and per position the
    greedy choice of one forward over each cache for the same sequence (no divergence can cascade)."""
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1))
    prompts = prompts_of((3, 17, 40, 90, 150, 300), seed=2)
    out = {}
    for dtype in ("auto", "fp8"):
        engine = Engine(
            model, PagedKVCache.for_model(model, 2**22, dtype), max_num_batched_tokens=64
        )
        gen = generate(engine, prompts, 16)
        choices = []
        for prompt in prompts:
            cache = PagedKVCache.for_model(model, 2**22, dtype)
            view = cache.view([list(range(-(-len(prompt) // BLOCK_SIZE)))], [0], [len(prompt)])
            with torch.no_grad():
                hidden = model.forward_hidden(
                    torch.tensor(prompt), view.positions, [len(prompt)], view
                )
                choices += model.compute_logits(hidden).argmax(-1).tolist()
        out[dtype] = (gen.outputs, choices, gen.stats["kv_cache"])
    return out


# index_head_dim -> the lower bound of the per-position agreement. 16 is the engine checkpoint's; 128 is the real
# models' indexer width, where the FP8 indexer's Hadamard rotation spreads over 128 values, not 16.
# Measured (one scale per vector, q and k Hadamard-rotated): 528/600 at 16 (518 unrotated), 517/600 at 128.
FP8_AGREEMENT = {16: 0.87, 128: 0.85}


@pytest.mark.parametrize("index_head_dim", sorted(FP8_AGREEMENT))
def test_fp8_cache_agrees_with_full_precision(index_head_dim, tmp_path):
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, {**FP8_CONFIG, "index_head_dim": index_head_dim}, tmp_path, 3)
    got = spawn(fp8_against_full, 1, str(tmp_path))[0]
    (full, full_choices, _), (fp8, fp8_choices, stats) = got["auto"], got["fp8"]
    generated = sum(a == b for want, have in zip(full, fp8) for a, b in zip(want, have))
    positions = sum(a == b for a, b in zip(full_choices, fp8_choices))
    print(
        f"FP8 cache against float32 (index_head_dim {index_head_dim}): {generated}/{sum(map(len, full))} generated "
        f"greedy tokens equal (a divergence cascades), {positions}/{len(full_choices)} per-position greedy choices "
        f"equal"
    )
    # per token and layer: 128 e4m3 + 1 float32 scale + 8 float32 rope; + d e4m3 + 1 scale on indexer layers
    assert stats["bytes_per_token"] == 3 * (128 + 4 + 8 * 4) + 2 * (index_head_dim + 4)
    # a tiny random MoE: a rounding that flips one expert choice moves the logits a lot, and its indexer's scores
    # are close together (an FP8 score error several times the gap at the top-k boundary), so the bound is loose
    assert FP8_AGREEMENT[index_head_dim] <= positions / len(full_choices) < 1, (
        f"{positions}/{len(full_choices)}"
    )
