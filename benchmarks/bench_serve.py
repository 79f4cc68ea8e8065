"""Load on a running `spmoe serve` (or any OpenAI-compatible server): at each concurrency level, keep that many
streaming completions in flight until `--num-prompts` have finished, then report request throughput, output
tokens/s, the p50 / p99 time to first token (TTFT) and time per output token after the first (TPOT), and the
prefix cache's hit rate over the level (prompt tokens found cached / looked up, from the server's `/metrics`:
spmoe's or vLLM's `...:prefix_cache_hits_total` / `...:prefix_cache_queries_total`; "-" if it has none).

Prompts are random token ids (`--input-len` of them, below `--token-id-limit`), so every prompt has exactly
that length; `ignore_eos` makes every request generate `--output-len` tokens. The token counts come from the
server's `usage`.

    spmoe serve --model DIR --tp 2 --device cuda --dtype bfloat16 &
    python benchmarks/bench_serve.py --concurrency 1 4 16 64 --input-len 1024 --output-len 128
"""

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class Result:
    ttft_s: float
    latency_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']['message']}")
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - began
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream had no usage chunk; expected one with stream_options.include_usage")
    return Result(ttft, time.perf_counter() - began, usage["completion_tokens"])


async def prefix_cache_counts(client: httpx.AsyncClient, base: str) -> tuple[float, float] | None:
    """(prompt tokens looked up in the prefix cache, tokens found) from the server's `/metrics`, summed over
    label sets; None when it reports neither."""
    response = await client.get(base.removesuffix("/v1") + "/metrics")
    counts = {}
    for line in response.text.splitlines() if response.status_code == 200 else []:
        if line.startswith("#"):  # HELP / TYPE
            continue
        name, _, value = line.rpartition(" ")
        for kind in ("queries", "hits"):
            if name.split("{")[0].endswith(f":prefix_cache_{kind}_total"):
                counts[kind] = counts.get(kind, 0.0) + float(value)
    return (counts.get("queries", 0.0), counts.get("hits", 0.0)) if counts else None


async def run_level(base: str, model: str, concurrency: int, prompts: list[list[int]], output_len: int):
    """-> (results, seconds, prefix cache hit rate over the level or None)."""
    url = base + "/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await one_request(client, url, model, prompts[0], 2)  # warm-up
        gate = asyncio.Semaphore(concurrency)

        async def gated(prompt):
            async with gate:
                return await one_request(client, url, model, prompt, output_len)

        before = await prefix_cache_counts(client, base)
        began = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        seconds = time.perf_counter() - began
        after = await prefix_cache_counts(client, base)
        hit_rate = None
        if before is not None and after is not None and after[0] > before[0]:
            hit_rate = (after[1] - before[1]) / (after[0] - before[0])
        return results, seconds, hit_rate


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="served model name (default: the server's first model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-prompts", type=int, help="requests per level (default: 4 x concurrency, >= 8)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument(
        "--token-id-limit",
        type=int,
        default=256,
        help="prompt token ids are drawn from [0, limit) (default 256: bytes in most vocabularies)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    model = args.model or httpx.get(base + "/models").json()["data"][0]["id"]
    rng = random.Random(args.seed)
    print(f"bench_serve: {base}, model {model!r}, {args.input_len} prompt tokens -> {args.output_len} output tokens")
    print(
        f"{'concurrency':>11}{'requests':>10}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'hit rate':>10}  (ms)"
    )
    for concurrency in args.concurrency:
        count = args.num_prompts or max(8, 4 * concurrency)
        prompts = [[rng.randrange(args.token_id_limit) for _ in range(args.input_len)] for _ in range(count)]
        results, seconds, hit_rate = asyncio.run(run_level(base, model, concurrency, prompts, args.output_len))
        ttft = [r.ttft_s * 1e3 for r in results]
        tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None] or [float("nan")]
        output_tokens = sum(r.output_tokens for r in results)
        print(
            f"{concurrency:>11}{count:>10}{count / seconds:>8.2f}{output_tokens / seconds:>11.1f}"
            f"{statistics.median(ttft):>10.1f}{percentile(ttft, 99):>10.1f}"
            f"{statistics.median(tpot):>10.2f}{percentile(tpot, 99):>10.2f}"
            f"{'-' if hit_rate is None else f'{hit_rate:.1%}':>10}",
            flush=True,
        )


if __name__ == "__main__":
    main()
