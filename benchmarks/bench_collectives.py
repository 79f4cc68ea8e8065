"""Our SP layout primitives against raw NCCL on 2 GPUs, at H = 6144, bf16, launched eagerly and replayed from
a CUDA graph; plus the fused (hidden, residual) gather against one and two gathers of H, our one-shot
kernels (`spmoe/distributed/one_shot.py`) where the input fits their buffer, and torch's symmetric-memory
one-shot all-reduce (no NVLink multicast) for the small sizes.

N tokens, t = 2 ranks, n = ceil(N / t) rows per rank. Per call, microseconds (CUDA-event median on rank 0;
graph: 20 calls captured in one graph, time / 20).

    python benchmarks/bench_collectives.py
"""

import os

import torch
import torch.distributed as dist
from timing import cuda_ms

from spmoe.config import ParallelConfig
from spmoe.distributed import (
    _all_gather_sp_states,
    get_parallel_state,
    shard_rows,
    sp_all_gather,
    sp_reduce_scatter,
    spawn,
)
from spmoe.distributed.comm import all_reduce
from spmoe.distributed.one_shot import OneShot

H = 6144
ROWS = [1, 8, 64, 256, 1024, 4096, 16384]
REPS = 20


def measure(fn) -> tuple[float, float]:
    """-> (eager us, graph us) per call."""
    eager = cuda_ms(fn, REPS, warmup=3, barrier=True) * 1e3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return eager, start.elapsed_time(end) * 1e3 / REPS


def symm_mem_all_reduce(rows: int):
    """torch's one-shot all-reduce on a symmetric-memory buffer, or None where it is not available."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(rows, H, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        return lambda: torch.ops.symm_mem.one_shot_all_reduce(
            buffer, "sum", dist.group.WORLD.group_name
        )
    except Exception as e:  # noqa: BLE001 - reported as n/a with the reason
        return f"n/a ({type(e).__name__})"


def run():
    state = get_parallel_state()
    group, t = state.tp_group, state.tp_size
    results = []
    one_shot = OneShot(group, state.device)
    for rows in ROWS:
        n = shard_rows(rows, t)
        shard, shard2 = (
            torch.randn(n, H, device="cuda").bfloat16(),
            torch.randn(n, H, device="cuda").bfloat16(),
        )
        full = torch.randn(n * t, H, device="cuda").bfloat16()
        gathered, scattered = (
            torch.empty(n * t, H, device="cuda").bfloat16(),
            torch.empty_like(shard),
        )
        both = torch.empty(n * t, 2 * H, device="cuda").bfloat16()
        cases = {
            "nccl all_gather": lambda: dist.all_gather_into_tensor(gathered, shard, group=group),
            "sp_all_gather": lambda: sp_all_gather(shard, rows),
            "nccl reduce_scatter": lambda: dist.reduce_scatter_tensor(scattered, full, group=group),
            "sp_reduce_scatter": lambda: sp_reduce_scatter(full[:rows]),
            "nccl all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_reduce (ours)": lambda: all_reduce(full, group),
            "fused gather (h, r)": lambda: _all_gather_sp_states(shard, shard2, rows),
            "one gather of 2H": lambda: dist.all_gather_into_tensor(
                both, torch.cat([shard, shard2], 1), group=group
            ),
            "two gathers of H": lambda: (
                dist.all_gather_into_tensor(gathered, shard, group=group),
                dist.all_gather_into_tensor(gathered, shard2, group=group),
            ),
        }
        for kind, x, out in (
            ("all_gather", shard, gathered),
            ("reduce_scatter", full, scattered),
            ("all_reduce", full, full),
        ):
            if one_shot.fits(kind, x):
                cases[f"one-shot {kind}"] = lambda kind=kind, x=x, out=out: one_shot.run(
                    kind, x, out
                )
        symm = symm_mem_all_reduce(n * t) if rows <= 1024 else "skipped (large)"
        for name, fn in cases.items():
            results.append((rows, name, *measure(fn)))
        if callable(symm):
            results.append((rows, "symm_mem one-shot all_reduce", *measure(symm)))
        else:
            results.append(
                (rows, f"symm_mem one-shot all_reduce {symm}", float("nan"), float("nan"))
            )
    return results if state.rank == 0 else None


def main():
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = spawn(run, 2, config=ParallelConfig(tensor_parallel_size=2), device="cuda")[0]
    print(
        f"GPU {torch.cuda.get_device_name()} x2, torch {torch.__version__}; H {H}, bf16; us per call "
        f"(NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, "
        f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')})"
    )
    print(f"{'N':>6}  {'primitive':<44}{'eager us':>10}{'graph us':>10}")
    for rows, name, eager, graph in results:
        print(f"{rows:>6}  {name:<44}{eager:>10.1f}{graph:>10.1f}")


if __name__ == "__main__":
    main()
