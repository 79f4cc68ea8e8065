"""vLLM's value syntax: lengths with suffixes, the speculative config as JSON and dotted keys,
--hf-overrides merged into the model config, and vLLM's dtype names."""

import json

import pytest

from spmoe.config import ModelConfig
from spmoe.entrypoints.vllm_values import (
    SpeculativeConfig,
    block_size_note,
    check_quantization,
    fold_dotted,
    parse_device,
    parse_json_object,
    parse_kv_cache_dtype,
    parse_length,
    resolve_dtype,
    served_model_names,
)
from tests.engine.conftest import ENGINE_CONFIG


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2048", 2048),
        ("1k", 1000),
        ("1K", 1024),
        ("128k", 128000),
        ("128K", 131072),
        ("25.6k", 25600),
        ("1m", 1000000),
        ("1M", 1048576),
        (" 64 ", 64),
        ("0", 0),
    ],
)
def test_lengths_with_suffixes(text, expected):
    assert parse_length(text) == expected


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("1.5K", "a fraction needs a decimal suffix"),
        ("1.0005k", "not a whole number"),
        ("12x", "expected an integer"),
        ("-5", "expected an integer"),
        ("", "expected an integer"),
    ],
)
def test_bad_lengths_name_the_option(text, complaint):
    with pytest.raises(ValueError, match=complaint) as e:
        parse_length(text)
    assert str(e.value).startswith("--max-model-len: ") and "\n" not in str(e.value)


SPEC = "--speculative-config"


def test_dotted_keys_fold_into_one_json_option():
    argv = [
        "m",
        "--tp",
        "2",
        f"{SPEC}.method",
        "mtp",
        f"{SPEC}.num_speculative_tokens=1",
        "--port",
        "8",
    ]
    folded = fold_dotted(argv, (SPEC, "--hf-overrides"))
    assert folded[:3] == ["m", "--tp", "2"] and folded[5:] == ["--port", "8"]
    assert folded[3] == SPEC and json.loads(folded[4]) == {
        "method": "mtp",
        "num_speculative_tokens": 1,
    }


def test_json_and_dotted_forms_merge_in_order():
    argv = [
        f"{SPEC}={json.dumps({'method': 'eagle', 'num_speculative_tokens': 3})}",
        "--hf-overrides.rope_scaling.factor",
        "4.0",
        f"{SPEC}.method",
        "deepseek_mtp",
        "--hf-overrides",
        '{"rope_scaling": {"type": "yarn"}, "num_hidden_layers": 2}',
    ]
    folded = fold_dotted(argv, (SPEC, "--hf-overrides"))
    assert folded[0] == SPEC and json.loads(folded[1]) == {
        "method": "deepseek_mtp",
        "num_speculative_tokens": 3,
    }
    assert folded[2] == "--hf-overrides"
    assert json.loads(folded[3]) == {
        "rope_scaling": {"factor": 4.0, "type": "yarn"},
        "num_hidden_layers": 2,
    }
    assert len(folded) == 4


def test_dotted_form_errors():
    with pytest.raises(ValueError, match="expected a value after it"):
        fold_dotted([f"{SPEC}.method"], (SPEC,))
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        fold_dotted([SPEC, "[1]"], (SPEC,))
    with pytest.raises(ValueError, match="non-empty key"):
        fold_dotted([f"{SPEC}..method", "mtp"], (SPEC,))


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp", "glm4_moe_mtp"])
def test_mtp_methods(method):
    assert (
        SpeculativeConfig.parse(
            {"method": method, "num_speculative_tokens": 2}
        ).num_speculative_tokens
        == 2
    )
    assert SpeculativeConfig.parse({"method": method}).num_speculative_tokens == 1
    assert (
        SpeculativeConfig.parse(
            {"method": method, "model": "org/m"}, "org/m"
        ).num_speculative_tokens
        == 1
    )


