"""A hostile client against `spmoe serve`: while `--streams` streaming completions run, send a 100 MB body
(once with Content-Length, once chunked), a 20 MB prompt, and poll /health every 50 ms (from a process of its
own, so that the client's threads do not delay the probes). Reports what each oversized request got, whether
every stream finished, the /health latencies under this load and idle before it, and how much the server's
memory (the `spmoe serve` process and every rank, summed VmRSS) grew over its level before the load.

It starts the server itself (the demo checkpoint unless --model, TP 2 on the CPU, default flags) on a free
port and stops it with SIGTERM at the end.

    python benchmarks/bench_abuse.py --streams 64
"""

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from spmoe.distributed.launcher import free_port

MB = 10**6


def tree_rss_bytes(pid: int) -> int:
    """VmRSS of `pid` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        total += next(
            (
                int(line.split()[1]) * 1024
                for line in status.splitlines()
                if line.startswith("VmRSS:")
            ),
            0,
        )
    return total


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "spmoe",
        "serve",
        "--tp",
        "2",
        "--port",
        str(port),
        "--served-model-name",
        "m",
    ]
    command += ["--model", args.model] if args.model else []
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "ready: http://" in line:
            break
    else:
        raise SystemExit(f"spmoe serve exited with {proc.wait()} before it was ready")
    threading.Thread(
        target=lambda: [sys.stderr.write(line) for line in proc.stderr], daemon=True
    ).start()
    return proc, f"http://127.0.0.1:{port}"


def probe_health(base: str, stop, latencies) -> None:
    """In a process of its own: GET /health every 50 ms until `stop` is set; each latency (s) into `latencies`."""
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            began = time.perf_counter()
            client.get(base + "/health").raise_for_status()
            latencies.put(time.perf_counter() - began)
            time.sleep(0.05)


def health_latencies(
    base: str,
    seconds: float | None,
    until: threading.Event | None = None,
    started: threading.Event | None = None,
) -> list[float]:
    """/health latencies from a separate process, from its first probe (then `started` is set) for `seconds`
    or until `until` is set."""
    ctx = multiprocessing.get_context("spawn")
    stop, latencies = ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=probe_health, args=(base, stop, latencies))
    prober.start()
    found = [latencies.get(timeout=300)]
    if started is not None:
        started.set()
    if until is None:
        time.sleep(seconds)
    else:
        until.wait()
    stop.set()
    while prober.is_alive() or not latencies.empty():
        try:
            found.append(latencies.get(timeout=0.2))
        except Exception:  # noqa: BLE001 - queue.Empty: the prober has stopped
            pass
    prober.join()
    return found


def chunks(piece: bytes, count: int):
    yield b'{"model": "m", "prompt": "'
    for _ in range(count):
        yield piece
    yield b'"}'


def oversized(base: str, kind: str, body, results: dict) -> None:
    """One hostile request; records (status or the transport error, seconds)."""
    began = time.perf_counter()
    try:
        response = httpx.post(base + "/v1/completions", content=body, timeout=120)
        outcome = f"{response.status_code} {response.json()['error']['message'][:90]}"
    except httpx.HTTPError as e:
        outcome = f"connection ended: {type(e).__name__}"
    results[kind] = (outcome, time.perf_counter() - began)


def stream(base: str, i: int, finished: list) -> None:
    body = {
        "model": "m",
        "prompt": f"stream {i}:",
        "max_tokens": 16,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    if (
        response.status_code == 200
        and lines[-1] == "data: [DONE]"
        and '"finish_reason": "length"' in lines[-2]
    ):
        finished.append(i)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint folder (default: the demo checkpoint)")
    p.add_argument(
        "--streams", type=int, default=64, help="concurrent streaming completions (default 64)"
    )
    args = p.parse_args()
    proc, base = start_server(args)
    try:
        httpx.post(
            base + "/v1/completions",
            json={"model": "m", "prompt": "warm", "max_tokens": 2},
            timeout=120,
        )
        idle = health_latencies(base, 5.0)
        rss_before = peak = tree_rss_bytes(proc.pid)
        bodies = {  # built before the clock starts
            "100 MB body, Content-Length": b'{"model": "m", "prompt": "'
            + b"x" * (100 * MB)
            + b'"}',
            "100 MB body, chunked": chunks(b"x" * MB, 100),
            "20 MB prompt": json.dumps(
                {"model": "m", "prompt": "word " * (4 * MB), "max_tokens": 4}
            ).encode(),
        }
        done = threading.Event()

        def watch_memory() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tree_rss_bytes(proc.pid))
                time.sleep(0.05)

        finished: list[int] = []
        results: dict = {}
        threads = [
            threading.Thread(target=stream, args=(base, i, finished)) for i in range(args.streams)
        ]
        threads += [
            threading.Thread(target=oversized, args=(base, kind, body, results))
            for kind, body in bodies.items()
        ]
        health: list[float] = []
        probing = threading.Event()
        watchers = [
            threading.Thread(target=watch_memory),
            threading.Thread(
                target=lambda: health.extend(health_latencies(base, None, done, probing))
            ),
        ]
        for t in watchers:
            t.start()
        probing.wait()
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - began
        done.set()
        for t in watchers:
            t.join()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    print(
        f"\nserver: TP 2 CPU, {os.cpu_count()} cores; {args.streams} streams of 16 tokens + 3 oversized requests"
    )
    for kind in bodies:
        outcome, took = results[kind]
        print(f"  {kind:<28} -> {outcome} ({took:.2f} s)")
    print(f"  streams finished: {len(finished)}/{args.streams} in {seconds:.1f} s")
    for label, latencies in (("idle before", idle), ("under the load", health)):
        ordered = sorted(latencies)
        print(
            f"  /health {label}: {len(ordered)} probes, p50 {1e3 * statistics.median(ordered):.1f} ms, "
            f"p99 {1e3 * ordered[int(0.99 * (len(ordered) - 1))]:.1f} ms, max {1e3 * ordered[-1]:.1f} ms"
        )
    print(
        f"  server RSS (all processes): {rss_before / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB "
        f"(+{(peak - rss_before) / 2**20:.0f} MiB)"
    )
    print(f"  after SIGTERM the server exited with {code}")


if __name__ == "__main__":
    main()
