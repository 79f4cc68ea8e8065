"""The table of vLLM serve flags: refused ones stop the parser with one line and exit status 2, accepted ones
leave a note, and the README links the table's page (docs/vllm-compatibility.md) rather than copying it."""

import argparse
from pathlib import Path

import pytest

from spmoe.entrypoints.vllm_flags import VLLM_FLAGS, add_vllm_flags, markdown_table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spmoe serve")
    p.add_argument("--tp", type=int, default=1)
    add_vllm_flags(p)
    return p


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["-pp", "2"],
            "-pp 2: spmoe does not support pipeline parallelism; for several machines run spmoe under torchrun",
        ),
        (
            ["--distributed-executor-backend", "ray"],
            "--distributed-executor-backend ray: spmoe does not support the ray and external_launcher executors",
        ),
        (
            ["--data-parallel-address", "10.0.0.1"],
            "--data-parallel-address 10.0.0.1: spmoe does not support vLLM's",
        ),
        (
            ["--headless"],
            "--headless: spmoe does not support vLLM's multi-node data parallelism; for several",
        ),
        (
            ["--no-enable-chunked-prefill"],
            "--no-enable-chunked-prefill: spmoe does not support turning chunked",
        ),
        (
            ["--tokenizer-mode", "deepseek_v32"],
            "--tokenizer-mode deepseek_v32: spmoe does not support other tokenizer",
        ),
        (["-O", "3"], "-O 3: spmoe does not support torch.compile"),
    ],
)
def test_a_refused_flag_is_one_line_and_exit_2(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--tp", "2", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spmoe serve: error: {expected}") and err.count("\n") == 1, err


def test_multi_node_refusals_give_the_torchrun_line(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--nnodes", "2"])
    assert "torchrun --nnodes 2 --node-rank R --nproc-per-node 8" in capsys.readouterr().err


def test_accepted_flags_and_values_leave_notes():
    args = parser().parse_args(
        [
            "--trust-remote-code",
            "-pp",
            "1",
            "--distributed-executor-backend",
            "mp",
            "--enable-chunked-prefill",
            "--tp",
            "4",
        ]
    )
    assert args.tp == 4
    assert args.vllm_notes == [
        "--trust-remote-code: accepted: spmoe runs no code from the checkpoint",
        "--enable-chunked-prefill: accepted: always on (prompts longer than --max-num-batched-tokens prefill in "
        "chunks)",
    ]
    assert parser().parse_args([]).vllm_notes == []
    assert not {"trust_remote_code", "pipeline_parallel_size"} & set(
        vars(args)
    )  # nothing else is stored


def test_the_table_is_consistent():
    names = [name for flag in VLLM_FLAGS for name in flag.names]
    assert len(names) == len(set(names))
    for flag in VLLM_FLAGS:
        assert flag.verdict in ("taken", "noted", "refused")
        assert bool(flag.instead) == (flag.verdict == "refused"), flag.names
        assert not flag.declared_here or flag.verdict == "noted"


def test_the_readme_links_the_table_instead_of_copying_it():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "(docs/vllm-compatibility.md)" in readme
    assert markdown_table().splitlines()[0] not in readme
