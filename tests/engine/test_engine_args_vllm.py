"""vLLM's names and values in EngineArgs: the aliases parse to the same options as spmoe's names, the speculative
config as JSON and as dotted keys, `auto` settled for the device, the dtype and CUDA graphs."""

import json

import pytest
import torch

from spmoe.engine.args import EngineArgs
from spmoe.engine.vllm_values import fold_dotted
from spmoe.entrypoints.cli import DOTTED_OPTIONS, OneLineParser
from tests.engine.conftest import ENGINE_CONFIG


def parse(argv: list[str], model_dir=None) -> EngineArgs:
    parser = OneLineParser(prog="spmoe serve")
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli(parser.parse_args(fold_dotted(argv, DOTTED_OPTIONS)), model_dir)


def test_vllm_names_are_aliases():
    ours = parse(["--tp", "2", "--dp", "2", "--max-model-len", "131072", "--kv-cache-dtype", "fp8"])
    for argv in (
        ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--max-model-len", "128K"],
        ["-tp", "2", "-dp", "2", "--max-model-len", "131072"],
    ):
        assert parse([*argv, "--kv-cache-dtype", "fp8_e4m3"]) == ours
    assert parse(["--max-model-len", "128k"]).max_model_len == 128000


def test_speculative_config_json_and_dotted():
    dotted = parse(
        ["--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens", "2"]
    )
    as_json = parse(
        [
            "--speculative-config",
            json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2}),
        ]
    )
    assert (
        dotted.drafts
        == as_json.drafts
        == parse(["--speculative", "mtp", "--num-speculative-tokens", "2"]).drafts
        == 2
    )
    assert parse(["--speculative-config", '{"method": "glm4_moe_mtp"}']).drafts == 1
    with pytest.raises(
        ValueError, match="--speculative-config says what --speculative does; pass one or the other"
    ):
        parse(["--speculative", "mtp", "--speculative-config.method", "mtp"])


def test_auto_device_dtype_and_graphs(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({**ENGINE_CONFIG, "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = parse([], tmp_path)
    assert (on_cpu.device, on_cpu.dtype) == ("cpu", "bfloat16")
    assert parse(["--dtype", "float"], tmp_path).dtype == "float32"
    assert parse(["--hf-overrides", '{"torch_dtype": "float32"}'], tmp_path).dtype == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = parse([], tmp_path)
    assert (on_gpu.device, on_gpu.dtype, on_gpu.cuda_graphs) == ("cuda", "bfloat16", None)
    assert parse(["--device", "cpu"], tmp_path).device == "cpu"
    capturable = type("Model", (), {"graph_capturable": (True, "triton")})()
    syncing = type("Model", (), {"graph_capturable": (False, "torch")})()
    assert on_gpu.use_cuda_graphs(capturable) and not on_gpu.use_cuda_graphs(syncing)
    for argv in (["--enforce-eager"], ["--device", "cpu"]):
        assert not parse(argv, tmp_path).use_cuda_graphs(capturable), argv
    # DP replays graphs too: its ranks agree on each step's graph before the replay (ranks.py)
    assert parse(["--dp", "2"], tmp_path).use_cuda_graphs(capturable)
    assert parse(["--speculative-config.method", "mtp"], tmp_path).use_cuda_graphs(
        capturable
    )  # MTP in graphs too
    assert parse(["--cuda-graphs"], tmp_path).use_cuda_graphs(
        syncing
    )  # asked: the engine then says why not
    assert EngineArgs().cuda_graphs is False and not EngineArgs(device="cuda").use_cuda_graphs(
        capturable
    )
