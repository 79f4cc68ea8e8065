"""`benchmarks/train_checkpoint.py`, the command that trains the demo checkpoint: a smoke run of two steps writes
a checkpoint spmoe loads and transformers computes alike; the MTP layer it trains computes what spmoe's MTP
layer computes from the saved weights; the indexer it trains scores as transformers' indexer does."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import spawn

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "train_checkpoint.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_a_checkpoint_spmoe_loads(tmp_path):
    from spmoe.entrypoints.forward import run_forward

    out, heldout = tmp_path / "ckpt", tmp_path / "heldout.txt"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--heldout", str(heldout)]
        + ["--steps", "2", "--dense-steps", "1", "--window", "80", "--batch", "1"]
        + ["--threads", "1", "--log-every", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "step     1" in done.stdout and "sha256 " in done.stdout, done.stdout
    assert len(heldout.read_bytes()) > 4096
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] >= 4096 and config["index_topk"] < 512
    seqs = [list(heldout.read_bytes()[:100])]
    logits, _ = run_forward(str(out), ParallelConfig(), seqs)
    assert logits.shape == (100, config["vocab_size"]) and torch.isfinite(logits).all()


def spmoe_mtp_logits(folder: str, tokens: list[int]) -> torch.Tensor:
    """spmoe's target hidden and MTP draft logits `[S, V]` for one sequence of S + 1 tokens."""
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(), with_mtp=True)
    ids, positions = torch.tensor(tokens), torch.arange(len(tokens) - 1)
    with torch.no_grad():
        hidden = model.forward_hidden(ids[:-1], positions, [len(tokens) - 1])
        mtp = model.mtp[0]
        return mtp.logits(mtp(ids[1:], positions, hidden, [len(tokens) - 1]))


@pytest.fixture(scope="module")
def trained_pieces(tmp_path_factory):
    """A random model and MTP layer as the script builds them, saved as the script saves them."""
    import transformers

    script = load_script()
    torch.manual_seed(0)
    config = transformers.GlmMoeDsaConfig(
        **{k: v for k, v in script.CONFIG.items() if k != "model_type"}
    )
    config._attn_implementation = "eager"
    model = transformers.GlmMoeDsaForCausalLM(config)
    mtp = script.MTPLayer(config)
    mtp.apply(model._init_weights)
    with torch.no_grad():  # away from the initial zeros and ones, so that every weight matters
        for p in [*model.parameters(), *mtp.parameters()]:
            p.add_(torch.randn(p.shape) * 0.05)
    folder = tmp_path_factory.mktemp("pieces")
    script.save(model, mtp, config, str(folder))
    # the saved bf16 weights are what both sides compute with
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    mtp.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in mtp.state_dict().items()})
    return script, model.eval(), mtp.eval(), folder


def test_trained_mtp_layer_is_spmoes(trained_pieces, monkeypatch):
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

    script, model, mtp, folder = trained_pieces
    # as in training (the recorder reads the scores it keeps)
    monkeypatch.setattr(
        modeling_glm_moe_dsa.GlmMoeDsaIndexer, "forward", script.training_indexer_forward
    )
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    recorder = script.Recorder(model, mtp)
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens[:-1]])).last_hidden_state
        inputs = recorder.inputs
        want = model.lm_head(
            mtp(
                model.model.embed_tokens(torch.tensor([tokens[1:]])),
                hidden,
                inputs["attention_mask"],
                inputs["position_embeddings"],
                inputs["position_ids"],
            )
        )[0]
    got = spawn(spmoe_mtp_logits, 1, str(folder), tokens)[0]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_training_indexer_selects_what_transformers_selects(trained_pieces):
    """The training forward's indexer (its scores kept for the loss) picks transformers' top-k."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

    script, model, _, _ = trained_pieces
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(
        1, 100, model.config.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    positions = torch.arange(100)[None]
    rotary = model.model.rotary_emb(hidden, position_ids=positions)
    mask = torch.full((1, 100, 100), torch.finfo(torch.float32).min).triu(1)
    want = modeling_glm_moe_dsa.GlmMoeDsaIndexer.forward(
        attn.indexer, hidden, q_resid, rotary, mask, positions
    )
    got = script.training_indexer_forward(attn.indexer, hidden, q_resid, rotary, mask)
    # the sets per query agree (order within a set is topk's business)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert attn.indexer.scores.requires_grad
