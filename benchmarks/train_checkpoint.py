"""Train the small GLM-5.2-shaped checkpoint that `spmoe demo` and the numerics tests use.

The model is transformers' `GlmMoeDsaForCausalLM` (autograd through the reference implementation, whose
saved checkpoint is the Hugging Face `glm_moe_dsa` layout spmoe loads) plus one MTP layer built from
transformers' decoder layer, wired as spmoe's `DeepseekV32MultiTokenPredictorLayer` computes it:

    x = eh_proj([enorm(embed(t[p+1])) zeroed at p = 0 | hnorm(h[p])])   h: the main model's post-norm hidden
    mtp hidden = shared_head.norm(decoder_layer(x)); logits = lm_head(mtp hidden) -> t[p+2]

What is trained, and how:
- the language model on next-byte cross-entropy, with DSA sparse attention (`index_topk` of a longer
  window) after a dense warm-up (`--dense-steps`: `index_topk` lifted to the window);
- the MTP layer on its next-next-byte cross-entropy (weight `--mtp-weight`);
- every indexer toward its layer's attention, as DeepSeek-V3.2 trains its lightning indexer: the KL
  divergence from the attention probabilities summed over heads to the softmax of the index scores over
  the keys the layer attended (inputs detached, so the indexer loss trains the indexer alone and the
  language loss never reaches it; transformers selects the top-k under no_grad);
- the routers' `e_score_correction_bias` by the auxiliary-loss-free rule (after each step, each expert's
  bias moves by `--bias-rate` toward the mean load).

Corpus: the Python standard library's source (`*.py` under the running interpreter's Lib, tests and
site-packages excluded), one document per file; a file whose path's CRC-32 is 0 mod 16 is held out, and a
prefix of the held-out text is written to `--heldout` (shipped in the repository, since the library
differs between Python versions). Deterministic from `--seed` with `--threads` fixed (the same Python
version gives the same corpus). Writes bf16 weights, `config.json`, the byte-level tokenizer with the GLM
chat template, and `generation_config.json`, then prints the checkpoint's SHA-256.

    python benchmarks/train_checkpoint.py --out spmoe/checkpoints/glm-stdlib-tiny
"""

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

CONFIG = dict(  # vocab_size: 256 bytes + 8 special tokens (spmoe.entrypoints.demo's tokenizer)
    model_type="glm_moe_dsa",
    architectures=["GlmMoeDsaForCausalLM"],
    vocab_size=264,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    mlp_layer_types=["dense", "sparse", "sparse"],
    indexer_types=["full", "shared", "full"],
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_topk=64,
    index_n_heads=4,
    index_head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    num_nextn_predict_layers=1,
    max_position_embeddings=4096,
    eos_token_id=256,
    tie_word_embeddings=False,
)
HELD_OUT_MOD = 16  # a file is held out when crc32(relative path) % HELD_OUT_MOD == 0


def corpus(lib: Path, held_out: bool) -> list[bytes]:
    """The standard library's files under `lib`, in path order: the training or the held-out ones."""
    docs = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib).as_posix()
        if rel.startswith(("test/", "site-packages/", "idlelib/idle_test/", "lib2to3/tests/")):
            continue
        if "/tests/" in rel or "/test/" in rel:
            continue
        if (zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0) == held_out:
            docs.append(f"# {rel}\n".encode() + path.read_bytes())
    return docs


