"""Fused MoE experts in Triton on CUDA: bfloat16 / float16, or FP8 e4m3 128 x 128 block-scaled
weights with per-token 128-channel activation groups (the GLM-5.2 / DeepSeek-V3 FP8 checkpoints).
Routing comes from outside, so SP pad rows (id -1) are skipped."""

import torch

from spmoe.layers.moe.experts.base import Experts, ExpertsDeployment


class TritonExperts(Experts):
    name = "triton"

    def __init__(self, cfg, first: int, count: int):
        self.keeps_fp8 = cfg.fp8_block_size is not None
        super().__init__(cfg, first, count)

    @classmethod
    def _device_reason(cls, d: ExpertsDeployment) -> str | None:
        if d.device != "cuda":
            return f"needs a CUDA device, got {d.device}"
        if not d.triton:
            return "triton is not installed"
        needed = (8, 9) if d.fp8_block else (8, 0)
        if d.capability < needed:
            return (
                f"needs compute capability >= {needed} for {'FP8' if d.fp8_block else 'bf16'}, "
                f"got {d.capability}"
            )
        return None

    @classmethod
    def _weights_reason(cls, d: ExpertsDeployment) -> str | None:
        if d.dtype not in (torch.bfloat16, torch.float16):
            return f"computes in bfloat16 / float16, got {d.dtype}"
        if d.fp8_block is not None and d.fp8_block != (128, 128):
            return f"FP8 weights need 128 x 128 blocks, got {d.fp8_block}"
        if d.hidden_size % 128 or d.intermediate_size % 128:
            return (
                f"hidden size {d.hidden_size} and expert intermediate size {d.intermediate_size} "
                "must be multiples of 128"
            )
        return None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[m, H]`, ids / weights `[m, k]` -> `[m, H]`, the weighted sum over this
        rank's experts."""
        from spmoe.layers.moe.experts.triton_kernels import fused_moe

        if self.keeps_fp8:
            return fused_moe(
                x, ids, weights, self.first, self.w13, self.w2, self.w13_scale, self.w2_scale
            )
        return fused_moe(x, ids, weights, self.first, self.gate_up_proj, self.down_proj)
