"""Load on a running `spmoe serve` (or any OpenAI-compatible server): at each concurrency level, keep that many
streaming completions in flight until `--num-prompts` have finished, then report request throughput, output
tokens/s, and the p50 / p99 time to first token (TTFT) and time per output token after the first (TPOT). On a
server that speculates (its /metrics has `spmoe:spec_decode_*` counters) it also reports each level's MTP
acceptance rate (accepted / proposed draft tokens) and mean accepted length (tokens per verification: 1 +
accepted / verifications), from the counters' growth over the level.

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


async def run_level(base: str, model: str, concurrency: int, prompts: list[list[int]], output_len: int):
    url = base + "/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await one_request(client, url, model, prompts[0], 2)  # warm-up
        gate = asyncio.Semaphore(concurrency)

        async def gated(prompt):
            async with gate:
                return await one_request(client, url, model, prompt, output_len)

        began = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return results, time.perf_counter() - began


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(base: str) -> dict[str, float] | None:
    """The server's speculation counters from its /metrics (summed over model names), or None when it has
    none (no speculation, or a server without them)."""
    response = httpx.get(base.removesuffix("/v1") + "/metrics")
    if response.status_code != 200:
        return None
    found = dict.fromkeys(SPEC_COUNTERS, 0.0)
    seen = False
    for line in response.text.splitlines():
        for name in SPEC_COUNTERS:
            if line.startswith(f"spmoe:spec_decode_{name}_total"):
                found[name] += float(line.rsplit(" ", 1)[1])
                seen = True
    return found if seen else None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> str:
    """-> the level's acceptance rate and mean accepted length, or "" without counters."""
    if before is None or after is None:
        return ""
    grown = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    if not grown["num_drafts"]:
        return f"{'-':>8}{'-':>8}"
    rate = grown["num_accepted_tokens"] / grown["num_draft_tokens"]
    length = 1 + grown["num_accepted_tokens"] / grown["num_drafts"]
    return f"{rate:>8.1%}{length:>8.2f}"


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
    speculating = spec_counters(base) is not None
    print(f"bench_serve: {base}, model {model!r}, {args.input_len} prompt tokens -> {args.output_len} output tokens")
    print(
        f"{'concurrency':>11}{'requests':>10}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}" + (f"{'accept':>8}{'length':>8}" if speculating else "") + "  (ms)"
    )
    for concurrency in args.concurrency:
        count = args.num_prompts or max(8, 4 * concurrency)
        prompts = [[rng.randrange(args.token_id_limit) for _ in range(args.input_len)] for _ in range(count)]
        before = spec_counters(base) if speculating else None
        results, seconds = asyncio.run(run_level(base, model, concurrency, prompts, args.output_len))
        spec = acceptance(before, spec_counters(base) if speculating else None)
        ttft = [r.ttft_s * 1e3 for r in results]
        tpot = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None] or [float("nan")]
        output_tokens = sum(r.output_tokens for r in results)
        print(
            f"{concurrency:>11}{count:>10}{count / seconds:>8.2f}{output_tokens / seconds:>11.1f}"
            f"{statistics.median(ttft):>10.1f}{percentile(ttft, 99):>10.1f}"
            f"{statistics.median(tpot):>10.2f}{percentile(tpot, 99):>10.2f}{spec}",
            flush=True,
        )


if __name__ == "__main__":
    main()
