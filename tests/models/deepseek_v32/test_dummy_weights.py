"""--load-format dummy: random weights from config.json alone (no safetensors file exists), the same model on
1 and 2 TP ranks, with --hf-overrides applied to the config."""

import json

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.entrypoints.jobs import flatten
from spmoe.models.deepseek_v32.weights import load_model
from tests.engine.conftest import ENGINE_CONFIG

SEQS = [[5, 17, 3, 90, 41, 8], [60, 2]]
OVERRIDES = {
    "num_hidden_layers": 2,
    "mlp_layer_types": ["dense", "sparse"],
    "indexer_types": ["full", "shared"],
}


def _dummy_logits(folder: str):
    state = get_parallel_state()
    parallel = ParallelConfig(tensor_parallel_size=state.tp_size)
    model = load_model(folder, parallel, load_format="dummy", overrides=OVERRIDES, with_mtp=True)
    ids, positions, seq_lens = flatten(SEQS, "cpu")
    with torch.no_grad():
        logits = model(ids, positions, seq_lens)
    return (logits, len(model.model.layers), len(model.mtp)) if state.rank == 0 else None


def test_dummy_weights_need_only_the_config_and_do_not_depend_on_tp(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ENGINE_CONFIG))  # no *.safetensors here
    one, layers, mtp = spawn(_dummy_logits, 1, str(tmp_path))[0]
    two, *_ = spawn(_dummy_logits, 2, str(tmp_path))[0]
    assert (layers, mtp) == (2, 1)  # the overrides took effect; the MTP layer is built too
    assert (
        one.shape == (sum(map(len, SEQS)), ENGINE_CONFIG["vocab_size"])
        and torch.isfinite(one).all()
    )
    assert one.std() > 0.1  # random weights, not zeros
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-4)
