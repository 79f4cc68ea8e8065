"""The trained demo checkpoint on one CUDA GPU in bfloat16, CUDA graphs against the eager engine: held-out
prompt logprobs through the prompt-chunk graphs (the same perplexity and greedy choices), greedy
continuations through the decode graphs, and with MTP k = 3 through the drafter's graphs (the same
tokens)."""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.testing.heldout import heldout_sequences

from ..multigpu import requires_gpus
from .test_heldout_engine import BUDGET, MTP_PROMPTS, SEQS, ppl, prompt_logprobs

NEW = 48


def graphs_and_eager(folder: str) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import generate
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), torch.bfloat16, "cuda", with_mtp=True)
    out = {}
    for graphs in (False, True):
        for k in (0, 3):
            engine = Engine(
                model,
                PagedKVCache.for_model(model, 2**26),
                num_speculative_tokens=k,
                cuda_graphs=graphs,
                max_num_seqs=8,
                max_num_batched_tokens=BUDGET,
            )
            if k == 0:
                out[graphs, "logprobs"] = prompt_logprobs(engine, SEQS)
            gen = generate(engine, MTP_PROMPTS + heldout_sequences(2, 33, offset=9000), NEW)
            out[graphs, k] = gen.outputs
            phases = gen.stats["phases"]
            out[graphs, k, "replayed"] = {name: phases[name]["replays"] for name in phases}
    return out


@requires_gpus(1)
@pytest.mark.gpu
def test_graphs_match_eager_on_heldout_text():
    got = spawn(graphs_and_eager, 1, str(CHECKPOINT), device="cuda")[0]
    eager, graphs = got[False, "logprobs"], got[True, "logprobs"]
    agree = sum(a[1] == b[1] for x, y in zip(eager, graphs) for a, b in zip(x, y))
    total = sum(map(len, eager))
    print(
        f"held-out perplexity, bf16 on CUDA: eager {ppl(eager):.5f}, graphs {ppl(graphs):.5f}; "
        f"greedy choices equal at {agree}/{total}; graph replays by phase "
        f"{got[True, 0, 'replayed']} (k=0), {got[True, 3, 'replayed']} (k=3)"
    )
    assert abs(ppl(graphs) / ppl(eager) - 1) < 1e-4 and agree == total
    assert ppl(eager) < 6  # the trained model (a uniform guess: 264)
    for k in (0, 3):
        assert got[True, k] == got[False, k], f"k={k}: graphs changed the greedy tokens"
        replayed = got[True, k, "replayed"]
        assert replayed["decode"] > 0 and (k == 0 or replayed["draft"] > 0), (k, replayed)
    assert got[False, 3] == got[False, 0]  # drafts change no greedy token
