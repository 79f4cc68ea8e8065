"""A front end process of `spmoe serve`, started as rank 0 starts it but against an engine socket
held here (no ranks, no model): its start-up time (the process started -> it listens and says hello
to the engine), its resident memory then (RSS, and the peak), and whether torch and spmoe's layers
are in the process (read from its /proc maps: torch's shared library); then `--restarts` times,
against a real `spmoe serve` on the demo checkpoint, how long a killed front end takes to be
replaced (SIGKILL -> /health answers 200 again), and how long after the death past the restart
budget the server command exits. Medians of `--reps`.

    python benchmarks/bench_front_end.py --reps 5
"""

import argparse
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq

from spmoe.distributed.launcher import free_port
from spmoe.engine.request import EngineMetrics
from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.entrypoints.serve.engine.front_ends import MAX_RESTARTS
from spmoe.entrypoints.serve.frontend.process import FrontEndOptions
from spmoe.entrypoints.serve.wire import (
    Codec,
    EngineFacts,
    FromEngine,
    FrontEndLaunch,
    PrivateAddress,
)

FRONT_END = [sys.executable, "-m", "spmoe.entrypoints.serve.frontend"]


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def maps_torch(pid: int) -> bool:
    """Whether torch's shared library is mapped into `pid`."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def launch_here(
    tokenizer: str, address: PrivateAddress, port: int, max_num_waiting: int
) -> FrontEndLaunch:
    """What rank 0 hands a front end: serve `tokenizer`'s byte vocabulary on `port`, against an
    engine socket at `address` in this process (its folder the front end's shared one), as front
    end 1 (it prints no ready line)."""
    facts = EngineFacts(
        max_model_len=2048,
        max_num_waiting=max_num_waiting,
        vocab_size=264,
        eos_token_ids=(),
        num_speculative_tokens=0,
    )
    options = FrontEndOptions(tokenizer, ["bench"], "127.0.0.1", port)
    return FrontEndLaunch(
        target="spmoe.entrypoints.serve.frontend.process:serve_http",
        args=pickle.dumps((options,)),
        address=address.url,
        identity=b"bench",
        facts=facts,
        engine_pid=os.getpid(),
        shared_dir=address.folder,
        index=1,
    )


def hello_from(engine: zmq.Socket) -> bytes:
    """Wait for a front end's hello on `engine` (up to 120 s). -> its identity."""
    if not engine.poll(120_000):
        raise RuntimeError("the front end did not say hello in 120 s")
    peer, _ = engine.recv_multipart()
    return peer


def start_once(tokenizer: str, port: int) -> dict:
    """One front end against an engine socket here. -> its start-up seconds, memory, torch."""
    address, codec = PrivateAddress(), Codec()
    engine = zmq.Context.instance().socket(zmq.ROUTER)
    engine.bind(address.url)
    launch = launch_here(tokenizer, address, port, 64)
    began = time.perf_counter()
    proc = subprocess.Popen(FRONT_END, stdin=subprocess.PIPE)
    try:
        proc.stdin.write(pickle.dumps(launch))
        proc.stdin.close()
        peer = hello_from(engine)
        seconds = time.perf_counter() - began
        rss, peak = memory_kib(proc.pid)
        torch = maps_torch(proc.pid)
        hello = FromEngine(outputs=[], metrics=EngineMetrics(), front_ends=1)
        engine.send_multipart((peer, codec.encode(hello)))
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.close()
        address.remove()
    return {"start_s": seconds, "rss_mib": rss / 1024, "peak_mib": peak / 1024, "torch": torch,
            "health": health}  # fmt: skip


def front_ends_of(pid: int) -> list[int]:
    """The live front end processes under `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = Path(stat.parent, "cmdline").read_bytes()
        except OSError:
            continue
        if (
            fields[0] != "Z"
            and b"serve.frontend" in cmdline
            and is_below(int(stat.parent.name), pid)
        ):
            found.append(int(stat.parent.name))
    return found


def is_below(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def restarts(model: str, log: Path) -> dict:
    """A server on the demo checkpoint; its front end killed `MAX_RESTARTS` + 1 times. -> the
    seconds from each of the first kills to /health 200 again, and from the last kill to the
    command's exit."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "spmoe", "serve", model, "--port", str(port)],
            stdout=err,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 600
        while not healthy(base):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        replaced = []
        for _ in range(MAX_RESTARTS):
            (front,) = front_ends_of(server.pid)
            began = time.perf_counter()
            os.kill(front, signal.SIGKILL)
            while front_ends_of(server.pid) == [front] or not healthy(base):
                time.sleep(0.02)
            replaced.append(time.perf_counter() - began)
        (front,) = front_ends_of(server.pid)
        began = time.perf_counter()
        os.kill(front, signal.SIGKILL)
        code = server.wait(timeout=120)
        return {"replaced_s": replaced, "stopped_s": time.perf_counter() - began, "exit": code}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=str(CHECKPOINT))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--restarts", type=int, default=1, help="servers whose front end is killed (0: none)"
    )
    args = parser.parse_args()
    starts = [start_once(args.tokenizer, free_port()) for _ in range(args.reps)]
    report = {
        "start_s": statistics.median(s["start_s"] for s in starts),
        "rss_mib": statistics.median(s["rss_mib"] for s in starts),
        "peak_mib": statistics.median(s["peak_mib"] for s in starts),
        "torch": [s["torch"] for s in starts],
        "health": [s["health"] for s in starts],
    }
    with tempfile.TemporaryDirectory() as folder:
        runs = [
            restarts(str(CHECKPOINT), Path(folder, f"serve{i}.log")) for i in range(args.restarts)
        ]
    if runs:
        report["replaced_s"] = statistics.median(s for run in runs for s in run["replaced_s"])
        report["stopped_s"] = statistics.median(run["stopped_s"] for run in runs)
        report["exit"] = [run["exit"] for run in runs]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
