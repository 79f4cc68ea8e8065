"""The trained demo checkpoint through the engine, on held-out text (`spmoe.testing.heldout`): prompt
logprobs (prefilled in chunks, so later chunks read the cache) give the same perplexity over the paged and the
dense cache; the FP8 paged cache stays within 1% of the bf16 one's perplexity and agrees with its greedy choice
at >= 95% of positions; MTP speculation accepts drafts on text the model has learned, and changes no greedy
token; a prompt found in the prefix cache and `n` choices forked from one prompt get what a lone request gets.
"""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.request import Request, SamplingParams
from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.testing.heldout import heldout_sequences

from .conftest import choices_and_alone

SEQS = heldout_sequences(3, 512)
BUDGET = 128  # tokens a step feeds: each 512-token prompt in 4 chunks
MTP_PROMPTS = heldout_sequences(4, 96, offset=4096)
MTP_NEW = 32


def prompt_logprobs(engine, seqs: list[list[int]]) -> list[list[tuple[float, int]]]:
    """-> per sequence, per token after the first: (its logprob, the greedy choice at that position)."""
    for i, seq in enumerate(seqs):
        engine.add_request(Request(f"p{i}", seq, 1, SamplingParams(prompt_logprobs=1)))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = [(lp, top[0][0]) for lp, top in out.prompt_logprobs[1:]]
    return [got[f"p{i}"] for i in range(len(seqs))]


def caches(folder: str) -> dict:
    """Prompt logprobs over the dense and the paged cache (float32 model), and over the bf16 and the FP8 paged
    cache (bf16 model)."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(folder, ParallelConfig(), dtype)
        builds = {"paged": lambda: PagedKVCache.for_model(model, 2**24)}
        if dtype == torch.float32:
            builds["dense"] = lambda: KVCache.for_model(model, len(SEQS), 513)
        else:
            builds["fp8"] = lambda: PagedKVCache.for_model(model, 2**24, "fp8")
        for name, build in builds.items():
            engine = Engine(model, build(), max_num_batched_tokens=BUDGET)
            out[(name, str(dtype))] = prompt_logprobs(engine, SEQS)
    return out


@pytest.fixture(scope="module")
def by_cache():
    return spawn(caches, 1, str(CHECKPOINT))[0]


def ppl(rows: list[list[tuple[float, int]]]) -> float:
    lps = [lp for row in rows for lp, _ in row]
    return float(torch.tensor(lps, dtype=torch.float64).mean().neg().exp())


def test_paged_and_dense_cache_give_the_same_perplexity(by_cache):
    paged, dense = (
        ppl(by_cache[("paged", "torch.float32")]),
        ppl(by_cache[("dense", "torch.float32")]),
    )
    print(f"held-out perplexity, float32: paged cache {paged:.5f}, dense cache {dense:.5f}")
    assert abs(paged / dense - 1) < 1e-5
    assert paged < 6  # a trained model (a uniform guess: 264)


def test_fp8_cache_against_bf16(by_cache):
    bf16, fp8 = by_cache[("paged", "torch.bfloat16")], by_cache[("fp8", "torch.bfloat16")]
    agree = sum(a[1] == b[1] for x, y in zip(bf16, fp8) for a, b in zip(x, y))
    total = sum(map(len, bf16))
    print(
        f"bf16 model: perplexity bf16 cache {ppl(bf16):.4f}, FP8 cache {ppl(fp8):.4f} "
        f"({ppl(fp8) / ppl(bf16) - 1:+.2%}); greedy choices equal at {agree}/{total} "
        f"({agree / total:.1%})"
    )
    assert abs(ppl(fp8) / ppl(bf16) - 1) < 0.01
    assert 0.95 <= agree / total < 1  # < 1: the FP8 cache was really used


def speculate(folder: str) -> dict:
    """Greedy and temperature-1 generation after held-out prompts with k = 0..3 MTP drafts -> tokens and the
    speculation statistics per (k, temperature)."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import generate
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    out = {}
    for k in range(4):
        for temperature in (0.0, 1.0) if k else (0.0,):  # k = 0: the greedy reference
            engine = Engine(model, PagedKVCache.for_model(model, 2**24), num_speculative_tokens=k)
            gen = generate(engine, MTP_PROMPTS, MTP_NEW, SamplingParams(temperature, seed=5))
            out[(k, temperature)] = (gen.outputs, gen.stats.get("speculative"))
    return out


@pytest.fixture(scope="module")
def speculated():
    return spawn(speculate, 1, str(CHECKPOINT))[0]


def test_mtp_drafts_are_accepted_on_heldout_text(speculated):
    for k in (1, 2, 3):
        for temperature in (0.0, 1.0):
            spec = speculated[(k, temperature)][1]
            print(
                f"k={k} T={temperature}: acceptance {spec['acceptance_rate']:.3f}, mean accepted length "
                f"{spec['mean_accepted_length']:.3f}, per position {spec['per_position']}"
            )
            assert spec["per_position"][0] > 0.35  # the first draft; random weights: ~0
        # greedy output is the target's, drafts or not
        assert speculated[(k, 0.0)][0] == speculated[(0, 0.0)][0]
    greedy = [speculated[(k, 0.0)][1]["mean_accepted_length"] for k in (1, 2, 3)]
    assert 1.6 < greedy[0] < greedy[1] < greedy[2]  # a longer draft gets more tokens through a step


def forks_and_prefix(folder: str) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import generate
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig())
    engine = Engine(model, PagedKVCache.for_model(model, 2**24), max_num_batched_tokens=BUDGET)
    prompt = SEQS[0][:300]
    first = generate(engine, [prompt], 16, record_logits=True)
    hits = engine.metrics().prefix_cache_hits
    again = generate(engine, [prompt], 16, record_logits=True)
    return {
        "first": (first.outputs, first.logits[0]),
        "again": (again.outputs, again.logits[0]),
        "hits": engine.metrics().prefix_cache_hits - hits,
        "forks": choices_and_alone(engine, prompt, [1, 2, 3], 8),
    }


def test_prefix_cache_hits_and_forks_change_nothing(engine_checkpoint):
    got = spawn(forks_and_prefix, 1, str(CHECKPOINT))[0]
    assert got["hits"] > 0
    assert got["again"][0] == got["first"][0]
    assert (got["again"][1] - got["first"][1]).abs().max() < 1e-4
    choices, alone, choice_logits, alone_logits, queries, _ = got["forks"]
    assert queries > 0 and choices == alone
    assert (choice_logits - alone_logits).abs().max() < 1e-4
