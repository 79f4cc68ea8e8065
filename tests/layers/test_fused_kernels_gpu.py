"""The fused Triton kernels (`spmoe.layers.fused_triton`, and the FP8 quantisation of indexer queries) against
their torch references (RMSNorm, Rotary, Router, the indexer key's LayerNorm + rope (+ Hadamard) + cache write,
`quantize_fp8_vectors`, with the kernels switched off) on one CUDA GPU in bfloat16, at GLM-5.2 / DeepSeek-V3.2
widths and at a tiny width whose expert groups are not powers of 2. The `check_*` functions take the device and
dtype, so the same checks run on CPU under the Triton interpreter (float32 / float16) while developing (not the
FP8 ones: the interpreter's e4m3 rounding is not the GPU's)."""

import itertools

import pytest
import torch

from spmoe.config import ModelConfig
from spmoe.layers import fused
from spmoe.layers.moe.router import Router
from spmoe.layers.norm import RMSNorm
from spmoe.layers.rotary import Rotary
from spmoe.layers.sparse_attention import dequantize, hadamard_matrix, hadamard_rotate, quantize_fp8_vectors

from ..multigpu import requires_gpus

ROUTERS = {  # E, top-k, n_group, topk_group
    "glm": dict(n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1),
    "dsv3": dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4),
    "tiny": dict(n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2),
}
BASE = dict(model_type="glm_moe_dsa", vocab_size=64, hidden_size=512, intermediate_size=64, moe_intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=64, routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
            index_topk=8, index_n_heads=32, index_head_dim=128, rms_norm_eps=1e-5)


def reference(fn, *args):
    """fn(*args) with the fused kernels switched off: the torch reference."""
    fused.ENABLED = False
    try:
        return fn(*args)
    finally:
        fused.ENABLED = True


def check_add_rms_norm(device: str, dtype: torch.dtype):
    from spmoe.layers.fused_triton import add_rms_norm

    gen = torch.Generator(device=device).manual_seed(0)
    for rows, size, strided in ((1, 6144, False), (8, 6144, False), (37, 512, True), (3, 2048, True)):
        norm = RMSNorm(size, 1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.2, generator=gen)
        wide = torch.randn(rows, size + 64 * strided, generator=gen, device=device).to(dtype)
        x = wide[:, :size]  # rows strided like a split of a merged projection
        residual = torch.randn(rows, size, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            out, new_residual = add_rms_norm(x, residual, norm.weight, norm.eps)
            ref_out, ref_residual = reference(norm.add_norm, x, residual)
            torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)  # one rounded add
            torch.testing.assert_close(out, ref_out)
            alone, same = add_rms_norm(x, None, norm.weight, norm.eps)
            torch.testing.assert_close(alone, reference(norm, x))
            assert same is x


def check_rope(device: str, dtype: torch.dtype):
    from spmoe.layers.fused_triton import rope_

    cfg = ModelConfig.from_dict({**BASE, **ROUTERS["glm"]})
    gen = torch.Generator(device=device).manual_seed(1)
    for n_tok in (1, 8, 33):
        rotary = Rotary(cfg, torch.randint(0, 5000, (n_tok,), generator=gen, device=device), dtype)
        for heads, dim, rope_at, interleaved in ((64, 256, 192, True), (1, 576, 512, True), (32, 128, 0, False),
                                                 (32, 128, 0, True), (1, 128, 0, False)):
            x = torch.randn(n_tok, heads, dim, generator=gen, device=device).to(dtype)
            part = x[..., rope_at:rope_at + 64]
            expected = x.clone()
            expected[..., rope_at:rope_at + 64] = (rotary.interleaved if interleaved else rotary.half_split)(part)
            rope_(part, rotary.cos, rotary.sin, interleaved)
            # the kernel rounds each product and sum as torch does (without FP fusion: equal on an H200; with it a
            # last bit differed in 0.6% of the bf16 elements); one bf16 step of values near 1 is 0.0039
            torch.testing.assert_close(x, expected, rtol=1.6e-2, atol=8e-3)


