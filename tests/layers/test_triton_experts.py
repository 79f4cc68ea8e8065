"""The Triton experts (bfloat16, and FP8 block-128 with per-token-group activations) against the torch
reference at GLM-5.2 widths (H 6144, I 2048, top-8), on a CUDA GPU; and an FP8 checkpoint loaded with its FP8
weights kept against the same checkpoint dequantised."""

import pytest
import torch
import torch.nn.functional as F

from spmoe.config import ModelConfig

from ..multigpu import kernel_devices, requires_gpus

# this rank holds experts 16..31
H, I, TOTAL_EXPERTS, LOCAL, FIRST, TOP_K = (
    6144,
    2048,
    32,
    16,
    16,
    8,
)


def glm_config(fp8: bool) -> ModelConfig:
    return ModelConfig.from_dict(
        dict(
            model_type="glm_moe_dsa",
            vocab_size=64,
            hidden_size=H,
            intermediate_size=4 * I,
            moe_intermediate_size=I,
            num_hidden_layers=1,
            num_attention_heads=8,
            n_routed_experts=TOTAL_EXPERTS,
            num_experts_per_tok=TOP_K,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            index_topk=8,
            index_n_heads=2,
            index_head_dim=32,
            rms_norm_eps=1e-5,
            quantization_config={
                "quant_method": "fp8",
                "fmt": "e4m3",
                "weight_block_size": [128, 128],
            }
            if fp8
            else None,
        )
    )


