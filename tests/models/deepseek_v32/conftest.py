"""Tiny random checkpoints written by transformers, and transformers' logits for them (the oracle)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

SEQ_BATCHES = [[17, 1, 2, 3, 5], [1], [1, 1], [3], [5], [9, 2]]  # total N = 28, 1, 2, 3, 5, 11
COMMON = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    n_routed_experts=12,
    num_experts_per_tok=3,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=8,
    max_position_embeddings=64,
)
# Widths that divide over 8 TP ranks, 16 experts (2 a rank at EP 8): GLM-5.2's structure at tiny widths.
TP8_WIDTHS = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=16,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=2,
    max_position_embeddings=64,
)
MODELS = {
    # A dense layer after an MoE layer, IndexShare, ungrouped router.
    "glm": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            num_hidden_layers=4,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            indexer_types=["full", "shared", "full", "shared"],
            n_group=1,
            topk_group=1,
        ),
    ),
    # MoE first (SP from the embedding on), grouped router, yarn rope with mscale.
    "dsv32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            num_hidden_layers=3,
            mlp_layer_types=["sparse", "dense", "sparse"],
            n_group=4,
            topk_group=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
}
FP8_BLOCK = (5, 7)  # deliberately not aligned with any TP shard, to exercise block offsets


def token_batches(vocab: int) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(7)
    return [
        [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
        for lens in SEQ_BATCHES
    ]


def hf_logits(model, batches) -> list[torch.Tensor]:
    """transformers' logits, one `[N, V]` per batch. Rows from a sequence's first tied DSA top-k choice on are
    NaN: at a tie (relu makes exact zeros common in tiny models) transformers' `topk` picks among equal
    scores arbitrarily, while spmoe picks the earliest positions, so those rows have no single right answer."""
    with torch.no_grad():
        return [torch.cat([_untied_logits(model, seq) for seq in seqs]) for seqs in batches]


def _untied_logits(model, seq: list[int]) -> torch.Tensor:
    scores, topk = [], torch.Tensor.topk

    def recording_topk(self, k, *args, **kwargs):
        # the indexer's [1, S, S] scores
        if self.dim() == 3 and self.shape[-2:] == (
            len(seq),
            len(seq),
        ):
            scores.append((self.detach().clone(), k))
        return topk(self, k, *args, **kwargs)

    torch.Tensor.topk = recording_topk
    try:
        logits = model(torch.tensor([seq])).logits[0]
    finally:
        torch.Tensor.topk = topk
    first_tie = len(seq)
    for score, k in scores:
        if score.shape[-1] > k:
            ranked = score[0].sort(-1, descending=True).values
            tied = (ranked[:, k - 1] == ranked[:, k]) & (ranked[:, k] > -1e30)  # both allowed keys
            if tied.any():
                first_tie = min(first_tie, int(tied.nonzero()[0]))
    logits[first_tie:] = float("nan")
    return logits


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| over the rows `hf_logits` did not mark NaN (row 0 never is)."""
    keep = ~torch.isnan(want).any(-1)
    return ((got[keep] - want[keep]).abs().max() / want[keep].abs().max()).item()


def make_nontrivial(model) -> None:
    """Random correction bias, norm weights away from 1, experts and router large enough to matter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "experts" in name or name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (folder, batches, oracle logits per batch). Includes "glm_fp8", an FP8 block-scaled copy."""
    import transformers

    out = {}
    for name, (config_cls, model_cls, extra) in MODELS.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(
            getattr(transformers, config_cls)(**COMMON, **extra)
        ).eval()
        make_nontrivial(model)
        folder = tmp_path_factory.mktemp(name)
        # dsv32 is written in several shards with an index file, as the real checkpoints are.
        model.save_pretrained(folder, max_shard_size="100KB" if name == "dsv32" else "1GB")
        assert (folder / "model.safetensors.index.json").is_file() == (name == "dsv32")
        batches = token_batches(COMMON["vocab_size"])
        out[name] = (str(folder), batches, hf_logits(model, batches))
        if name == "glm":
            out["glm_fp8"] = fp8_copy(model, folder, tmp_path_factory.mktemp("glm_fp8"), batches)
    return out