@pytest.mark.parametrize(
    "config, complaint",
    [
        (
            {"method": "mtp", "draft_tensor_parallel_size": 1},
            "spmoe does not support the key 'draft_tensor_parallel_size'",
        ),
        ({"method": "eagle3"}, "method 'eagle3' is not supported"),
        ({"num_speculative_tokens": 1}, "method None is not supported"),
        ({"method": "mtp", "model": "other/draft"}, "separate draft model"),
        (
            {"method": "mtp", "num_speculative_tokens": 0},
            "method 'mtp' needs num_speculative_tokens, an integer >= 1, got 0",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": "2"},
            "method 'mtp' needs num_speculative_tokens, an integer >= 1, got '2'",
        ),
    ],
)
def test_speculative_config_refusals_are_one_line(config, complaint):
    with pytest.raises(ValueError, match=complaint) as e:
        SpeculativeConfig.parse(config, "org/m")
    assert str(e.value).startswith(f"{SPEC}: ") and "\n" not in str(e.value)


def test_kv_cache_dtype_names():
    assert [parse_kv_cache_dtype(t) for t in ("auto", "fp8", "fp8_e4m3")] == ["auto", "fp8", "fp8"]
    with pytest.raises(ValueError, match="spmoe's FP8 cache is e4m3"):
        parse_kv_cache_dtype("fp8_e5m2")


def test_dtype_auto():
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cuda") == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cpu") == "float32"
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, "cpu") == "bfloat16"
    assert resolve_dtype("auto", {}, "cpu") == "float32"
    assert resolve_dtype("float", {"torch_dtype": "bfloat16"}, "cpu") == "float32"
    with pytest.raises(
        ValueError, match="expected one of auto, bfloat16, float32, float, got 'float64'"
    ):
        resolve_dtype("float64", {}, "cpu")
    # float16 is refused in one line naming bfloat16 (docs/vllm-compatibility.md: why)
    for half in ("float16", "half"):
        with pytest.raises(
            ValueError, match=rf"^--dtype: .* float16 \({half}\): .* use --dtype bfloat16"
        ):
            resolve_dtype(half, {}, "cpu")


def test_device_names():
    assert [parse_device(t) for t in ("auto", "cpu", "cuda")] == [None, "cpu", "cuda"]
    with pytest.raises(ValueError, match="^--device: spmoe runs on cuda or cpu, not tpu"):
        parse_device("tpu")


def test_served_model_names():
    assert served_model_names(None, "org/m") == ["org/m"]
    assert served_model_names(["glm-5.2", "glm", "glm-5.2"], "org/m") == ["glm-5.2", "glm"]
    with pytest.raises(ValueError, match="must not be empty"):
        served_model_names(["a", " "], "org/m")


def test_hf_overrides_merge_into_the_model_config(tmp_path):
    config = {**ENGINE_CONFIG, "rope_scaling": {"rope_type": "default", "keep": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    overrides = parse_json_object(
        '{"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"], "indexer_types": ["full", "full"]}',
        "--hf-overrides",
    )
    cfg = ModelConfig.from_file(tmp_path, overrides)
    assert (cfg.num_hidden_layers, cfg.mlp_layer_types, cfg.indexer_types) == (
        2,
        ("dense", "sparse"),
        ("full", "full"),
    )
    assert ModelConfig.from_file(tmp_path).num_hidden_layers == ENGINE_CONFIG["num_hidden_layers"]
    with pytest.raises(
        ValueError, match="mlp_layer_types must list"
    ):  # the merged config is validated
        ModelConfig.from_file(tmp_path, {"num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"--hf-overrides: expected a JSON object, got '\{bad' "):
        parse_json_object("{bad", "--hf-overrides")


def test_quantization_only_as_the_checkpoint_declares_it():
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    check_quantization("fp8", fp8)
    check_quantization(None, {})
    with pytest.raises(
        ValueError,
        match="^--quantization fp8: spmoe does not quantize at load time and the checkpoint is",
    ):
        check_quantization("fp8", {})
    with pytest.raises(
        ValueError, match="--quantization awq: .* the checkpoint declares fp8; leave the flag out$"
    ):
        check_quantization("awq", fp8)


def test_block_size_other_than_64_is_noted():
    assert block_size_note(64) == block_size_note(None) == ""
    assert block_size_note(16).startswith(
        "--block-size 16: spmoe's paged cache has blocks of 64 tokens only"
    )
