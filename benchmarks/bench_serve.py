"""Load on a running `spmoe serve` (or any OpenAI-compatible server): at each concurrency level, keep that many
streaming completions in flight until `--num-prompts` have finished; at each `--request-rate`, start the
requests at Poisson arrivals of that many per second, however many are in flight. Per level: request
throughput, output tokens/s, the p50 / p99 time to first token (TTFT) and time per output token after the
first (TPOT), the TTFT of the level's first request, and, from the server's `/metrics` before and after the
level ("-" for a server without the counter): the prefix cache's hit rate (prompt tokens found cached / looked
up: spmoe's or vLLM's `...:prefix_cache_hits_total` / `...:prefix_cache_queries_total`), and spmoe's engine
steps, the share of them that compiled a kernel or captured a CUDA graph, the compiles and captures after
the server reported ready, and on a server that speculates the MTP acceptance rate (accepted / proposed draft
tokens, `...:spec_decode_num_accepted_tokens_total` / `...:spec_decode_num_draft_tokens_total`) and the mean
accepted length (tokens per verification: 1 + accepted / `...:spec_decode_num_drafts_total`).

Prompts are random token ids (`--input-len` of them, below `--token-id-limit`), so every prompt has exactly
that length; `ignore_eos` makes every request generate `--output-len` tokens. The token counts come from the
server's `usage`. No warm-up completion is sent: the server warms itself before it reports ready;
each client process sends one `GET /models` before the clock starts, so that its own first
request's set-up is not counted in the first TTFT.

The client runs in `--client-processes` processes (`clients` column; default one per 32 streams, at
most a quarter of the machine's cores), each with its share of the streams and the prompts, started
together: one Python process parsing every SSE chunk is a ceiling of its own (7.8-39k chunks a
second on the development machine, `bench_streaming.py --client-ceiling`), and a client that reads
late inflates the TTFT and starts each next request late, which the server's figures would
otherwise carry.

    spmoe serve --model DIR --tp 2 --device cuda --dtype bfloat16 &
    python benchmarks/bench_serve.py --concurrency 1 16 64 256 --request-rate 20 --input-len 1024 --output-len 128

`--sampling plain processed` runs every level per setting, side by side: `plain` is greedy with nothing
else; `processed` is greedy with logprobs=5 and presence, frequency and repetition penalties on every request
(the sampler's logits processing, penalty counts and logprobs all at work). So that the order of the settings
does not bias their ratio (the first run paid kernels compiled after ready and the device's first-run effects),
each level first runs every setting once untimed (rows marked `warm-up`), then `--rounds` timed rounds of every
setting, the order reversed every other round (round 1 plain then processed, round 2 processed then plain, ...:
with an even `--rounds` each goes first as often), each row printed; then it prints processed /
plain for the output token rate and the median TPOT: the median over the rounds of each round's ratio, and
each round's. Each run gets fresh prompts (none finds another's cached).

`--json PATH` also writes every run's figures and the ratios as JSON (`{"runs": [...], "ratios": [...]}`),
for scripts (`bench_serve_vs_generate.py` reads it).

    python benchmarks/bench_serve.py --concurrency 64 --num-prompts 128 --sampling plain processed --rounds 2
"""

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import httpx


@dataclass
class Result:
    ttft_s: float
    latency_s: float
    output_tokens: int
    events: int  # the stream's chunks with choices

    @property
    def tpot_s(self) -> float | None:
        return (
            (self.latency_s - self.ttft_s) / (self.output_tokens - 1)
            if self.output_tokens > 1
            else None
        )


# A request sent on a kept-alive connection that the server closed before it answered (no response
# came) is sent again, this many times at most: uvicorn closes a connection 5 s after it wrote the
# last byte of a response, which a client reading seconds behind the server (its own CPU the limit)
# learns only when it sends the next request on it. The time to first token counts from the first try.
STALE_RETRIES = 3

SAMPLING = {
    "plain": {},
    "processed": {
        "logprobs": 5,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
}


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    sampling: str,
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **SAMPLING[sampling],
    }
    began = time.perf_counter()
    for attempt in range(STALE_RETRIES + 1):
        response = None
        try:
            async with client.stream("POST", url, json=body) as response:
                return await read_stream(response, began)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if response is not None or attempt == STALE_RETRIES:
                raise


