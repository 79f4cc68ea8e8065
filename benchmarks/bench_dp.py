"""TP2 against TP1 x DP2 on 2 GPUs (NCCL), the only data-parallel layout 2 GPUs allow, on the same model:
GLM-5.2 widths (H 6144, 64 heads, q_lora 2048, kv_lora 512, DSA indexer, 256 experts top-8 + 1 shared,
I 2048), 2 MoE layers, random bf16 weights, Triton experts, the engine's KV cache.

A step processes the same global batch in every layout: TP2 runs it on one DP group; TP1 x DP2 gives each
DP rank half of the sequences. Reported: ms per step (CUDA-event median, rank 0),
tokens/s, and the MoE work per rank (rows dispatched, rows computed by the experts) of one more step.

    python benchmarks/bench_dp.py
"""

import zlib

import torch
from timing import cuda_ms

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.engine.cache.slots import KVCache
from spmoe.entrypoints.jobs import split_for_dp
from spmoe.layers.moe.work import count_moe_work
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

GLM = dict(
    model_type="glm_moe_dsa",
    vocab_size=4096,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=2,
    mlp_layer_types=["sparse", "sparse"],
    indexer_types=["full", "shared"],
    num_attention_heads=64,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_topk=2048,
    index_n_heads=32,
    index_head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=202752,
)
LAYOUTS = [("TP2, SP off", 2, 1, "off"), ("TP2, SP on", 2, 1, "on"), ("TP1 x DP2", 1, 2, "off")]
PREFILL = [(1, 1024), (1, 4096), (4, 1024)]  # (sequences, tokens each)
DECODE = [1, 8, 64]  # sequences, 1 token each, after a 128-token context


def random_weights(model: torch.nn.Module) -> None:
    """Seeded by parameter name, so replicated weights agree across ranks (every rank routes a token the
    same way) and two builds of the same layer (SP on and off) get the same router, attention and experts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.normal_(0, 0.1, generator=gen)
            else:
                p.normal_(0, p.shape[-1] ** -0.5, generator=gen)


def timed_step(model, cache, seqs, starts, reps):
    """One forward over this DP rank's share -> (ms, median of `reps` after a warm-up; the MoE work of one
    more, untimed step: counting it syncs the host)."""
    state = get_parallel_state()
    mine = split_for_dp(list(range(len(seqs))), state.dp_rank, state.dp_size)
    lens = [seqs[i] for i in mine]
    view = cache.view(mine, [starts] * len(mine), lens)
    ids = torch.randint(0, GLM["vocab_size"], (sum(lens),), device="cuda")
    with torch.no_grad():
        ms = cuda_ms(
            lambda: model.forward_hidden(ids, view.positions, lens, view), reps, barrier=True
        )
        with count_moe_work() as work:
            model.forward_hidden(ids, view.positions, lens, view)
    return ms, work.as_dict()


def run(layouts_for_this_world):
    state = get_parallel_state()
    rows = []
    for label, tp, dp, sp in layouts_for_this_world:
        parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sp=sp)
        model = DeepseekV32ForCausalLM(
            ModelConfig.from_dict(GLM), parallel, torch.bfloat16, "cuda"
        ).eval()
        random_weights(model)
        cache = KVCache.for_model(model, 64, 4096 + 8)
        for seqs, tokens in PREFILL:
            ms, work = timed_step(model, cache, [tokens] * seqs, 0, reps=5)
            rows.append((label, f"prefill {seqs}x{tokens}", ms, seqs * tokens / ms * 1e3, work))
        for seqs in DECODE:
            ms, work = timed_step(model, cache, [1] * seqs, 128, reps=30)
            rows.append((label, f"decode {seqs}", ms, seqs / ms * 1e3, work))
        del model, cache
        torch.cuda.empty_cache()
    return rows if state.rank == 0 else None


def main():
    results = []
    for tp, dp in ((2, 1), (1, 2)):
        layouts = [layout for layout in LAYOUTS if layout[1:3] == (tp, dp)]
        results += spawn(
            run,
            2,
            layouts,
            config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp),
            device="cuda",
        )[0]
    print(
        f"GPU {torch.cuda.get_device_name()} x2, torch {torch.__version__}; GLM-5.2 widths, 2 MoE layers, bf16"
    )
    print(
        f"{'layout':<14}{'step':<18}{'ms':>9}{'tokens/s':>11}  rank 0: rows dispatched, rows computed"
    )
    for label, step, ms, tps, work in results:
        print(
            f"{label:<14}{step:<18}{ms:>9.2f}{tps:>11.0f}  {work['rows_dispatched']:>6} {work['rows_computed']:>8}"
        )


if __name__ == "__main__":
    main()
