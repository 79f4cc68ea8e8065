"""The fused Triton kernels (`spmoe.layers.fused_triton`, and the FP8 quantisation of indexer queries) against
their torch references (RMSNorm, Rotary, Router, the paged cache's latent write, `silu_mul`, the indexer key's
LayerNorm + rope (+ Hadamard) + cache write, `quantize_index_vectors`, with the kernels switched off) on one CUDA
GPU in bfloat16, at GLM-5.2 / DeepSeek-V3.2 widths and at a tiny width whose expert groups are not powers of 2;
and the MoE's one-program alignment against its multi-kernel form; the cos/sin table's rows against `cos_sin`, bit
for bit. The `check_*` functions take the device and
dtype, so the same checks run on CPU under the Triton interpreter (float32 / float16) while developing (not the
FP8 ones: the interpreter's e4m3 rounding is not the GPU's)."""

import itertools

import pytest
import torch

from spmoe.config import ModelConfig
from spmoe.layers import fused
from spmoe.layers.mlp import silu_mul
from spmoe.layers.moe.router import Router
from spmoe.layers.norm import RMSNorm
from spmoe.layers.paged_rows import quantize_index_vectors
from spmoe.layers.quantization.fp8 import (
    dequantize,
    hadamard_matrix,
    hadamard_rotate,
    quantize_fp8_vectors,
)
from spmoe.layers.rotary import Rotary, RotaryTable, cos_sin

from ..multigpu import requires_gpus

