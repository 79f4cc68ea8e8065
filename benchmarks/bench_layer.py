"""One GLM-5.2 MoE decoder layer on TP x DP GPUs (default TP 2 x DP 1; EP over all of them: 128 of the 256
experts per rank on 2), random bf16 weights, the experts backend `auto` picks (Triton on a Hopper GPU): SP on
against SP off, and what `auto` picks. N is the tokens of each DP rank.

The layer runs as it does inside the model: SP on takes and returns SHARDED (hidden, residual) `[n, H]` (the
steady state of an SP region), SP off PARTIAL `[N, H]`. Attention attends this step's tokens only: decode N
is N one-token sequences, prefill N is sequences of 1024 tokens; there is no cached context, so SP's share of
the time is as large as it gets (attention is the same computation with SP on and off).

Per N: ms per layer (CUDA-event median on rank 0) over 8 calls of the layer in a row, as a model's layers
follow each other (each call takes a copy of the same input, so SP on and off route the same tokens to the
same experts: at small N the time follows how many experts each rank streams), launched eagerly (up to a few
thousand tokens this is the host's launch time) and replayed from one CUDA graph of the 8 calls (N <= 4096;
the graph's memory is held);
the on/off ratios; and, for one eager call, the GPU operations the layer launches (kernels, copies and
memsets, from the profiler) and the collectives. Then the weight memory per rank of the whole model (78
layers, 3 dense, without the MTP layer) for SP off and SP on with each scope.

    python benchmarks/bench_layer.py [--tp 2] [--dp 1] [--decode 1 2 4] [--prefill 1024]
"""

import argparse
import os
from dataclasses import replace

import torch
from bench_dp import GLM, random_weights
from timing import cuda_ms, gpu_ops, graphed, launch_count

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, sp_shard, spawn
from spmoe.distributed.layer_plan import build_layer_plan
from spmoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmoe.layers.moe.experts.base import ExpertsDeployment
from spmoe.layers.moe.experts.selection import select_experts
from spmoe.layers.moe.experts.torch_ref import TorchExperts
from spmoe.models.deepseek_v32.decoder_layer import DeepseekV32DecoderLayer, attention_batch
from spmoe.models.deepseek_v32.model import _default_dtype

DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [1024, 4096, 8192, 16384]
PREFILL_SEQ = 1024
MODES = {"off": False, "on": True}
GRAPH_MAX = 4096  # largest N timed from a CUDA graph
CHAIN = 8  # layer calls per timed run


def with_sp(mode: str, scope: str = "moe") -> ParallelConfig:
    """This run's TP x DP layout with SP `mode` ("on" / "off") and `scope`."""
    return replace(get_parallel_state().config, sp=mode, sp_scope=scope)


def build_layer(cfg: ModelConfig, sp: bool, device: str) -> DeepseekV32DecoderLayer:
    """Layer 0 (MoE) of the plan: input SHARDED with SP, the embedding's PARTIAL sum without."""
    parallel = with_sp("on" if sp else "off")
    experts = select_experts(
        ExpertsDeployment.for_layer(cfg, parallel, sp, torch.bfloat16, "cuda"), "auto"
    )
    with torch.device(device), _default_dtype(torch.bfloat16):
        return DeepseekV32DecoderLayer(
            cfg, build_layer_plan(cfg, parallel).layers[0], experts, parallel.ep_backend
        )


