"""Is float16 sound for spmoe's model? The trained demo checkpoint through the engine (paged cache, prompts
prefilled in chunks of 128 tokens) on 3 x 512 tokens of held-out text, in float32, bfloat16 and float16:
each dtype's held-out perplexity, how often its greedy choice is float32's, and how many log-probabilities
are not finite. `spmoe serve` refuses `--dtype float16` (docs/vllm-compatibility.md says why); this is the
measurement behind that page's figures.

    python benchmarks/half_precision.py
"""

import math
import sys
from pathlib import Path

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.testing.heldout import heldout_sequences

# the repository root, for the test's helper
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.engine.test_heldout_engine import prompt_logprobs  # noqa: E402

SEQS = heldout_sequences(3, 512)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def logprobs_by_dtype() -> dict:
    """dtype name -> per sequence, per token after the first: (its logprob, the greedy choice)."""
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.models.deepseek_v32.weights import load_model

    out = {}
    for dtype in DTYPES:
        model = load_model(str(CHECKPOINT), ParallelConfig(), dtype)
        engine = Engine(model, PagedKVCache.for_model(model, 2**24), max_num_batched_tokens=128)
        out[str(dtype).removeprefix("torch.")] = prompt_logprobs(engine, SEQS)
    return out


def main() -> None:
    runs = spawn(logprobs_by_dtype, 1)[0]
    reference = runs["float32"]
    positions = sum(len(seq) for seq in reference)
    for name, run in runs.items():
        logprobs = [lp for seq in run for lp, _ in seq]
        same = sum(a[1] == b[1] for seq, ref in zip(run, reference) for a, b in zip(seq, ref))
        print(
            f"{name:>9}: held-out perplexity {math.exp(-sum(logprobs) / len(logprobs)):.4f}, "
            f"greedy choice float32's at {same / positions:.2%} of {positions} positions, "
            f"{sum(not math.isfinite(lp) for lp in logprobs)} non-finite"
        )


if __name__ == "__main__":
    main()
