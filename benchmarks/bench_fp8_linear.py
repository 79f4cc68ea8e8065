"""FP8 block-128 linears at GLM-5.2's shapes (TP 1, or one rank's at `--tp`) on one GPU: the Triton
kernels (`quantization.fp8_kernels`: split-K GEMV with the activations quantised inside for m <= 16,
else quantise + GEMM) against bf16 `F.linear` (cuBLAS) on the same shapes, and against
`torch._scaled_mm` with 1 x 128 activation and 128 x 128 weight scales (cuBLAS's block-scaled FP8
GEMM, given the same quantised activations; the quantisation is timed with it).

Each call is timed inside a CUDA graph that cycles through enough copies of the weight to exceed the
L2 cache (so every call reads its weight from HBM, as in a model), median of CUDA-event timings over
the replays. Printed per shape and m: microseconds per call and what that is as bytes / s (weight +
activations + output; the decode cases' roofline is 4.3 TB/s on an H200, 3.35 on an H100) or TFLOP/s
(prefill). `_scaled_mm`'s output is checked against the torch reference before it is timed; if this
torch build refuses the block-scaled form, the row says why.

`--sweep` times the Triton GEMM's launch configs (`fp8_matmul`'s `config`: tiles, k splits, warps,
stages) per shape and m instead, every candidate printed, then the fastest as entries of
`fp8_kernels.MATMUL_CONFIGS`.

    python benchmarks/bench_fp8_linear.py [--tp 8] [--m 1 16 64 8192] [--sweep]
"""

import argparse

import torch
import torch.nn.functional as F
from timing import cuda_ms

from spmoe.layers.moe.experts.triton_kernels import quantize_fp8
from spmoe.layers.quantization.fp8_kernels import (
    MatmulConfig,
    decode_split,
    fp8_matmul,
    m_bucket,
    matmul_config,
)
from spmoe.layers.quantization.fp8_linear import fp8_linear_torch, quantize_blocks

SHAPES = {  # name: (n, k) at TP 1; x_proj's FP8 parts padded to 128-row blocks as MergedLinear holds them
    "x_proj (q_a + kv_a + wk)": (2048 + 640 + 128, 6144),
    "x_proj (q_a + kv_a)": (2048 + 640, 6144),
    "q_b_proj": (64 * 256, 2048),
    "indexer.wq_b": (32 * 128, 2048),
    "o_proj": (6144, 64 * 256),
    "shared gate_up": (2 * 2048, 6144),
    "shared down": (6144, 2048),
    "dense gate_up": (2 * 12288, 6144),
    "dense down": (6144, 12288),
}
# how TP splits each: "n" column-parallel, "k" row-parallel, None replicated (the MLA down
# projections and the indexer); the shared experts as off SP (TP-sharded, replicated under SP)
TP_SPLIT = {
    "q_b_proj": "n",
    "o_proj": "k",
    "shared gate_up": "n",
    "shared down": "k",
    "dense gate_up": "n",
    "dense down": "k",
}


def shapes_at(tp: int) -> dict[str, tuple[int, int]]:
    """`SHAPES` on one rank of TP `tp` (each split dimension divided by tp)."""
    return {
        name: (
            n // tp if TP_SPLIT.get(name) == "n" else n,
            k // tp if TP_SPLIT.get(name) == "k" else k,
        )
        for name, (n, k) in SHAPES.items()
    }


L2_BYTES = 60 << 20  # H200: 50 MiB of L2, with a margin
REPS = 30


def scaled_mm(xq, xs, w, ws):
    """cuBLAS's block-scaled FP8 GEMM: xq `[m, k]` e4m3 with scales `[m, k / 128]` (outer-dim-major, as it
    asks), w `[n, k]` e4m3 with `[n / 128, k / 128]` -> bf16 `[m, n]`."""
    return torch._scaled_mm(
        xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(), out_dtype=torch.bfloat16
    )


