"""Where a decode step's device time goes, by kernel family, and how near its bytes roofline each family
that streams weights runs inside the whole step (not in isolation): the FP8 linears (`fp8_matmul` and its
split-K sums: every FP8 `Linear` but kv_b_proj), kv_b_proj's per-head products (`fp8_head_matmul`), and the
routed experts (their gate_up and down kernels: the experts the step's rows touch). The time is the kernels'
device time in one eager call under the profiler (`timing.gpu_ops`: the same kernels a graph replays); the
bytes are the weights as stored (FP8 values and their float32 block scales)."""

import re

import torch
from timing import gpu_ops

from spmoe.layers.moe.moe import MoE

# family -> kernel names (Triton kernels by their function's name, the rest by what the profiler calls them)
FAMILIES = {
    # the simulated rank's stand-in routing: a cost of the simulation that a real rank does not pay
    "simulation": re.compile(r"_seeded_routing_kernel|_rotate_to_busiest_kernel"),
    "fp8_linear": re.compile(r"_fp8_matmul_kernel|_sum_splits_kernel"),
    "fp8_head": re.compile(r"_fp8_head_matmul_kernel"),
    "experts": re.compile(r"_gate_up_kernel|_down_kernel"),
    "expert_routing": re.compile(r"_count_kernel|_blocks_kernel|_place_kernel|_align_\w*kernel"),
    "attention": re.compile(r"indexer|topk|sparse_mla|_rows|mla|attention", re.I),
    "gemm_bf16": re.compile(r"gemm|sm90_xmma|cutlass|cublas|nvjet", re.I),
    "copy_fill": re.compile(r"Memcpy|Memset|copy|fill|cat", re.I),
}


TOP_KERNELS = 8  # per family, the kernels of most device time, by name


def family_of(kernel: str) -> str:
    return next((name for name, pattern in FAMILIES.items() if pattern.search(kernel)), "other")


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the target's weights each weight-streaming family reads once per step, all experts
    counted (`experts`: per expert, the routed experts' bytes over their count, per MoE layer)."""
    found = {"fp8_linear": 0, "fp8_head": 0}
    for name, p in model.named_parameters():
        if name.startswith("mtp") or ".experts." in name:
            continue
        is_fp8 = p.dtype == torch.float8_e4m3fn or name.endswith("weight_scale")
        if is_fp8:
            found["fp8_head" if "kv_b_proj" in name else "fp8_linear"] += (
                p.numel() * p.element_size()
            )
    moe = [m for m in model.model.modules() if isinstance(m, MoE)]
    found["expert_each"] = [
        sum(p.numel() * p.element_size() for p in m.experts.parameters()) // m.experts.count
        for m in moe
    ]
    return found


def kernel_report(step, model, experts_touched: list[int], bandwidth: float) -> dict:
    """One eager `step()` under the profiler -> per family: launches, device microseconds, its
    `TOP_KERNELS` kernels of most time (`top`), and for the weight-streaming families the bytes
    they must read and the share of `bandwidth` (bytes/s) that is."""
    ops = gpu_ops(step)
    report: dict[str, dict] = {}
    for kernel, (launches, micros) in sorted(ops.items(), key=lambda op: -op[1][1]):
        row = report.setdefault(family_of(kernel), {"launches": 0, "us": 0.0, "top": []})
        row["launches"] += launches
        row["us"] += micros
        if len(row["top"]) < TOP_KERNELS:
            row["top"].append({"kernel": kernel[:120], "launches": launches, "us": micros})
    weights = weight_bytes(model)
    needed = {
        "fp8_linear": weights["fp8_linear"],
        "fp8_head": weights["fp8_head"],
        "experts": sum(b * t for b, t in zip(weights["expert_each"], experts_touched)),
    }
    for family, nbytes in needed.items():
        row = report.get(family)
        if row and row["us"] and nbytes:
            row["bytes"] = nbytes
            row["roofline"] = nbytes / (row["us"] * 1e-6) / bandwidth
    report["busy_us"] = sum(row["us"] for row in report.values())
    return report
