"""A hostile client against `spmoe serve`: while `--streams` streaming completions run, send a 100 MB body
(once with Content-Length, once chunked), a 20 MB prompt, and poll /health every 50 ms. Reports what each
oversized request got, whether every stream finished, the /health latencies, and how much the server's memory
(the `spmoe serve` process and every rank, summed VmRSS) grew over its level before the load.

It starts the server itself (the demo checkpoint unless --model, TP 2 on the CPU, default flags) on a free
port and stops it with SIGTERM at the end.

    python benchmarks/bench_abuse.py --streams 64
"""

import argparse
import json
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
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "spmoe", "serve", "--tp", "2", "--port", str(port), "--served-model-name", "m"]
    command += ["--model", args.model] if args.model else []
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "ready: http://" in line:
            break
    else:
        raise SystemExit(f"spmoe serve exited with {proc.wait()} before it was ready")
    threading.Thread(target=lambda: [sys.stderr.write(line) for line in proc.stderr], daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def oversized(base: str, kind: str, results: dict) -> None:
    """One hostile request; records (status or the transport error, seconds)."""
    began = time.perf_counter()
    try:
        if kind == "100 MB body, Content-Length":
            body = b'{"model": "m", "prompt": "' + b"x" * (100 * MB) + b'"}'
            response = httpx.post(base + "/v1/completions", content=body, timeout=120)
        elif kind == "100 MB body, chunked":
            piece = b"x" * MB

            def chunks():
                yield b'{"model": "m", "prompt": "'
                for _ in range(100):
                    yield piece
                yield b'"}'

            response = httpx.post(base + "/v1/completions", content=chunks(), timeout=120)
        else:  # a 20 MB prompt, under the body limit
            body = json.dumps({"model": "m", "prompt": "word " * (4 * MB), "max_tokens": 4})
            response = httpx.post(base + "/v1/completions", content=body, timeout=120)
        outcome = f"{response.status_code} {response.json()['error']['message'][:90]}"
    except httpx.HTTPError as e:
        outcome = f"connection ended: {type(e).__name__}"
    results[kind] = (outcome, time.perf_counter() - began)


def stream(base: str, i: int, finished: list) -> None:
    body = {"model": "m", "prompt": f"stream {i}:", "max_tokens": 16, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    if response.status_code == 200 and lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]:
        finished.append(i)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: the demo checkpoint)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streaming completions (default 64)")
    args = p.parse_args()
    proc, base = start_server(args)
    try:
        httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "warm", "max_tokens": 2}, timeout=120)
        rss_before = peak = tree_rss_bytes(proc.pid)
        done = threading.Event()
        health: list[float] = []

        def watch() -> None:
            nonlocal peak
            with httpx.Client(timeout=30) as client:
                while not done.is_set():
                    began = time.perf_counter()
                    client.get(base + "/health").raise_for_status()
                    health.append(time.perf_counter() - began)
                    peak = max(peak, tree_rss_bytes(proc.pid))
                    time.sleep(0.05)

        finished: list[int] = []
        results: dict = {}
        threads = [threading.Thread(target=stream, args=(base, i, finished)) for i in range(args.streams)]
        kinds = ("100 MB body, Content-Length", "100 MB body, chunked", "20 MB prompt")
        threads += [threading.Thread(target=oversized, args=(base, kind, results)) for kind in kinds]
        watcher = threading.Thread(target=watch)
        began = time.perf_counter()
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
        seconds = time.perf_counter() - began
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    print(f"\nserver: TP 2 CPU, {os.cpu_count()} cores; {args.streams} streams of 16 tokens + 3 oversized requests")
    for kind in kinds:
        outcome, took = results[kind]
        print(f"  {kind:<28} -> {outcome} ({took:.2f} s)")
    print(f"  streams finished: {len(finished)}/{args.streams} in {seconds:.1f} s")
    ordered = sorted(health)
    print(
        f"  /health: {len(health)} probes, p50 {1e3 * statistics.median(ordered):.1f} ms, "
        f"p99 {1e3 * ordered[int(0.99 * (len(ordered) - 1))]:.1f} ms, max {1e3 * ordered[-1]:.1f} ms"
    )
    print(
        f"  server RSS (all processes): {rss_before / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB "
        f"(+{(peak - rss_before) / 2**20:.0f} MiB)"
    )
    print(f"  after SIGTERM the server exited with {code}")


if __name__ == "__main__":
    main()
