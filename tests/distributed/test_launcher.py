"""The local launcher: results come back in rank order, a failing or dead rank fails fast, never hangs; the
rendezvous listens on loopback only; with `drain_s` a SIGTERM is passed on to rank 0, which may finish."""

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spmoe.config import ParallelConfig
from spmoe.distributed import RankFailed, Stopped, get_parallel_state, spawn
from spmoe.distributed.comm import all_reduce


def rank_and_sum():
    state = get_parallel_state()
    x = torch.tensor([float(state.rank)])
    return state.rank, state.tp_rank, state.dp_rank, all_reduce(x, state.tp_group).item()


def raise_on_rank_1():
    if get_parallel_state().rank == 1:
        raise ValueError("boom on purpose")
    # rank 0 blocks here until it is killed
    all_reduce(torch.ones(1), get_parallel_state().tp_group)


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


def listening_addresses() -> set[str]:
    """Rank 0: the addresses that something listens on at MASTER_PORT (the rendezvous store), from /proc."""
    port, found = int(os.environ["MASTER_PORT"]), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # little-endian 32-bit words
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
                found.add(
                    socket.inet_ntop(
                        socket.AF_INET if len(raw) == 4 else socket.AF_INET6, b"".join(words)
                    )
                )
    return found


def test_rendezvous_listens_on_loopback_only():
    assert spawn(listening_addresses, 2)[0] == {"127.0.0.1"}


def wait_for_sigterm(ready: str) -> bool:
    """Rank 0 writes `ready` once its SIGTERM handler is in place, waits for the signal, then lets rank 1 go.
    -> whether this rank saw a SIGTERM."""
    seen = threading.Event()
    if get_parallel_state().rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: seen.set())
        Path(ready).write_text("ready")
        seen.wait(60)
    dist.barrier()
    return seen.is_set()


@pytest.mark.parametrize("drain_s", [30.0, None])
def test_sigterm_is_passed_on_to_rank_0_when_draining(drain_s, tmp_path):
    ready = tmp_path / "ready"

    def signal_once_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_ready, daemon=True).start()
    if drain_s is None:  # every rank is killed at once
        with pytest.raises(Stopped, match="SIGTERM"):
            spawn(wait_for_sigterm, 2, str(ready))
    else:
        assert spawn(wait_for_sigterm, 2, str(ready), drain_s=drain_s) == [True, False]


def test_results_in_rank_order_with_dp_groups():
    out = spawn(
        rank_and_sum, 4, config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    )
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
        (
            signal.SIGKILL,
            "rank 1 of 2 was killed by SIGKILL (possibly out of memory) before returning a result",
        ),
        (signal.SIGSEGV, "rank 1 of 2 was killed by SIGSEGV before returning a result"),
    ):
        with pytest.raises(RankFailed) as info:
            spawn(kill_rank_1, 2, signum)
        assert str(info.value).splitlines()[0] == first_line
