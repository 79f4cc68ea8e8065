"""The Triton experts (bfloat16, and FP8 block-128 with per-token-group activations) against the torch
reference at GLM-5.2 widths (H 6144, I 2048, top-8), on a CUDA GPU; and an FP8 checkpoint loaded with its FP8
weights kept against the same checkpoint dequantised."""

import pytest
import torch
import torch.nn.functional as F

from spmoe.config import ModelConfig

from ..multigpu import requires_gpus

H, I, TOTAL_EXPERTS, LOCAL, FIRST, TOP_K = 6144, 2048, 32, 16, 16, 8  # this rank holds experts 16..31


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
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
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
        reference, ours = TorchExperts(glm_config(False), FIRST, LOCAL), TritonExperts(glm_config(False), FIRST, LOCAL)
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
        err8 = ((got8 - emulated_fp8(x.float(), ids, weights, w13_dq, w2_dq)).abs().max() / want.abs().max()).item()
        loose = ((got8 - want).abs().max() / want.abs().max()).item()
        assert err8 < 2e-2, f"fp8 rows={rows}: rel err {err8:.2e} against the emulated FP8 reference"
        assert loose < 0.15, f"fp8 rows={rows}: rel err {loose:.2e} against the unquantised reference"
        assert torch.all(got[: rows // 5] == 0) and torch.all(got8[: rows // 5] == 0)  # pad rows stay zero
    print(f"rows={rows}: bf16 rel err {err:.1e}, fp8 {err8:.1e} (emulated) / {loose:.1e} (unquantised)")


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
    config = {**SMALL, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
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
        out.append((experts.name, experts.w13.dtype if experts.keeps_fp8 else experts.gate_up_proj.dtype, logits))
    return out


@requires_gpus(1)
@pytest.mark.gpu
def test_fp8_checkpoint_keeps_fp8_weights(tmp_path):
    from spmoe.distributed import spawn

    fp8_checkpoint(tmp_path)
    (name_t, dtype_t, ref), (name_x, dtype_x, got) = spawn(
        logits_with, 1, tmp_path, ["torch", "triton"], device="cuda"
    )[0]
    assert (name_t, dtype_t) == ("torch", torch.bfloat16) and (name_x, dtype_x) == ("triton", torch.float8_e4m3fn)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 0.1, f"FP8 triton model against the dequantised torch model: rel err {err:.2e}"
    print(f"FP8 checkpoint: triton (FP8 weights) vs torch (dequantised) logits rel err {err:.1e}")
