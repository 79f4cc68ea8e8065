"""The HTTP front end's streaming cost with the model taken out: does one front end process keep up with
an engine that steps like the GPU's?

A scripted engine (this file, in a process of its own) plays rank 0's engine process on the real wire: it
starts the real front end process (`spmoe.entrypoints.serve.frontend`, the demo's byte tokenizer), takes
its requests (at most `--streams` running, as `--max-num-seqs`), and every step gives each running
request one token (its first in the step that admits it) until `--output-len`, taking `--step-ms` +
`--step-ms-per-seq` x batch per step (defaults: a line through the H100's `spmoe generate` figures at GLM-5.2
widths, 2026-12-07: 2.53 / 3.54 / 7.16 ms a step at 16 / 64 / 256 sequences). `bench_serve.py`'s client
(the GPU run's) keeps `--streams` streaming completions in flight from this process. Per level:
- `ideal`: the engine's output tokens/s with every step full (`--streams` over the step's time);
- `out tok/s`: the client's (usage tokens over the wall time), and `/ ideal`;
- `batch`: the engine's mean running requests a step (`--streams` when the front end keeps up), and
  `idle s`, its seconds with nothing to run;
- `FE us/tok` and `FE us/ev`: the front end process's CPU seconds (user + system) over the tokens and
  the SSE events it sent: its own cost, whatever else runs on the machine;
- `events/s` and `tok/ev`: the SSE events (chunks with a choice) the client read; `cl us/ev`: the
  client's CPU (this process's) per event;
- the client's TTFT and TPOT (ms), and `clients`: its processes (`--client-processes`, each count
  a row of its own).
The wall-clock columns need a core each for the engine, the front end and the client; on a machine with
fewer free cores they measure the machine, and the CPU columns are the ones to compare.

`--client-ceiling` first measures the client alone against a canned server (raw asyncio, chunks shaped like
the front end's, one token each, every stream served in turn as fast as the sockets take them): the most
events a second the client reads, so that a front end figure near it is known to be the client's.

`--before DIR` runs every level a second time with the front end imported from DIR (another checkout:
the code before a change), alternating which goes first, the two side by side in one table.

    python benchmarks/bench_streaming.py --streams 16 64 256 --client-ceiling --before ../main
"""

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import zmq
from bench_front_end import hello_from, launch_here
from bench_serve import percentile, run_level_split

from spmoe.distributed.launcher import free_port
from spmoe.engine.request import EngineMetrics, RequestOutput
from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.entrypoints.serve.wire import Codec, FromEngine, PrivateAddress

TEXT_IDS = list(range(32, 127))  # the byte tokenizer's printable ASCII: what the engine "generates"
HEARTBEAT_S = 0.5


