"""Linear layers whose weights are (possibly) a TP shard of the checkpoint's.

`tp_dim` tells the loader how to slice the checkpoint weight `[out, in]`: 0 = column-parallel (this
rank's output rows), 1 = row-parallel (this rank's input columns; the output is a PARTIAL sum),
None = replicated.

Weights are in the model dtype, or (`keep_fp8`, for FP8 checkpoints on the GPU) the checkpoint's
e4m3 values with their float32 scale per 128 x 128 block (`weight_scale`
`[ceil(out / 128), ceil(in / 128)]`), computed by `quantization.fp8_linear`. A TP shard of an FP8
weight must start and end on block edges.
"""

import torch
import torch.nn.functional as F
from torch import nn

from spmoe.layers.quantization.fp8_linear import FP8_BLOCK, block_grid, fp8_linear


def _fp8_parameters(rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty e4m3 `[rows, cols]` weight and float32 block scales, on the default device."""
    weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
    return weight, nn.Parameter(
        torch.empty(*block_grid(rows, cols), dtype=torch.float32), requires_grad=False
    )


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, tp_dim: int | None = None, tp_size: int = 1
    ):
        super().__init__()
        if tp_dim is not None:
            full = (out_features, in_features)[tp_dim]
            if full % tp_size:
                raise ValueError(
                    f"cannot split {full} {'output' if tp_dim == 0 else 'input'} features of a "
                    f"linear layer over {tp_size} TP ranks"
                )
            if tp_dim == 0:
                out_features //= tp_size
            else:
                in_features //= tp_size
        self.tp_dim = tp_dim if tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_scale = None  # FP8: the block scales

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def fp8_misfit(self) -> str | None:
        """Why this rank's shard cannot keep the checkpoint's FP8 blocks (it cuts through
        one), or None."""
        if self.tp_dim is not None and self.weight.shape[self.tp_dim] % FP8_BLOCK[self.tp_dim]:
            side = ("output", "input")[self.tp_dim]
            return (
                f"its {self.weight.shape[self.tp_dim]} {side} features per TP rank are not a "
                "multiple of 128"
            )
        return None

    def keep_fp8(self) -> None:
        """Hold the weight as the checkpoint's e4m3 values and block scales (replacing the
        model-dtype weight)."""
        device = self.weight.device
        with torch.device(device):
            self.weight, self.weight_scale = _fp8_parameters(*self.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return fp8_linear(x, self.weight, self.weight_scale)
        return F.linear(x, self.weight)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out `[m, out]` += this layer of x `[m, in]`, accumulated by the GEMM itself (no
        separate add)."""
        if self.is_fp8:
            return fp8_linear(x, self.weight, self.weight_scale, out=out)
        return out.addmm_(x, self.weight.t())

    def checkpoint_plan(
        self, owner: str, scale_suffix: str
    ) -> dict[str, tuple[torch.Tensor, int | None, bool]]:
        """Checkpoint key -> (destination, TP dim, raw: copy as stored) of this layer's weight, and
        of its FP8 scales (`{owner}.{scale_suffix}`)."""
        plan = {f"{owner}.weight": (self.weight.data, self.tp_dim, self.is_fp8)}
        if self.is_fp8:
            plan[f"{owner}.{scale_suffix}"] = (self.weight_scale.data, self.tp_dim, True)
        return plan


