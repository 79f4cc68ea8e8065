"""--load-format dummy: random weights from config.json alone (no safetensors file exists), the same model on
1 and 2 TP ranks, with --hf-overrides applied to the config."""

import json
from pathlib import Path

import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.entrypoints.jobs import flatten
from spmoe.models.deepseek_v32.weights import (
    load_model,
    write_fp8_checkpoint,
    write_random_checkpoint,
)
from tests.engine.conftest import ENGINE_CONFIG
from tests.models.deepseek_v32.test_fp8_checkpoints import CONFIG as FP8_CONFIG

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


def _write_fp8_twin(folder: str, config: dict) -> None:
    model = load_model(folder, ParallelConfig(), with_mtp=True)
    write_fp8_checkpoint(model, config, Path(folder) / "fp8")


def _module_types_and_dtypes(folder: str, load_format: str) -> dict:
    """-> {parameter name: (module type, shape, dtype)} of the FP8 model in `folder`, kept FP8, with MTP."""
    model = load_model(
        folder, ParallelConfig(), load_format=load_format, keep_fp8=True, with_mtp=True
    )
    owners = {
        f"{name}.{p}": type(module).__name__
        for name, module in model.named_modules()
        for p, _ in module.named_parameters(recurse=False)
    }
    return {name: (owners[name], tuple(t.shape), t.dtype) for name, t in model.named_parameters()}


def test_dummy_fp8_weights_build_the_fp8_checkpoints_modules_and_dtypes(tmp_path):
    """`--load-format dummy` on an FP8 config keeps the attention, dense, shared and MTP linears FP8
    block-128 as the real checkpoint's FP8 twin loads them: the same parameters, module types, shapes and
    dtypes (the indexer's head weights stay unquantised in both)."""
    config = dict(FP8_CONFIG, num_nextn_predict_layers=1)
    spawn(write_random_checkpoint, 1, config, tmp_path, 11)
    spawn(_write_fp8_twin, 1, str(tmp_path), config)
    real = spawn(_module_types_and_dtypes, 1, str(tmp_path / "fp8"), "auto")[0]
    dummy = spawn(_module_types_and_dtypes, 1, str(tmp_path / "fp8"), "dummy")[0]
    assert dummy == real
    fp8 = {name for name, (_, _, dtype) in dummy.items() if dtype == torch.float8_e4m3fn}
    for linear in (
        "layers.0.self_attn.q_b_proj",
        "layers.0.self_attn.o_proj",
        "layers.0.mlp.down_proj",
        "layers.1.mlp.shared_experts.down_proj",
        "layers.0.self_attn.x_proj.weight_fp8",  # q_a, kv_a and the indexer's wk, merged
        "layers.0.self_attn.indexer.wq_b",
        "mtp.0.eh_proj",
        "mtp.0.mtp_block.self_attn.indexer.wq_b",
    ):
        assert any(linear in name for name in fp8), f"{linear} is not FP8: {sorted(fp8)}"
    assert not any("indexer.weights_proj" in name for name in fp8)
