"""The two EP dispatch backends of an SP MoE layer on 2 GPUs (NCCL): all-gather / reduce-scatter against
per-token all-to-all with per-rank deduplication, with our Triton bf16 experts at GLM-5.2 widths (256 experts,
top-8, 128 per rank, H 6144, I 2048) and a random router. Per rank: n token rows; reported: time per call
(CUDA-event median, ms) and the bytes each backend moves per rank.

    python benchmarks/bench_dispatch.py
"""

import torch
from timing import cuda_ms

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.layers.moe.dispatch import DISPATCH
from spmoe.layers.moe.experts.triton_experts import TritonExperts

ROWS = [1, 4, 32, 256, 2048, 8192]
GLM = dict(
    model_type="glm_moe_dsa",
    vocab_size=64,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=1,
    num_attention_heads=64,
    n_routed_experts=256,
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
)


def run():
    state = get_parallel_state()
    cfg = ModelConfig.from_dict(GLM)
    per_rank = cfg.n_routed_experts // state.ep_size
    with torch.device("cuda"):
        experts = TritonExperts(cfg, state.ep_rank * per_rank, per_rank).bfloat16()
    gen = torch.Generator(device="cuda").manual_seed(state.rank)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, cfg.hidden_size**-0.5, generator=gen)
        experts.down_proj.normal_(0, cfg.moe_intermediate_size**-0.5, generator=gen)
    rows_out = []
    for rows in ROWS:
        x = torch.randn(rows, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
        ids = (
            torch.rand(rows, cfg.n_routed_experts, generator=gen, device="cuda")
            .topk(8, dim=-1)
            .indices
        )
        weights = torch.rand(rows, 8, generator=gen, device="cuda")
        result = {"rows": rows}
        for name, dispatch in DISPATCH.items():

            def call():
                return dispatch(x, ids, weights, experts, state.ep_group, rows)

            with torch.no_grad():
                with count_collectives() as counted:
                    call()
                ms = cuda_ms(call, 10 if rows <= 2048 else 4, warmup=3, barrier=True)
            result[name] = (ms, sum(v["bytes"] for v in counted.as_dict().values()))
        rows_out.append(result)
    return rows_out


def main():
    results = spawn(run, 2, config=ParallelConfig(tensor_parallel_size=2, sp="on"), device="cuda")
    print(
        f"GPU {torch.cuda.get_device_name()} x2, torch {torch.__version__}; per rank n rows; ms (rank 0) and MiB "
        f"moved per rank"
    )
    print(
        f"{'n':>6} {'AG/RS ms':>9} {'a2a ms':>8} {'a2a/AGRS':>9} {'AG/RS MiB':>10} {'a2a MiB':>8}"
    )
    for r in results[0]:
        (t1, b1), (t2, b2) = r["allgather_reducescatter"], r["all_to_all"]
        print(
            f"{r['rows']:>6} {t1:>9.3f} {t2:>8.3f} {t2 / t1:>9.2f} {b1 / 2**20:>10.2f} {b2 / 2**20:>8.2f}"
        )


if __name__ == "__main__":
    main()