def cpu_seconds(pid: int) -> float:
    """User + system seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ScriptedEngine:
    """The engine's side of the wire for one front end: requests in, one token per running request a
    step out. `run(conn)` serves until `conn` says "quit"; "begin" starts a level's counters, "end"
    sends them back (steps, tokens, idle seconds, the front end's CPU seconds)."""

    def __init__(
        self, streams: int, step_s: float, step_s_per_seq: float, front_end: subprocess.Popen
    ):
        self.streams, self.step_s, self.step_s_per_seq = streams, step_s, step_s_per_seq
        self.front_end = front_end
        self.waiting: list = []
        self.live: dict[str, list] = {}  # request id -> [request, tokens given]
        self.counters = {}

    def run(self, engine: zmq.Socket, peer: bytes, conn) -> None:
        codec = Codec()
        began_cpu = 0.0
        last_sent = time.perf_counter()
        while True:
            if conn.poll():
                what = conn.recv()
                if what == "quit":
                    return
                if what == "begin":
                    self.counters = {"steps": 0, "tokens": 0, "idle_s": 0.0}
                    began_cpu = cpu_seconds(self.front_end.pid)
                else:
                    used = cpu_seconds(self.front_end.pid) - began_cpu
                    conn.send({**self.counters, "front_end_cpu_s": used})
            if not self.live and not self.waiting:
                idle = time.perf_counter()
                engine.poll(50)
                self.counters["idle_s"] = self.counters.get("idle_s", 0.0) + (
                    time.perf_counter() - idle
                )
            while engine.poll(0):
                _, data = engine.recv_multipart()
                message = codec.to_engine.decode(data)
                self.waiting += message.adds
                for request_id in message.aborts:
                    self.live.pop(request_id, None)
            outputs = self.step()
            if outputs or time.perf_counter() - last_sent > HEARTBEAT_S:
                message = FromEngine(outputs=outputs, metrics=EngineMetrics(), front_ends=1)
                engine.send_multipart((peer, codec.encode(message)))
                last_sent = time.perf_counter()

    def step(self) -> list[RequestOutput]:
        """Admit what fits, give every running request its next token, take the step's time."""
        while self.waiting and len(self.live) < self.streams:
            request = self.waiting.pop(0)
            self.live[request.request_id] = [request, 0]
        if not self.live:
            return []
        began = time.perf_counter()
        outputs = []
        for request_id, entry in list(self.live.items()):
            request, given = entry
            token = TEXT_IDS[given % len(TEXT_IDS)]
            entry[1] = given = given + 1
            done = given >= request.max_new_tokens
            outputs.append(
                RequestOutput(
                    request_id,
                    [token],
                    "length" if done else None,
                    prompt_tokens=len(request.prompt),
                    queue_s=0.0 if given == 1 else None,
                    prefill_s=0.0 if given == 1 else None,
                )
            )
            if done:
                del self.live[request_id]
        self.counters["steps"] = self.counters.get("steps", 0) + 1
        self.counters["tokens"] = self.counters.get("tokens", 0) + len(outputs)
        # the step's time, as a GPU step at this batch would take it
        rest = self.step_s + self.step_s_per_seq * len(outputs) - (time.perf_counter() - began)
        if rest > 0:
            time.sleep(rest)
        return outputs


def engine_process(conn, streams: int, port: int, step_s: float, per_seq: float, code: str):
    """Start a front end (its code imported from `code`) and play its engine until told to quit."""
    address = PrivateAddress()
    engine = zmq.Context.instance().socket(zmq.ROUTER)
    engine.setsockopt(zmq.LINGER, 0)
    engine.bind(address.url)
    launch = launch_here(str(CHECKPOINT), address, port, 4 * streams)
    # `code` first: its spmoe; the rest as it was (packages installed beside the checkout)
    path = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    front_end = subprocess.Popen(
        [sys.executable, "-m", "spmoe.entrypoints.serve.frontend"], stdin=subprocess.PIPE, env=env
    )
    try:
        front_end.stdin.write(pickle.dumps(launch))
        front_end.stdin.close()
        peer = hello_from(engine)
        hello = FromEngine(outputs=[], metrics=EngineMetrics(), front_ends=1)
        engine.send_multipart((peer, Codec().encode(hello)))
        conn.send("ready")
        ScriptedEngine(streams, step_s, per_seq, front_end).run(engine, peer, conn)
    finally:
        front_end.terminate()
        try:
            front_end.wait(timeout=30)
        except subprocess.TimeoutExpired:
            front_end.kill()
            front_end.wait()
        engine.close()
        address.remove()


def wait_healthy(base: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base} did not turn healthy in {seconds:.0f} s")


def load(
    base: str, streams: int, requests: int, input_len: int, output_len: int, processes: int
) -> dict:
    """`requests` streaming completions, `streams` at a time, through bench_serve's client in
    `processes` processes."""
    prompts = [[(7 * i + j) % 256 for j in range(input_len)] for i in range(requests)]
    arrivals = [0.0] * requests
    results, seconds, client_cpu = run_level_split(
        processes, base + "/v1", "bench", prompts, output_len, streams, arrivals, "plain"
    )
    wrong = [r.output_tokens for r in results if r.output_tokens != output_len]
    if wrong:
        raise RuntimeError(f"expected usage of {output_len} tokens a request, got {wrong[:5]}")
    tokens = sum(r.output_tokens for r in results)
    events = sum(r.events for r in results)
    ttft = [r.ttft_s * 1e3 for r in results]
    tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "events": events,
        "client_cpu_s": client_cpu,
        "client_processes": processes,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": statistics.median(tpot),
    }