def check_router(device: str, dtype: torch.dtype):
    from spmoe.layers.fused_triton import route

    gen = torch.Generator(device=device).manual_seed(2)
    for name, fields in ROUTERS.items():
        cfg = ModelConfig.from_dict({**BASE, **fields})
        router = Router(cfg).to(device)
        with torch.no_grad():
            router.weight.normal_(0, cfg.hidden_size ** -0.5, generator=gen)
            router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
        for rows, valid in ((1, 1), (8, 8), (5, 3), (64, 61)):
            x = torch.randn(rows, cfg.hidden_size, generator=gen, device=device).to(dtype)
            logits = torch.nn.functional.linear(x.float(), router.weight)
            with torch.no_grad():
                ids, weights = route(logits, router.e_score_correction_bias, valid, cfg.n_group, cfg.topk_group,
                                     cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)
                ref_ids, ref_weights = reference(router, x, valid)
            order, ref_order = ids.sort(-1), ref_ids.sort(-1)  # the same experts; ties may order them differently
            assert torch.equal(order.values, ref_order.values), f"{name}, {rows} rows: experts differ"
            torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
            assert (ids[valid:] == -1).all() and (weights[valid:] == 0).all()
        # all scores tied: the lowest groups, then the lowest experts in them
        ids, _ = route(torch.zeros(2, cfg.n_routed_experts, device=device),
                       torch.zeros(cfg.n_routed_experts, device=device), 2, cfg.n_group, cfg.topk_group,
                       cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        assert ids.tolist() == [list(range(cfg.num_experts_per_tok))] * 2, f"{name}: {ids.tolist()}"


def check_index_key(device: str, dtype: torch.dtype):
    from spmoe.layers.fused_triton import index_key_to_cache

    gen = torch.Generator(device=device).manual_seed(3)
    for model_type, fp8, n_tok in itertools.product(("glm_moe_dsa", "deepseek_v32"), (False, True), (1, 8, 33)):
        cfg = ModelConfig.from_dict({**BASE, **ROUTERS["glm"], "model_type": model_type})  # rope interleaved / not
        norm = torch.nn.LayerNorm(cfg.index_head_dim, eps=1e-6).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.2, generator=gen)
            norm.bias.normal_(0.0, 0.2, generator=gen)
        wide = torch.randn(n_tok, 160, generator=gen, device=device) * 2 + 0.5
        x = wide.to(dtype)[:, 16:144]  # rows strided like a split of the merged projection
        rotary = Rotary(cfg, torch.randint(0, 5000, (n_tok,), generator=gen, device=device), dtype)
        rows = 4 * 64
        slots = torch.randperm(rows, generator=gen, device=device)[:n_tok]
        keys = torch.zeros(rows, 128, dtype=torch.float8_e4m3fn if fp8 else dtype, device=device)
        scales = torch.ones(rows, 1, device=device) if fp8 else None
        index_key_to_cache(x, norm.weight, norm.bias, norm.eps, rotary.cos, rotary.sin, cfg.indexer_rope_interleaved,
                           slots, keys, scales, hadamard_matrix(128, x.device) if fp8 else None)

        def torch_key():
            with torch.no_grad():
                k = norm(x)
            rotary.rotate_(k[:, None, :cfg.qk_rope_head_dim], cfg.indexer_rope_interleaved)
            return quantize_fp8_vectors(hadamard_rotate(k)) if fp8 else (k, None)

        want, want_scale = reference(torch_key)
        untouched = torch.ones(rows, dtype=torch.bool, device=device)
        untouched[slots] = False
        assert (keys[untouched].float() == 0).all(), "a row that no token writes changed"
        case = f"{model_type}, fp8 {fp8}, {n_tok} tokens"
        # LayerNorm's statistics are summed in another order than torch's: a last bit may differ, then the rope
        # products round it again (2 bf16 steps); FP8 values (after a Hadamard product summed in another order)
        # may then round to the next e4m3 step (2**-3)
        exact = (keys[slots].float() == want.float()).float().mean().item()
        assert exact > 0.95, (case, exact)
        if fp8:
            assert (scales[untouched] == 1).all()
            torch.testing.assert_close(scales[slots], want_scale, rtol=1.6e-2, atol=0)
            torch.testing.assert_close(dequantize(keys[slots], scales[slots]), dequantize(want, want_scale),
                                       rtol=0.13, atol=want_scale.max().item() * 2 ** -6)
        else:
            torch.testing.assert_close(keys[slots], want, rtol=1.6e-2, atol=8e-3)


def check_quantize_query(device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(4)
    for n_tok in (1, 8, 33):
        q = hadamard_rotate((torch.randn(n_tok, 32, 128, generator=gen, device=device)
                             * torch.logspace(-2, 2, 32, device=device)[:, None]).to(dtype))  # float32, as the indexer's
        values, scale = quantize_fp8_vectors(q)  # the experts' quantisation kernel: vectors of 128
        want, want_scale = reference(quantize_fp8_vectors, q)
        assert values.shape == q.shape and scale.shape == (n_tok, 32, 1)
        torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)  # the kernel divides by 448
        exact = (values.float() == want.float()).float().mean().item()
        assert exact > 0.97, exact  # its approximate division may round a value to the next e4m3 step
        torch.testing.assert_close(values.float(), want.float(), rtol=0.13, atol=2 ** -9)  # e4m3's least step


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("check", [check_add_rms_norm, check_rope, check_router, check_index_key,
                                   check_quantize_query])
def test_fused_kernel_matches_torch(check):
    check("cuda", torch.bfloat16)
