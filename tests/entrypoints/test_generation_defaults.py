"""--generation-config: the model's generation_config.json as the default of every sampling field a request
leaves out."""

import json

import pytest

from spmoe.entrypoints.generation_defaults import GenerationDefaults

GENERATION_CONFIG = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 77,
    "do_sample": True,
    "eos_token_id": [3],
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return tmp_path


def test_auto_reads_the_model_folder(model_dir):
    defaults = GenerationDefaults.load("auto", model_dir)
    assert defaults.values == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 77,
    }
    assert defaults.describe() == (
        f"generation defaults from {model_dir / 'generation_config.json'}: temperature=0.6, top_p=0.95, top_k=40, "
        "min_p=0.05, repetition_penalty=1.1, max_tokens=77 (a request's own fields win)"
    )


def test_a_request_s_own_fields_win(model_dir):
    defaults = GenerationDefaults.load("auto", model_dir)
    request = {"temperature": 0.0, "top_p": 1.0, "max_tokens": None, "seed": 5}
    applied = defaults.apply(request, given={"temperature", "seed"})
    assert applied["temperature"] == 0.0 and applied["seed"] == 5  # sent by the client
    assert (
        applied["top_p"] == 0.95 and applied["max_tokens"] == 77 and applied["top_k"] == 40
    )  # left out


def test_vllm_ignores_the_file_and_a_folder_is_read_from_there(model_dir, tmp_path_factory):
    assert GenerationDefaults.load("vllm", model_dir).values == {}
    assert "none from the model" in GenerationDefaults.load("vllm", model_dir).describe()
    elsewhere = tmp_path_factory.mktemp("other")
    assert GenerationDefaults.load("auto", elsewhere).values == {}  # auto: a model without the file
    assert GenerationDefaults.load(str(model_dir), elsewhere).values["top_k"] == 40
    with pytest.raises(
        ValueError, match="expected a folder with generation_config.json, found none"
    ):
        GenerationDefaults.load(str(elsewhere), model_dir)


def test_overrides_and_bad_values(model_dir):
    defaults = GenerationDefaults.load("auto", model_dir, {"temperature": 1.0, "max_new_tokens": 5})
    assert defaults.values["temperature"] == 1.0 and defaults.values["max_tokens"] == 5
    assert defaults.values["top_p"] == 0.95
    assert GenerationDefaults.load("vllm", model_dir, {"top_k": 2}).values == {"top_k": 2}
    with pytest.raises(ValueError, match="'num_beams' is not one spmoe applies"):
        GenerationDefaults.load("auto", model_dir, {"num_beams": 2})
    for name, bad in (
        ("top_p", 0),
        ("temperature", -1),
        ("max_new_tokens", 0),
        ("top_k", 2.5),
        ("min_p", "x"),
    ):
        (model_dir / "generation_config.json").write_text(json.dumps({name: bad}))
        with pytest.raises(ValueError, match=f"{name} = {bad!r} is out of range"):
            GenerationDefaults.load("auto", model_dir)
    (model_dir / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        GenerationDefaults.load("auto", model_dir)