class MergedLinear(nn.Module):
    """Linear layers that read the same input, run as one GEMM: weight `[sum(widths), in]`, the
    parts' rows one after another. Replicated, or column-parallel (`tp_size > 1`): this rank holds
    its slice of every part's output rows. The checkpoint keeps the parts as separate tensors;
    `checkpoint_plan` maps each part's key to its rows of the merged weight.

    With FP8 parts (`keep_fp8`), those run as one FP8 GEMM (`weight_fp8`, each part's rows padded to
    a multiple of 128 so that every part starts on a block edge) and the others as one GEMM in the
    model dtype (`weight`).
    """

    def __init__(self, in_features: int, parts: dict[str, int], tp_size: int = 1):
        """parts: each part's name (relative to the module that owns this one, e.g. "indexer.wk") ->
        its output width (the whole width, before a TP split)."""
        super().__init__()
        for name, width in parts.items():
            if width % tp_size:
                raise ValueError(
                    f"cannot split the {width} output features of {name} over {tp_size} TP ranks"
                )
        self.parts = {name: width // tp_size for name, width in parts.items()}
        self.tp_dim = 0 if tp_size > 1 else None
        self.dense_parts = dict(self.parts)
        self.fp8_parts: dict[str, int] = {}  # name -> its width padded to a multiple of 128
        self.weight = nn.Parameter(torch.empty(sum(self.parts.values()), in_features))
        self.weight_fp8 = self.weight_scale = None

    def fp8_misfit(self, names: set[str]) -> str | None:
        """Why these parts' TP shards cannot keep the checkpoint's FP8 blocks, or None."""
        if self.tp_dim is None:
            return None
        cut = [name for name in names if self.parts[name] % FP8_BLOCK[0]]
        return (
            f"the output features per TP rank of {cut} are not a multiple of 128" if cut else None
        )

    def keep_fp8(self, names: set[str]) -> None:
        """Hold these parts as the checkpoint's e4m3 values and block scales; the rest stay in the
        model dtype."""
        device, dtype, in_features = self.weight.device, self.weight.dtype, self.weight.shape[1]
        self.fp8_parts = {
            n: -(-w // FP8_BLOCK[0]) * FP8_BLOCK[0] for n, w in self.parts.items() if n in names
        }
        self.dense_parts = {n: w for n, w in self.parts.items() if n not in names}
        with torch.device(device):
            # in the model dtype even when no part is left in it: the layer's dtype and device
            # (attention's cache needs read them)
            self.weight = nn.Parameter(
                torch.empty(sum(self.dense_parts.values()), in_features, dtype=dtype)
            )
            self.weight_fp8, self.weight_scale = _fp8_parameters(
                sum(self.fp8_parts.values()), in_features
            )
            self.weight_fp8.data.view(torch.uint8).zero_()  # the pad rows stay zero

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x `[N, in]` -> each part's output `[N, width]` (views of one product per
        kind of weight)."""
        out = {}
        if self.dense_parts:
            out |= zip(
                self.dense_parts,
                F.linear(x, self.weight).split(list(self.dense_parts.values()), dim=-1),
            )
        if self.fp8_parts:
            y = fp8_linear(x, self.weight_fp8, self.weight_scale).split(
                list(self.fp8_parts.values()), dim=-1
            )
            out |= {name: part[..., : self.parts[name]] for name, part in zip(self.fp8_parts, y)}
        return {name: out[name] for name in self.parts}

    def checkpoint_plan(
        self, owner: str, scale_suffix: str
    ) -> dict[str, tuple[torch.Tensor, int | None, bool]]:
        """Checkpoint key `{owner}.{part}.weight` -> (the part's rows of the merged weight (sliced
        from the checkpoint's along the TP dim), TP dim, raw); FP8 parts also map their scales
        (`.{scale_suffix}`)."""
        plan = {}
        rows = self.weight.data.split(list(self.dense_parts.values()), dim=0)
        for name, part in zip(self.dense_parts, rows):
            plan[f"{owner}.{name}.weight"] = (part, self.tp_dim, False)
        if self.fp8_parts:
            rows = self.weight_fp8.data.split(list(self.fp8_parts.values()), dim=0)
            scales = self.weight_scale.data.split(
                [w // FP8_BLOCK[0] for w in self.fp8_parts.values()], dim=0
            )
            for name, part, scale in zip(self.fp8_parts, rows, scales):
                plan[f"{owner}.{name}.weight"] = (part[: self.parts[name]], self.tp_dim, True)
                blocks = -(-self.parts[name] // FP8_BLOCK[0])
                plan[f"{owner}.{name}.{scale_suffix}"] = (scale[:blocks], self.tp_dim, True)
        return plan
