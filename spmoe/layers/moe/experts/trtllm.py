"""FlashInfer's TRT-LLM FP8 block-scale MoE kernels (Blackwell, the SM100 family only).

Two classes, as in the upstream change (the reasons: `docs/upstream-bugs.md`, item 7):

- `TrtLlmFp8ExpertsMonolithic` routes inside the kernel from the router logits. It never sees our -1
  ids, so it cannot skip SP pad rows, and it would need the full logits dispatched;
  `_supports_parallel_config` therefore refuses sequence parallelism (and EPLB, and any dispatch but
  all-gather / reduce-scatter).
- `TrtLlmFp8ExpertsModular` takes our routing (ids and weights packed as the kernel wants), so pad
  rows carry weight 0; it refuses only EPLB and dispatch backends the kernel was not built for.

Not run here: the kernels exist only on SM100 GPUs and FlashInfer is not installed on our machines.
The calls follow FlashInfer's documented signatures; the selection rules are tested everywhere.
"""

import torch
import torch.nn.functional as F

from spmoe.layers.moe.experts.base import Experts, ExpertsDeployment
from spmoe.layers.quantization.fp8 import quantize_fp8_groups


class TrtLlmFp8ExpertsBase(Experts):
    keeps_fp8 = True

    @classmethod
    def _device_reason(cls, d: ExpertsDeployment) -> str | None:
        if d.device != "cuda" or d.capability is None or d.capability[0] != 10:
            return (
                f"needs a Blackwell SM100-family GPU, got {d.device} with capability {d.capability}"
            )
        if not d.flashinfer:
            return "FlashInfer is not installed"
        return None

    @classmethod
    def _weights_reason(cls, d: ExpertsDeployment) -> str | None:
        if d.fp8_block != (128, 128):
            return f"needs FP8 weights with 128 x 128 blocks, got {d.fp8_block}"
        if d.dtype != torch.bfloat16:
            return f"computes in bfloat16, got {d.dtype}"
        if d.num_experts > 2048:
            return f"supports at most 2048 experts, got {d.num_experts}"
        return None

    @classmethod
    def _supports_parallel_config(cls, d: ExpertsDeployment) -> bool:
        """The monolithic kernel: only all-gather / reduce-scatter dispatch, and neither EPLB nor
        sequence parallelism (its in-kernel routing would route SP pad rows as real tokens). spmoe
        also keeps it to DP = 1: it takes router logits, not a dispatched batch, so it cannot reach
        experts of other DP groups."""
        return (
            d.ep_backend == "allgather_reducescatter"
            and not (d.enable_eplb or d.use_sequence_parallel_moe)
            and d.data_parallel_size == 1
        )

    def _kernel_args(self) -> dict:
        cfg = self.cfg
        return dict(
            gemm1_weights=self.w13,
            gemm1_weights_scale=self.w13_scale,
            gemm2_weights=self.w2,
            gemm2_weights_scale=self.w2_scale,
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            intermediate_size=cfg.moe_intermediate_size,
            local_expert_offset=self.first,
            local_num_experts=self.count,
        )


class TrtLlmFp8ExpertsMonolithic(TrtLlmFp8ExpertsBase):
    name = "flashinfer_trtllm_monolithic"
    routes_internally = True

    def forward(self, x: torch.Tensor, router) -> torch.Tensor:
        """x FULL `[m, H]` and the router module -> `[m, H]` over this rank's experts (DeepSeek-V3
        routing: sigmoid, bias-corrected grouped top-k, renormalised, scaled)."""
        from flashinfer.fused_moe import RoutingMethodType, trtllm_fp8_block_scale_moe

        xq, scale = quantize_fp8_groups(x)
        return trtllm_fp8_block_scale_moe(
            routing_logits=F.linear(x.float(), router.weight),
            routing_bias=router.e_score_correction_bias.to(x.dtype),
            hidden_states=xq,
            hidden_states_scale=scale.t().contiguous(),
            routed_scaling_factor=self.cfg.routed_scaling_factor,
            routing_method_type=RoutingMethodType.DeepSeekV3,
            **self._kernel_args(),
        )


class TrtLlmFp8ExpertsModular(TrtLlmFp8ExpertsBase):
    name = "flashinfer_trtllm_modular"

    @classmethod
    def _supports_parallel_config(cls, d: ExpertsDeployment) -> bool:
        """Routing comes from outside, so SP pad rows are masked: only EPLB and dispatch backends
        other than all-gather / reduce-scatter are refused."""
        return d.ep_backend == "allgather_reducescatter" and not d.enable_eplb

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[m, H]`, ids / weights `[m, k]` (already scaled; id -1 = none) -> `[m, H]` over this
        rank's experts. A -1 route is sent to expert 0 with weight 0."""
        from flashinfer.fused_moe import RoutingMethodType, trtllm_fp8_block_scale_routed_moe

        weights = (
            torch.where(ids >= 0, weights, 0.0).to(torch.bfloat16).view(torch.int16).to(torch.int32)
        )
        packed = (ids.clamp(min=0).to(torch.int32) << 16) | (weights & 0xFFFF)
        xq, scale = quantize_fp8_groups(x)
        return trtllm_fp8_block_scale_routed_moe(
            topk_ids=packed,
            routing_bias=None,
            hidden_states=xq,
            hidden_states_scale=scale.t().contiguous(),
            routed_scaling_factor=1.0,
            routing_method_type=RoutingMethodType.DeepSeekV3,
            **self._kernel_args(),
        )
