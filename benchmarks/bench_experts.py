"""Routed experts on one GPU at GLM-5.2 widths: our Triton kernels (bf16, FP8 block-128) against the torch
reference loop and `torch._grouped_mm`, with the roofline.

One MoE layer's 128 local experts of 256 (EP rank 0 of 2), top-8, H 6144, I 2048, random router, bf16
activations. Times are CUDA-event medians after warm-up, in ms, launched eagerly (every method), and ours
also replayed from a CUDA graph. Roofline = max(touched expert weight bytes
/ 4.3 TB/s, FLOPs / 790 TFLOP/s); for FP8 the bytes are halved and the FLOP rate doubled.

    python benchmarks/bench_experts.py                 # the table
    python benchmarks/bench_experts.py --sweep         # best tile config per N, for pick_config
"""

import argparse

import torch
import torch.nn.functional as F
from timing import cuda_ms, graphed

from spmoe.layers.moe.experts.triton_kernels import fused_moe, pick_config

H, I, EXPERTS, LOCAL, TOP_K = 6144, 2048, 256, 128, 8
DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [1024, 2048, 4096, 8192, 16384]
HBM, BF16_FLOPS = 4.3e12, 790e12


def quantize_blocks(w: torch.Tensor):
    """`[E, N, K]` -> (FP8 e4m3 `[E, N, K]`, float32 scales `[E, N/128, K/128]`), one per 128 x 128 block."""
    blocks = w.float().view(w.shape[0], w.shape[1] // 128, 128, w.shape[2] // 128, 128)
    scale = blocks.abs().amax((2, 4)) / 448.0
    return (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(w.shape), scale


def routing(rows: int, gen):
    """-> global ids `[rows, 8]` of 256 (this rank owns experts [0, 128)), the same with -1 where not local,
    and the routing weights."""
    ids = torch.rand(rows, EXPERTS, generator=gen, device="cuda").topk(TOP_K, dim=-1).indices
    return (
        ids,
        torch.where(ids < LOCAL, ids, -1),
        torch.rand(rows, TOP_K, generator=gen, device="cuda"),
    )


def roofline(local_ids, weight_bytes: float, flops_rate: float) -> float:
    touched = local_ids[local_ids >= 0].unique().numel()
    pairs = (local_ids >= 0).sum().item()
    return max(touched * 3 * H * I * weight_bytes / HBM, 2 * pairs * 3 * H * I / flops_rate) * 1e3


def torch_loop(x, local, weights, w13, w2):
    out = torch.zeros_like(x)
    for e in torch.unique(local[local >= 0]).tolist():
        rows, slot = torch.nonzero(local == e, as_tuple=True)
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        out.index_add_(
            0, rows, F.linear(F.silu(gate) * up, w2[e]) * weights[rows, slot, None].to(x.dtype)
        )
    return out


def grouped_mm(x, local, weights, w13_t, w2_t):
    """What a user reaches for in plain PyTorch: sort the (row, expert) pairs, two grouped GEMMs, scatter."""
    flat = local.flatten()
    order = torch.argsort(torch.where(flat >= 0, flat, LOCAL), stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=LOCAL)
    offs = counts.cumsum(0).to(torch.int32)
    # local pairs, grouped by expert (one host sync, as a user would write it)
    kept = order[: int(offs[-1])]
    rows = kept // TOP_K
    gate_up = torch._grouped_mm(x[rows], w13_t, offs=offs)  # [P, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2_t, offs=offs) * weights.flatten()[kept, None].to(
        x.dtype
    )
    return torch.zeros_like(x).index_add_(0, rows, y)


def table(args, gen, w13, w2, w13_t, w2_t, fp8):
    print(
        f"{'N':>6} {'torch loop':>11} {'grouped_mm':>11} {'triton bf16':>12} {'triton fp8':>11} "
        f"{'roof bf16':>10} {'roof fp8':>9} {'bf16 %roof':>10} {'fp8 %roof':>10} {'grouped/bf16':>12} "
        f"{'bf16/fp8':>9} {'bf16 graph':>11} {'fp8 graph':>10} {'%roof':>6} {'%roof':>6}"
    )
    for rows in args.rows:
        x = torch.randn(rows, H, generator=gen, device="cuda").bfloat16()
        ids, local, weights = routing(rows, gen)
        reps = 20 if rows <= 1024 else 5
        t_loop = cuda_ms(lambda: torch_loop(x, local, weights, w13, w2), 3 if rows > 256 else 10)
        t_grouped = cuda_ms(lambda: grouped_mm(x, local, weights, w13_t, w2_t), reps)
        t_bf16 = cuda_ms(lambda: fused_moe(x, ids, weights, 0, w13, w2), reps)
        t_fp8 = cuda_ms(lambda: fused_moe(x, ids, weights, 0, *fp8), reps)
        g_bf16 = cuda_ms(graphed(lambda: fused_moe(x, ids, weights, 0, w13, w2)), reps)
        g_fp8 = cuda_ms(graphed(lambda: fused_moe(x, ids, weights, 0, *fp8)), reps)
        r16, r8 = roofline(local, 2, BF16_FLOPS), roofline(local, 1, 2 * BF16_FLOPS)
        print(
            f"{rows:>6} {t_loop:>11.3f} {t_grouped:>11.3f} {t_bf16:>12.3f} {t_fp8:>11.3f} {r16:>10.3f} {r8:>9.3f} "
            f"{r16 / t_bf16:>10.0%} {r8 / t_fp8:>10.0%} {t_grouped / t_bf16:>12.2f} {t_bf16 / t_fp8:>9.2f} "
            f"{g_bf16:>11.3f} {g_fp8:>10.3f} {r16 / g_bf16:>6.0%} {r8 / g_fp8:>6.0%}",
            flush=True,
        )


CONFIGS = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in [
        (16, 64, 128, 4, 4),
        (16, 64, 128, 4, 5),
        (16, 128, 128, 4, 4),
        (16, 64, 256, 4, 3),
        (16, 32, 128, 4, 5),
        (32, 64, 128, 4, 4),
        (32, 128, 128, 4, 4),
        (64, 64, 128, 4, 4),
        (64, 128, 64, 8, 3),
        (64, 128, 128, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 128, 128, 8, 3),
        (128, 64, 128, 4, 3),
        (128, 128, 64, 4, 4),
    ]
]


