"""The engine's options on the command line (`engine_flags.py`) into `EngineArgs`: one declaration
of the options, the same flags and rules in `generate` and `serve`."""

import argparse
import re
from dataclasses import fields

import pytest

from spmoe.engine.args import EngineArgs
from spmoe.entrypoints.cli import main
from spmoe.entrypoints.engine_flags import ENGINE_FLAGS, add_engine_args, engine_args_from_cli


def parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from_cli(parser.parse_args(argv))


def test_every_field_has_its_flag_named_as_the_engine_names_it():
    """The command line covers the engine's options one for one, in their order, and each option's
    first flag is the one the engine's errors name (`EngineArgs.flag`)."""
    assert list(ENGINE_FLAGS) == [f.name for f in fields(EngineArgs)]
    assert [flag.names[0] for flag in ENGINE_FLAGS.values()] == [
        EngineArgs.flag(name) for name in ENGINE_FLAGS
    ]
    with pytest.raises(ValueError, match=r"^--ep-backend must be one of \('allgather"):
        EngineArgs(ep_backend="nccl")


def test_flags_fill_the_fields():
    assert parse([]) == EngineArgs()  # the flags' defaults are the dataclass's
    got = parse(
        "--tp 2 --dp 3 --sp on --sp-scope all --ep-backend all_to_all --dtype bfloat16 --max-num-seqs 4 "
        "--max-model-len 100 --max-num-batched-tokens 64 --kv-cache-memory 0.5 --kv-cache-dtype fp8 "
        "--speculative mtp --num-speculative-tokens 2".split()
    )
    assert (got.tp, got.dp, got.sp, got.sp_scope, got.ep_backend, got.dtype) == (
        2,
        3,
        "on",
        "all",
        "all_to_all",
        "bfloat16",
    )
    assert (got.max_num_seqs, got.max_model_len, got.max_num_batched_tokens) == (4, 100, 64)
    assert (got.kv_cache_memory, got.kv_cache_dtype, got.drafts) == (0.5, "fp8", 2)
    parallel = got.parallel_config()
    assert (parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.sp_scope) == (
        2,
        3,
        "all",
    )
    assert parse(["--speculative", "mtp"]).drafts == 1 and parse([]).drafts == 0
    # vLLM 0.7's form: the drafts alone draft with the checkpoint's MTP layer
    assert parse(["--num-speculative-tokens", "3"]).drafts == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (
            ["--speculative", "mtp", "--num-speculative-tokens", "0"],
            "--num-speculative-tokens must be >= 1 (MTP drafts per step), got 0",
        ),
        (
            ["--kv-cache", "dense", "--kv-cache-dtype", "fp8"],
            "size the paged cache; got them with --kv-cache dense",
        ),
    ],
)
def test_one_rule_for_every_command(argv, message, capsys):
    """The same bad options are the same one-line error from `generate` and `serve` (before any
    checkpoint is read: these need none)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(argv)
    for command in (
        ["serve"],
        ["generate", "--model", "m", "--input-ids", "i", "--max-new-tokens", "1", "--output", "o"],
    ):
        assert main(command + argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith(f"spmoe {command[0]}: error: ")
            and message in err[0]
        ), err
