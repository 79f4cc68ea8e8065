"""Run a function on N local ranks and collect what each returns.

`spawn(fn, world_size, *args)` starts `world_size` fresh processes, sets the torchrun environment in
each, initialises the process groups, calls `fn(*args)` and returns the list of per-rank results
(rank order). If a rank raises, or dies without a result, the other ranks are killed at once and
`RankFailed` carries that rank's traceback to the caller. It never waits on a dead rank.

No rank outlives the process that spawned it:
- a rank asks Linux to SIGKILL it when the thread that spawned it ends (`PR_SET_PDEATHSIG`; the
  parent's death included), and a watchdog thread in the rank polls its parent's pid as well (for a
  parent that died before the request took effect, and on systems without it);
- while `spawn` waits, SIGTERM and SIGINT in the parent raise `Stopped`: every rank is killed before
  it propagates. The ranks ignore SIGINT, so a Ctrl-C (sent to the whole process group) reaches the
  parent only. With `drain_s` a first SIGTERM is passed on to rank 0 instead (a server drains its
  requests), and the ranks get `drain_s` seconds to return before they are killed; a second signal
  kills them at once.

`launch(fn, world_size, *args)` is what the command line uses: under torchrun (one process per rank,
on one or many machines) it runs `fn` in this process, with torchrun's signal handling left as it is
(its agent sends SIGTERM, then SIGKILL, to its workers); otherwise it spawns local ranks.
"""

import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from spmoe.config import ParallelConfig
from spmoe.distributed.groups import DEFAULT_TIMEOUT_S, destroy_distributed, init_distributed

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCHDOG_PERIOD_S = 0.5


class RankFailed(RuntimeError):
    """A spawned rank raised or died; the message holds which rank and its traceback."""


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT reached the parent while its ranks ran; every rank was killed. A
    KeyboardInterrupt, so that no `except Exception` on the way swallows it and whatever stops on
    Ctrl-C (pytest) stops on it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """In a rank: be killed when the parent dies, by the kernel (Linux) and by a watchdog thread."""
    # the parent turns a Ctrl-C into killing every rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="spmoe-parent-watchdog", daemon=True).start()


