"""Linear layers whose weights are (possibly) a TP shard of the checkpoint's.

`tp_dim` tells the loader how to slice the checkpoint weight `[out, in]`: 0 = column-parallel (this rank's
output rows), 1 = row-parallel (this rank's input columns; the output is a PARTIAL sum), None = replicated.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp_dim: int | None = None, tp_size: int = 1):
        super().__init__()
        if tp_dim is not None:
            full = (out_features, in_features)[tp_dim]
            if full % tp_size:
                raise ValueError(
                    f"cannot split {full} {'output' if tp_dim == 0 else 'input'} features of a linear "
                    f"layer over {tp_size} TP ranks"
                )
            if tp_dim == 0:
                out_features //= tp_size
            else:
                in_features //= tp_size
        self.tp_dim = tp_dim if tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MergedLinear(nn.Module):
    """Linear layers that read the same input, run as one GEMM: weight `[sum(widths), in]`, the parts' rows one
    after another. Replicated, or column-parallel (`tp_size > 1`): this rank holds its slice of every part's
    output rows. The checkpoint keeps the parts as separate tensors; `checkpoint_plan` maps each part's key to
    its rows of the merged weight.
    """

    def __init__(self, in_features: int, parts: dict[str, int], tp_size: int = 1):
        """parts: each part's name (relative to the module that owns this one, e.g. "indexer.wk") -> its output
        width (the whole width, before a TP split)."""
        super().__init__()
        for name, width in parts.items():
            if width % tp_size:
                raise ValueError(f"cannot split the {width} output features of {name} over {tp_size} TP ranks")
        self.parts = {name: width // tp_size for name, width in parts.items()}
        self.tp_dim = 0 if tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(sum(self.parts.values()), in_features))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x `[N, in]` -> each part's output `[N, width]` (views of one `[N, sum(widths)]` product)."""
        return dict(zip(self.parts, F.linear(x, self.weight).split(list(self.parts.values()), dim=-1)))

    def checkpoint_plan(self, owner: str) -> dict[str, torch.Tensor]:
        """Checkpoint key `{owner}.{part}.weight` -> the part's rows of the merged weight (sliced from the
        checkpoint's along `tp_dim`)."""
        rows = self.weight.data.split(list(self.parts.values()), dim=0)
        return {f"{owner}.{name}.weight": part for name, part in zip(self.parts, rows)}