ROUTERS = {  # E, top-k, n_group, topk_group
    "glm": dict(
        n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1, hidden_size=6144
    ),
    "dsv3": dict(
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, hidden_size=7168
    ),
    "tiny": dict(n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2),
}
BASE = dict(
    model_type="glm_moe_dsa",
    vocab_size=64,
    hidden_size=512,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=64,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_topk=8,
    index_n_heads=32,
    index_head_dim=128,
    rms_norm_eps=1e-5,
)


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
    for rows, size, strided in (
        (1, 6144, False),
        (8, 6144, False),
        (37, 512, True),
        (3, 2048, True),
    ):
        norm = RMSNorm(size, 1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.2, generator=gen)
        wide = torch.randn(rows, size + 64 * strided, generator=gen, device=device).to(dtype)
        x = wide[:, :size]  # rows strided like a split of a merged projection
        residual = torch.randn(rows, size, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            out, new_residual = add_rms_norm(x, residual, norm.weight, norm.eps)
            ref_out, ref_residual = reference(norm.add_norm, x, residual)
            # one rounded add
            torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
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
        for heads, dim, rope_at, interleaved in (
            (64, 256, 192, True),
            (1, 576, 512, True),
            (32, 128, 0, False),
            (32, 128, 0, True),
            (1, 128, 0, False),
        ):
            x = torch.randn(n_tok, heads, dim, generator=gen, device=device).to(dtype)
            part = x[..., rope_at : rope_at + 64]
            expected = x.clone()
            expected[..., rope_at : rope_at + 64] = (
                rotary.interleaved if interleaved else rotary.half_split
            )(part)
            rope_(part, rotary.cos, rotary.sin, interleaved)
            # the kernel rounds each product and sum as torch does (without FP fusion: equal on an H200; with it a
            # last bit differed in 0.6% of the bf16 elements); one bf16 step of values near 1 is 0.0039
            torch.testing.assert_close(x, expected, rtol=1.6e-2, atol=8e-3)


def check_router(device: str, dtype: torch.dtype):
    from spmoe.layers.fused_triton import GEMV_ROWS, GEMV_SLICE, route, router_logit_sums

    gen = torch.Generator(device=device).manual_seed(2)
    for name, fields in ROUTERS.items():
        cfg = ModelConfig.from_dict({**BASE, **fields})
        router = Router(cfg).to(device)
        with torch.no_grad():
            router.weight.normal_(0, cfg.hidden_size**-0.5, generator=gen)
            router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
        for rows, valid in ((1, 1), (8, 8), (5, 3), (20, 17), (64, 61)):
            x = torch.randn(rows, cfg.hidden_size, generator=gen, device=device).to(dtype)
            with torch.no_grad():
                sums = router_logit_sums(x, router.weight)
                if cfg.hidden_size > GEMV_SLICE:  # the GEMV's partial sums, else cuBLAS's logits
                    assert (sums.shape[1] > 1) == (rows <= GEMV_ROWS), (name, rows, sums.shape)
                # the float32 logits; only the order of the float32 sums differs
                torch.testing.assert_close(
                    sums.sum(1),
                    torch.nn.functional.linear(x.float(), router.weight),
                    rtol=1e-5,
                    atol=1e-5,
                )
                ids, weights = router(x, valid)
                ref_ids, ref_weights = reference(router, x, valid)
            # the same experts; ties may order them differently
            order, ref_order = (
                ids.sort(-1),
                ref_ids.sort(-1),
            )
            assert torch.equal(order.values, ref_order.values), (
                f"{name}, {rows} rows: experts differ"
            )
            torch.testing.assert_close(
                weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
            )
            assert (ids[valid:] == -1).all() and (weights[valid:] == 0).all()
        # all scores tied: the lowest groups, then the lowest experts in them
        ids, _ = route(
            torch.zeros(2, 3, cfg.n_routed_experts, device=device),
            torch.zeros(cfg.n_routed_experts, device=device),
            2,
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        assert ids.tolist() == [list(range(cfg.num_experts_per_tok))] * 2, f"{name}: {ids.tolist()}"


def check_silu_mul(device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(3)
    for rows, size, strided in ((1, 2048, False), (8, 12288, False), (37, 100, True)):
        both = torch.randn(rows, 2 * size + 8 * strided, generator=gen, device=device).to(dtype) * 3
        # strided rows, like halves of one product
        gate, up = (
            both[:, :size],
            both[:, size : 2 * size],
        )
        torch.testing.assert_close(silu_mul(gate, up), reference(silu_mul, gate, up))


def check_mla_cache_write(device: str, dtype: torch.dtype):
    """The normed latent and rotated rope key written through `paged_rows.write_latent_projection` (one kernel)
    into layer 0 of a paged cache, and by the torch reference into layer 1, over the same slots: the same rows."""
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
    from spmoe.layers.norm import RMSNorm
    from spmoe.layers.paged_rows import write_latent_projection
    from spmoe.layers.quantization.fp8 import dequantize

    cfg = ModelConfig.from_dict({**BASE, **ROUTERS["glm"]})
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    gen = torch.Generator(device=device).manual_seed(4)
    norm = RMSNorm(c, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=gen)
    for kv_cache_dtype in ("auto", "fp8"):
        cache = PagedKVCache(
            cfg, {0: False, 1: False}, 64 * BLOCK_SIZE * 2 * 1408, dtype, device, kv_cache_dtype
        )
        tables = [[5, 2], [7], [1, 3, 4]]
        for starts, lens in (([0, 0, 0], [70, 3, 130]), ([70, 3, 130], [1, 1, 1])):
            view = cache.view(tables, starts, lens)
            n = sum(lens)
            rotary = Rotary(cfg, view.positions, dtype)
            wide = torch.randn(n, c + r + 96, generator=gen, device=device).to(dtype) * 2
            kv_a = wide[:, 32 : 32 + c + r]  # strided rows, like the split of the merged projection
            with torch.no_grad():
                write_latent_projection(view.layer(0), view.slot_mapping, kv_a, norm, rotary)
                reference(
                    write_latent_projection,
                    view.layer(1),
                    view.slot_mapping,
                    kv_a.clone(),
                    norm,
                    rotary,
                )
        got, want = cache.layers[0], cache.layers[1]
        # the rope key: rope_'s rounding (see check_rope)
        torch.testing.assert_close(got.rope, want.rope, rtol=1.6e-2, atol=8e-3)
        if kv_cache_dtype == "auto":
            torch.testing.assert_close(got.latent, want.latent)
            continue
        torch.testing.assert_close(got.latent_scale, want.latent_scale, rtol=1e-6, atol=0)
        same = (got.latent.view(torch.uint8) == want.latent.view(torch.uint8)).float().mean().item()
        assert same > 0.99, f"only {same:.4f} of the FP8 latent bytes equal the reference's"
        values, ref = (
            dequantize(got.latent, got.latent_scale),
            dequantize(want.latent, want.latent_scale),
        )
        # the smallest e4m3 step, scaled
        step = want.latent_scale.repeat_interleave(128, dim=1) * 2**-9
        assert ((values - ref).abs() <= 0.125 * ref.abs() + step).all(), (
            "an FP8 latent is off by more than a step"
        )


def check_align_one_program(device: str, dtype: torch.dtype):
    """`align_pairs` as one program against its three-kernel form: the same blocks of the same experts, each
    holding the same pairs (their order within an expert's run is free)."""
    from spmoe.layers.moe.experts import triton_kernels

    gen = torch.Generator(device=device).manual_seed(5)
    for rows, k, first, count, experts, block_m in (
        (1, 8, 0, 64, 64, 16),
        (8, 8, 0, 64, 64, 16),
        (16, 8, 64, 128, 256, 16),
        (5, 3, 3, 7, 12, 64),
    ):
        ids = torch.stack(
            [torch.randperm(experts, generator=gen, device=device)[:k] for _ in range(rows)]
        )
        ids[rows // 2 : rows // 2 + 1] = -1  # an SP pad row
        aligned = []
        for one_program in (triton_kernels.ONE_PROGRAM_PAIRS, 0):
            triton_kernels.ONE_PROGRAM_PAIRS, saved = one_program, triton_kernels.ONE_PROGRAM_PAIRS
            try:
                aligned.append(triton_kernels.align_pairs(ids, first, count, block_m))
            finally:
                triton_kernels.ONE_PROGRAM_PAIRS = saved
        (pairs, blocks), (ref_pairs, ref_blocks) = aligned
        assert torch.equal(blocks, ref_blocks), (rows, k, blocks.tolist(), ref_blocks.tolist())
        # each row's expert, as a sort key
        owner = blocks.long().repeat_interleave(block_m) * (ids.numel() + 1)
        by_expert = [owner + p.long() for p in (pairs, ref_pairs)]
        # each expert's pairs, and pads
        assert torch.equal(by_expert[0].sort().values, by_expert[1].sort().values)
        local = ((ids >= first) & (ids < first + count)).sum().item()
        # every local pair placed once, nothing else
        assert (pairs < ids.numel()).sum().item() == local


def check_index_key(device: str, dtype: torch.dtype):
    from spmoe.layers.fused_triton import index_key_to_cache

    gen = torch.Generator(device=device).manual_seed(3)
    for model_type, fp8, n_tok in itertools.product(
        ("glm_moe_dsa", "deepseek_v32"), (False, True), (1, 8, 33)
    ):
        # rope interleaved / not
        cfg = ModelConfig.from_dict({**BASE, **ROUTERS["glm"], "model_type": model_type})
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
        index_key_to_cache(
            x,
            norm.weight,
            norm.bias,
            norm.eps,
            rotary.cos,
            rotary.sin,
            cfg.indexer_rope_interleaved,
            slots,
            keys,
            scales,
            hadamard_matrix(128, x.device) if fp8 else None,
        )

        def torch_key():
            with torch.no_grad():
                k = norm(x)
            rotary.rotate_(k[:, None, : cfg.qk_rope_head_dim], cfg.indexer_rope_interleaved)
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
            torch.testing.assert_close(
                dequantize(keys[slots], scales[slots]),
                dequantize(want, want_scale),
                rtol=0.13,
                atol=want_scale.max().item() * 2**-6,
            )
        else:
            torch.testing.assert_close(keys[slots], want, rtol=1.6e-2, atol=8e-3)


def check_quantize_query(device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(4)
    for n_tok in (1, 8, 33):
        heads_of_all_sizes = torch.logspace(-2, 2, 32, device=device)[:, None]
        # float32, as the indexer's
        q = hadamard_rotate(
            (torch.randn(n_tok, 32, 128, generator=gen, device=device) * heads_of_all_sizes).to(
                dtype
            )
        )
        # the experts' quantisation kernel: vectors of 128
        values, scale = quantize_index_vectors(q)
        want, want_scale = reference(quantize_fp8_vectors, q)
        assert values.shape == q.shape and scale.shape == (n_tok, 32, 1)
        # the kernel divides by 448
        torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
        exact = (values.float() == want.float()).float().mean().item()
        # its approximate division may round a value to the next e4m3 step
        assert exact > 0.97, exact
        # e4m3's least step
        torch.testing.assert_close(values.float(), want.float(), rtol=0.13, atol=2**-9)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize(
    "check",
    [
        check_add_rms_norm,
        check_rope,
        check_router,
        check_silu_mul,
        check_mla_cache_write,
        check_align_one_program,
        check_index_key,
        check_quantize_query,
    ],
)
def test_fused_kernel_matches_torch(check):
    check("cuda", torch.bfloat16)


@requires_gpus(1)
@pytest.mark.gpu
def test_rotary_table_rows_equal_computed_rows():
    """A CUDA model's cos/sin table for GLM-5.2's 202752 positions, default and yarn rope, bf16 and float32: the
    rows `Rotary` looks up equal `cos_sin`'s bit for bit; with the fused kernels off, or for another dtype,
    `Rotary` computes them."""
    yarn = {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 1.0,
            "original_max_position_embeddings": 4096,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    }
    length = 202752
    gen = torch.Generator(device="cuda").manual_seed(9)
    positions = torch.cat(
        [
            torch.randint(0, length, (61,), generator=gen, device="cuda"),
            torch.tensor([0, length - 1], device="cuda"),
        ]
    )
    for fields in ({}, yarn):
        cfg = ModelConfig.from_dict(
            {**BASE, **ROUTERS["glm"], **fields, "max_position_embeddings": length}
        )
        for dtype in (torch.bfloat16, torch.float32):
            table = RotaryTable.for_model(cfg, "cuda", dtype)
            assert table.table.shape == (length, 2, 32)
            want_cos, want_sin = cos_sin(cfg, positions, dtype)
            looked_up = Rotary(cfg, positions, dtype, table)
            assert looked_up.cos.stride() == (64, 1)  # a view of the gathered [N, 2, 32] rows
            assert torch.equal(looked_up.cos, want_cos) and torch.equal(looked_up.sin, want_sin), (
                fields,
                dtype,
            )
            computed = reference(Rotary, cfg, positions, dtype, table)
            assert computed.cos.stride() == (32, 1) and torch.equal(computed.cos, want_cos)
            other = Rotary(cfg, positions, torch.float16, table)
            assert other.cos.dtype == torch.float16 and other.cos.stride() == (32, 1)


@requires_gpus(1)
@pytest.mark.gpu
def test_row_kernels_past_32_bit_offsets():
    """Each row kernel on tensors of more than 2**31 elements: the last rows (whose offsets pass 2**31) equal the
    same kernel run on those rows alone, and the torch reference for them; the cache writes land in rows past
    2**31 / row width of a cache that large, nothing else moves."""
    from spmoe.layers.fused_triton import add_rms_norm, index_key_to_cache, rope_, write_mla_cache

    gen = torch.Generator(device="cuda").manual_seed(9)
    tail = slice(-3, None)
    size = 6144
    rows = 2**31 // size + 2  # 349527
    norm = RMSNorm(size, 1e-5).to(device="cuda", dtype=torch.bfloat16)
    # views of it below
    flat = torch.randn(2**31 + 2**16, generator=gen, device="cuda", dtype=torch.bfloat16)
    x = flat[: rows * size].view(rows, size)
    residual = torch.randn(rows, size, generator=gen, device="cuda").bfloat16()
    with torch.no_grad():
        out, new_residual = add_rms_norm(x, residual, norm.weight, norm.eps)
        small = add_rms_norm(x[tail].clone(), residual[tail].clone(), norm.weight, norm.eps)
        ref = reference(norm.add_norm, x[tail], residual[tail])
    for got, alone, want in zip((out[tail], new_residual[tail]), small, ref):
        assert torch.equal(got, alone)
        torch.testing.assert_close(got, want)
    del out, new_residual, residual

    # silu_mul: gate and up, halves of 4096-wide rows
    both = flat[: (2**31 // 4096 + 2) * 4096].view(-1, 4096)
    gate, up = both[:, :2048], both[:, 2048:]
    got = silu_mul(gate, up)
    torch.testing.assert_close(
        got[tail], silu_mul(gate[tail].clone(), up[tail].clone()), rtol=0, atol=0
    )
    torch.testing.assert_close(got[tail], reference(silu_mul, gate[tail], up[tail]))
    del got, both, gate, up

    cfg = ModelConfig.from_dict({**BASE, **ROUTERS["glm"]})
    # q of GLM-5.2's 64 heads x 256
    tokens = flat[: (2**31 // (64 * 256) + 2) * 64 * 256].view(-1, 64, 256)
    positions = torch.randint(0, 5000, (tokens.shape[0],), generator=gen, device="cuda")
    rotary = Rotary(cfg, positions, torch.bfloat16)
    alone = tokens[tail].clone()
    rope_(tokens[..., :64], rotary.cos, rotary.sin, True)
    rope_(alone[..., :64], rotary.cos[tail], rotary.sin[tail], True)
    assert torch.equal(tokens[tail], alone)
    del x, tokens, flat

    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cache_rows = 2**31 // c + 3
    latent = torch.zeros(cache_rows, c, dtype=torch.bfloat16, device="cuda")
    rope = torch.zeros(cache_rows, r, dtype=torch.bfloat16, device="cuda")
    kv_a = torch.randn(3, c + r, generator=gen, device="cuda").bfloat16()
    slots = torch.tensor([cache_rows - 1, cache_rows - 3, 5], device="cuda")
    small = (
        torch.zeros(3, c, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(3, r, dtype=torch.bfloat16, device="cuda"),
    )
    rot = Rotary(cfg, torch.tensor([7, 80, 3000], device="cuda"), torch.bfloat16)
    write_mla_cache(kv_a, norm.weight[:c], 1e-6, rot.cos, rot.sin, slots, latent, None, rope)
    write_mla_cache(
        kv_a,
        norm.weight[:c],
        1e-6,
        rot.cos,
        rot.sin,
        torch.arange(3, device="cuda"),
        *small[:1],
        None,
        small[1],
    )
    assert torch.equal(latent[slots], small[0]) and torch.equal(rope[slots], small[1])
    assert (
        latent[slots].abs().sum() > 0 and latent[-2].abs().sum() == 0 and rope[-2].abs().sum() == 0
    )
    del latent, rope

    dim = cfg.index_head_dim
    key_rows = 2**31 // dim + 3
    keys = torch.zeros(key_rows, dim, dtype=torch.bfloat16, device="cuda")
    small_keys = torch.zeros(3, dim, dtype=torch.bfloat16, device="cuda")
    ln = torch.nn.LayerNorm(dim, eps=1e-6).to(device="cuda", dtype=torch.bfloat16)
    k_in = torch.randn(3, dim, generator=gen, device="cuda").bfloat16()
    slots = torch.tensor([key_rows - 1, key_rows - 3, 5], device="cuda")
    for target, where in ((keys, slots), (small_keys, torch.arange(3, device="cuda"))):
        index_key_to_cache(
            k_in, ln.weight, ln.bias, ln.eps, rot.cos, rot.sin, True, where, target, None, None
        )
    assert (
        torch.equal(keys[slots], small_keys)
        and keys[slots].abs().sum() > 0
        and keys[-2].abs().sum() == 0
    )