def _child(parent_pid, rank, world_size, port, fn, args, config, device, timeout_s, results):
    _die_with_parent(parent_pid)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_distributed(config, device=device, timeout_s=timeout_s)
        out = fn(*args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def spawn(
    fn,
    world_size: int,
    *args,
    config: ParallelConfig | None = None,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    drain_s: float | None = None,
) -> list:
    """Run `fn(*args)` on `world_size` local ranks; return each rank's result, rank 0 first.

    `fn` must be importable by name (a module-level function). `config` defaults to TP over all
    ranks. `timeout_s` bounds every collective inside `fn`. `drain_s`: a SIGTERM goes to rank 0,
    which (with the others) then has that long to return; None: a SIGTERM kills every rank at once.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            daemon=True,
            args=(os.getpid(), r, world_size, port, fn, args, config, device, timeout_s, results),
        )
        for r in range(world_size)
    ]
    drain = _Drain(procs[0], drain_s)
    with _stop_on_signals(drain):
        return _run(procs, results, world_size, drain)


class _Drain:
    """A SIGTERM passed on to rank 0 (`spawn`'s `drain_s`), and how long the ranks then have."""

    def __init__(self, rank0, seconds: float | None):
        self.rank0, self.seconds, self.deadline = rank0, seconds, None

    def begin(self) -> bool:
        """-> True if the SIGTERM was passed on to rank 0 (the first one, with `seconds` set,
        rank 0 running)."""
        if self.seconds is None or self.deadline is not None or self.rank0.pid is None:
            return False
        os.kill(self.rank0.pid, signal.SIGTERM)
        self.deadline = time.monotonic() + self.seconds
        return True

    def check(self) -> None:
        """During a drain: raise `Stopped` once its time is over, or when rank 0 has died of
        the SIGTERM."""
        if self.deadline is None:
            return
        if time.monotonic() > self.deadline or self.rank0.exitcode == -signal.SIGTERM:
            raise Stopped(signal.SIGTERM)


def _run(procs, results, world_size: int, drain: _Drain) -> list:
    """Start the ranks, collect their results; kill every rank still alive on the way out,
    however it ends."""
    outputs: dict[int, object] = {}
    errors: dict[int, str] = {}  # rank -> traceback, or how it died (`_death`)
    died: set[int] = set()  # ranks that ended without reporting
    try:
        for p in procs:
            p.start()
        while len(outputs) < world_size and not errors:
            drain.check()
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and p.exitcode is not None:
                        errors[r] = _death(p.exitcode)
                        died.add(r)
                continue
            (outputs if ok else errors)[rank] = pickle.loads(payload) if ok else payload
        if errors:
            _settle(procs, results, outputs, errors, died)
            drain.check()
            raise RankFailed(_describe(errors, died, world_size))
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join()
    return [outputs[r] for r in range(world_size)]


@contextmanager
def _stop_on_signals(drain: _Drain):
    """SIGTERM and SIGINT raise `Stopped` once (a second signal during the cleanup is absorbed),
    except a first SIGTERM that `drain` passes on to rank 0; the previous handlers come back
    afterwards. Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def stop(signum, frame):
        if signum == signal.SIGTERM and not received and drain.begin():
            return
        received.append(signum)
        if len(received) == 1:
            raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _settle(procs, results, outputs, errors, died, grace_s: float = 1.0):
    """After a first failure, wait briefly for the other ranks' reports: a rank that died often
    makes its peers fail too, and the dead rank is the one to blame."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and len(outputs) + len(errors) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.05)
            (outputs if ok else errors)[rank] = pickle.loads(payload) if ok else payload
        except queue.Empty:
            pass
    for r, p in enumerate(procs):
        if r not in outputs and r not in errors and p.exitcode not in (None, 0):
            errors[r] = _death(p.exitcode)
            died.add(r)


def _death(exitcode: int) -> str:
    """How a rank that reported nothing ended: its exit code, or the signal that killed it
    (multiprocessing gives -N for signal N). The kernel's OOM killer sends SIGKILL,
    hence the hint."""
    if exitcode >= 0:
        return f"exited with code {exitcode} without returning a result"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    hint = " (possibly out of memory)" if -exitcode == signal.SIGKILL else ""
    return f"was killed by {name}{hint} before returning a result"


def _describe(errors: dict[int, str], died: set[int], world_size: int) -> str:
    """First line: the root cause in one line: a rank that died
    (`rank 1 of 2 was killed by SIGKILL ...`), else the first rank to report an error
    (`rank 1 of 2 failed: ValueError: ...`; its peers usually fail after it, with
    connection errors)."""
    dead = [r for r in errors if r in died]
    first = dead[0] if dead else next(iter(errors))
    reason = errors[first].strip().splitlines()[-1]
    details = "\n".join(
        f"--- rank {r} of {world_size}:\n{errors[r].strip()}" for r in sorted(errors)
    )
    return f"rank {first} of {world_size} {reason if dead else 'failed: ' + reason}\n{details}"


def launch(
    fn,
    world_size: int,
    *args,
    config: ParallelConfig | None = None,
    device: str = "cpu",
    drain_s: float | None = None,
):
    """Run `fn(*args)` on every rank; return rank 0's result (None on the other ranks under
    torchrun). `drain_s`: see `spawn` (under torchrun the agent's SIGTERM reaches every rank
    itself). A `config.simulate_rank` runs rank 0 alone, in one process
    (`spmoe.distributed.simulated`)."""
    if config is not None and config.simulate_rank:
        world_size = 1
    if "WORLD_SIZE" not in os.environ:
        return spawn(fn, world_size, *args, config=config, device=device, drain_s=drain_s)[0]
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes; the parallel config "
            f"needs {world_size}"
        )
    init_distributed(config, device=device)
    try:
        result = fn(*args)
    finally:
        destroy_distributed()
    return result if int(os.environ["RANK"]) == 0 else None