class MTPLayer(torch.nn.Module):
    """One MTP layer as spmoe computes it (see the module docstring); `block` is transformers' decoder layer
    at index num_hidden_layers (a sparse MoE layer with a full indexer)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaDecoderLayer,
            GlmMoeDsaRMSNorm,
        )

        layers = config.num_hidden_layers
        block_config = copy.deepcopy(config)
        block_config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        block_config.indexer_types = [*config.indexer_types, "full"]
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = GlmMoeDsaRMSNorm(h, eps), GlmMoeDsaRMSNorm(h, eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = GlmMoeDsaDecoderLayer(block_config, layers)
        self.head_norm = GlmMoeDsaRMSNorm(h, eps)

    def forward(self, embeds, hidden, mask, position_embeddings, position_ids):
        """embeds `[B, S, H]` (token p + 1), hidden `[B, S, H]` post-norm -> `[B, S, H]` post-norm."""
        embeds = embeds.clone()
        embeds[:, 0] = 0.0  # position 0 has no previous token: spmoe zeroes its embedding
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))
        out, _ = self.block(
            x,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
        )
        return self.head_norm(out)

    def checkpoint_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """-> this layer's tensors under their checkpoint names `model.layers.{layer}.*`, experts per expert."""
        out = {
            "enorm.weight": self.enorm.weight,
            "hnorm.weight": self.hnorm.weight,
            "eh_proj.weight": self.eh_proj.weight,
            "shared_head.norm.weight": self.head_norm.weight,
        }
        for key, value in self.block.state_dict().items():
            if key.endswith("experts.gate_up_proj"):
                gate, up = value.chunk(2, dim=1)
                for e in range(value.shape[0]):
                    out[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                    out[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
            elif key.endswith("experts.down_proj"):
                for e in range(value.shape[0]):
                    out[key.replace("down_proj", f"{e}.down_proj.weight")] = value[e]
            else:
                out[key] = value
        return {f"model.layers.{layer}.{k}": v.detach() for k, v in out.items()}


class Recorder:
    """Forward hooks: each indexer layer's attention input, mask and probabilities (for the indexer loss),
    the first layer's mask and rotary tables (for the MTP layer), and the routers' expert choices."""

    def __init__(self, model, mtp: MTPLayer):
        self.attention, self.loads, self.inputs = [], [], {}
        attentions = [layer.self_attn for layer in model.model.layers] + [mtp.block.self_attn]
        for attn in attentions:
            if attn.indexer is not None:
                attn.register_forward_hook(self._attention, with_kwargs=True)
        model.model.layers[0].register_forward_pre_hook(self._first_layer, with_kwargs=True)
        for module in [*model.modules(), *mtp.modules()]:
            if type(module).__name__ == "GlmMoeDsaTopkRouter":
                module.register_forward_hook(self._router)
        self.routers = [
            m
            for m in [*model.modules(), *mtp.modules()]
            if type(m).__name__ == "GlmMoeDsaTopkRouter"
        ]

    def _attention(self, attn, args, kwargs, output):
        self.attention.append((attn.indexer.scores, output[1].detach()))

    def _first_layer(self, layer, args, kwargs):
        self.inputs = kwargs

    def _router(self, router, args, output):
        self.loads.append((router, output[2].detach()))

    def clear(self):
        self.attention.clear()
        self.loads.clear()


def index_scores(ix, hidden, q_resid, position_embeddings) -> torch.Tensor:
    """The indexer's scores `[B, S, T]` with gradients to its own weights only (inputs detached): the math of
    transformers' `GlmMoeDsaIndexer`, as one batched product instead of its broadcast one."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    hidden, q_resid = hidden.detach(), q_resid.detach()
    b, s, _ = hidden.shape
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    rope = ix.qk_rope_head_dim
    q_rot, k_rot = apply_rotary_pos_emb_interleave(
        q[..., :rope], k[..., :rope], *position_embeddings, unsqueeze_dim=2
    )
    q = torch.cat([q_rot, q[..., rope:]], -1)  # [B, S, h, D]
    k = torch.cat([k_rot, k[..., rope:]], -1).squeeze(2)  # [B, T, D]
    scores = F.relu(
        torch.bmm(q.reshape(b, s * ix.n_heads, -1), k.transpose(1, 2)) * ix.softmax_scale
    )
    weights = ix.weights_proj(hidden) * ix.n_heads**-0.5  # [B, S, h]
    return torch.bmm(weights.reshape(b * s, 1, -1), scores.view(b * s, ix.n_heads, -1)).view(
        b, s, -1
    )


def training_indexer_forward(
    ix, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kw
):
    """Replaces `GlmMoeDsaIndexer.forward` while training: the same top-k, and the scores kept (with their
    gradients) in `ix.scores` for the indexer loss."""
    ix.scores = index_scores(ix, hidden_states, q_resid, position_embeddings)
    masked = ix.scores.detach() + attention_mask  # additive causal mask [B, S, T]
    return masked.topk(min(ix.index_topk, masked.shape[-1]), dim=-1).indices.to(torch.int32)


def indexer_loss(scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """KL(attention probabilities summed over heads || softmax of the index scores over the attended keys).
    scores `[B, S, T]`, probs `[B, h, S, T]`."""
    target = probs.sum(1)
    target = target / target.sum(-1, keepdim=True)
    attended = target > 0
    log_q = torch.log_softmax(scores.masked_fill(~attended, float("-inf")), -1)
    cross = -(target * log_q.masked_fill(~attended, 0.0)).sum(-1)
    return (cross + torch.xlogy(target, target).sum(-1)).mean()


def batches(docs: list[bytes], window: int, batch: int, seed: int):
    """Endless `[batch, window + 2]` int64 windows drawn from `docs` (weighted by length)."""
    rng = random.Random(seed)
    text = b"".join(docs)
    while True:
        starts = [rng.randrange(0, len(text) - window - 2) for _ in range(batch)]
        yield torch.tensor([list(text[s : s + window + 2]) for s in starts])


def train(args) -> None:
    import transformers
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

    modeling_glm_moe_dsa.GlmMoeDsaIndexer.forward = training_indexer_forward
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = transformers.GlmMoeDsaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    config._attn_implementation = "eager"  # the attention probabilities, for the indexer loss
    model = transformers.GlmMoeDsaForCausalLM(config)
    mtp = MTPLayer(config)
    mtp.apply(model._init_weights)
    model.to(args.device), mtp.to(args.device)
    for i, layer in enumerate(model.model.layers):  # IndexShare as configured (not ignored)
        if (layer.self_attn.indexer is None) != (CONFIG["indexer_types"][i] == "shared"):
            raise RuntimeError(f"transformers {transformers.__version__} ignores indexer_types")
    recorder = Recorder(model, mtp)
    indexers = [m for m in [*model.modules(), *mtp.modules()] if hasattr(m, "index_topk")]
    params = [*model.parameters(), *mtp.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    lib = Path(args.corpus or sysconfig.get_paths()["stdlib"])
    train_docs, held_docs = corpus(lib, False), corpus(lib, True)
    if args.heldout:
        text = b"".join(held_docs)[: args.heldout_bytes]
        Path(args.heldout).write_bytes(text.decode("utf-8", "ignore").encode())
    print(
        f"corpus: {sum(map(len, train_docs)) / 1e6:.1f} MB in {len(train_docs)} training files, "
        f"{sum(map(len, held_docs)) / 1e6:.2f} MB in {len(held_docs)} held-out files; "
        f"{sum(p.numel() for p in params) / 1e6:.2f} M parameters; {args.threads} threads",
        flush=True,
    )
    data = batches(train_docs, args.window, args.batch, args.seed)
    began = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        topk = args.window if step < args.dense_steps else CONFIG["index_topk"]
        for indexer in indexers:
            indexer.index_topk = topk
        tokens = next(data).to(args.device)
        x = tokens[:, : args.window]
        recorder.clear()
        out = model.model(x)
        hidden = out.last_hidden_state
        lm = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), tokens[:, 1:-1].flatten())
        inputs = recorder.inputs
        mtp_hidden = mtp(
            model.model.embed_tokens(tokens[:, 1:-1]),
            hidden,
            inputs["attention_mask"],
            inputs["position_embeddings"],
            inputs["position_ids"],
        )
        mtp_loss = F.cross_entropy(model.lm_head(mtp_hidden).flatten(0, 1), tokens[:, 2:].flatten())
        kl = sum(indexer_loss(*entry) for entry in recorder.attention) / len(recorder.attention)
        loss = lm + args.mtp_weight * mtp_loss + kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            for router, chosen in recorder.loads:
                load = torch.bincount(chosen.flatten(), minlength=router.num_experts).float()
                router.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  lm {lm.item():.4f}  mtp {mtp_loss.item():.4f}  indexer KL "
                f"{kl.item():.4f}  lr {lr:.2e}  topk {topk}  "
                f"{time.perf_counter() - began:.0f} s",
                flush=True,
            )
    print(f"trained {args.steps} steps in {time.perf_counter() - began:.0f} s", flush=True)
    save(model.cpu(), mtp.cpu(), config, args.out)


def save(model, mtp: MTPLayer, config, out: str) -> None:
    """bf16 safetensors (main model as transformers saves it, then the MTP layer), config, tokenizer."""
    from spmoe.entrypoints.demo import write_demo_tokenizer

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    mtp_tensors = mtp.checkpoint_tensors(config.num_hidden_layers)
    tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp_tensors.items()})
    # the router's weight and correction bias stay float32, as GLM-5.2 ships them
    for key in tensors:
        if key.endswith(("gate.weight", "e_score_correction_bias")):
            source = model.state_dict() if key in model.state_dict() else mtp_tensors
            tensors[key] = source[key].float().contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    write_demo_tokenizer(folder)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"wrote {folder} ({path.stat().st_size / 2**20:.2f} MiB); sha256 {digest}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument("--heldout", help="file to write the held-out evaluation text into")
    parser.add_argument("--heldout-bytes", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dense-steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--corpus", help="the standard library folder (default: this interpreter's)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (deterministic) or cuda")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    if args.window <= CONFIG["index_topk"]:
        print(
            f"error: --window must exceed index_topk {CONFIG['index_topk']} (else attention is dense), "
            f"got {args.window}",
            file=sys.stderr,
        )
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