def sweep(args, gen, w13, w2, fp8):
    for rows in args.rows:
        x = torch.randn(rows, H, generator=gen, device="cuda").bfloat16()
        ids, _, weights = routing(rows, gen)
        for name, weights_args, is_fp8 in (("bf16", (w13, w2), False), ("fp8", fp8, True)):
            results = []
            for cfg in CONFIGS:
                if is_fp8 and (cfg["BLOCK_K"] != 128 or cfg["BLOCK_N"] > 128):
                    continue
                try:
                    results.append(
                        (
                            cuda_ms(
                                lambda: fused_moe(x, ids, weights, 0, *weights_args, config=cfg), 10
                            ),
                            cfg,
                        )
                    )
                except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped, and said
                    print(f"  {name} N={rows} {cfg}: {type(e).__name__}")
            best = min(results, key=lambda r: r[0])
            chosen = cuda_ms(lambda: fused_moe(x, ids, weights, 0, *weights_args), 10)
            print(
                f"N={rows:>6} {name}: best {best[0]:.3f} ms {best[1]}; pick_config {chosen:.3f} ms "
                f"{pick_config(rows * TOP_K, LOCAL, is_fp8)}",
                flush=True,
            )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=lambda s: [int(v) for v in s.split(",")], default=DECODE + PREFILL
    )
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(LOCAL, 2 * I, H, generator=gen, device="cuda") * H**-0.5).bfloat16()
    w2 = (torch.randn(LOCAL, H, I, generator=gen, device="cuda") * I**-0.5).bfloat16()
    (q13, s13), (q2, s2) = quantize_blocks(w13), quantize_blocks(w2)
    fp8 = (q13, q2, s13, s2)
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; {LOCAL} of {EXPERTS} experts, top-{TOP_K}, "
        f"H {H}, I {I}; times in ms",
        flush=True,
    )
    if args.sweep:
        sweep(args, gen, w13, w2, fp8)
    else:
        table(args, gen, w13, w2, w13.transpose(1, 2), w2.transpose(1, 2), fp8)


if __name__ == "__main__":
    main()
