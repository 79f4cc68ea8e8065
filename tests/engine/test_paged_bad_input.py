"""The paged cache's limits, checked before any rank starts: a one-line error naming the limit and
the value for a budget that holds no block, a sequence longer than the whole cache, and options that
do not go together; the same checks for `spmoe serve` on its defaults (settled per device), and the
engine's own check of a request against its cache."""

import json

import pytest

from spmoe.config import ParallelConfig
from spmoe.entrypoints.cli import main

from .conftest import ENGINE_CONFIG

# the engine checkpoint without MTP: 3 layers of 16 + 8 float32 values, indexer keys of 16 on 2 of
# them
BYTES_PER_TOKEN = 3 * 24 * 4 + 2 * 16 * 4
TWO_BLOCKS_GIB = 2 * 64 * BYTES_PER_TOKEN / 2**30


@pytest.mark.parametrize(
    "case, extra, fragment",
    [
        (
            "budget below one block",
            ["--kv-cache-memory", "1e-6"],
            f"--kv-cache-memory 1e-06 GiB holds no block: one block of 64 tokens in each of the 3 attention layers "
            f"takes "
            f"{64 * BYTES_PER_TOKEN} B",
        ),
        (
            "sequence longer than the cache",
            ["--kv-cache-memory", str(TWO_BLOCKS_GIB)],
            f"a sequence needs 134 KV cache positions (prompt, new tokens and drafts); "
            f"--kv-cache-memory {TWO_BLOCKS_GIB} "
            f"GiB holds 128 tokens in all",
        ),
        (
            "GPU share beyond the GPU",
            ["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization must be a fraction in (0, 1], got 1.5",
        ),
        (
            "FP8 on the dense cache",
            ["--kv-cache", "dense", "--kv-cache-dtype", "fp8"],
            "--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged cache; got them with "
            "--kv-cache dense",
        ),
        (
            "zero token budget",
            ["--max-num-batched-tokens", "0"],
            "--max-num-batched-tokens must be >= 1, got 0",
        ),
        (
            "NaN budget",
            ["--kv-cache-memory", "nan"],
            "--kv-cache-memory must be a finite number of GiB > 0, got nan",
        ),
        (
            "infinite budget",
            ["--kv-cache-memory", "inf"],
            "--kv-cache-memory must be a finite number of GiB > 0, got inf",
        ),
        (
            "negative budget",
            ["--kv-cache-memory", "-2"],
            "--kv-cache-memory must be a finite number of GiB > 0, got -2.0",
        ),
    ],
)
def test_generate_rejects(case, extra, fragment, engine_checkpoint, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([list(range(1, 91)) + list(range(1, 41))]))  # 130 tokens
    code = main(
        [
            "generate",
            "--model",
            engine_checkpoint,
            "--tp",
            "1",
            "--input-ids",
            str(ids),
            "--max-new-tokens",
            "4",
            "--output",
            str(tmp_path / "out.json"),
            *extra,
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("spmoe generate: error: ") and fragment in err[-1], (
        case,
        err,
    )


def test_serve_checks_the_budget(engine_checkpoint):
    from spmoe.engine.args import EngineArgs
    from spmoe.entrypoints.serve.engine.rank import check_serve

    with pytest.raises(ValueError, match="--kv-cache-memory 1e-06 GiB holds no block"):
        check_serve(engine_checkpoint, EngineArgs(kv_cache_memory=1e-6))
    # the settled default max_model_len (2048 on the CPU: the config states no
    # max_position_embeddings)
    with pytest.raises(ValueError) as e:
        check_serve(engine_checkpoint, EngineArgs(kv_cache_memory=TWO_BLOCKS_GIB))
    assert str(e.value) == (
        f"a sequence needs 2048 KV cache positions (prompt, new tokens and drafts); --kv-cache-memory "
        f"{TWO_BLOCKS_GIB} GiB holds 128 tokens in all: raise --kv-cache-memory or ask for fewer positions with "
        f"--max-model-len"
    )
    args, waiting = check_serve(
        engine_checkpoint, EngineArgs(kv_cache_memory=TWO_BLOCKS_GIB, max_model_len=128)
    )
    assert (args.max_num_seqs, args.max_model_len, waiting) == (8, 128, 64)
    assert check_serve(engine_checkpoint, EngineArgs(max_num_seqs=2), max_num_waiting=7)[1] == 7
    with pytest.raises(ValueError, match="--max-num-waiting must be >= 1, got 0"):
        check_serve(engine_checkpoint, EngineArgs(), max_num_waiting=0)


@pytest.mark.parametrize(
    "device, positions, given, expected",
    [
        # (max_num_seqs, max_model_len) given, None: left to the default -> with max_num_waiting's
        # default
        (
            "cuda",
            202752,
            (None, None),
            (256, 202752, 1024),
        ),  # a GPU: vLLM's 256 and the whole context
        (
            "cpu",
            202752,
            (None, None),
            (8, 2048, 64),
        ),  # the CPU: small, the paged cache sized from them
        ("cpu", 1000, (None, None), (8, 1000, 64)),
        ("cuda", None, (None, None), (256, 2048, 1024)),  # no stated context: 2048
        ("cuda", 202752, (3, 100), (3, 100, 64)),  # the flags win; the waiting queue at least 64
        ("cuda", 202752, (100, None), (100, 202752, 400)),
        ("cpu", 4096, (32, 4096), (32, 4096, 128)),
    ],
)
def test_serve_defaults_settle_per_device(device, positions, given, expected):
    """`for_model` and `default_max_num_waiting` are pure: "cuda" needs no GPU here."""
    from spmoe.config import ModelConfig
    from spmoe.engine.args import EngineArgs
    from spmoe.entrypoints.serve.engine.rank import default_max_num_waiting, for_model

    cfg = ModelConfig.from_dict({**ENGINE_CONFIG, "max_position_embeddings": positions})
    max_num_seqs, max_model_len = given
    args = for_model(
        EngineArgs(device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len), cfg
    )
    assert (args.max_num_seqs, args.max_model_len, default_max_num_waiting(args)) == expected
    assert args.device == device


def test_serve_waiting_default_counts_every_dp_group():
    from spmoe.config import ModelConfig
    from spmoe.engine.args import EngineArgs
    from spmoe.entrypoints.serve.engine.rank import default_max_num_waiting, for_model

    args = for_model(EngineArgs(device="cuda", dp=2), ModelConfig.from_dict(ENGINE_CONFIG))
    assert default_max_num_waiting(args) == 2048  # 4 x 256 running in each of 2 groups


def engine_rejects(folder: str) -> str:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.request import Request
    from spmoe.models.deepseek_v32.weights import load_model

    model = load_model(folder, ParallelConfig(tensor_parallel_size=1))
    engine = Engine(model, PagedKVCache.for_model(model, 2 * 64 * BYTES_PER_TOKEN))
    try:
        engine.add_request(Request("long", list(range(1, 91)) + list(range(1, 41)), 4))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_engine_rejects_a_request_the_cache_cannot_hold(engine_checkpoint):
    from spmoe.distributed import spawn

    assert spawn(engine_rejects, 1, engine_checkpoint)[0] == (
        "request 'long': the prompt has 130 tokens; with max_new_tokens=4 and 0 speculative tokens it needs 134 KV "
        "cache positions, the cache holds 128 per sequence"
    )


def test_view_rejects_block_ids_outside_the_cache():
    """A block table naming a block the cache does not have is an error, before any kernel reads or
    writes it."""
    import torch

    from spmoe.config import ModelConfig
    from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache, token_bytes

    cfg = ModelConfig.from_dict(ENGINE_CONFIG)
    cache = PagedKVCache(
        cfg,
        {0: True},
        3 * BLOCK_SIZE * token_bytes(cfg, {0: True}, torch.float32, "auto"),
        torch.float32,
        "cpu",
    )
    # 3: the scratch
    assert cache.view([[2, 0], [1]], [0, 0], [70, 5]).block_tables.tolist() == [
        [2, 0],
        [1, 3],
    ]
    for tables in ([[4]], [[0, 7]], [[-1]]):
        with pytest.raises(
            ValueError, match=r"block ids must be in \[0, 3\] \(the cache's 3 blocks"
        ):
            cache.view(tables, [0], [1])
