"""FP8 linears kept as stored, on one GPU in bf16, against the dequantised bf16 reference on the same checkpoint:
the logits of a paged prefill and of a decode step (absorbed MLA's W_UK / W_UV products in FP8 included) within
the bound docs/performance-log/2026-12.md states (`FP8_LOGIT_RMS_ERROR`, as on CPU), and the weights' GPU bytes
equal to the checkpoint's within 2%."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.models.deepseek_v32.weights import (
    load_model,
    write_fp8_checkpoint,
    write_random_checkpoint,
)

from ...multigpu import requires_gpus
from .test_fp8_checkpoints import CONFIG, FP8_LOGIT_RMS_ERROR, relative_rms_error

# GLM-5.2's head layout (192 + 256 kv_b rows per head), so heads start mid-block as in the real model
GPU_CONFIG = {
    **CONFIG,
    "index_topk": 16,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "kv_lora_rank": 512,
    "num_attention_heads": 8,
}
PROMPTS = [[5, 9, 1, 33, 17, 2, 60, 7], [3, 4, 50, 11]]


def _paged_logits(folder: str, keep_fp8: bool) -> tuple[list[torch.Tensor], int]:
    from spmoe.engine.cache.paged import PagedKVCache

    model = load_model(folder, ParallelConfig(), torch.bfloat16, "cuda", keep_fp8=keep_fp8)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = PagedKVCache.for_model(model, 1 << 26)
    tables, lens = [[0], [1]], [len(p) for p in PROMPTS]
    prefill = cache.view(tables, [0, 0], lens)
    decode = cache.view(tables, lens, [1, 1])
    with torch.no_grad():
        ids = torch.tensor(sum(PROMPTS, []), device="cuda")
        first = model(ids, prefill.positions, lens, prefill)
        second = model(torch.tensor([8, 40], device="cuda"), decode.positions, [1, 1], decode)
    return [first.float().cpu(), second.float().cpu()], nbytes


def _bf16_twin(folder: str) -> None:
    model = load_model(folder, ParallelConfig(), torch.bfloat16, "cuda")
    write_fp8_checkpoint(model, GPU_CONFIG, Path(folder) / "fp8")


@requires_gpus(1)
@pytest.mark.gpu
def test_fp8_linears_agree_with_the_dequantised_reference(tmp_path):
    spawn(write_random_checkpoint, 1, GPU_CONFIG, tmp_path, 5)
    spawn(_bf16_twin, 1, str(tmp_path), device="cuda")
    folder = str(tmp_path / "fp8")
    (kept, kept_bytes), (reference, _) = (
        spawn(_paged_logits, 1, folder, keep, device="cuda")[0] for keep in (True, False)
    )
    for got, want in zip(kept, reference):
        assert 0 < relative_rms_error(got, want) < FP8_LOGIT_RMS_ERROR
    with safe_open(Path(folder) / "model.safetensors", "pt") as f:
        file_bytes = sum(_nbytes(f, k) for k in f.keys())
    assert abs(kept_bytes / file_bytes - 1) < 0.02, (kept_bytes, file_bytes)


def _nbytes(f, key: str) -> int:
    t = f.get_tensor(key)
    return t.numel() * t.element_size()
