"""The simulated rank's stand-in routing of one MoE layer, as `MoE._seeded` runs it at TP 8 / EP 8:
the torch reference (`simulated.block_tokens`, `seeded_routing`, `rotate_to_busiest`) against the
Triton kernel (`moe.seeded_triton`), per `--tokens` count of the DP group's step (SP off: 8 blocks
of every token; SP on: 8 shards). Per row: the launches of one call (the profiler's count), and the
milliseconds of one call replayed in a CUDA graph (as the engine runs a decode step), torch's over
the kernel's. GLM-5.2's 256 experts, top-8, the busiest load (size_rank's default):

    python benchmarks/bench_seeded_routing.py --tokens 1 4 16 64 256 1024 8192

A real rank runs none of this: it is what the simulation adds to each MoE layer of the step that
`size_rank.py` measures.
"""

import argparse

import torch
from timing import cuda_ms, gpu_ops, graphed, launch_count

from spmoe.distributed.simulated import block_tokens, rotate_to_busiest, seeded_routing
from spmoe.layers.moe.seeded_triton import seeded_routing as seeded_routing_fused

EXPERTS, K, SCALE, TP, EP = 256, 8, 2.5, 8, 8


def by_torch(blocks: tuple, rows: int) -> torch.Tensor:
    starts, valid = block_tokens(*blocks, "cuda")
    ids, _ = seeded_routing(0, 5, starts, valid, rows, EXPERTS, K, SCALE)
    return rotate_to_busiest(ids, EP, EXPERTS)


def by_kernel(blocks: tuple, rows: int) -> torch.Tensor:
    return seeded_routing_fused(0, 5, blocks, rows, EXPERTS, K, SCALE, "cuda", EP)[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 8192])
    parser.add_argument("--sp", choices=("off", "on"), default="off")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(f"stand-in routing of one MoE layer, TP {TP} / EP {EP}, SP {args.sp}, busiest load")
    print(f"{'tokens':>7} {'rows':>6} {'torch launches':>15} {'kernel launches':>16}", end="")
    print(f" {'torch ms':>9} {'kernel ms':>10} {'x':>6}")
    for tokens in args.tokens:
        sharded = args.sp == "on"
        blocks, rows = (tokens, sharded, TP, EP, 0), -(-tokens // TP) if sharded else tokens
        if not torch.equal(by_torch(blocks, rows), by_kernel(blocks, rows)):
            raise SystemExit(f"the kernel's ids differ from torch's at {tokens} tokens")
        launches = [
            launch_count(gpu_ops(lambda f=f: f(blocks, rows))) for f in (by_torch, by_kernel)
        ]
        times = [
            cuda_ms(graphed(lambda f=f: f(blocks, rows)), args.reps, warmup=3)
            for f in (by_torch, by_kernel)
        ]
        print(
            f"{tokens:>7} {EP * rows:>6} {launches[0]:>15} {launches[1]:>16} {times[0]:>9.4f} "
            f"{times[1]:>10.4f} {times[0] / times[1]:>6.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
