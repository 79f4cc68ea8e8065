"""FP8 block-128 checkpoints: the DeepSeek / GLM format (`weight_scale_inv`) and compressed-tensors FP8 block
(`weight_scale`, an `ignore` list) load to the same model; the FP8 linears kept as stored (their torch
reference on CPU, TP 1 and 2) agree with the dequantised reference; misfit scales are one-line errors naming
the layer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn
from spmoe.layers.linear import Linear, MergedLinear
from spmoe.models.deepseek_v32.weights import (
    load_model,
    write_fp8_checkpoint,
    write_random_checkpoint,
)

# widths whose TP-2 shards are whole 128-blocks. Every expert and every key is selected (top-k = all), so the
# logits are continuous in the weights: no routing or indexer choice flips between the FP8 and reference paths.
CONFIG = dict(
    model_type="glm_moe_dsa",
    vocab_size=64,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    mlp_layer_types=["dense", "sparse"],
    indexer_types=["full", "shared"],
    num_attention_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    index_topk=8,
    index_n_heads=4,
    index_head_dim=64,
    rms_norm_eps=1e-5,
    num_nextn_predict_layers=0,
)
IDS = [5, 9, 1, 33, 17, 2, 60]
# docs/performance-log/2026-12.md states it; the GPU test holds the kernels to it too
FP8_LOGIT_RMS_ERROR = 0.06


def relative_rms_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.float() - want.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt()
    )


SCHEMES = ("fp8", "compressed-tensors")


def _logits(folder, keep_fp8: bool | None, tp: int = 1) -> tuple[torch.Tensor, list[str]]:
    """-> (logits `[7, V]` of IDS, the kinds of linear module that hold FP8 weights)."""
    model = load_model(folder, ParallelConfig(tensor_parallel_size=tp), keep_fp8=keep_fp8)
    with torch.no_grad():
        logits = model(torch.tensor(IDS), torch.arange(len(IDS)), [len(IDS)])
    fp8 = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.is_fp8 or isinstance(m, MergedLinear) and m.fp8_parts
    ]
    return logits, sorted({type(m).__name__ for m in fp8})


def _twins_and_logits(folder: str) -> dict:
    """Writes the DeepSeek-format and compressed-tensors twins of the float32 checkpoint in `folder` -> their
    logits, dequantised (False) and kept FP8 (True)."""
    model = load_model(folder, ParallelConfig())
    for scheme in SCHEMES:
        write_fp8_checkpoint(model, CONFIG, Path(folder) / scheme, scheme)
    return {(s, keep): _logits(Path(folder) / s, keep) for s in SCHEMES for keep in (False, True)}


def _tp2_logits(folder) -> torch.Tensor:
    return _logits(folder, True, tp=2)[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    spawn(write_random_checkpoint, 1, CONFIG, folder, 11)
    return folder, spawn(_twins_and_logits, 1, str(folder))[0]


def test_compressed_tensors_loads_as_the_deepseek_format(checkpoints):
    folder, logits = checkpoints
    ds = load_file(folder / "fp8" / "model.safetensors")
    ct = load_file(folder / "compressed-tensors" / "model.safetensors")
    assert ds["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.q_b_proj.weight_scale" in ct
    # left unquantised
    assert ds["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    for keep in (False, True):
        (ds_logits, ds_kinds), (ct_logits, ct_kinds) = (
            logits["fp8", keep],
            logits["compressed-tensors", keep],
        )
        assert torch.equal(ds_logits, ct_logits)
        assert ds_kinds == ct_kinds == (["Linear", "MergedLinear"] if keep else [])


def test_kept_fp8_agrees_with_the_dequantised_reference_at_tp_1_and_2(checkpoints):
    """The kept path quantises activations per token and 128 channels as well (e4m3 rounds by up to 2**-4): the
    logits' RMS error against the dequantised reference stays under `FP8_LOGIT_RMS_ERROR` of their RMS (docs:
    the bound); TP 2 (each rank its shard of the blocks and scales) equals TP 1 up to the order of the sums."""
    folder, logits = checkpoints
    reference, kept = logits["fp8", False][0], logits["fp8", True][0]
    tp2 = spawn(_tp2_logits, 2, folder / "fp8", config=ParallelConfig(tensor_parallel_size=2))[0]
    assert 0 < relative_rms_error(kept, reference) < FP8_LOGIT_RMS_ERROR
    torch.testing.assert_close(tp2, kept, atol=2e-3 * reference.std(), rtol=0)


def _expect_errors(cases: list[tuple[str, bool, str]]) -> None:
    for folder, keep, match in cases:
        with pytest.raises(ValueError, match=match):
            load_model(folder, ParallelConfig(), keep_fp8=keep)


def _edit(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    save_file(edit_tensors(tensors) if edit_tensors else tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    return str(dst)


def _ignoring(pattern):
    def edit(config):
        ignore = config["quantization_config"]["ignore"]
        config["quantization_config"]["ignore"] = ignore + [pattern] if pattern else ignore[:3]
        return config

    return edit


def test_misfit_scales_are_one_line_errors_naming_the_layer(checkpoints, tmp_path):
    folder, _ = checkpoints
    layer, src, ct = (
        "model.layers.0.self_attn.q_b_proj",
        folder / "fp8",
        folder / "compressed-tensors",
    )
    bad = _edit(
        src, tmp_path / "shape", lambda t: {**t, f"{layer}.weight_scale_inv": torch.ones(3, 1)}
    )
    missing = _edit(
        src,
        tmp_path / "missing",
        lambda t: {k: v for k, v in t.items() if k != f"{layer}.weight_scale_inv"},
    )
    ignored = _edit(ct, tmp_path / "ignored", edit_config=_ignoring(r"re:.*q_b_proj$"))
    not_ignored = _edit(ct, tmp_path / "not_ignored", edit_config=_ignoring(None))
    shape = rf"{layer}\.weight_scale_inv: checkpoint shape \(3, 1\) does not match the expected \(4, 1\)"
    cases = [
        (bad, False, shape),
        (bad, True, shape),
        (
            missing,
            True,
            rf"layer {layer}: {layer}\.weight is FP8 but the checkpoint has no {layer}\.weight_scale_inv",
        ),
        (ignored, False, rf"layer {layer}: the quantization config leaves it unquantised, but"),
        (
            not_ignored,
            False,
            r"indexer\.weights_proj: FP8 by the quantization config \(not in its ignore list\)",
        ),
    ]
    spawn(_expect_errors, 1, cases)
