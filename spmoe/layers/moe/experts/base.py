"""The routed-experts interface shared by every backend, and the facts that decide
which backend fits.

A backend computes, for `[m, H]` rows and their routing (`ids` / `weights` `[m, k]`, global expert
ids, -1 = none), the weighted sum over this rank's experts `[first, first + count)`; rows routed
elsewhere, and ids of -1 (SP pad rows), contribute nothing. A backend that routes inside its kernel
takes the router's inputs instead (`routes_internally`), so it can never honour the -1 mask.

Weights are either dense in the model dtype (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`;
FP8 checkpoints are dequantised on load) or, for FP8 backends, the checkpoint's FP8 e4m3 weights
with their per-block float32 scales (`w13` `[E, 2I, H]` + `w13_scale`, `w2` `[E, H,
I]` + `w2_scale`).
"""

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from spmoe.config import ModelConfig, ParallelConfig


@dataclass(frozen=True)
class ExpertsDeployment:
    """What decides whether an expert backend can run one MoE layer. Selection reads these fields
    and nothing else, so the same deployment gets the same backend on every machine."""

    device: str  # "cpu" or "cuda"
    capability: tuple[int, int] | None  # CUDA compute capability; None on CPU
    dtype: torch.dtype  # activations, and the weights unless they stay FP8
    fp8_block: tuple[int, int] | None  # the checkpoint's FP8 e4m3 block size, None if not FP8
    hidden_size: int
    intermediate_size: int
    num_experts: int
    use_sequence_parallel_moe: bool
    ep_backend: str
    # the installed libraries, like the GPU a fact of the deployment (`for_layer` probes them)
    triton: bool  # Triton is importable
    flashinfer: bool  # FlashInfer is importable
    data_parallel_size: int = 1
    # spmoe has no EPLB; the field is here so the kernels' rule is stated and tested
    enable_eplb: bool = False

    @classmethod
    def for_layer(
        cls,
        cfg: ModelConfig,
        parallel: ParallelConfig,
        use_sequence_parallel_moe: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "ExpertsDeployment":
        device = torch.device(device)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls(
            device.type,
            capability,
            dtype,
            cfg.fp8_block_size,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            use_sequence_parallel_moe,
            parallel.ep_backend,
            triton=_installed("triton"),
            flashinfer=_installed("flashinfer"),
            data_parallel_size=parallel.data_parallel_size,
        )


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class Experts(nn.Module):
    name: ClassVar[str]
    routes_internally: ClassVar[bool] = False
    # holds the checkpoint's FP8 weights instead of dequantising them
    keeps_fp8: ClassVar[bool] = False
    # reads routing back to the host, so a CUDA graph cannot capture it
    syncs_host: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig, first: int, count: int):
        super().__init__()
        self.cfg, self.first, self.count = cfg, first, count
        e, inter, hidden = count, cfg.moe_intermediate_size, cfg.hidden_size
        if self.keeps_fp8:
            bm, bn = cfg.fp8_block_size
            fp8 = dict(dtype=torch.float8_e4m3fn)
            self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden, **fp8), requires_grad=False)
            self.w13_scale = nn.Parameter(
                torch.empty(e, 2 * inter // bm, hidden // bn, dtype=torch.float32)
            )
            self.w2 = nn.Parameter(torch.empty(e, hidden, inter, **fp8), requires_grad=False)
            self.w2_scale = nn.Parameter(
                torch.empty(e, hidden // bm, inter // bn, dtype=torch.float32)
            )
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden))
            self.down_proj = nn.Parameter(torch.empty(e, hidden, inter))

    # -- selection --------------------------------------------------------------------------------

    @classmethod
    def unsupported_reason(cls, d: ExpertsDeployment) -> str | None:
        """None when this backend can run `d`; otherwise why not. Checked in order: device, weights
        and dtype, parallel config."""
        reason = cls._device_reason(d) or cls._weights_reason(d)
        if reason is None and not cls._supports_parallel_config(d):
            reason = (
                "the parallel config is not supported (sequence parallel: "
                f"{d.use_sequence_parallel_moe}, DP: {d.data_parallel_size}, EPLB: "
                f"{d.enable_eplb}, EP backend: {d.ep_backend})"
            )
        return reason

    @classmethod
    def _device_reason(cls, d: ExpertsDeployment) -> str | None:
        return None

    @classmethod
    def _weights_reason(cls, d: ExpertsDeployment) -> str | None:
        return None

    @classmethod
    def _supports_parallel_config(cls, d: ExpertsDeployment) -> bool:
        return True

    # -- weights ----------------------------------------------------------------------------------

    def checkpoint_plan(self, prefix: str) -> dict[str, tuple[torch.Tensor, bool]]:
        """Checkpoint key -> (destination view, raw) for this rank's experts. raw: copy the stored
        FP8 values or scales as they are; otherwise the loader dequantises FP8 into the
        destination's dtype."""
        plan, inter = {}, self.cfg.moe_intermediate_size
        for e in range(self.count):
            key = f"{prefix}.{self.first + e}"
            if self.keeps_fp8:
                split, scale = inter // self.cfg.fp8_block_size[0], self.cfg.fp8_scale_suffix
                plan |= {
                    f"{key}.gate_proj.weight": (self.w13[e, :inter], True),
                    f"{key}.up_proj.weight": (self.w13[e, inter:], True),
                    f"{key}.down_proj.weight": (self.w2[e], True),
                    f"{key}.gate_proj.{scale}": (self.w13_scale[e, :split], True),
                    f"{key}.up_proj.{scale}": (self.w13_scale[e, split:], True),
                    f"{key}.down_proj.{scale}": (self.w2_scale[e], True),
                }
            else:
                plan |= {
                    f"{key}.gate_proj.weight": (self.gate_up_proj[e, :inter], False),
                    f"{key}.up_proj.weight": (self.gate_up_proj[e, inter:], False),
                    f"{key}.down_proj.weight": (self.down_proj[e], False),
                }
        return plan

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids `[m, k]` -> this rank's expert index, or -1 where the expert
        lives elsewhere."""
        local = ids - self.first
        return torch.where((local >= 0) & (local < self.count), local, -1)
