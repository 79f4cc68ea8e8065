"""The host work of one serving step under DP that a simulated rank cannot see: rank 0's step plan broadcast to
every rank and the DP groups' outputs and metrics gathered back to it (`engine.ranks.ServingLoop.step`'s
control plane, gloo over the machine's CPUs), with `--dp` x `--tp` local processes. Each DP group's TP rank
0 returns `batch` outputs of `tokens` new tokens each (MTP: the accepted drafts too). Prints the median
microseconds per step and the line for `configs/node_latency.json`'s `host_us_per_step`.

    python benchmarks/bench_dp_host.py --dp 8 --batches 1 2 8 32 --tokens 1 3 --out dp_host.json

Run it on the GPU machine (its CPUs serve the node). The DP batch agreement is a collective of the EP group
(NCCL on the node): the simulated rank counts it, and the projection prices it as one.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.distributed.comm import broadcast_object, gather_object
from spmoe.engine.ranks import StepPlan
from spmoe.engine.request import EngineMetrics, RequestOutput


def control_plane_us(batches: list[int], tokens: list[int], reps: int) -> dict:
    """On every rank: per (batch, tokens), the median microseconds of one step's plan broadcast and output
    gather (rank 0's clock; the other ranks return None)."""
    state, results = get_parallel_state(), {}
    for batch in batches:
        for count in tokens:
            outputs = [RequestOutput(f"req-{i}", list(range(count)), None) for i in range(batch)]
            times = []
            for _ in range(reps):
                began = time.perf_counter()
                broadcast_object(StepPlan("step"), state.control_group)
                mine = (outputs, EngineMetrics(running=batch)) if state.tp_rank == 0 else None
                gather_object(mine, state.control_group)
                times.append((time.perf_counter() - began) * 1e6)
            results[f"{batch}x{count}"] = statistics.median(times[reps // 10 :])
    return results if state.rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 8, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[1], help="new tokens per output")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", help="JSON of the medians")
    opts = p.parse_args(argv)
    config = ParallelConfig(tensor_parallel_size=opts.tp, data_parallel_size=opts.dp)
    medians = spawn(
        control_plane_us, config.world_size, opts.batches, opts.tokens, opts.reps, config=config
    )[0]
    for case, us in medians.items():
        print(f"dp={opts.dp} tp={opts.tp} batch x tokens {case}: {us:.1f} us per step")
    if opts.out:
        Path(opts.out).write_text(
            json.dumps({"dp": opts.dp, "tp": opts.tp, "us": medians}, indent=1)
        )
    print(
        f'node_latency.json host_us_per_step "dp": {max(medians.values()):.1f} (the largest case)'
    )
    return medians


if __name__ == "__main__":
    main()
