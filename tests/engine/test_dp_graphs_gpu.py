"""DP 2 attention x EP 2 on two GPUs (bfloat16, Triton experts, NCCL) with CUDA graphs: decode,
drafter (MTP k = 2) and mixed-step graphs captured on both ranks, every step replayed as the ranks
agree (`ranks.agree_step`), one rank chunking a long prompt while the other decodes, then one rank
idle; greedy tokens as the eager DP engine's, nothing captured or compiled after warm-up. The CPU
form of these checks (collectives and host reads of every replay): `test_dp_graphs_cpu.py`."""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn

from ..conftest import relative_error
from ..multigpu import requires_gpus
from .test_paged_engine_gpu import CONFIG

PROMPTS = {0: (300, 20), 1: (7,)}  # DP rank -> its prompts' lengths (budget 128: 300 is chunked)


def dp_engines(folder: str) -> dict:
    from spmoe.distributed import get_parallel_state
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.ranks import channel, generate
    from spmoe.engine.warmup import warm_up
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    parallel = ParallelConfig(tensor_parallel_size=1, data_parallel_size=2)
    model = load_model(folder, parallel, torch.bfloat16, state.device, with_mtp=True)
    gen = torch.Generator().manual_seed(state.dp_rank)
    vocab = CONFIG["vocab_size"]
    prompts = [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPTS[state.dp_rank]
    ]
    out = {}
    for graphs in (False, True):
        engine = Engine(
            model, PagedKVCache.for_model(model, 2**26), num_speculative_tokens=2,
            cuda_graphs=graphs, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512,
            ranks=channel(),
        )  # fmt: skip
        warm_up(engine, lambda line: None)
        got = generate(engine, prompts, 16, record_logits=True)
        phases = got.stats["phases"]
        replays = [phases[name]["replays"] for name in ("prefill", "decode", "draft")]
        m = engine.metrics()
        out[graphs] = (got.outputs, torch.cat(got.logits), replays, m.compiles_after_ready)
    return out


@pytest.mark.gpu
@requires_gpus(2)
def test_dp2_graph_steps_generate_what_the_eager_dp_engine_does(tmp_path):
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, {**CONFIG, "num_nextn_predict_layers": 1}, tmp_path, 1)
    config = ParallelConfig(tensor_parallel_size=1, data_parallel_size=2)
    ranks = spawn(dp_engines, 2, str(tmp_path), config=config, device="cuda")
    for rank, got in enumerate(ranks):
        (tokens, logits, _, _), (g_tokens, g_logits, replays, after_ready) = got[False], got[True]
        print(rank, replays, after_ready)
        assert g_tokens == tokens, rank
        assert relative_error(g_logits, logits) < 2e-2, rank
        assert all(replays) and after_ready == 0, (rank, replays, after_ready)
