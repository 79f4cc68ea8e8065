"""The model enforces its declared layouts: a tensor of the wrong layout is an error naming the shapes, and
SP pad rows are never routed to an expert."""

import pytest
import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.entrypoints.jobs import flatten
from spmoe.layers.attention import AttentionBatch
from spmoe.layers.moe.router import Router
from spmoe.layers.rotary import Rotary
from spmoe.models.deepseek_v32.decoder_layer import causal_within_sequences


def test_router_gives_pad_rows_no_experts(checkpoints):
    cfg = ModelConfig.from_file(checkpoints["dsv32"][0])
    router = Router(cfg)
    torch.nn.init.normal_(router.weight)
    ids, weights = router(torch.randn(4, cfg.hidden_size), 2)
    assert ids.shape == (4, cfg.num_experts_per_tok)
    assert (ids[:2] >= 0).all() and (ids[2:] == -1).all() and (weights[2:] == 0).all()
    assert torch.allclose(weights[:2].sum(-1), torch.full((2,), cfg.routed_scaling_factor))


def wrong_layouts(folder):
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(
        folder,
        ParallelConfig(tensor_parallel_size=get_parallel_state().tp_size, sp="on", sp_scope="all"),
    )
    messages = []
    for num_tokens in (1, 5):
        ids, positions, seq_lens = flatten([list(range(num_tokens))], "cpu")
        hidden = torch.zeros(num_tokens, model.cfg.hidden_size)
        batch = AttentionBatch(
            Rotary(model.cfg, positions, hidden.dtype), causal_within_sequences(seq_lens, hidden)
        )
        layer = model.model.layers[1]  # declared SHARDED input: [ceil(N/t), H]; hand it FULL [N, H]
        try:
            layer(torch.zeros(num_tokens + 1, model.cfg.hidden_size), None, batch, None, num_tokens)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    try:
        model(torch.tensor([1, 2, 3]), torch.tensor([0, 1]), [3])
        messages.append(None)
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_wrong_layout_is_an_error_naming_the_shapes(checkpoints):
    h = 48
    one, five, positions = spawn(wrong_layouts, 2, checkpoints["glm"][0])[0]
    assert (
        one
        == f"layer 1 input (SHARDED, N=1): expected a 2-D tensor with 1 rows, got shape (2, {h})"
    )
    assert (
        five
        == f"layer 1 input (SHARDED, N=5): expected a 2-D tensor with 3 rows, got shape (6, {h})"
    )
    assert positions is not None and "positions (2,)" in positions


@pytest.mark.parametrize("lens, allowed", [([2, 1], [[1, 0, 0], [1, 1, 0], [0, 0, 1]])])
def test_attention_stays_within_each_sequence(lens, allowed):
    assert causal_within_sequences(lens, torch.zeros(1)).int().tolist() == allowed
