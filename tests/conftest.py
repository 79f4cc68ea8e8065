"""Fixtures for every test folder: the demo checkpoint's tokenizer (`spmoe.entrypoints.demo`: token
b < 256 is byte b, then 8 special tokens, `<|end|>` the eos) loaded as the server loads one, and a
grammar compiler over it; a tiny checkpoint with an MTP layer (`engine_checkpoint`, of
`tests.engine.conftest.ENGINE_CONFIG`); and `relative_error`, for comparisons of tensors."""

import pytest
import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory) -> str:
    from spmoe.distributed import spawn
    from spmoe.models.deepseek_v32.weights import write_random_checkpoint
    from tests.engine.conftest import ENGINE_CONFIG

    folder = tmp_path_factory.mktemp("engine_ckpt")
    spawn(write_random_checkpoint, 1, ENGINE_CONFIG, folder, 1)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from spmoe.entrypoints.demo import write_demo_tokenizer
    from spmoe.entrypoints.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_demo_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """A GrammarCompiler over the demo tokenizer's 264 tokens."""
    from spmoe.engine.sampling.grammar import GrammarCompiler

    return GrammarCompiler.from_tokenizer(tokenizer, len(tokenizer))
