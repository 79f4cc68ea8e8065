"""The one timing loop every benchmark uses: CUDA events around single calls, median after warm-up."""

import statistics

import torch
import torch.distributed as dist


def cuda_ms(fn, reps: int, warmup: int = 1, barrier: bool = False) -> float:
    """Median milliseconds of `fn()` over `reps` calls, each timed between two CUDA events after `warmup`
    untimed calls. `barrier`: line the ranks up before each call (for collectives)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if barrier:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """fn captured once in a CUDA graph (its inputs are fixed tensors) after one eager warm-up call; returns
    the replay. The graph's memory stays held while the replay is referenced."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
