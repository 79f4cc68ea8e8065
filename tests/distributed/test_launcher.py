"""The local launcher: results come back in rank order, and a failing or dead rank fails fast, never hangs."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from spmoe.config import ParallelConfig
from spmoe.distributed import RankFailed, get_parallel_state, spawn
from spmoe.distributed.comm import all_reduce


def rank_and_sum():
    state = get_parallel_state()
    x = torch.tensor([float(state.rank)])
    return state.rank, state.tp_rank, state.dp_rank, all_reduce(x, state.tp_group).item()


def raise_on_rank_1():
    if get_parallel_state().rank == 1:
        raise ValueError("boom on purpose")
    all_reduce(torch.ones(1), get_parallel_state().tp_group)  # rank 0 blocks here until it is killed


def die_on_rank_1():
    if get_parallel_state().rank == 1:
        os._exit(3)
    all_reduce(torch.ones(1), get_parallel_state().tp_group)


def kill_rank_1(signum: int):
    if get_parallel_state().rank == 1:
        os.kill(os.getpid(), signum)
    all_reduce(torch.ones(1), get_parallel_state().tp_group)


def stall_rank_1():
    if get_parallel_state().rank == 1:
        time.sleep(60)
    all_reduce(torch.ones(1), get_parallel_state().tp_group)


def test_results_in_rank_order_with_dp_groups():
    out = spawn(rank_and_sum, 4, config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
    # TP groups are {0,1} and {2,3}: the all-reduce sums within a group only.
    assert out == [(0, 0, 0, 1.0), (1, 1, 0, 1.0), (2, 0, 1, 5.0), (3, 1, 1, 5.0)]


@pytest.mark.parametrize(
    "fn, message",
    [
        (raise_on_rank_1, "rank 1 of 2 failed: ValueError: boom on purpose"),
        (die_on_rank_1, "rank 1 of 2 exited with code 3 without returning a result"),
    ],
)
def test_failing_rank_fails_fast(fn, message):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1") as info:
        spawn(fn, 2)
    assert str(info.value).splitlines()[0] == message
    assert time.monotonic() - start < 30


def test_collective_timeout_turns_a_stalled_peer_into_an_error():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0") as info:
        spawn(stall_rank_1, 2, timeout_s=3)
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()
    assert time.monotonic() - start < 40


def test_init_distributed_needs_the_torchrun_environment(monkeypatch):
    from spmoe.distributed import init_distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="RANK"):
        init_distributed()
    assert not dist.is_initialized()


def test_a_rank_killed_by_a_signal_is_named():
    """The first line names the signal, with the likely cause for SIGKILL (the OOM killer's signal)."""
    import signal

    for signum, first_line in (
        (signal.SIGKILL, "rank 1 of 2 was killed by SIGKILL (possibly out of memory) before returning a result"),
        (signal.SIGSEGV, "rank 1 of 2 was killed by SIGSEGV before returning a result"),
    ):
        with pytest.raises(RankFailed) as info:
            spawn(kill_rank_1, 2, signum)
        assert str(info.value).splitlines()[0] == first_line
