"""The torch paths behind the fused kernels: rope rotated in place equals the out-of-place reference on the
strided views attention hands it; the cos/sin table holds `cos_sin`'s rows and is made only for CUDA models of
a stated length (a CPU forward computes its rows); a merged projection (attention's input projections, the
MLP's gate and up) equals its parts as separate layers, loads each part's checkpoint tensor into its own rows,
and splits every part over TP ranks."""

import pytest
import torch
import torch.nn.functional as F

from spmoe.config import ModelConfig
from spmoe.layers.linear import MergedLinear
from spmoe.layers.rotary import Rotary, RotaryTable, cos_sin

CFG = dict(
    model_type="glm_moe_dsa",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    index_topk=4,
    index_n_heads=2,
    index_head_dim=16,
    rms_norm_eps=1e-6,
)


def test_rotate_in_place_equals_reference():
    cfg = ModelConfig.from_dict(CFG)
    rotary = Rotary(cfg, torch.tensor([0, 3, 17, 40]), torch.float32)
    for interleaved in (True, False):
        q = torch.randn(4, 3, 16)  # [N, heads, nope 8 + rope 8]: the rope part is a strided view
        before = q.clone()
        rotated = (rotary.interleaved if interleaved else rotary.half_split)(q[..., 8:])
        expected = torch.cat([q[..., :8], rotated], -1)
        rotary.rotate_(q[..., 8:], interleaved)
        assert torch.equal(q, expected)
        assert torch.equal(q[..., :8], before[..., :8]) and not torch.equal(
            q[..., 8:], before[..., 8:]
        )


def test_rotary_table_rows_are_cos_sin_and_only_cuda_models_have_one():
    cfg = ModelConfig.from_dict({**CFG, "max_position_embeddings": 50})
    assert RotaryTable.for_model(cfg, "cpu", torch.float32) is None
    # length not stated
    assert RotaryTable.for_model(ModelConfig.from_dict(CFG), "cuda", torch.float32) is None
    table = RotaryTable(cfg, 50, "cpu", torch.float32)
    positions = torch.tensor([0, 3, 17, 49, 3])
    want_cos, want_sin = cos_sin(cfg, positions, torch.float32)
    cos, sin = table.lookup(positions)
    assert cos.shape == sin.shape == (5, 4) and cos.stride() == sin.stride() == (8, 1)
    torch.testing.assert_close(cos, want_cos, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sin, want_sin, rtol=1e-6, atol=1e-7)
    assert not torch.equal(cos[1], cos[2])
    # on CPU the rows are computed, the reference
    rotary = Rotary(cfg, positions, torch.float32, table)
    assert (
        torch.equal(rotary.cos, want_cos)
        and torch.equal(rotary.sin, want_sin)
        and rotary.cos.is_contiguous()
    )


def test_merged_linear_equals_its_parts_and_loads_them():
    parts = {"q_a_proj": 5, "kv_a_proj_with_mqa": 7, "indexer.wk": 3}
    merged = MergedLinear(12, parts)
    weights = {name: torch.randn(width, 12) for name, width in parts.items()}
    plan = merged.checkpoint_plan("model.layers.0.self_attn", "weight_scale_inv")
    assert sorted(plan) == sorted(f"model.layers.0.self_attn.{name}.weight" for name in parts)
    with torch.no_grad():
        for name, w in weights.items():
            plan[f"model.layers.0.self_attn.{name}.weight"][0].copy_(w)
    x = torch.randn(6, 12)
    out = merged(x)
    assert list(out) == list(parts)
    for name, w in weights.items():
        torch.testing.assert_close(out[name], F.linear(x, w))


def test_merged_linear_splits_every_part_over_tp():
    merged = MergedLinear(12, {"gate_proj": 8, "up_proj": 8}, tp_size=2)
    assert merged.parts == {"gate_proj": 4, "up_proj": 4} and merged.tp_dim == 0
    assert merged.weight.shape == (8, 12)
    with pytest.raises(
        ValueError, match="cannot split the 6 output features of up_proj over 4 TP ranks"
    ):
        MergedLinear(12, {"gate_proj": 8, "up_proj": 6}, tp_size=4)