def quantize_blocks(w: torch.Tensor):
    """`[E, N, K]` float -> (FP8 `[E, N, K]`, scales `[E, N/128, K/128]`), and the dequantised weights."""
    e, n, k = w.shape
    blocks = w.view(e, n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax((2, 4)) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(e, n, k), scale, (q.float() * scale[:, :, None, :, None]).view(e, n, k)


def routing(rows: int, gen):
    ids = torch.stack([torch.randperm(TOTAL_EXPERTS, generator=gen)[:TOP_K] for _ in range(rows)])
    ids[: rows // 5] = -1  # some SP pad rows
    return ids.cuda(), torch.rand(rows, TOP_K, generator=gen).cuda()


def emulated_fp8(x, ids, weights, w13, w2):
    """What the FP8 kernels compute, in float32: activations rounded to FP8 per 128-channel group."""
    from spmoe.layers.quantization.fp8 import quantize_fp8_groups

    def rounded(a):
        q, s = quantize_fp8_groups(a)
        return (q.float().view(a.shape[0], -1, 128) * s[..., None]).view(a.shape)

    out = torch.zeros(x.shape[0], H, device=x.device)
    xr = rounded(x)
    for row, slot in zip(*torch.nonzero((ids >= FIRST) & (ids < FIRST + LOCAL), as_tuple=True)):
        e = ids[row, slot] - FIRST
        gate, up = (w13[e] @ xr[row]).chunk(2)
        act = rounded((F.silu(gate) * up)[None])[0]
        out[row] += weights[row, slot] * (w2[e] @ act)
    return out


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_triton_experts_match_reference(rows):
    from spmoe.layers.moe.experts.torch_ref import TorchExperts
    from spmoe.layers.moe.experts.triton_experts import TritonExperts

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=gen).cuda().bfloat16()
    ids, weights = routing(rows, gen)
    w13 = (torch.randn(LOCAL, 2 * I, H, generator=gen) * H**-0.5).cuda()
    w2 = (torch.randn(LOCAL, H, I, generator=gen) * I**-0.5).cuda()
    with torch.device("cuda"):
        reference, ours = (
            TorchExperts(glm_config(False), FIRST, LOCAL),
            TritonExperts(glm_config(False), FIRST, LOCAL),
        )
        fp8 = TritonExperts(glm_config(True), FIRST, LOCAL)
    with torch.no_grad():
        for module in (reference, ours):
            module.gate_up_proj.copy_(w13)
            module.down_proj.copy_(w2)
        want = reference.float()(x.float(), ids, weights)
        got = ours.bfloat16()(x, ids, weights).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"bf16 rows={rows}: rel err {err:.2e}"
        (fp8.w13.data, fp8.w13_scale.data, w13_dq), (fp8.w2.data, fp8.w2_scale.data, w2_dq) = (
            quantize_blocks(w13),
            quantize_blocks(w2),
        )
        got8 = fp8(x, ids, weights).float()
        err8 = (
            (got8 - emulated_fp8(x.float(), ids, weights, w13_dq, w2_dq)).abs().max()
            / want.abs().max()
        ).item()
        loose = ((got8 - want).abs().max() / want.abs().max()).item()
        assert err8 < 2e-2, (
            f"fp8 rows={rows}: rel err {err8:.2e} against the emulated FP8 reference"
        )
        assert loose < 0.15, (
            f"fp8 rows={rows}: rel err {loose:.2e} against the unquantised reference"
        )
        # pad rows stay zero
        assert torch.all(got[: rows // 5] == 0) and torch.all(got8[: rows // 5] == 0)
    print(
        f"rows={rows}: bf16 rel err {err:.1e}, fp8 {err8:.1e} (emulated) / {loose:.1e} (unquantised)"
    )


SMALL = dict(
    model_type="glm_moe_dsa",
    vocab_size=64,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    mlp_layer_types=["dense", "sparse"],
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    index_topk=4,
    index_n_heads=2,
    index_head_dim=32,
    rms_norm_eps=1e-5,
)


def fp8_checkpoint(folder):
    """A checkpoint whose expert weights are FP8 with 128 x 128 block scales (the rest stays float32)."""
    import json

    from safetensors.torch import load_file, save_file

    from spmoe.distributed import spawn
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint

    spawn(write_random_checkpoint, 1, SMALL, folder, 0)
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if ".experts." in k]:
        q, scale, _ = quantize_blocks(tensors[key][None])
        tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = q[0], scale[0]
    save_file(tensors, folder / "model.safetensors")
    config = {
        **SMALL,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    }
    (folder / "config.json").write_text(json.dumps(config))


def logits_with(folder, backends):
    from spmoe.config import ParallelConfig
    from spmoe.entrypoints.jobs import flatten
    from spmoe.models.deepseek_v32.weights import load_model

    out = []
    for backend in backends:
        model = load_model(folder, ParallelConfig(moe_backend=backend), torch.bfloat16, "cuda")
        experts = model.model.layers[1].mlp.experts
        with torch.no_grad():
            logits = model(*flatten([[1, 5, 9, 13, 2, 7], [3, 4]], "cuda")).cpu()
        out.append(
            (
                experts.name,
                experts.w13.dtype if experts.keeps_fp8 else experts.gate_up_proj.dtype,
                logits,
            )
        )
    return out


@requires_gpus(1)
@pytest.mark.gpu
def test_fp8_checkpoint_keeps_fp8_weights(tmp_path):
    from spmoe.distributed import spawn

    fp8_checkpoint(tmp_path)
    (name_t, dtype_t, ref), (name_x, dtype_x, got) = spawn(
        logits_with, 1, tmp_path, ["torch", "triton"], device="cuda"
    )[0]
    assert (name_t, dtype_t) == ("torch", torch.bfloat16) and (name_x, dtype_x) == (
        "triton",
        torch.float8_e4m3fn,
    )
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 0.1, f"FP8 triton model against the dequantised torch model: rel err {err:.2e}"
    print(f"FP8 checkpoint: triton (FP8 weights) vs torch (dequantised) logits rel err {err:.1e}")


def routed(rows: int, skewed: bool, gen):
    """ids / weights `[rows, TOP_K]` on CUDA: distinct experts per row; skewed: 9 rows in 10 pick the hot local
    experts 16, 17 and 18 (one expert's run then holds most rows); a fifth of the rows are SP pad rows (all -1),
    and a few single routes are -1 too."""
    scores = torch.rand(rows, TOTAL_EXPERTS, generator=gen, device="cuda")
    if skewed:
        scores[torch.rand(rows, generator=gen, device="cuda") < 0.9, FIRST : FIRST + 3] += 1
    ids = scores.topk(TOP_K, dim=1).indices
    ids[torch.rand(rows, TOP_K, generator=gen, device="cuda") < 0.02] = -1
    ids[: rows // 5] = -1
    return ids, torch.rand(rows, TOP_K, generator=gen, device="cuda")


def reference_moe(x, ids, weights, w13, w2, fp8: bool):
    """The fused MoE in float32, one expert at a time (the kernels' roundings: the activation stored in x's
    dtype; FP8: x and the activation rounded to e4m3 per 128-channel group, w13 / w2 dequantised)."""
    from spmoe.layers.quantization.fp8 import quantize_fp8_groups

    def rounded(a):
        if not fp8:
            return a.to(x.dtype).float()
        q, s = quantize_fp8_groups(a)
        return (q.float().view(a.shape[0], -1, 128) * s[..., None]).view(a.shape)

    out, xf = torch.zeros(x.shape[0], H, device=x.device), rounded(x.float())
    for e in range(LOCAL):
        rows, slot = torch.nonzero(ids == FIRST + e, as_tuple=True)
        if rows.numel():
            gate, up = (xf[rows] @ w13[e].T).chunk(2, dim=1)
            act = rounded(F.silu(gate) * up)
            out.index_add_(0, rows, (act @ w2[e].T) * weights[rows, slot, None])
    return out


def distinct_configs(fp8: bool) -> list[dict]:
    """Each tile config `pick_config` can return (its branches, by pairs per expert)."""
    from spmoe.layers.moe.experts.triton_kernels import pick_config

    configs = [pick_config(n, 1, fp8) for n in (1, 16, 17, 64, 65, 128, 129, 512, 513, 1 << 20)]
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


# rows: 1 .. 3000 in the decode and prefill configs; 43691, where m * top_k * H first passes 2**31 (the bound of
# the [m * k, H] buffer the down projection used to fill); 349526, where m * H passes 2**31 (x, the output) and
# the sorted rows times I do too
MOE_SWEEP = [
    (1, False),
    (3, True),
    (32, False),
    (100, True),
    (200, False),
    (1000, True),
    (3000, False),
]
MOE_LARGE = [(43691, True, False), (43691, True, True), (349526, False, False)]


def check_fused_moe(rows: int, skewed: bool, fp8: bool, configs: list[dict | None]):
    from spmoe.layers.moe.experts.triton_kernels import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(rows)
    ids, weights = routed(rows, skewed, gen)
    w13 = torch.randn(LOCAL, 2 * I, H, generator=gen, device="cuda") * H**-0.5
    w2 = torch.randn(LOCAL, H, I, generator=gen, device="cuda") * I**-0.5
    x = torch.randn(rows, H, generator=gen, device="cuda").bfloat16()
    if fp8:
        (w13, w13_scale, w13_ref), (w2, w2_scale, w2_ref) = (
            quantize_blocks(w13),
            quantize_blocks(w2),
        )
    else:
        w13_ref, w2_ref = w13.bfloat16().float(), w2.bfloat16().float()
        w13, w2, w13_scale, w2_scale = w13.bfloat16(), w2.bfloat16(), None, None
    with torch.no_grad():
        want = reference_moe(x, ids, weights, w13_ref, w2_ref, fp8)
        # pad rows, rows routed elsewhere
        nothing_local = ~((ids >= FIRST) & (ids < FIRST + LOCAL)).any(1)
        for config in configs:
            got = fused_moe(x, ids, weights, FIRST, w13, w2, w13_scale, w2_scale, config=config)
            assert got.shape == x.shape and got.dtype == x.dtype
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            label = f"rows {rows}, skewed {skewed}, fp8 {fp8}, config {config}"
            assert err < 2e-2, f"{label}: rel err {err:.2e}"
            assert torch.all(got[nothing_local] == 0), label
            print(f"{label}: rel err {err:.1e}")


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows,skewed", MOE_SWEEP)
def test_fused_moe_sweep(rows, skewed, fp8):
    """`fused_moe` against the float32 reference from 1 to 3000 rows, its default config (every branch of
    `pick_config` is the default of some size here) and, at 200 rows, every config it can pick."""
    check_fused_moe(rows, skewed, fp8, [None] + (distinct_configs(fp8) if rows == 200 else []))


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("rows,skewed,fp8", MOE_LARGE)
def test_fused_moe_past_32_bit_offsets(rows, skewed, fp8):
    check_fused_moe(rows, skewed, fp8, [None])


@pytest.mark.gpu
@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("rows,channels", [(1, 7168), (37, 128), (5, 1664), (3, 2048 + 16 * 128)])
def test_quantize_fp8_matches_torch(device, rows, channels):
    """`quantize_fp8` (a program per row and 16 channel groups) against the torch reference, at row
    widths of 1, 13, 32 and 56 groups (a last program full, partial or alone), over a strided view:
    the same scales; values equal but for a few (Triton's division on a GPU is approximate, and the
    interpreter's float8 conversion rounds ties away from zero and loses a carry into the exponent:
    168 -> 176, -124 -> -64), none of them off by half its value (a misplaced group would be)."""
    from spmoe.layers.moe.experts.triton_kernels import quantize_fp8
    from spmoe.layers.quantization.fp8 import quantize_fp8_groups

    gen = torch.Generator(device=device).manual_seed(rows * channels)
    wide = torch.randn(rows, channels + 256, device=device, generator=gen).bfloat16()
    x = wide[:, 128 : 128 + channels]
    x[0, :128] = 0  # a group of zeros: the smallest scale
    got, got_scale = quantize_fp8(x)
    want, want_scale = quantize_fp8_groups(x)
    torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
    got, want = got.float(), want.float()
    assert ((got - want).abs() <= want.abs() / 2 + 2**-9).all()
    assert (got == want).float().mean() > 0.95
