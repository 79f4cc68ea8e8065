"""The one timing loop every benchmark uses (CUDA events around single calls, median after warm-up), and the
GPU operations a call launches (from the profiler)."""

import statistics
from collections import Counter

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


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


def gpu_ops(fn) -> dict[str, tuple[int, float]]:
    """The GPU operations (kernels, copies, memsets) one eager call of `fn` launches: name -> (launches, total
    device microseconds). `sum(n for n, _ in gpu_ops(fn).values())` is the launch count."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches, micros = Counter(), Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches[event.name] += 1
            micros[event.name] += event.device_time
    return {name: (launches[name], micros[name]) for name in launches}


def launch_count(ops: dict[str, tuple[int, float]]) -> int:
    """The launches of a `gpu_ops` result."""
    return sum(n for n, _ in ops.values())


def layer_ops(layers, step) -> tuple[list[dict[str, tuple[int, float]]], object]:
    """The GPU operations (`gpu_ops`) of each of `layers` (decoder layers): their inputs are caught in one eager
    call of `step`, then each layer runs alone on them under the profiler (at TP 1 a layer changes none of its
    inputs; it rewrites the same cache rows). Returns what `step` returned too: (per-layer ops, step's result)."""
    calls = []
    hooks = [
        layer.register_forward_hook(lambda m, args, _out: calls.append((m, args)))
        for layer in layers
    ]
    try:
        result = step()
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        return [gpu_ops(lambda: layer(*args)) for layer, args in calls], result
