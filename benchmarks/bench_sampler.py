"""The batched sampler alone: the time of one `Sampler.sample` call on `--batch` rows of `--vocab` logits, plain
greedy against every row with logprobs=5 and presence / frequency / repetition penalties (greedy or sampled),
against temperature sampling with top_p. Run on the GPU to see what the processors cost per decode step:

    python benchmarks/bench_sampler.py --device cuda --batch 1 16 64 --vocab 154880

The logits are Gaussian times `--logit-scale`: at the default scale 5, top_p 0.95 keeps tens to hundreds of
GLM-5.2's 154880 tokens (a trained model's next-token distribution is that peaked or more); at scale 1 it
keeps about 115000. (The sampler sorts every row in full either way; this tells a faster top_p apart.)
"""

import argparse

import torch
from timing import cuda_ms

from spmoe.engine.sampling import Sampler, SamplingParams

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5)
SETTINGS = {
    "greedy": SamplingParams(),
    "greedy + logprobs + penalties": SamplingParams(**PENALTIES),
    "sampled, top_p 0.95": SamplingParams(1.0, top_p=0.95),
    "sampled, top_p 0.95 + logprobs + penalties": SamplingParams(1.0, top_p=0.95, **PENALTIES),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=154880, help="GLM-5.2's vocabulary by default")
    parser.add_argument("--logit-scale", type=float, default=5.0, help="logits = Gaussian x this")
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        raise SystemExit(f"bench_sampler: times CUDA calls; expected --device cuda, got {args.device}")
    print(f"bench_sampler: {args.device}, vocab {args.vocab}, logit scale {args.logit_scale}; ms per sample() call")
    print(f"{'batch':>6}  " + "".join(f"{name:>46}" for name in SETTINGS))
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=args.device) * args.logit_scale
        times = []
        for params in SETTINGS.values():
            sampler = Sampler(batch, args.vocab, args.device)
            rows = [sampler.add(params, list(range(100)), output=list(range(50, 80))) for _ in range(batch)]
            times.append(cuda_ms(lambda: sampler.sample(logits, rows, [30] * batch), args.reps, warmup=2))
        print(f"{batch:>6}  " + "".join(f"{t:>46.3f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