def one_level(args, streams: int, code: str, processes: int) -> dict:
    """A front end from `code` against the scripted engine, loaded at `streams` by `processes`
    client processes."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    port = free_port()
    engine = context.Process(
        target=engine_process,
        args=(child, streams, port, args.step_ms / 1e3, args.step_ms_per_seq / 1e3, code),
    )
    engine.start()
    try:
        if not conn.poll(180) or conn.recv() != "ready":
            raise RuntimeError("the scripted engine did not start its front end")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        conn.send("begin")
        try:
            requests = args.requests_per_stream * streams
            got = load(base, streams, requests, args.input_len, args.output_len, processes)
        except Exception as e:
            engine.join(1)
            state = "runs" if engine.is_alive() else f"exited with {engine.exitcode}"
            raise RuntimeError(f"the load failed; the scripted engine process {state}") from e
        conn.send("end")
        got.update(conn.recv())
        conn.send("quit")
    finally:
        engine.join(60)
        if engine.is_alive():
            engine.kill()
    step = args.step_ms + args.step_ms_per_seq * streams
    got["ideal_tok_s"] = streams / step * 1e3
    return got


async def canned_stream(reader, writer, chunk: bytes, output_len: int):
    """Answer each request on one connection with `output_len` copies of `chunk` (one HTTP chunk
    each, one a turn of all the connections), a usage chunk and [DONE]."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed the connection
            return
        if head.startswith(b"GET "):  # the client's first request, before the clock starts
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            continue
        length = next(
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        usage = {"completion_tokens": output_len, "prompt_tokens": 1, "total_tokens": 1}
        last = json.dumps({"choices": [], "usage": usage}).encode()
        for frame in [chunk] * output_len + [b"data: " + last + b"\n\n", b"data: [DONE]\n\n"]:
            writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def canned_server(port: int, output_len: int) -> None:
    """The client's yardstick: a server as fast as its sockets (see `canned_stream`)."""
    choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": None}
    payload = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "bench"}
    payload.update(choices=[choice], usage=None)
    chunk = b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def serve():
        server = await asyncio.start_server(
            lambda r, w: canned_stream(r, w, chunk, output_len), "127.0.0.1", port
        )
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def can_connect(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def client_ceiling(args, streams: int, processes: int) -> dict:
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=canned_server, args=(port, args.output_len)
    )
    server.start()
    try:
        deadline = time.monotonic() + 120
        while not can_connect(port):
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError("the canned server did not listen in 120 s")
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        requests = args.requests_per_stream * streams
        return load(base, streams, requests, 4, args.output_len, processes)
    finally:
        server.kill()
        server.join()


def row(name: str, streams: int, got: dict) -> str:
    tokens, events = got["tokens"], max(got["events"], 1)
    ideal, ratio, engine = f"{'-':>10}", f"{'-':>8}", f"{'-':>7}{'-':>8}{'-':>10}{'-':>10}"
    if "ideal_tok_s" in got:
        ideal = f"{got['ideal_tok_s']:>10.0f}"
        ratio = f"{tokens / got['seconds'] / got['ideal_tok_s']:>8.3f}"
        cpu = got["front_end_cpu_s"] * 1e6
        engine = (
            f"{tokens / max(got['steps'], 1):>7.1f}{got['idle_s']:>8.2f}"
            f"{cpu / tokens:>10.1f}{cpu / events:>10.1f}"
        )
    return (
        f"{name:>13}{streams:>8}{ideal}{tokens / got['seconds']:>10.0f}{ratio}{engine}"
        f"{events / got['seconds']:>10.0f}{tokens / events:>7.2f}"
        f"{got['client_cpu_s'] / events * 1e6:>10.1f}{got['ttft_p50_ms']:>10.1f}"
        f"{got['ttft_p99_ms']:>10.1f}{got['tpot_p50_ms']:>10.2f}{got['client_processes']:>8}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=2.22, help="the step's time at batch 0")
    parser.add_argument(
        "--step-ms-per-seq", type=float, default=0.0193, help="what each running request adds"
    )
    parser.add_argument("--client-ceiling", action="store_true")
    parser.add_argument(
        "--client-processes",
        type=int,
        nargs="+",
        default=[1],
        help="bench_serve's client in this many processes; several: each level once per count",
    )
    parser.add_argument("--before", help="a checkout whose front end runs each level too")
    parser.add_argument("--json", type=Path, help="also write every level's figures there")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    codes = [("this", here)] + ([("before", args.before)] if args.before else [])
    print(
        f"bench_streaming: {args.input_len} -> {args.output_len} tokens, "
        f"{args.requests_per_stream} requests a stream, step {args.step_ms} ms + "
        f"{args.step_ms_per_seq} ms a sequence"
    )
    print(
        f"{'front end':>13}{'streams':>8}{'ideal':>10}{'out tok/s':>10}{'/ ideal':>8}{'batch':>7}"
        f"{'idle s':>8}{'FE us/tok':>10}{'FE us/ev':>10}{'events/s':>10}{'tok/ev':>7}"
        f"{'cl us/ev':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'clients':>8}"
    )
    figures = []
    for streams, processes in itertools.product(args.streams, args.client_processes):
        if args.client_ceiling:
            got = client_ceiling(args, streams, processes)
            figures.append({"front_end": "canned", "streams": streams, **got})
            print(row("canned server", streams, got), flush=True)
        for name, code in codes if len(figures) % 2 == 0 else codes[::-1]:
            got = one_level(args, streams, code, processes)
            figures.append({"front_end": name, "streams": streams, **got})
            print(row(name, streams, got), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
