"""Bad input ends `spmoe forward` with exit 1 and a one-line error that names what was wrong; a broken
checkpoint is an error naming the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.entrypoints.cli import main


def forward_cli(tmp_path, model, ids, tp=2, sp="on"):
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(ids if isinstance(ids, str) else json.dumps(ids))
    return main(
        [
            "forward",
            "--model",
            str(model),
            "--tp",
            str(tp),
            "--sp",
            sp,
            "--input-ids",
            str(ids_file),
            "--save-logits",
            str(tmp_path / "out.safetensors"),
        ]
    )


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("missing model", "model config not found"),
        (
            "tp does not divide heads",
            "num_attention_heads = 12 is not divisible by tensor_parallel_size = 5",
        ),
        (
            "tp does not divide experts",
            "n_routed_experts = 12 is not divisible by the expert-parallel size = 8",
        ),
        ("sp on with tp 1", "needs tensor_parallel_size > 1"),
        ("token id out of range", "token id 96, expected an int in [0, 96)"),
        ("negative token id", "token id -1"),
        ("empty batch", "expected a non-empty JSON list"),
        ("empty sequence", "sequence 1 must be a non-empty list"),
        ("corrupt ids file", "is not valid JSON"),
        ("corrupt config", "config.json is not valid JSON"),
        (
            "eos outside the vocabulary",
            "eos_token_id 96 is not a token id: expected an int in [0, 96)",
        ),
    ],
)
def test_bad_input_is_a_one_line_error(case, fragment, checkpoints, tmp_path, capsys):
    model, ids, tp, sp = checkpoints["glm"][0], [[1, 2], [3]], 2, "on"
    if case == "missing model":
        model = tmp_path / "nowhere"
    elif case == "tp does not divide heads":
        tp = 5
    elif case == "tp does not divide experts":
        tp = 8  # a config where heads (16) and vocab (128) divide by 8 but the 12 experts do not
        model = tmp_path / "m"
        shutil.copytree(checkpoints["glm"][0], model)
        config = json.loads((model / "config.json").read_text())
        config.update(num_attention_heads=16, num_key_value_heads=16, vocab_size=96 + 8 * 4)
        (model / "config.json").write_text(json.dumps(config))
    elif case == "sp on with tp 1":
        tp = 1
    elif case == "token id out of range":
        ids = [[1, 96]]
    elif case == "negative token id":
        ids = [[-1]]
    elif case == "empty batch":
        ids = []
    elif case == "empty sequence":
        ids = [[1], []]
    elif case == "corrupt ids file":
        ids = "[[1, 2"
    elif case == "corrupt config":
        model = tmp_path / "m"
        shutil.copytree(checkpoints["glm"][0], model)
        (model / "config.json").write_text("{not json")
    elif case == "eos outside the vocabulary":
        model = tmp_path / "m"
        shutil.copytree(checkpoints["glm"][0], model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(
            json.dumps({**config, "eos_token_id": [1, config["vocab_size"]]})
        )
    assert forward_cli(tmp_path, model, ids, tp, sp) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and fragment in err[-1], err
    assert err[-1].startswith("spmoe forward: error:")


def load_broken(folders):
    from spmoe.models.deepseek_v32.weights import load_model

    errors = []
    for folder in folders:
        try:
            load_model(folder, ParallelConfig(tensor_parallel_size=get_parallel_state().tp_size))
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the message is what is under test
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_broken_checkpoints_name_the_tensor(checkpoints, tmp_path):
    source = checkpoints["glm"][0]
    tensors = load_file(f"{source}/model.safetensors")
    variants = {
        "missing": (
            {
                k: v
                for k, v in tensors.items()
                if k != "model.layers.1.mlp.experts.5.up_proj.weight"
            },
            "missing 1 tensor(s), first: model.layers.1.mlp.experts.5.up_proj.weight",
        ),
        "unexpected": (
            {**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)},
            "unexpected tensor: model.layers.0.self_attn.extra.weight",
        ),
        "shape": (
            {**tensors, "model.layers.2.mlp.down_proj.weight": torch.zeros(48, 70)},
            "model.layers.2.mlp.down_proj.weight: checkpoint shape (48, 70) does not match the expected (48, 72)",
        ),
        "int32": (
            {
                **tensors,
                "model.layers.1.self_attn.o_proj.weight": tensors[
                    "model.layers.1.self_attn.o_proj.weight"
                ].int(),
            },
            "tensor model.layers.1.self_attn.o_proj.weight: checkpoint dtype I32; expected a floating-point tensor",
        ),
    }
    folders = []
    for name, (content, _) in variants.items():
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(f"{source}/config.json", folder)
        save_file(content, folder / "model.safetensors")
        folders.append(str(folder))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(source, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    errors = spawn(load_broken, 2, folders + [str(corrupt)])[0]
    for (name, (_, fragment)), error in zip(variants.items(), errors):
        assert error is not None and fragment in error, (name, error)
    # the rest is safetensors' own
    assert errors[-1].startswith(
        f"ValueError: {corrupt}/model.safetensors is not a readable safetensors file: Error while deserializing header"
    ), errors[-1]


def test_a_failing_rank_ends_forward_with_one_line(checkpoints, tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoints["glm"][0], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    assert forward_cli(tmp_path, corrupt, [[1, 2]]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("spmoe forward: error: rank"), err
