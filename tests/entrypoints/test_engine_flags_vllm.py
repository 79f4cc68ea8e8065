"""vLLM's names and values in EngineArgs: the aliases parse to the same options as spmoe's names,
the speculative config as JSON and as dotted keys, `auto` settled for the device, the dtype and CUDA
graphs, and the options of vLLM's launch lines that cannot apply here noted and dropped."""

import json

import pytest
import torch

from spmoe.engine.args import EngineArgs
from spmoe.entrypoints.cli import DOTTED_OPTIONS, OneLineParser
from spmoe.entrypoints.engine_flags import add_engine_args, engine_args_from_cli
from spmoe.entrypoints.vllm_values import SpeculativeConfig, fold_dotted
from tests.engine.conftest import ENGINE_CONFIG


def parse(argv: list[str], model_dir=None, notes=None) -> EngineArgs:
    parser = OneLineParser(prog="spmoe serve")
    add_engine_args(parser)
    args = parser.parse_args(fold_dotted(argv, DOTTED_OPTIONS))
    return engine_args_from_cli(args, model_dir, notes)


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


def test_speculative_config_lookups_and_hybrids():
    """vLLM's ngram and suffix launch lines as vLLM spells them (dotted keys too), with vLLM's
    defaults, and spmoe's hybrids; each malformed one refused in one line naming what it
    expected."""
    from spmoe.engine.speculation import NgramConfig, Speculation, SuffixConfig

    def speculation(config: dict) -> Speculation:
        return parse(["--speculative-config", json.dumps(config)]).speculation

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 6}
    assert speculation(ngram) == Speculation(
        num_speculative_tokens=4,
        mtp=False,
        lookup=NgramConfig(prompt_lookup_min=6, prompt_lookup_max=6),
    )
    dotted = [
        "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "4",
        "--speculative-config.prompt_lookup_min", "2", "--speculative-config.prompt_lookup_max", "6",
    ]  # fmt: skip
    assert parse(dotted).speculation.lookup == NgramConfig(prompt_lookup_min=2, prompt_lookup_max=6)
    suffix = speculation({"method": "suffix", "suffix_decoding_min_token_prob": 0.2})
    assert suffix == Speculation(
        num_speculative_tokens=24, mtp=False, lookup=SuffixConfig(min_token_prob=0.2)
    )
    hybrid = speculation({"method": "mtp+suffix", "num_speculative_tokens": 5})
    assert (hybrid.mtp_drafts, hybrid.lookup_name) == (5, "suffix")
    assert (
        parse(
            [
                "--speculative-config.method",
                "mtp+ngram",
                "--speculative-config.num_speculative_tokens",
                "3",
            ]
        ).drafts
        == 3
    )
    for config, message in (
        (
            {"method": "ngram"},
            "method 'ngram' needs num_speculative_tokens, an integer >= 1, got None",
        ),
        (
            {"method": "mtp", "prompt_lookup_max": 3},
            "method 'mtp' does not take the key 'prompt_lookup_max'",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min=4, prompt_lookup_max=2",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 2},
            "suffix_decoding_min_token_prob must be in",
        ),
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            "method 'eagle' is not supported; expected one of",
        ),
        ({"method": "mtp+ngram"}, "method 'mtp\\+ngram' needs num_speculative_tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(config)


@pytest.mark.parametrize(
    "argv, device, dropped, note",
    [
        (
            ["--gpu-memory-utilization", "0.9"],
            "cpu",
            "gpu_memory_utilization",
            "--gpu-memory-utilization 0.9: ignored on cpu (a share of GPU memory)",
        ),
        (
            ["--kv-cache-memory", "2", "--gpu-memory-utilization", "0.9"],
            "cuda",
            "gpu_memory_utilization",
            "--gpu-memory-utilization 0.9: ignored: --kv-cache-memory sizes the paged cache",
        ),
        (
            ["--block-size", "16"],
            "cpu",
            "block_size",
            "--block-size 16: spmoe's paged cache has blocks of 64 tokens only",
        ),
    ],
)
def test_what_cannot_apply_here_is_noted_and_dropped(argv, device, dropped, note, monkeypatch):
    """vLLM's launch lines run here: a GPU share on the CPU, a GPU share beside a size in bytes
    (which vLLM also lets win), a block size other than MLA's 64."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    notes = []
    args = parse(argv, notes=notes)
    assert getattr(args, dropped) is None and args.device == device
    assert len(notes) == 1 and notes[0].startswith(note), notes
    assert parse(
        ["--block-size", "64", "--device", "cuda", "--gpu-memory-utilization", "0.9"], notes=notes
    )
    assert len(notes) == 1  # what applies is kept, without a note
    with pytest.raises(ValueError, match="--block-size must be 64, the paged cache's only block"):
        EngineArgs(block_size=16)  # the engine's own options are not a launch line: an error


def test_device_auto_and_vllms_other_devices(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse(["--device", "auto"]).device == "cpu"
    with pytest.raises(SystemExit):
        parse(["--device", "neuron"])
    assert "argument --device: spmoe runs on cuda or cpu, not neuron" in capsys.readouterr().err