def per_call_us(fn, copies: int) -> float:
    """Microseconds of one call of fn(i) (i = 0 .. copies - 1 in turn), from a CUDA graph of `copies` calls."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    return cuda_ms(graph.replay, REPS, warmup=3) * 1e3 / copies


DECODE_TILES = {  # m bucket -> (block_m, block_n, num_warps, num_stages) tried, each at several k splits
    16: [(16, 32, 4, 4), (16, 64, 4, 4), (16, 64, 4, 6), (16, 128, 4, 4), (16, 128, 8, 3)],
    32: [(32, 64, 4, 4), (32, 128, 4, 4)],
    64: [(64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 8, 4), (32, 128, 4, 4)],
}
PREFILL_TILES = [(128, 128, 8, 3), (128, 128, 4, 4), (128, 64, 4, 4), (64, 128, 4, 4)]


def candidates(m: int, n: int, k: int) -> list[MatmulConfig]:
    """The configs the sweep times for m rows: decode tiles at no split, at `decode_split`'s and at twice it;
    prefill tiles unsplit; and the one `matmul_config` picks."""
    bucket = m_bucket(m)
    found = [matmul_config(m, n, k)]
    if bucket == 0:
        found += [MatmulConfig(bm, bn, 1, w, st) for bm, bn, w, st in PREFILL_TILES]
    for bm, bn, w, st in DECODE_TILES.get(bucket, []):
        split = decode_split(-(-m // bm) * -(-n // bn), k)
        found += [MatmulConfig(bm, bn, s, w, st) for s in sorted({1, split, 2 * split})]
    return list(dict.fromkeys(found))


def sweep(ms: list[int], shapes: dict[str, tuple[int, int]], gen) -> None:
    """Every candidate's time per shape and m (a line each, the table's own pick marked *), then the fastest
    per shape and m bucket as `MATMUL_CONFIGS` entries."""
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; Triton FP8 GEMM configs")
    print(
        "config = (block_m, block_n, split_k, num_warps, num_stages); us per call; * = matmul_config's pick"
    )
    picks = []
    for name, (n, k) in shapes.items():
        w8, ws = quantize_blocks(
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        )
        copies = max(1, -(-L2_BYTES // w8.nbytes))
        ws8 = [(w8, ws)] + [(w8.clone(), ws.clone()) for _ in range(copies - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = fp8_linear_torch(x, w8, ws).float()
            chosen, timed = matmul_config(m, n, k), []
            for cfg in candidates(m, n, k):
                try:
                    got = fp8_matmul(x, w8, ws, config=cfg).float()
                    error = float((got - want).norm() / want.norm())
                    if error > 1e-2:
                        print(f"  {name} m {m} {tuple(cfg)}: relative error {error:.3g}, skipped")
                        continue
                    us = per_call_us(lambda i: fp8_matmul(x, *ws8[i], config=cfg), copies)
                except Exception as e:  # a config the compiler refuses (shared memory): skipped
                    print(f"  {name} m {m} {tuple(cfg)}: {type(e).__name__}")
                    continue
                timed.append((us, cfg))
                rate = (
                    (w8.nbytes + 2 * m * (k + n)) / us / 1e3
                    if m <= 256
                    else 2 * m * n * k / us / 1e6
                )
                unit = "GB/s" if m <= 256 else "TF/s"
                mark = "*" if cfg == chosen else " "
                shape = f"{name:<26} n {n:>6} k {k:>6} m {m:>5}"
                print(
                    f"{shape} {mark} {tuple(cfg)!s:<22} {us:9.1f} us {rate:7.0f} {unit}", flush=True
                )
            if timed:
                us, best = min(timed)
                picks.append(
                    f"    ({m_bucket(m)}, {n}, {k}): {best!r},  # m {m}: {us:.1f} us, {name}"
                )
    print("fastest per shape and m (as MATMUL_CONFIGS entries):")
    print("\n".join(picks), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 8192])
    p.add_argument(
        "--sweep", action="store_true", help="time the Triton GEMM's launch configs instead"
    )
    p.add_argument("--tp", type=int, default=1, help="the shapes on one rank of this TP size")
    args = p.parse_args()
    shapes = shapes_at(args.tp)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.sweep:
        sweep(args.m, shapes, gen)
        return
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, TP {args.tp} shapes; "
        "us per call (GB/s | TFLOP/s)"
    )
    print(
        f"{'shape':<26} {'n':>6} {'k':>6} {'m':>5}  {'bf16 F.linear':>22} {'FP8 Triton':>22} {'FP8 _scaled_mm':>22}"
    )
    for name, (n, k) in shapes.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        w8, ws = quantize_blocks(w16)
        copies16 = max(1, -(-L2_BYTES // w16.nbytes))
        copies8 = max(1, -(-L2_BYTES // w8.nbytes))
        ws16 = [w16] + [w16.clone() for _ in range(copies16 - 1)]
        ws8 = [(w8, ws)] + [(w8.clone(), ws.clone()) for _ in range(copies8 - 1)]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            flops = 2 * m * n * k

            def rate(us, weight_bytes):
                if m > 256:
                    return f"{us:9.1f} ({flops / us / 1e6:6.0f} TF/s)"
                return f"{us:9.1f} ({(weight_bytes + 2 * m * (k + n)) / us / 1e3:6.0f} GB/s)"

            bf16 = per_call_us(lambda i: F.linear(x, ws16[i]), copies16)
            tri = per_call_us(lambda i: fp8_matmul(x, *ws8[i]), copies8)
            cells = [rate(bf16, w16.nbytes), rate(tri, w8.nbytes + ws.nbytes)]
            try:
                want = fp8_linear_torch(x, w8, ws).float()
                xq, xs = quantize_fp8(x)
                got = scaled_mm(xq, xs, w8, ws).float()
                error = float((got - want).norm() / want.norm())
                if error > 1e-2:
                    raise ValueError(f"relative error {error:.3g} against the reference")
                cells.append(
                    rate(
                        per_call_us(lambda i: scaled_mm(*quantize_fp8(x), *ws8[i]), copies8),
                        w8.nbytes,
                    )
                )
            except (RuntimeError, ValueError) as e:
                cells.append(f"refused: {str(e).splitlines()[0][:60]}")
            print(
                f"{name:<26} {n:>6} {k:>6} {m:>5}  {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}",
                flush=True,
            )


if __name__ == "__main__":
    main()
