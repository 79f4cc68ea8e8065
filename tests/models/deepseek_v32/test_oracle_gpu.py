"""The transformers oracle on GPUs: our bfloat16 logits with TP over every GPU (NCCL), SP off and on, against
transformers' float32 logits on the CPU.

bfloat16 rounding flips a discrete choice now and then (an expert in the router's top-k, a key in the DSA
top-k) where float32 scores are nearly tied; the rows behind a flip legitimately differ by much more than
rounding. So most rows must match closely, and SP on must match SP off (same kernels, same dtype) closely
everywhere.
"""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state
from spmoe.entrypoints.jobs import flatten

from ...multigpu import requires_gpus, run_on_gpus

# per row, relative to the row's largest |logit|: bfloat16 keeps 8 significant bits
ROW_TOLERANCE = 5e-2
ROWS_WITHIN = 0.75  # of the compared rows
MEDIAN_TOLERANCE = 2.5e-2
SP_TOLERANCE = 3e-2  # SP on against SP off, every row


def gpu_logits(cases):
    """cases: [(folder, sp, batches)] -> per case, per batch logits `[N, V]` on the CPU."""
    from spmoe.models.deepseek_v32.weights import load_model

    state, out = get_parallel_state(), []
    for folder, sp, batches in cases:
        model = load_model(
            folder,
            ParallelConfig(tensor_parallel_size=state.tp_size, sp=sp),
            torch.bfloat16,
            state.device,
        )
        with torch.no_grad():
            out.append([model(*flatten(seqs, state.device)).cpu() for seqs in batches])
    return out


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row max |got - want| / max |want|, over the rows the oracle did not mark NaN (after a tied DSA
    top-k in float32, see conftest.hf_logits)."""
    keep = ~torch.isnan(want).any(-1)
    return (got[keep] - want[keep]).abs().amax(-1) / want[keep].abs().amax(-1)


@pytest.mark.gpu
@requires_gpus(2)
def test_bf16_logits_on_gpus_match_float32_oracle(checkpoints):
    cases = [(name, sp) for name in ("glm", "dsv32") for sp in ("off", "on")]
    results = run_on_gpus(
        gpu_logits, [(checkpoints[n][0], sp, checkpoints[n][1]) for n, sp in cases]
    )[0]
    logits, failures = dict(zip(cases, results)), []
    for name, sp in cases:
        errors = torch.cat(
            [row_errors(got, want) for got, want in zip(logits[name, sp], checkpoints[name][2])]
        )
        within = (errors < ROW_TOLERANCE).float().mean().item()
        print(
            f"{name} SP {sp}: {within:.1%} of {errors.numel()} rows within {ROW_TOLERANCE} of the float32 oracle, "
            f"median {errors.median().item():.2e}, worst {errors.max().item():.2e}"
        )
        if within < ROWS_WITHIN or errors.median().item() > MEDIAN_TOLERANCE:
            failures.append((name, sp, within, errors.median().item()))
    for name in ("glm", "dsv32"):
        worst = max(
            row_errors(on, off).max().item()
            for on, off in zip(logits[name, "on"], logits[name, "off"])
        )
        print(f"{name}: SP on against SP off on the GPUs, worst row {worst:.2e}")
        if worst > SP_TOLERANCE:
            failures.append((name, "on vs off", worst))
    assert not failures, failures
