"""The batched sampler alone: the time of one `Sampler.sample` call on `--batch` rows of `--vocab` logits, plain
greedy against every row with logprobs=5 and presence / frequency / repetition penalties (greedy or sampled),
against temperature sampling with top_p. Run on the GPU to see what the processors cost per decode step:

    python benchmarks/bench_sampler.py --device cuda --batch 1 16 64 256 --vocab 154880

A second table sets the two ways of finding the top_k / top_p threshold side by side, for top_p 0.95 and for
top_k 50 + top_p 0.95: the full sort (`top_k_top_p_threshold_by_sort`) against the Triton kernel
(`top_k_top_p_triton`), alone ("threshold") and inside a whole `sample()` call (`spmoe.layers.fused.ENABLED`
off: the sort and the torch race; on: both kernels), with the sort's time over the kernel's.

A third table sets the two ways of drawing sampled rows side by side: the seeded race by torch
(`draw_tokens_by_torch`: `[rows, V]` noise, softmax, ratio, argmax) against the Triton kernel
(`seeded_race_triton`), alone ("race", every row drawing) and inside whole `sample()` calls of temperature-1
rows and of top_p 0.95 rows (the top_p threshold by its kernel in both columns: only the race differs), with the
torch time over the kernel's.

The logits are Gaussian times `--logit-scale`: at the default scale 5, top_p 0.95 keeps tens to hundreds of
GLM-5.2's 154880 tokens (a trained model's next-token distribution is that peaked or more); at scale 1 it
keeps about 115000 (the kernel's search then narrows a dense crossing: its slowest case).
"""

import argparse

import torch
from timing import cuda_ms

from spmoe.engine.request import SamplingParams
from spmoe.engine.sampling import sampler as sampling
from spmoe.engine.sampling.noise import draw_tokens_by_torch, seed_keys
from spmoe.engine.sampling.processors import top_k_top_p_threshold_by_sort
from spmoe.engine.sampling.sampler import Sampler
from spmoe.layers import fused

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5)
SETTINGS = {
    "greedy": SamplingParams(),
    "greedy + logprobs + penalties": SamplingParams(**PENALTIES),
    "sampled, top_p 0.95": SamplingParams(1.0, top_p=0.95),
    "sampled, top_p 0.95 + logprobs + penalties": SamplingParams(1.0, top_p=0.95, **PENALTIES),
}
RACES = {"temperature 1": SamplingParams(1.0), "top_p 0.95": SamplingParams(1.0, top_p=0.95)}
TRUNCATIONS = {
    "top_p 0.95": SamplingParams(1.0, top_p=0.95),
    "top_k 50 + top_p 0.95": SamplingParams(1.0, top_k=50, top_p=0.95),
}


def sample_ms(params: SamplingParams, logits: torch.Tensor, reps: int) -> float:
    """Median ms of one `Sampler.sample` call with every row of `logits` `[m, V]` on `params`."""
    batch, vocab = logits.shape
    sampler = Sampler(batch, vocab, logits.device)
    rows = [sampler.add(params, list(range(100)), output=list(range(50, 80))) for _ in range(batch)]
    return cuda_ms(lambda: sampler.sample(logits, rows, [30] * batch), reps, warmup=2)


def compare_truncations(args) -> None:
    """The sort and the kernel side by side: threshold alone and whole sample() calls, ms per call."""
    from spmoe.engine.sampling.top_k_top_p_triton import top_k_top_p_threshold

    print(f"top_k / top_p threshold, sort vs Triton kernel: ms per call, vocab {args.vocab}")
    columns = (
        ("setting", 22),
        ("batch", 6),
        ("threshold sort", 15),
        ("kernel", 8),
        ("x", 6),
        ("sample() sort", 14),
    )
    print(" ".join(f"{name:>{width}}" for name, width in columns + (("kernel", 8), ("x", 6))))
    for name, params in TRUNCATIONS.items():
        for batch in args.batch:
            logits = torch.randn(batch, args.vocab, device=args.device) * args.logit_scale
            top_k = torch.full((batch,), params.top_k, dtype=torch.int64, device=args.device)
            top_p = torch.full((batch,), params.top_p, device=args.device)
            sort = cuda_ms(
                lambda: top_k_top_p_threshold_by_sort(logits, top_k, top_p), args.reps, warmup=2
            )
            kernel = cuda_ms(
                lambda: top_k_top_p_threshold(logits, top_k, top_p), args.reps, warmup=2
            )
            fused.ENABLED = False
            sort_sample = sample_ms(params, logits, args.reps)
            fused.ENABLED = True
            kernel_sample = sample_ms(params, logits, args.reps)
            print(
                f"{name:>22} {batch:>6} {sort:>15.3f} {kernel:>8.3f} {sort / kernel:>5.1f}x {sort_sample:>14.3f} "
                f"{kernel_sample:>8.3f} {sort_sample / kernel_sample:>5.1f}x",
                flush=True,
            )


def compare_races(args) -> None:
    """The torch race and the kernel side by side: the draw alone and whole sample() calls, ms per call."""
    from spmoe.engine.sampling.seeded_race_triton import seeded_race

    print(f"seeded race, torch vs Triton kernel: ms per call, vocab {args.vocab}")
    columns = [("batch", 6), ("race torch", 11), ("kernel", 8), ("x", 6)]
    for name in RACES:
        columns += [(f"sample() {name}: torch", 28), ("kernel", 8), ("x", 6)]
    print(" ".join(f"{name:>{width}}" for name, width in columns))
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=args.device) * args.logit_scale
        at = torch.arange(batch, device=args.device)
        keys = torch.tensor([seed_keys(seed) for seed in range(batch)], device=args.device)
        index = torch.full((batch,), 30, device=args.device)
        torch_race = cuda_ms(
            lambda: draw_tokens_by_torch(logits, at, keys, index), args.reps, warmup=2
        )
        kernel = cuda_ms(lambda: seeded_race(logits, at, keys, index), args.reps, warmup=2)
        line = f"{batch:>6} {torch_race:>11.3f} {kernel:>8.3f} {torch_race / kernel:>5.1f}x"
        for params in RACES.values():
            # the race alone by torch: `draw_tokens` reads `use_fused` from its own module, the threshold stays
            sampling.use_fused = lambda t: False
            torch_sample = sample_ms(params, logits, args.reps)
            sampling.use_fused = fused.use_fused
            kernel_sample = sample_ms(params, logits, args.reps)
            line += f" {torch_sample:>28.3f} {kernel_sample:>8.3f} {torch_sample / kernel_sample:>5.1f}x"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=154880, help="GLM-5.2's vocabulary by default")
    parser.add_argument("--logit-scale", type=float, default=5.0, help="logits = Gaussian x this")
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        raise SystemExit(
            f"bench_sampler: times CUDA calls; expected --device cuda, got {args.device}"
        )
    print(
        f"bench_sampler: {args.device}, vocab {args.vocab}, logit scale {args.logit_scale}; ms per sample() call"
    )
    print(f"{'batch':>6}  " + "".join(f"{name:>46}" for name in SETTINGS))
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=args.device) * args.logit_scale
        times = [sample_ms(params, logits, args.reps) for params in SETTINGS.values()]
        print(f"{batch:>6}  " + "".join(f"{t:>46.3f}" for t in times), flush=True)
    compare_truncations(args)
    compare_races(args)


if __name__ == "__main__":
    main()
