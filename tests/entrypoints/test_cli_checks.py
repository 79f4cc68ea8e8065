"""Every input of `spmoe generate`, `forward` and `selfcheck` is checked before any rank starts: each bad
input is exactly one line on stderr, exit 1, and no rank is launched (launching fails these tests)."""

import json
import shutil

import pytest
import torch

from spmoe.entrypoints.cli import main


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("a rank was started before the input was checked")

    for target in (
        "spmoe.entrypoints.generate.launch",
        "spmoe.entrypoints.forward.launch",
        "spmoe.entrypoints.cli.spawn",
    ):
        monkeypatch.setattr(target, launched)


def copy_with(checkpoint: str, folder, **config_changes) -> str:
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(folder)


def run(capsys, argv) -> str:
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


GENERATE_CASES = {  # case -> ({option: value, or None for a flag}, the line after "spmoe generate: error: ";
    #                        "..." ends a prefix)
    "output in a missing folder": (
        {"--output": "{tmp}/nowhere/out.json"},
        "--output {tmp}/nowhere/out.json: the folder {tmp}/nowhere does not exist",
    ),
    "output is a folder": (
        {"--output": "{tmp}"},
        "--output {tmp} is a folder; expected a file path",
    ),
    "output in /proc": (
        {"--output": "/proc/version"},
        "--output /proc/version cannot be written: ...",
    ),
    "prompt + new tokens beyond max_position_embeddings": (
        {"--max-new-tokens": "14", "--model": "{short}"},
        "the longest prompt (3 tokens) with 14 new tokens and 0 speculative tokens: 17 positions, more than the "
        "model's max_position_embeddings = 16",
    ),
    "max-model-len beyond max_position_embeddings": (
        {"--max-model-len": "17", "--model": "{short}"},
        "--max-model-len: 17 positions, more than the model's max_position_embeddings = 16",
    ),
    "max-model-len 0": ({"--max-model-len": "0"}, "--max-model-len must be >= 1, got 0"),
    "max-num-seqs 0": ({"--max-num-seqs": "0"}, "--max-num-seqs must be >= 1, got 0"),
    "max-num-seqs -1": ({"--max-num-seqs": "-1"}, "--max-num-seqs must be >= 1, got -1"),
    # 2 ranks x 2 slots x 1e10 positions x (3 x 24 MLA + 2 x 16 indexer values) x 4 B = 1.664e13 B
    "KV cache beyond memory": (
        {"--max-model-len": "10000000000"},
        "the KV cache needs 15497.2 GiB (2 rank(s) x 2 "
        "slots, 1 of them scratch, x 10000000000 positions x 416 B per token), more than "
        "MemAvailable, ...",
    ),
    "zero drafts": (
        {"--speculative": "mtp", "--num-speculative-tokens": "0"},
        "--num-speculative-tokens must be >= 1 (MTP drafts per step), got 0",
    ),
    "zero drafts alone": (
        {"--num-speculative-tokens": "0"},
        "--num-speculative-tokens must be >= 1 (MTP drafts per step), got 0",
    ),
    "drafts alone without an MTP layer": (
        {"--num-speculative-tokens": "2", "--model": "{no_mtp}"},
        "--speculative mtp needs an MTP layer; the checkpoint has num_nextn_predict_layers = 0",
    ),
    "eos id beyond the vocabulary": (
        {"--eos-id": "96"},
        "--eos-id 96 is not a token id: expected an int in [0, 96)",
    ),
    "negative temperature": (
        {"--temperature": "-1"},
        "temperature must be a finite number >= 0 (0 = greedy), got -1.0",
    ),
    "NaN temperature": (
        {"--temperature": "nan"},
        "temperature must be a finite number >= 0 (0 = greedy), got nan",
    ),
    "top-p 0": ({"--temperature": "1", "--top-p": "0"}, "top_p must be in (0, 1], got 0.0"),
    "CUDA graphs on CPU": (
        {"--cuda-graphs": None},
        "--cuda-graphs needs a CUDA device (the model is on cpu)",
    ),
    "CUDA without GPUs": (
        {"--device": "cuda"},
        "--device cuda with 2 ranks needs 2 visible GPU(s), found 0",
    ),
    "config is a JSON list": (
        {"--model": "{list_config}"},
        "a model config must be a JSON object, got a list: [1, 2]",
    ),
    "config field as a string": (
        {"--model": "{string_heads}"},
        "config field num_attention_heads must be an integer >= 1, got '6' (str)",
    ),
    "model is a file": (
        {"--model": "{engine}/model.safetensors"},
        "expected a checkpoint folder with config.json, got the file {engine}/model.safetensors",
    ),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_input_is_checked_before_any_rank_starts(
    case, engine_checkpoint, tmp_path, capsys
):
    if case == "CUDA without GPUs" and torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    extra, expected = GENERATE_CASES[case]
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    paths = dict(
        tmp=tmp_path,
        engine=engine_checkpoint,
        list_config=tmp_path / "list",
        short=copy_with(engine_checkpoint, tmp_path / "short", max_position_embeddings=16),
        string_heads=copy_with(engine_checkpoint, tmp_path / "heads", num_attention_heads="6"),
        no_mtp=copy_with(engine_checkpoint, tmp_path / "no_mtp", num_nextn_predict_layers=0),
    )
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    options = {
        "--model": engine_checkpoint,
        "--tp": "2",
        "--sp": "on",
        "--input-ids": ids,
        "--max-new-tokens": "4",
        "--output": tmp_path / "out.json",
    }
    for option, value in extra.items():  # None: a flag
        options[option] = None if value is None else value.format(**paths)
    line = run(
        capsys,
        ["generate"]
        + [
            x
            for option, value in options.items()
            for x in ((option,) if value is None else (option, value))
        ],
    )
    expected = "spmoe generate: error: " + expected.format(**paths)
    if expected.endswith("..."):
        assert line.startswith(expected[:-3]), line
    else:
        assert line == expected


def test_forward_outputs_and_lengths_are_checked_before_any_rank_starts(
    engine_checkpoint, tmp_path, capsys
):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 2], list(range(20))]))
    short = copy_with(engine_checkpoint, tmp_path / "short", max_position_embeddings=16)
    base = ["forward", "--tp", "2", "--sp", "on", "--input-ids", ids]
    cases = [
        (
            ["--model", engine_checkpoint, "--save-logits", tmp_path / "nowhere" / "l.safetensors"],
            f"--save-logits {tmp_path}/nowhere/l.safetensors: the folder {tmp_path}/nowhere does not exist",
        ),
        (
            [
                "--model",
                engine_checkpoint,
                "--save-logits",
                tmp_path / "l.safetensors",
                "--stats",
                tmp_path / "nowhere" / "s.json",
            ],
            f"--stats {tmp_path}/nowhere/s.json: the folder {tmp_path}/nowhere does not exist",
        ),
        (
            ["--model", short, "--save-logits", tmp_path / "l.safetensors"],
            "the longest sequence: 20 positions, more than the model's max_position_embeddings = 16",
        ),
    ]
    for extra, expected in cases:
        assert run(capsys, base + extra) == f"spmoe forward: error: {expected}"
    assert not (tmp_path / "l.safetensors").exists()


@pytest.mark.parametrize("ranks", [0, -1])
def test_selfcheck_ranks_must_be_positive(ranks, capsys):
    assert (
        run(capsys, ["selfcheck", "--ranks", ranks])
        == f"spmoe selfcheck: error: --ranks must be >= 1, got {ranks}"
    )


def test_outputs_are_written_atomically(tmp_path):
    """A write that fails halfway (a stopped run) leaves the previous file whole and no temporary file; one that
    finishes replaces it, with the permissions a plain write would give."""
    from spmoe.entrypoints.jobs import write_atomically

    out = tmp_path / "out.json"
    out.write_text('{"previous": true}')

    def half_then_fail(path):
        path.write_text('{"outputs": [[1, 2')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(out, half_then_fail)
    assert out.read_text() == '{"previous": true}' and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["out.json"]
    write_atomically(out, lambda path: path.write_text('{"outputs": []}'))
    assert out.read_text() == '{"outputs": []}' and sorted(p.name for p in tmp_path.iterdir()) == [
        "out.json"
    ]
    fresh = tmp_path / "fresh.json"
    write_atomically(fresh, lambda path: path.write_text("{}"))
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    assert fresh.stat().st_mode == plain.stat().st_mode
