"""What the jobs share: reading token-id input and checking its ids, checking output paths before
any rank starts, writing an output file atomically, the flat batch, splitting a batch over the
data-parallel ranks and gathering it back. (The dtypes by name and the device check are engine
options: `spmoe.engine.args`.)"""

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import gather_object


def read_input_ids(path: str | Path, vocab_size: int) -> list[list[int]]:
    """A JSON list of token-id lists, one per sequence; every id in [0, vocab_size)."""
    try:
        seqs = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"input ids file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(seqs, list) or not seqs:
        raise ValueError(
            f"{path}: expected a non-empty JSON list of token-id lists, got {type(seqs).__name__} "
            f"{str(seqs)[:40]}"
        )
    for i, seq in enumerate(seqs):
        if not isinstance(seq, list) or not seq:
            raise ValueError(
                f"{path}: sequence {i} must be a non-empty list of token ids, got {str(seq)[:40]}"
            )
        for tok in seq:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
                raise ValueError(
                    f"{path}: sequence {i} has token id {tok!r}, expected an int in "
                    f"[0, {vocab_size})"
                )
    return seqs


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(temporary)` writes the whole file at a temporary path in the same folder, which then
    replaces `path` in one rename: a run stopped while writing leaves the previous file (or none),
    never a truncated one. A device or pipe (/dev/stdout) is written in place."""
    path = Path(path)
    if path.exists() and not path.is_file():
        write(path)
        return
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        umask = os.umask(0)
        os.umask(umask)
        # as open() would
        os.chmod(temporary, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask)
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def check_writable(path: str | Path, option: str) -> None:
    """Raise unless `path` can be written as a file: not a folder, in an existing folder where a
    file can be created (probed with a temporary file), and writable if it exists. A device or pipe
    (/dev/stdout) only needs to be writable."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; expected a file path")
    if path.exists() and not path.is_file():
        if not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path} is not writable")
        return
    if not path.parent.is_dir():
        raise ValueError(f"{option} {path}: the folder {path.parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".spmoe-probe-"):
            pass
    except OSError as e:
        raise ValueError(
            f"{option} {path} cannot be written: creating a file in {path.parent} "
            f"failed ({e.strerror})"
        ) from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {path} cannot be written: permission denied")


def flatten(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """-> input_ids `[N]`, positions `[N]` (restarting at 0 per sequence), seq_lens. No sequences:
    N = 0."""
    ids = torch.tensor([tok for seq in seqs for tok in seq], dtype=torch.long, device=device)
    positions = torch.cat(
        [torch.zeros(0, dtype=torch.long, device=device)]
        + [torch.arange(len(seq), device=device) for seq in seqs]
    )
    return ids, positions, [len(seq) for seq in seqs]


def split_for_dp(items: list, dp_rank: int, dp_size: int) -> list:
    """This DP rank's share of a batch: items dp_rank, dp_rank + dp_size, ... (possibly none)."""
    return items[dp_rank::dp_size]


def gather_from_dp(mine: list, dp_size: int) -> list | None:
    """Every DP rank's `split_for_dp` share -> the whole batch in its original order, on rank 0
    (None on the other ranks). Host objects over the control group, outside the counted
    collectives."""
    state = get_parallel_state()
    if dp_size == 1:
        return mine
    # one copy per DP group
    shares = gather_object(mine if state.tp_rank == 0 else None, state.control_group)
    if state.rank != 0:
        return None
    per_dp = shares[:: state.tp_size]  # TP rank 0 of each DP group
    whole = [None] * sum(len(share) for share in per_dp)
    for d, share in enumerate(per_dp):
        whole[d::dp_size] = share
    return whole
