"""Rank 0's front end processes: started once the engine is warm, watched from the engine loop,
restarted when one dies, and ended with the server.

Each front end runs `python -m spmoe.entrypoints.serve.frontend`, reads its `FrontEndLaunch`
(pickled) on standard input and connects to the engine's socket under an identity given here, so
that the engine loop knows whose requests to abort when it dies. The front ends share one folder
(mode 0700), made here before the first starts and removed when the server stops: their
Prometheus counters in `metrics/` (`PROMETHEUS_MULTIPROC_DIR`, as prometheus_client's multiprocess
mode wants), so a scrape of any of them totals every front end's, those of a dead one included; and
their stored responses' database (`frontend/response_store.py`), so that a response stored through
one is found through any other, a restarted one included.

A front end that exits with an error (killed, out of memory, a crash) while the server serves is
restarted in its place, with a line on stderr, at most `MAX_RESTARTS` times in `RESTART_WINDOW_S`;
one more failure in that window stops the server. Its clients' connections closed with it (the
kernel resets them), so no client waits on it. A front end that exits 0 drained on a SIGTERM or was
asked to stop: it is not restarted.
"""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from spmoe.entrypoints.serve.wire import EngineFacts, FrontEndLaunch

# restarts of dead front ends the server makes in any `RESTART_WINDOW_S`; one more failure stops it
MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0
# how long a front end may take to exit when rank 0 stops it, before SIGKILL
FRONT_END_EXIT_S = 10.0


@dataclass(frozen=True)
class FrontEndCommand:
    """The front end processes rank 0 starts: `count` of them, each running `target`
    ("module:function", called with the engine client, its launch and the arguments `args` holds;
    see `frontend/process.py`). `args` is pickled (`with_args`) where the command is made and
    unpickled in the front end process alone: the ranks carry it without loading its classes."""

    target: str
    args: bytes = pickle.dumps(())
    count: int = 1

    @classmethod
    def with_args(cls, target: str, *args, count: int = 1) -> "FrontEndCommand":
        return cls(target=target, args=pickle.dumps(args), count=count)


class FrontEnds:
    """The front end processes of one server, by the identity each has on the engine's socket."""

    def __init__(self, command: FrontEndCommand, address: str, facts: EngineFacts):
        self.command, self.address, self.facts = command, address, facts
        self.folder = tempfile.mkdtemp(prefix="spmoe-front-ends-")
        self.metrics_dir = os.path.join(self.folder, "metrics")
        os.mkdir(self.metrics_dir)
        # replaced, never changed in place: the engine loop's watch thread reads it
        self.procs: dict[bytes, subprocess.Popen] = {}
        self.index: dict[bytes, int] = {}
        self.restarts: deque[float] = deque()
        self.started = 0
        # why the front ends stopped the server (they kept dying); None while they serve
        self.failure: str | None = None

    def start(self) -> None:
        for index in range(self.command.count):
            self._start(index, restart=0)

    def _start(self, index: int, restart: int) -> None:
        self.started += 1
        identity = f"front-end-{index}-{self.started}".encode()
        launch = FrontEndLaunch(
            target=self.command.target,
            args=self.command.args,
            address=self.address,
            facts=self.facts,
            engine_pid=os.getpid(),
            shared_dir=self.folder,
            index=index,
            identity=identity,
            restart=restart,
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "spmoe.entrypoints.serve.frontend"],
            stdin=subprocess.PIPE,
            env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir},
        )
        proc.stdin.write(pickle.dumps(launch))
        proc.stdin.close()
        self.procs = {**self.procs, identity: proc}
        self.index[identity] = index

    def replace_dead(self, stopping: bool) -> tuple[list[bytes], str | None]:
        """Look at every front end once: each that exited with an error is restarted in its place
        (not while `stopping`, nor past the restart budget). -> the identities of those that exited
        with an error, and why the server must stop (None: it serves on)."""
        dead = [(i, p) for i, p in self.procs.items() if p.poll() not in (None, 0)]
        for identity, proc in dead:
            self.procs = {i: p for i, p in self.procs.items() if i != identity}
            why = f"the front end process {proc.pid} exited with code {proc.returncode}"
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
                self.restarts.popleft()
            if stopping:
                continue
            if len(self.restarts) >= MAX_RESTARTS:
                self.failure = self.failure or (
                    f"{why}, after {len(self.restarts)} restarts of front ends in "
                    f"{RESTART_WINDOW_S:g} s; stopping the server"
                )
                continue
            self.restarts.append(now)
            print(
                f"spmoe serve: {why}; its open requests end, and a new front end takes its place "
                f"(restart {len(self.restarts)} of at most {MAX_RESTARTS} in "
                f"{RESTART_WINDOW_S:g} s)",
                file=sys.stderr,
                flush=True,
            )
            self._start(self.index[identity], restart=len(self.restarts))
        return [identity for identity, _ in dead], self.failure

    def all_exited(self) -> bool:
        return all(proc.poll() is not None for proc in self.procs.values())

    def dead(self) -> subprocess.Popen | None:
        """A front end that exited with an error and has not been replaced yet (None: none)."""
        return next((p for p in self.procs.values() if p.poll() not in (None, 0)), None)

    def signal(self, signum: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def end(self, grace_s: float) -> None:
        """Each front end may exit on its own for `grace_s` (after a drain, or with the engine's
        error); then one still running gets SIGINT (it ends its requests at once and exits), and
        SIGKILL if it has not exited `FRONT_END_EXIT_S` later. Their shared folder is removed."""
        procs = list(self.procs.values())
        deadline = time.monotonic() + grace_s
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal(signal.SIGINT)
        deadline = time.monotonic() + FRONT_END_EXIT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
