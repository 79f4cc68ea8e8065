"""Which expert backend runs a MoE layer.

`auto` walks `PRIORITY` and takes the first backend whose `unsupported_reason` is None:

1. `flashinfer_trtllm_monolithic`: Blackwell + FlashInfer, FP8 block-128, not SP, DP = 1, no EPLB;
2. `flashinfer_trtllm_modular`: Blackwell + FlashInfer, FP8 block-128, no EPLB (SP allowed:
   external routing);
3. `triton`: CUDA + Triton, bfloat16 / float16 or FP8 block-128;
4. `torch`: anything (the reference; FP8 dequantised).

An explicit request (`torch`, `triton`, `flashinfer_trtllm` = monolithic, else modular) that does
not fit is an error that says why. The choice of `auto` is printed once per process and layer kind
(SP or not), on rank 0.
"""

import sys

from spmoe.distributed.groups import is_first_rank
from spmoe.layers.moe.experts.base import Experts, ExpertsDeployment
from spmoe.layers.moe.experts.torch_ref import TorchExperts
from spmoe.layers.moe.experts.triton_experts import TritonExperts
from spmoe.layers.moe.experts.trtllm import TrtLlmFp8ExpertsModular, TrtLlmFp8ExpertsMonolithic

PRIORITY = (TrtLlmFp8ExpertsMonolithic, TrtLlmFp8ExpertsModular, TritonExperts, TorchExperts)
REQUESTS = {
    "auto": PRIORITY,
    "torch": (TorchExperts,),
    "triton": (TritonExperts,),
    "flashinfer_trtllm": (TrtLlmFp8ExpertsMonolithic, TrtLlmFp8ExpertsModular),
}
_announced: set = set()


def select_experts(d: ExpertsDeployment, requested: str = "auto") -> type[Experts]:
    if requested not in REQUESTS:
        raise ValueError(f"moe_backend must be one of {tuple(REQUESTS)}, got {requested!r}")
    skipped = []
    for cls in REQUESTS[requested]:
        reason = cls.unsupported_reason(d)
        if reason is None:
            if requested == "auto":  # an explicit request needs no announcement
                _announce(cls, d, skipped)
            return cls
        skipped.append(f"{cls.name}: {reason}")
    raise ValueError(
        f"moe_backend {requested!r} does not fit this deployment: {'; '.join(skipped)}"
    )


def _announce(cls: type[Experts], d: ExpertsDeployment, skipped: list[str]) -> None:
    key = (cls, d)
    if key in _announced:
        return
    _announced.add(key)
    if is_first_rank():
        layers = "SP" if d.use_sequence_parallel_moe else "non-SP"
        print(
            f"spmoe: experts of {layers} MoE layers: {cls.name}"
            + (f" (skipped {'; '.join(skipped)})" if skipped else ""),
            file=sys.stderr,
            flush=True,
        )