def layer_inputs(cfg: ModelConfig, num_tokens: int, sp: bool, decode: bool):
    """(hidden, residual) in the layer's input layout, the same tokens with SP on and off, and the attention
    batch."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hidden, residual = (
        torch.randn(num_tokens, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
        for _ in "hr"
    )
    if sp:  # this rank's rows, pad rows zero
        hidden, residual = sp_shard(hidden), sp_shard(residual)
    lens = [1] * num_tokens if decode else [PREFILL_SEQ] * (num_tokens // PREFILL_SEQ)
    positions = torch.cat([torch.arange(n, device="cuda") for n in lens])
    ids = torch.zeros(num_tokens, dtype=torch.long, device="cuda")
    return hidden, residual, attention_batch(cfg, ids, positions, lens, None, torch.bfloat16)


def measure(layer, cfg, num_tokens: int, sp: bool, decode: bool) -> dict:
    hidden, residual, batch = layer_inputs(cfg, num_tokens, sp, decode)
    # a fresh copy of the input per call: without SP the layer all-reduces its PARTIAL input in place
    call = lambda: layer(hidden.clone(), residual, batch, None, num_tokens)  # noqa: E731

    def chain():
        for _ in range(CHAIN):
            call()

    with torch.no_grad():
        try:
            eager = cuda_ms(chain, 10 if decode else 3, warmup=1, barrier=True) / CHAIN
            graph = float("nan")
            if num_tokens <= GRAPH_MAX:
                replay = graphed(chain)
                graph = cuda_ms(replay, 10, barrier=True) / CHAIN
                del replay
        except torch.OutOfMemoryError:  # dense attention over N^2 keys at the largest prefill
            torch.cuda.empty_cache()
            return {
                "eager": float("nan"),
                "graph": float("nan"),
                "ops": 0,
                "collectives": "out of memory",
            }
        copy = hidden.clone()  # outside the profile: the count is the layer's own launches
        with count_collectives() as stats:
            ops = launch_count(gpu_ops(lambda: layer(copy, residual, batch, None, num_tokens)))
    counts = {k: v["count"] for k, v in stats.counts.items() if v["count"]}
    return {
        "eager": eager,
        "graph": graph,
        "ops": ops,
        "collectives": " ".join(f"{k} {v}" for k, v in counts.items()),
    }


def run(decode: list[int], prefill: list[int]):
    cfg = ModelConfig.from_dict(GLM)
    results = {}
    # one layer at a time: on 2 GPUs each holds 128 experts, about 9.7 GB
    for (
        mode,
        sp,
    ) in MODES.items():
        layer = build_layer(cfg, sp, "cuda").eval()
        random_weights(layer)
        for num_tokens in decode + prefill:
            results[mode, num_tokens] = measure(layer, cfg, num_tokens, sp, num_tokens in decode)
            if get_parallel_state().rank == 0:
                print(f"  measured SP {mode} N={num_tokens}", flush=True)
        del layer
        torch.cuda.empty_cache()
    return (results, weight_gib()) if get_parallel_state().rank == 0 else None


def weight_gib() -> dict[str, float]:
    """Weight GiB per rank of the whole model (no MTP layer) for SP off and on with each scope, from layers
    built on the meta device (no memory)."""
    layers = 78
    cfg = ModelConfig.from_dict(
        {
            **GLM,
            "num_hidden_layers": layers,
            "vocab_size": 154880,
            "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (layers - 3),
            "indexer_types": ["full"] * layers,
        }
    )
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        vocab = [
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size),
            ParallelLMHead(cfg.vocab_size, cfg.hidden_size),
        ]
    nbytes = lambda module: sum(p.numel() * p.element_size() for p in module.parameters())  # noqa: E731
    out = {}
    for label, mode, scope in (
        ("SP off", "off", "moe"),
        ("SP on, scope moe", "on", "moe"),
        ("SP on, scope all", "on", "all"),
    ):
        parallel = with_sp(mode, scope)
        plan = build_layer_plan(cfg, parallel)
        total = sum(map(nbytes, vocab))
        for idx, count in ((0, 3), (3, layers - 3)):  # one dense, one MoE layer
            # dense expert weights, as Triton's
            with (
                torch.device("meta"),
                _default_dtype(torch.bfloat16),
            ):
                layer = DeepseekV32DecoderLayer(
                    cfg, plan.layers[idx], TorchExperts, parallel.ep_backend
                )
            total += count * nbytes(layer)
        out[label] = total / 2**30
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel size (default 1); TP x DP GPUs in all"
    )
    p.add_argument("--decode", type=int, nargs="*", default=DECODE)
    p.add_argument("--prefill", type=int, nargs="*", default=PREFILL)
    args = p.parse_args()
    layout = ParallelConfig(tensor_parallel_size=args.tp, data_parallel_size=args.dp)
    results, memory = spawn(
        run, layout.world_size, args.decode, args.prefill, config=layout, device="cuda"
    )[0]
    auto = "on" if layout.use_sequence_parallel_moe else "off"
    print(
        f"GPU {torch.cuda.get_device_name()} x{layout.world_size}, torch {torch.__version__}, "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}; one GLM-5.2 MoE layer, TP {args.tp} x DP "
        f"{args.dp}, {GLM['n_routed_experts'] // layout.world_size} local experts, bf16; auto picks SP {auto} "
        f"here; N tokens per DP rank"
    )
    print(
        f"{'N':>6} {'SP off ms':>10} {'SP on ms':>10} {'on/off':>7} {'graph off':>10} {'graph on':>10} "
        f"{'on/off':>7} {'auto/best':>9}   GPU ops per layer off / on, collectives off | on (one eager call)"
    )
    for num_tokens in args.decode + args.prefill:
        off, on = results["off", num_tokens], results["on", num_tokens]
        best = "graph" if num_tokens <= GRAPH_MAX else "eager"
        auto_vs_best = results[auto, num_tokens][best] / min(off[best], on[best])
        print(
            f"{num_tokens:>6} {off['eager']:>10.3f} {on['eager']:>10.3f} {on['eager'] / off['eager']:>7.3f} "
            f"{off['graph']:>10.3f} {on['graph']:>10.3f} {on['graph'] / off['graph']:>7.3f} {auto_vs_best:>9.3f}"
            f"   {off['ops']} / {on['ops']}, {off['collectives']} | {on['collectives']}"
        )
    print(
        f"auto/best: auto's time over the better of on and off (graph times up to N={GRAPH_MAX}, then eager)"
    )
    print("weight memory per rank, whole model (78 layers, no MTP), bf16:")
    for label, gib in memory.items():
        print(f"  {label:<18} {gib:8.2f} GiB  ({gib / memory['SP off']:.4f} x SP off)")


if __name__ == "__main__":
    main()
