"""What stored Responses cost a front end.

Memory: `spmoe serve` on the demo checkpoint (one front end, no MTP) answers `--requests` Responses
requests shaped as the soak's (`soak_mix.Mix.responses`, not streamed), with `store` true or false
(`--store`), `--concurrency` at a time; the front end's RSS is read from /proc before the first and
after every `--every` requests. Prints one line per reading (requests answered, front end RSS in
MiB, its growth since the first) and the time each request took (median and p99, ms).

    python benchmarks/bench_response_store.py --requests 2000 --store true
    python benchmarks/bench_response_store.py --requests 2000 --store false

Time (`--latency`): `ResponseStore.put` and `.get` (a hit) on a database in a fresh temporary
folder, `--requests` of each, entries of the soak's sizes (a conversation of 3 messages, a response
of about 1.5 KB of JSON), while another process (a second front end) puts `--other-rate` a second
(0: as fast as it can), and how late the event loop is meanwhile (a ticker's 1 ms sleeps); prints
the median, p99 and max in microseconds. `--on-loop`: the same calls made on the event loop.

    python benchmarks/bench_response_store.py --latency --requests 5000 --other-rate 100
    python benchmarks/bench_response_store.py --latency --requests 5000 --other-rate 100 --on-loop
"""

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

import soak  # noqa: E402 - benchmarks/ is not a package
import soak_procs  # noqa: E402
from soak_mix import Mix  # noqa: E402

from spmoe.entrypoints.serve.frontend.response_store import ResponseStore  # noqa: E402

MIB = 1024 * 1024


def entry(rng: random.Random, rid: str) -> tuple[dict, list[dict]]:
    """A response and the conversation through it, of the soak's sizes: an input of 8 to 120
    characters, an answer of up to 32 tokens, the request's settings answered back."""
    words = " ".join(rng.choice(("alpha", "kilo", "sigma", "tango")) for _ in range(20))
    text = rng.choice((words[:8], words[:60], words[:120]))
    item = {"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed"}
    item["content"] = [{"type": "output_text", "text": words[:64], "annotations": []}]
    response = {"id": rid, "object": "response", "model": "demo", "status": "completed"}
    response |= {"output": [item], "instructions": None, "tools": [], "tool_choice": "auto"}
    response |= {f"setting_{i}": None for i in range(30)}  # what a response answers back
    conversation = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": words[:64]},
        {"role": "user", "content": text},
    ]
    return response, conversation


def put_forever(path: str, rate: float) -> None:
    """A second front end: puts `rate` a second (0: as fast as it can), until it is terminated."""
    store, rng, began = ResponseStore(path), random.Random(1), time.monotonic()
    for k in range(10**9):
        store.put_now(*entry(rng, f"resp_other{k}"))
        if rate:
            time.sleep(max(0.0, began + (k + 1) / rate - time.monotonic()))


async def timed(store: ResponseStore, requests: int, on_loop: bool) -> dict[str, list[float]]:
    """`requests` puts and gets (of the response just put), one after the other, in the
    store's thread (`on_loop`: on the event loop), while a ticker measures how late the event loop
    wakes it from 1 ms sleeps. -> seconds of each."""
    rng, took = random.Random(0), {"put": [], "get": [], "event loop lateness": []}

    async def ticker():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            took["event loop lateness"].append(time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    for k in range(requests):
        response, conversation = entry(rng, f"resp_{k}")
        t = time.perf_counter()
        if on_loop:
            store.put_now(response, conversation)
        else:
            await store.put(response, conversation)
        took["put"].append(time.perf_counter() - t)
        rid = f"resp_{k}"
        t = time.perf_counter()
        if on_loop:
            store.get_now(rid)
            await asyncio.sleep(0)  # the ticker's turn, as between two requests
        else:
            await store.get(rid)
        took["get"].append(time.perf_counter() - t)
    tick.cancel()
    return took


def latency(requests: int, rate: float, on_loop: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "responses.sqlite")
        store = ResponseStore(path)
        other = multiprocessing.get_context("spawn").Process(target=put_forever, args=(path, rate))
        other.start()
        time.sleep(1.0)
        try:
            took = asyncio.run(timed(store, requests, on_loop))
        finally:
            other.terminate()
            other.join()
    response, conversation = entry(random.Random(0), "resp_0")
    size = len(json.dumps(response)) + len(json.dumps(conversation))
    print(
        f"entry: about {size} bytes; {requests} puts and gets, another process putting "
        f"{rate:g} a second (0: as fast as it can); {'on' if on_loop else 'off'} the event loop"
    )
    for name, times in took.items():
        times.sort()
        p99 = times[int(0.99 * (len(times) - 1))]
        print(
            f"{name}: median {statistics.median(times) * 1e6:.0f} us, "
            f"p99 {p99 * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us"
        )


def front_end_rss(server: "soak.Server", port: int) -> int:
    """The RSS of the server's one front end (the process listening on `port`), in bytes."""
    pids = soak_procs.tree(server.proc.pid)
    (front_end,) = soak_procs.listeners(pids, port)
    return soak_procs.usage(front_end).rss_bytes


async def drive(url: str, port: int, server, args) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        models = (await http.get("/v1/models")).json()["data"][0]
        mix, rng = Mix(models["id"], models["max_model_len"]), random.Random(args.seed)
        bodies = []
        for _ in range(args.requests):
            body = mix.responses(rng, "").body | {"store": args.store, "stream": False}
            bodies.append(body)
        took: list[float] = []
        failed = 0
        start = front_end_rss(server, port)
        print(f"{0:>6} requests  front end RSS {start / MIB:7.1f} MiB", flush=True)
        for first in range(0, args.requests, args.every):
            queue = list(bodies[first : first + args.every])

            async def client():
                nonlocal failed
                while queue:
                    body = queue.pop()
                    t = time.perf_counter()
                    answer = await http.post("/v1/responses", json=body)
                    took.append(time.perf_counter() - t)
                    failed += answer.status_code != 200

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            rss = front_end_rss(server, port)
            print(
                f"{first + args.every:>6} requests  front end RSS {rss / MIB:7.1f} MiB  "
                f"{(rss - start) / MIB:+6.1f} MiB ({rss / start - 1:+.2%})  not 200: {failed}",
                flush=True,
            )
        took.sort()
        p99 = took[int(0.99 * (len(took) - 1))]
        median = statistics.median(took)
        print(f"request time: median {median * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--every", type=int, default=250, help="requests between readings")
    p.add_argument("--store", choices=("true", "false"), default="true")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency", action="store_true", help="time the store's put and get alone")
    p.add_argument("--other-rate", type=float, default=100.0, help="with --latency: puts/s")
    p.add_argument("--on-loop", action="store_true", help="with --latency: put, get on the loop")
    args = p.parse_args()
    if args.latency:
        latency(args.requests, args.other_rate, args.on_loop)
        return
    args.store = args.store == "true"
    serve_args = soak.parse_args(["--api-server-count", "1", "--mtp", "0"])
    with tempfile.TemporaryDirectory() as folder:
        server = soak.Server(serve_args, Path(folder) / "server.log")
        port = int(server.url.rsplit(":", 1)[1])
        try:
            asyncio.run(drive(server.url, port, server, args))
        finally:
            server.stop(soak_procs.tree(server.proc.pid))


if __name__ == "__main__":
    main()