def fp8_copy(model, folder, fp8_folder, batches):
    """Quantise every 2-D projection to FP8 e4m3 with FP8_BLOCK scales; the oracle runs on the dequantised
    weights, so both sides compute with exactly the same numbers."""
    tensors = load_file(folder / "model.safetensors")
    dequantised, quantised = {}, {}
    for key, w in tensors.items():
        if (
            w.dim() != 2
            or "norm" in key
            or "embed" in key
            or "lm_head" in key
            or key.endswith("gate.weight")
        ):
            quantised[key] = w
            continue
        rows, cols = -(-w.shape[0] // FP8_BLOCK[0]), -(-w.shape[1] // FP8_BLOCK[1])
        padded = torch.zeros(rows * FP8_BLOCK[0], cols * FP8_BLOCK[1])
        padded[: w.shape[0], : w.shape[1]] = w
        blocks = padded.view(rows, FP8_BLOCK[0], cols, FP8_BLOCK[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [rows, cols]
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        dq = (q.float() * scale[:, None, :, None]).view_as(padded)[: w.shape[0], : w.shape[1]]
        quantised[key] = q.view_as(padded)[: w.shape[0], : w.shape[1]].contiguous()
        quantised[key.removesuffix("weight") + "weight_scale_inv"] = scale
        dequantised[key] = dq
    save_file(quantised, fp8_folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }
    (fp8_folder / "config.json").write_text(json.dumps(config))
    model.load_state_dict(_packed(model, dequantised, tensors))
    return str(fp8_folder), batches, hf_logits(model, batches)


def _packed(model, dequantised: dict, original: dict) -> dict:
    """Per-expert checkpoint tensors -> the model's own state dict (packed gate_up / down experts)."""
    state = model.state_dict()
    weights = {**original, **dequantised}
    for key in state:
        if key in weights:
            state[key] = weights[key]
        elif key.endswith("experts.gate_up_proj"):
            prefix, n = key.removesuffix("gate_up_proj"), state[key].shape[0]
            state[key] = torch.stack(
                [
                    torch.cat(
                        [
                            weights[f"{prefix}{e}.gate_proj.weight"],
                            weights[f"{prefix}{e}.up_proj.weight"],
                        ]
                    )
                    for e in range(n)
                ]
            )
        elif key.endswith("experts.down_proj"):
            prefix, n = key.removesuffix("down_proj"), state[key].shape[0]
            state[key] = torch.stack([weights[f"{prefix}{e}.down_proj.weight"] for e in range(n)])
    return state


MTP_MAIN_LAYERS = 3
MTP_HF_LAYERS = dict(
    num_hidden_layers=4,
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    indexer_types=["full", "shared", "full", "full"],
    n_group=1,
    topk_group=1,
)


@pytest.fixture(scope="session")
def mtp_checkpoints(tmp_path_factory):
    """A 4-layer transformers GLM model whose last layer becomes the MTP block of a 3-layer model, as in the
    DeepSeek-V3 / GLM checkpoints (transformers does not save MTP weights, so the test adds enorm, hnorm,
    eh_proj and shared_head.norm). -> (transformers model, the added tensors, {"own": folder with the MTP
    layer's own embedding and head, "shared": folder without them})."""
    import transformers

    torch.manual_seed(1)
    hf = transformers.GlmMoeDsaForCausalLM(
        transformers.GlmMoeDsaConfig(**COMMON, **MTP_HF_LAYERS)
    ).eval()
    make_nontrivial(hf)
    base = tmp_path_factory.mktemp("mtp_hf")
    hf.save_pretrained(base)
    tensors = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    size, vocab, prefix = (
        COMMON["hidden_size"],
        COMMON["vocab_size"],
        f"model.layers.{MTP_MAIN_LAYERS}",
    )
    added = {
        f"{prefix}.enorm.weight": 1 + 0.3 * torch.randn(size, generator=gen),
        f"{prefix}.hnorm.weight": 1 + 0.3 * torch.randn(size, generator=gen),
        f"{prefix}.eh_proj.weight": torch.randn(size, 2 * size, generator=gen) * (2 * size) ** -0.5,
        f"{prefix}.shared_head.norm.weight": 1 + 0.3 * torch.randn(size, generator=gen),
    }
    own = {
        f"{prefix}.embed_tokens.weight": torch.randn(vocab, size, generator=gen),
        f"{prefix}.shared_head.head.weight": torch.randn(vocab, size, generator=gen) * size**-0.5,
    }
    config = json.loads((base / "config.json").read_text())
    config.update(
        num_hidden_layers=MTP_MAIN_LAYERS,
        num_nextn_predict_layers=1,
        mlp_layer_types=config["mlp_layer_types"][:MTP_MAIN_LAYERS],
        indexer_types=config["indexer_types"][:MTP_MAIN_LAYERS],
    )
    folders = {}
    for name, extra in (("shared", {}), ("own", own)):
        folder = tmp_path_factory.mktemp(f"mtp_{name}")
        save_file({**tensors, **added, **extra}, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
        folders[name] = str(folder)
    return hf, {**added, **own}, folders
