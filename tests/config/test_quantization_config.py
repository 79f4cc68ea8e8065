"""quantization_config -> the model config's FP8 fields: the DeepSeek / GLM `fp8` form and compressed-tensors FP8
block; which modules each leaves unquantised; every other scheme refused in one line naming it."""

import pytest

from spmoe.config import ModelConfig
from tests.models.deepseek_v32.test_fp8_checkpoints import CONFIG

BLOCK = dict(
    num_bits=8,
    type="float",
    strategy="block",
    block_structure=[128, 128],
    symmetric=True,
    dynamic=False,
)
ACTS = dict(
    num_bits=8, type="float", strategy="group", group_size=128, symmetric=True, dynamic=True
)


def compressed(
    weights=BLOCK, acts=ACTS, ignore=("lm_head", r"re:.*mlp\.gate$", "model.layers.0.mlp.down_proj")
):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
    }


def config(quantization) -> ModelConfig:
    return ModelConfig.from_dict({**CONFIG, "quantization_config": quantization})


def test_compressed_tensors_fp8_block():
    cfg = config(compressed())
    assert cfg.fp8_block_size == (128, 128) and cfg.fp8_scale_suffix == "weight_scale"
    assert cfg.fp8_expected("model.layers.0.self_attn.q_b_proj") is True  # every linear not ignored
    assert cfg.fp8_expected("model.layers.0.mlp.down_proj") is False  # an exact name
    assert cfg.fp8_expected("model.layers.0.mlp.down_proj_extra") is True  # exact: no prefix match
    assert cfg.fp8_expected("model.layers.3.mlp.gate") is False  # a re: pattern


def test_deepseek_fp8_with_modules_to_not_convert():
    cfg = config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["indexer.weights_proj"],
        }
    )
    assert cfg.fp8_scale_suffix == "weight_scale_inv"
    assert cfg.fp8_expected("model.layers.1.self_attn.indexer.weights_proj") is False  # a substring
    assert cfg.fp8_expected("model.layers.1.self_attn.q_b_proj") is None  # the stored dtype decides
    assert config(None).fp8_expected("model.layers.1.self_attn.q_b_proj") is False


@pytest.mark.parametrize(
    "quantization, message",
    [
        (
            compressed(weights={**BLOCK, "strategy": "channel"}),
            "compressed-tensors weights .* are not supported",
        ),
        (compressed(weights={**BLOCK, "num_bits": 4, "type": "int"}), "expected static FP8"),
        (compressed(acts={**ACTS, "dynamic": False}), "input_activations .* expected dynamic FP8"),
        ({**compressed(), "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
        ({**compressed(), "config_groups": {}}, "expected one config group"),
        ({"quant_method": "awq"}, "or compressed-tensors FP8 block"),
    ],
)
def test_other_schemes_are_refused(quantization, message):
    with pytest.raises(ValueError, match=message):
        config(quantization)
