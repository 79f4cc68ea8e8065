"""The trained demo checkpoint on held-out text (`spmoe.testing.heldout`), one forward per layout: spmoe's
perplexity equals transformers' within 1e-3 relative and is the same at TP 1, 2 and 4, SP on and off, and DP 2;
the checkpoint's FP8 block-128 twin stays within 3% of it."""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.entrypoints.demo import CHECKPOINT, CONFIG
from spmoe.entrypoints.forward import run_forward
from spmoe.testing.heldout import heldout_sequences, perplexity

SEQS = heldout_sequences(4, 512)  # contexts 8 x index_topk: the sparse selection matters


@pytest.fixture(scope="module")
def tp1() -> float:
    logits, _ = run_forward(str(CHECKPOINT), ParallelConfig(), SEQS)
    return perplexity(logits, SEQS)


def test_perplexity_equals_transformers(tp1):
    import transformers

    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)
    with torch.no_grad():
        logits = torch.cat([model.eval()(torch.tensor([s])).logits[0] for s in SEQS])
    want = perplexity(logits, SEQS)
    print(f"held-out perplexity: spmoe {tp1:.6f}, transformers {want:.6f}")
    assert abs(tp1 / want - 1) < 1e-3
    assert tp1 < 6  # a trained model (a uniform guess: 264)


@pytest.mark.parametrize("tp, dp, sp", [(2, 1, "off"), (2, 1, "on"), (4, 1, "on"), (1, 2, "off")])
def test_perplexity_is_the_same_in_every_layout(tp, dp, sp, tp1):
    parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sp=sp)
    logits, _ = run_forward(str(CHECKPOINT), parallel, SEQS)
    got = perplexity(logits, SEQS)
    print(f"TP {tp} DP {dp} SP {sp}: {got:.6f} (TP 1: {tp1:.6f})")
    assert abs(got / tp1 - 1) < 1e-5


def write_twin(folder: str, out: str) -> None:
    from pathlib import Path

    from spmoe.models.deepseek_v32.weights import load_model, write_fp8_checkpoint

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    write_fp8_checkpoint(model, CONFIG, Path(out))


def test_fp8_weights_within_3_percent(tp1, tmp_path):
    spawn(write_twin, 1, str(CHECKPOINT), str(tmp_path))
    logits, _ = run_forward(str(tmp_path), ParallelConfig(), SEQS)
    got = perplexity(logits, SEQS)
    print(f"FP8 block-128 twin: {got:.5f} against bf16 {tp1:.5f} ({got / tp1 - 1:+.2%})")
    assert got != tp1 and abs(got / tp1 - 1) < 0.03
