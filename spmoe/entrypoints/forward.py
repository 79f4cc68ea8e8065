"""One forward pass over a batch of sequences on T local ranks: the job behind `spmoe forward`."""

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, launch
from spmoe.engine.args import DTYPES, check_device
from spmoe.engine.engine import check_positions
from spmoe.entrypoints.jobs import check_writable, flatten, gather_from_dp, split_for_dp


def _rank_forward(model_dir: str, parallel: ParallelConfig, dtype: str, seqs: list[list[int]]):
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    model = load_model(model_dir, parallel, DTYPES[dtype], state.device)
    ids, positions, seq_lens = flatten(
        split_for_dp(seqs, state.dp_rank, state.dp_size), state.device
    )
    with torch.no_grad(), count_collectives() as stats:
        logits = model(ids, positions, seq_lens).cpu()
    per_seq = gather_from_dp(list(logits.split(seq_lens)), state.dp_size)
    if state.rank != 0:
        return None
    return torch.cat([logits[:0]] + per_seq), stats.as_dict()


def check_forward(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    seqs: list[list[int]],
    device: str,
    outputs: dict[str, str] | None = None,
) -> None:
    """Every check of a forward job, before any rank starts. `outputs`: option name -> path the
    caller will write."""
    cfg.check_parallel(parallel)
    check_device(device, parallel.world_size)
    for option, path in (outputs or {}).items():
        check_writable(path, option)
    check_positions(max(map(len, seqs)), cfg.max_position_embeddings, "the longest sequence")


def run_forward(
    model_dir: str,
    parallel: ParallelConfig,
    seqs: list[list[int]],
    dtype: str = "float32",
    device: str = "cpu",
) -> tuple[torch.Tensor, dict]:
    """-> (logits `[total tokens, vocab]` float32, rank 0's collective counts) on rank 0; None on
    the other ranks under torchrun. seqs: valid token ids (`jobs.read_input_ids` checks a file's).
    Validates before starting any rank."""
    check_forward(ModelConfig.from_file(model_dir), parallel, seqs, device)
    return launch(
        _rank_forward,
        parallel.world_size,
        model_dir,
        parallel,
        dtype,
        seqs,
        config=parallel,
        device=device,
    )