async def read_stream(response: httpx.Response, began: float) -> Result:
    """One streamed completion's events, to its usage chunk and [DONE]."""
    if response.status_code != 200:
        raise RuntimeError(
            f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
        )
    ttft, usage, events = None, None, 0
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']['message']}")
        if chunk["choices"]:
            events += 1
            if ttft is None:
                ttft = time.perf_counter() - began
        usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError(
            "the stream had no usage chunk; expected one with stream_options.include_usage"
        )
    return Result(ttft, time.perf_counter() - began, usage["completion_tokens"], events)


async def run_level(
    base: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int | None,
    arrivals: list[float],
    sampling: str,
):
    """Either `concurrency` requests in flight, or (None) each request started at its `arrivals` time (s)."""
    url = base + "/completions"
    connections = concurrency or len(prompts)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        # the client's own first request (its async HTTP stack's lazy imports and set-up: 0.1 s on
        # the development machine) before the clock starts; no request of the engine's
        (await client.get(base + "/models")).raise_for_status()
        gate = asyncio.Semaphore(connections)
        began = time.perf_counter()

        async def gated(prompt, at):
            await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
            async with gate:
                return await one_request(client, url, model, prompt, output_len, sampling)

        results = await asyncio.gather(*(gated(p, at) for p, at in zip(prompts, arrivals)))
        return results, time.perf_counter() - began


# Streams a client process keeps in flight, by default: one process (httpx, parsing each SSE chunk)
# read 16-18k chunks a second at 16-64 streams and 7.8k at 256 on the 2-core development machine
# under load, 38-39k unloaded (bench_streaming.py --client-ceiling), where 256 streams of the H100's
# engine at GLM-5.2 widths make about 24k tokens a second; see docs/performance.md.
STREAMS_PER_CLIENT_PROCESS = 32


def default_client_processes(concurrency: int | None) -> int:
    """One client process per `STREAMS_PER_CLIENT_PROCESS` streams (a request rate: one), at most
    a quarter of the machine's cores, so that the server keeps most of them."""
    wanted = math.ceil((concurrency or 1) / STREAMS_PER_CLIENT_PROCESS)
    return max(1, min(wanted, (os.cpu_count() or 1) // 4))


def client_process(
    conn, barrier, base, model, prompts, output_len, concurrency, arrivals, sampling
):
    """One client process's share of a level, started when every process is ready (`barrier`);
    sends back its results (as tuples), its CPU seconds and its start and end
    (`time.perf_counter`, the same clock in every process)."""
    try:
        barrier.wait(timeout=300)
        cpu = time.process_time()
        results, seconds = asyncio.run(
            run_level(base, model, prompts, output_len, concurrency, arrivals, sampling)
        )
        ended = time.perf_counter()
        results = [astuple(r) for r in results]
        conn.send((results, time.process_time() - cpu, ended - seconds, ended))
    except BaseException as e:
        barrier.abort()
        conn.send(RuntimeError(f"a client process failed: {e!r}"))


def run_level_split(processes: int, *level) -> tuple[list[Result], float, float]:
    """`run_level(*level)` spread over `processes` client processes (at most the streams and the
    prompts) started together, so that the client's own CPU is not what is measured: process i takes
    prompts i, i + processes, ... and its share of the streams. -> the results in the prompts' order,
    the seconds from the first process's start to the last one's end, and the client's CPU seconds
    (all its processes)."""
    base, model, prompts, output_len, concurrency, arrivals, sampling = level
    if processes == 1:
        cpu = time.process_time()
        results, seconds = asyncio.run(run_level(*level))
        return results, seconds, time.process_time() - cpu
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    pipes, workers = [], []
    for i in range(processes):
        streams = concurrency and concurrency // processes + (i < concurrency % processes)
        share = (prompts[i::processes], output_len, streams, arrivals[i::processes], sampling)
        mine, theirs = context.Pipe()
        worker = context.Process(target=client_process, args=(theirs, barrier, base, model, *share))
        worker.start()
        pipes.append(mine)
        workers.append(worker)
    try:
        outcomes = [pipe.recv() for pipe in pipes]
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    failed = [o for o in outcomes if isinstance(o, Exception)]
    if failed:
        raise failed[0]
    results = [None] * len(prompts)
    for i, (share, _, _, _) in enumerate(outcomes):
        results[i::processes] = [Result(*r) for r in share]
    seconds = max(o[3] for o in outcomes) - min(o[2] for o in outcomes)
    return results, seconds, sum(o[1] for o in outcomes)


COUNTERS = {  # counter -> how its name ends in /metrics (summed over label sets)
    "steps": ":engine_steps_total",
    "compiling": ":engine_steps_compiling_total",
    "after_ready": ":compiles_after_ready_total",
    "queries": ":prefix_cache_queries_total",
    "hits": ":prefix_cache_hits_total",
    "drafts": ":spec_decode_num_drafts_total",
    "draft_tokens": ":spec_decode_num_draft_tokens_total",
    "accepted": ":spec_decode_num_accepted_tokens_total",
}


def server_counters(base: str) -> dict[str, float]:
    """The `COUNTERS` the server's `/metrics` beside the API reports (those it has)."""
    try:
        response = httpx.get(base.removesuffix("/v1") + "/metrics")
    except httpx.HTTPError:
        return {}
    values = {}
    for line in response.text.splitlines() if response.status_code == 200 else []:
        if line.startswith("#"):  # HELP / TYPE
            continue
        name, _, value = line.rpartition(" ")
        for counter, suffix in COUNTERS.items():
            if name.split("{")[0].endswith(suffix):
                values[counter] = values.get(counter, 0.0) + float(value)
    return values


def counted(delta: dict[str, float], after: dict[str, float]) -> str:
    """The level's columns from its counters' growth `delta` and their values `after` it: hit rate, MTP
    acceptance rate and mean accepted length, steps, share compiling, compiles after ready."""
    hit_rate = f"{delta['hits'] / delta['queries']:.1%}" if delta.get("queries") else "-"
    accept = (
        f"{delta['accepted'] / delta['draft_tokens']:.1%}" if delta.get("draft_tokens") else "-"
    )
    length = f"{1 + delta['accepted'] / delta['drafts']:.2f}" if delta.get("drafts") else "-"
    hit_rate = f"{hit_rate:>10}{accept:>8}{length:>8}"
    if "steps" not in delta:
        return f"{hit_rate}{'-':>7}{'-':>10}{'-':>12}"
    share = 100 * delta["compiling"] / max(delta["steps"], 1)
    return f"{hit_rate}{delta['steps']:>7.0f}{share:>9.1f}%{after['after_ready']:>12.0f}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="served model name (default: the server's first model)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256])
    parser.add_argument(
        "--request-rate", type=float, nargs="*", default=[], help="Poisson arrival rates (req/s)"
    )
    parser.add_argument(
        "--num-prompts", type=int, help="requests per level (default: 4 x concurrency, >= 8)"
    )
    parser.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens per request (default 128)"
    )
    parser.add_argument(
        "--output-len", type=int, default=64, help="output tokens per request (default 64)"
    )
    parser.add_argument(
        "--token-id-limit",
        type=int,
        default=256,
        help="prompt token ids are drawn from [0, limit) (default 256: bytes in most vocabularies)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sampling",
        nargs="+",
        choices=list(SAMPLING),
        default=["plain"],
        help="request settings, each level run per setting (default plain; see above)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with several --sampling settings: timed rounds per level, after an untimed warm-up (default 1)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        help="client processes a level's streams are spread over (default: one per "
        f"{STREAMS_PER_CLIENT_PROCESS} streams, at most a quarter of the cores; see above)",
    )
    parser.add_argument(
        "--json", type=Path, help="also write every run's figures and the ratios there (JSON)"
    )
    args = parser.parse_args()
    if args.client_processes is not None and args.client_processes < 1:
        parser.error(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    base = args.base_url.rstrip("/")
    model = args.model or httpx.get(base + "/models").json()["data"][0]["id"]
    rng = random.Random(args.seed)
    print(
        f"bench_serve: {base}, model {model!r}, {args.input_len} prompt tokens -> {args.output_len} output tokens"
    )
    print(
        f"{'level':>12}{'sampling':>10}{'round':>8}{'requests':>9}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'1st TTFT':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'hit rate':>10}{'accept':>8}{'length':>8}"
        f"{'steps':>7}{'compiling':>10}{'after ready':>12}{'clients':>8}  (ms)"
    )
    runs, ratios = [], []
    levels = [(c, None) for c in args.concurrency] + [(None, r) for r in args.request_rate]
    for concurrency, rate in levels:
        count = args.num_prompts or max(8, 4 * (concurrency or 16))
        arrivals = [0.0] * count
        if rate is not None:
            for i in range(1, count):
                arrivals[i] = arrivals[i - 1] + rng.expovariate(rate)
        level = f"c={concurrency}" if rate is None else f"rate={rate:g}/s"
        # side by side: one untimed run of each setting first, then the settings in turn, round after round, the
        # order reversed every other round so that no setting always goes first
        order = [("warm-up", s) for s in args.sampling] if len(args.sampling) > 1 else []
        order += [
            (str(r + 1), s)
            for r in range(args.rounds)
            for s in args.sampling[:: 1 if r % 2 == 0 else -1]
        ]
        for round_, sampling in order:
            prompts = [
                [rng.randrange(args.token_id_limit) for _ in range(args.input_len)]
                for _ in range(count)
            ]
            processes = args.client_processes or default_client_processes(concurrency)
            processes = min(processes, concurrency or count, count)
            before = server_counters(base)
            results, seconds, client_cpu = run_level_split(
                processes, base, model, prompts, args.output_len, concurrency, arrivals, sampling
            )
            after = server_counters(base)
            ttft = [r.ttft_s * 1e3 for r in results]
            tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None] or [float("nan")]
            output_tokens = sum(r.output_tokens for r in results)
            run = dict(
                level=level,
                sampling=sampling,
                round=round_,
                requests=count,
                seconds=seconds,
                output_tokens=output_tokens,
                req_per_s=count / seconds,
                out_tok_per_s=output_tokens / seconds,
                ttft_p50_ms=statistics.median(ttft),
                ttft_p99_ms=percentile(ttft, 99),
                first_ttft_ms=ttft[0],
                tpot_p50_ms=statistics.median(tpot),
                tpot_p99_ms=percentile(tpot, 99),
                client_processes=processes,
                client_cpu_s=client_cpu,
                counters={
                    k: after[k] - before[k] for k in after if k in before
                },  # what the level added
            )
            runs.append(run)
            print(
                f"{level:>12}{sampling:>10}{round_:>8}{count:>9}{run['req_per_s']:>8.2f}{run['out_tok_per_s']:>11.1f}"
                f"{run['ttft_p50_ms']:>10.1f}{run['ttft_p99_ms']:>10.1f}{run['first_ttft_ms']:>10.1f}"
                f"{run['tpot_p50_ms']:>10.2f}{run['tpot_p99_ms']:>10.2f}{counted(run['counters'], after)}"
                f"{processes:>8}",
                flush=True,
            )
        if {"plain", "processed"} <= set(args.sampling):
            ratios.append(processed_over_plain(level, [r for r in runs if r["level"] == level]))
            ratio = ratios[-1]
            rounds = {
                key: " ".join(f"{v:.3f}" for v in ratio[key + "_rounds"])
                for key in ("out_tok_per_s", "tpot_p50")
            }
            print(
                f"{level:>12} processed / plain, median of {args.rounds} round(s): out tok/s "
                f"{ratio['out_tok_per_s']:.3f} ({rounds['out_tok_per_s']}), TPOT p50 {ratio['tpot_p50']:.3f} "
                f"({rounds['tpot_p50']})",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=1))


def processed_over_plain(level: str, runs: list[dict]) -> dict:
    """A level's timed runs -> processed / plain per round (each round's runs of the two settings) for the output
    token rate and the median TPOT, and the median over the rounds."""
    timed = {(r["round"], r["sampling"]): r for r in runs if r["round"] != "warm-up"}
    rounds = sorted({round_ for round_, _ in timed}, key=int)
    ratio = {"level": level}
    for key, column in (("out_tok_per_s", "out_tok_per_s"), ("tpot_p50", "tpot_p50_ms")):
        each = [timed[r, "processed"][column] / timed[r, "plain"][column] for r in rounds]
        ratio[key], ratio[key + "_rounds"] = statistics.median(each), each
    return ratio


if __name__ == "__main__":
    main()
