"""Prefix caching off and on, side by side in one run, on workloads whose prompts repeat what earlier requests
sent: time to first token (TTFT) and throughput, for the chat and agent workloads over a sweep of concurrency.

Workloads (token ids random; `--scale` multiplies every length; `--tiny`: a CPU smoke run, `Workload.smoke`):
- repeat: one prompt of 8192 + 64 tokens, then a second with the same 8192-token head and another 64-token
  tail; TTFT of each, one at a time. Its line: the second request's TTFT / the first's (goal <= 10% on).
- chat: conversations under one 1024-token system prompt, 4 turns each: a turn's prompt is the conversation
  so far (system prompt, earlier user messages and replies) plus a new 256-token user message; the reply has
  64 tokens.
- agent: agents sharing 8192 tokens of tool definitions, 4 turns each adding a 512-token tool result, with
  64-token replies (tool calls).
Chat and agent run at each level of `--concurrency` / `--agent-concurrency` (conversations at once: 1 4 16
64 and 1 4 16 by default), each level max(level, `--min-conversations`) conversations in a closed loop: a
conversation sends its next turn when its reply ends, and a new conversation starts when one ends, so that
`level` are in flight at once. Each level has its own random tokens (its own system prompt): nothing hits
across levels or workloads. Every request decodes greedily to its length (no eos).

Per level and setting: requests, prompt tokens, the prompt tokens the engine computed (the rest came from the
cache) and the hit rate, `compile steps`: the steps in which a Triton kernel variant compiled (a row with any
carries compile time in its figures), TTFT p50 / p90 (from adding the request to the step that returns its first
token), wall seconds, requests/s and output tokens/s. Then the goal's comparison, one line per workload: caching
off's TTFT p50 and throughput at the reference level (`--reference`; default the second highest, so that caching
on has a level above it to reach that TTFT with), and caching on's throughput at that same TTFT p50: from its
highest level whose TTFT p50 is at or below it, interpolated linearly on the (TTFT p50, requests/s) curve towards
the next level (whose TTFT p50 is above it); when its highest level stays below, that level's throughput (a lower
bound: more concurrency would add throughput until its TTFT reached caching off's); -> the ratio (goal >= 2x for
chat; in requests/s, which is output tokens/s over a fixed reply length).

The model: GLM-5.2 widths with `--layers` layers (default 4: 1 dense, 3 MoE of 64 experts top-8), random bf16
weights, one GPU, CUDA graphs (decode steps, and mixed steps of up to 512 tokens) whose block tables are
`--max-model-len` positions wide (default: the run's longest sequence, 10496 tokens at scale 1; before
2026-12-02 the whole cache, 1.5 M positions, which the indexer kernel's grid grows with); one engine per
setting, each with a paged cache of `--kv-cache-memory` GiB, both warmed up as the server warms up
(`warmup.warm_up`: prefill steps of every size class up to the token budget, on CUDA) and by one untimed pass
of a small chat workload longer than `index_topk`.
The workloads then run on them in turn, the setting that goes first alternating level by level (off first at the
first level, on first at the next, and so on across workloads), so that neither setting is always the one to meet
a new kernel variant (the prefill chunk shapes of cached prompts differ from uncached ones'), with a progress line
per level and setting. The default sweep is sized for about 4 minutes of workloads on one H200 at most: caching
off computes 1.54 M prompt tokens in all (a 32768-token prefill takes ~0.5 s there) and each setting runs about
3,300 decode steps.

    python benchmarks/bench_prefix_cache.py
    python benchmarks/bench_prefix_cache.py --tiny        # CPU smoke: a tiny model, short workloads
"""

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch
from bench_dp import random_weights
from bench_generate import glm_config

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import spawn

TINY = dict(  # a model the CPU runs in seconds, shaped like GLM-5.2 (an indexer, MoE layers)
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    q_lora_rank=32,
    kv_lora_rank=128,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    index_topk=64,
    index_n_heads=2,
    index_head_dim=32,
)


@dataclass(frozen=True)
class Workload:
    """`conversations` conversations of `turns` turns under one shared head of `shared` tokens, `concurrency`
    of them at once: a turn adds `user` tokens to the conversation and its reply `output` tokens."""

    shared: int
    conversations: int
    turns: int
    user: int
    output: int
    concurrency: int = 1

    def scaled(self, factor: float) -> "Workload":
        size = lambda n: max(1, round(n * factor))  # noqa: E731
        return replace(
            self, shared=size(self.shared), user=size(self.user), output=size(self.output)
        )

    def smoke(self) -> "Workload":
        """A CPU-sized version: lengths / 16, at most 3 turns with 4-token replies."""
        small = self.scaled(1 / 16)
        return replace(small, turns=min(3, self.turns), output=min(4, small.output))

    def at(self, concurrency: int, min_conversations: int) -> "Workload":
        """`concurrency` conversations at once, max(`concurrency`, `min_conversations`) in all."""
        return replace(
            self, concurrency=concurrency, conversations=max(concurrency, min_conversations)
        )

    @property
    def longest(self) -> int:
        """The tokens of a conversation's last turn with its reply."""
        return self.shared + self.turns * (self.user + self.output)

    def describe(self) -> str:
        return f"shared {self.shared} tokens, {self.turns} turns of +{self.user} tokens, {self.output}-token replies"


WORKLOADS = {
    "repeat": Workload(shared=8192, conversations=2, turns=1, user=64, output=1),
    "chat": Workload(shared=1024, conversations=16, turns=4, user=256, output=64),
    "agent": Workload(shared=8192, conversations=8, turns=4, user=512, output=64),
}


def run_workload(engine, work: Workload, vocab: int, seed: int | str) -> dict:
    """Drive the engine through the workload (closed loop: a conversation's next turn is added when its reply
    ends, a new conversation starts when one ends). -> the figures of one row."""
    from spmoe.engine.request import Request

    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    shared = tokens(work.shared)
    history, turns_done = [], []
    added, first, outputs, ttft, prompt_tokens = {}, {}, {}, [], 0
    before = engine.metrics()

    def send(conversation: int) -> None:
        nonlocal prompt_tokens
        history[conversation] += tokens(work.user)
        request_id = f"{conversation}-{turns_done[conversation]}"
        engine.add_request(Request(request_id, list(history[conversation]), work.output))
        added[request_id], outputs[request_id] = time.perf_counter(), []
        prompt_tokens += len(history[conversation])

    def start() -> None:
        history.append(list(shared))
        turns_done.append(0)
        send(len(history) - 1)

    began = time.perf_counter()
    for _ in range(min(work.concurrency, work.conversations)):
        start()
    while engine.has_unfinished():
        finished = []
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
                ttft.append(now - added[out.request_id])
            outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished.append(out.request_id)
        for request_id in finished:
            conversation = int(request_id.split("-")[0])
            history[conversation] += outputs[request_id]
            turns_done[conversation] += 1
            if turns_done[conversation] < work.turns:
                send(conversation)
            elif len(history) < work.conversations:
                start()
    seconds = time.perf_counter() - began
    after = engine.metrics()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    generated = sum(len(o) for o in outputs.values())
    return {
        "requests": len(outputs),
        "prompt tokens": prompt_tokens,
        "computed": prompt_tokens - hits,
        "hit rate": hits / queries if queries else 0.0,
        "compile steps": after.steps_compiling - before.steps_compiling,
        "TTFT p50 ms": statistics.median(ttft) * 1e3,
        "TTFT p90 ms": sorted(ttft)[min(len(ttft) - 1, round(0.9 * (len(ttft) - 1)))] * 1e3,
        "TTFT first ms": ttft[0] * 1e3,
        "TTFT last ms": ttft[-1] * 1e3,
        "seconds": seconds,
        "requests/s": len(outputs) / seconds,
        "output tok/s": generated / seconds,
    }


def throughput_at_ttft(
    curve: list[tuple[int, float, float]], target: float
) -> tuple[float, str, bool] | None:
    """Caching on's requests/s at TTFT p50 `target` ms, from its levels `curve` [(level, TTFT p50 ms,
    requests/s)] in increasing level: take the highest level whose TTFT p50 is at or below `target`; if a level
    above it exists (its TTFT p50 is above `target`), interpolate linearly between the two at `target`, else
    its throughput is a lower bound. -> (requests/s, how it was found, whether a lower bound), None if every
    level is above."""
    below = [i for i, (_, ttft, _) in enumerate(curve) if ttft <= target]
    if not below:
        return None
    low, t0, x0 = curve[below[-1]]
    if below[-1] + 1 == len(curve):
        return (
            x0,
            f"its highest level, {low} at once, has TTFT p50 {t0:.1f} ms: a lower bound",
            True,
        )
    high, t1, x1 = curve[below[-1] + 1]
    value = x0 + (x1 - x0) * (target - t0) / (t1 - t0)
    return (
        value,
        f"interpolated between {low} and {high} at once, TTFT p50 {t0:.1f} and {t1:.1f} ms",
        False,
    )


def run(args) -> list[tuple[str, dict, dict]]:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.warmup import warm_up
    from spmoe.models.deepseek_v32.weights import build_model

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    cfg = ModelConfig.from_dict({**glm_config(args.layers), **(TINY if args.tiny else {})})
    model = build_model(
        cfg, ParallelConfig(tensor_parallel_size=1), False, set(), dtype, device
    ).eval()
    random_weights(model)
    caches = {
        caching: PagedKVCache.for_model(model, int(args.kv_cache_memory * 2**30))
        for caching in (False, True)
    }
    cache = caches[True]
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(
        f"model: {args.layers} layers, hidden {cfg.hidden_size}, {params:.2f} B parameters on {device}; paged cache "
        f"{cache.num_blocks} blocks of {cache.block_size} tokens per setting",
        flush=True,
    )

    def smaller(work: Workload) -> Workload:
        return work.smoke() if args.tiny else work.scaled(args.scale)

    # past index_topk, so that the indexer's scoring kernels (which shorter contexts skip) compile here too, and
    # past the repeat workload's prompt, so that its first request (a whole chunk) compiles nothing; its own
    # tokens (a string seed: random.Random(-n) draws what random.Random(n) does)
    shared = max(2 * cfg.index_topk, smaller(WORKLOADS["repeat"]).shared) + 64
    warm = Workload(shared=shared, conversations=4, turns=2, user=64, output=8, concurrency=4)
    longest = max(w.longest for w in [warm] + [smaller(WORKLOADS[name]) for name in args.workloads])
    max_model_len = args.max_model_len or longest
    engines = {
        caching: Engine(
            model,
            caches[caching],
            cuda_graphs=device == "cuda",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=caching,
        )
        for caching in (False, True)
    }
    for engine in engines.values():
        warm_up(engine)
        run_workload(engine, warm, cfg.vocab_size, seed="warm-up")
    print(
        f"max_model_len {max_model_len} (the graphs' block tables); both engines warmed up (the server's warm-up, "
        "then a small chat workload); the setting that runs first "
        "alternates level by level (off first at the first level); 'compile steps': a row's steps in which a "
        "kernel variant compiled",
        flush=True,
    )
    results, seed, began, turn = {}, args.seed, time.perf_counter(), 0
    for name in args.workloads:
        levels = {"repeat": [1], "chat": args.concurrency, "agent": args.agent_concurrency}[name]
        for level in levels:
            work = (
                smaller(WORKLOADS[name])
                if name == "repeat"
                else smaller(WORKLOADS[name]).at(level, args.min_conversations)
            )
            seed += 1  # each level its own tokens: no hits across levels or workloads
            order, turn = ((False, True) if turn % 2 == 0 else (True, False)), turn + 1
            for caching in order:
                row = run_workload(engines[caching], work, cfg.vocab_size, seed)
                results[name, level, caching] = (work, row)
                print(
                    f"[{time.perf_counter() - began:6.1f} s] {name} {level} at once, "
                    f"caching {'on' if caching else 'off'}: "
                    f"{row['requests']} requests in {row['seconds']:.1f} s, TTFT p50 {row['TTFT p50 ms']:.1f} ms, "
                    f"hit rate {row['hit rate']:.1%}, {row['compile steps']} steps compiling",
                    flush=True,
                )
    return results


COLUMNS = (
    "requests",
    "prompt tokens",
    "computed",
    "hit rate",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "requests/s",
)
COLUMNS += ("output tok/s", "seconds", "compile steps")


def print_tables(results: dict, reference: int | None, min_conversations: int) -> None:
    names = dict.fromkeys(name for name, _, _ in results)
    for name in names:
        levels = sorted({level for n, level, _ in results if n == name})
        work = results[name, levels[0], False][0]
        if name == "repeat":
            off, on = results[name, 1, False][1], results[name, 1, True][1]
            print(f"\nrepeat: {work.describe()}, {work.conversations} requests one at a time")
            print(f"{'':>16}{'caching off':>14}{'caching on':>14}{'on / off':>10}")
            for key in off:
                ratio = f"{on[key] / off[key]:>10.2f}" if off[key] else ""
                fmt = (
                    ".1%" if key == "hit rate" else (".0f" if isinstance(off[key], int) else ".2f")
                )
                print(f"{key:>16}{off[key]:>14{fmt}}{on[key]:>14{fmt}}{ratio}")
            print(
                f"repeat: second request's TTFT / first's (goal <= 10% with caching on): caching off "
                f"{off['TTFT last ms'] / off['TTFT first ms']:.1%}, on {on['TTFT last ms'] / on['TTFT first ms']:.1%}"
            )
            continue
        print(
            f"\n{name}: {work.describe()}; a level of n at once runs max(n, {min_conversations}) conversations"
        )
        print(f"{'at once':>8}{'caching':>8}" + "".join(f"{key:>14}" for key in COLUMNS))
        for level in levels:
            for caching in (False, True):
                row = results[name, level, caching][1]
                cells = "".join(
                    f"{row[key]:>14.1%}"
                    if key == "hit rate"
                    else f"{row[key]:>14}"
                    if isinstance(row[key], int)
                    else f"{row[key]:>14.2f}"
                    for key in COLUMNS
                )
                print(f"{level:>8}{'on' if caching else 'off':>8}{cells}")
        at = reference if reference in levels else levels[-2 if len(levels) > 1 else -1]
        off = results[name, at, False][1]
        curve = [
            (
                level,
                results[name, level, True][1]["TTFT p50 ms"],
                results[name, level, True][1]["requests/s"],
            )
            for level in levels
        ]
        found = throughput_at_ttft(curve, off["TTFT p50 ms"])
        head = (
            f"{name}: equal TTFT p50: caching off at {at} at once: TTFT p50 {off['TTFT p50 ms']:.1f} ms, "
            f"{off['requests/s']:.2f} requests/s; caching on at that TTFT p50"
        )
        if found is None:
            print(f"{head}: none (every level of caching on is above it)")
        else:
            value, how, lower_bound = found
            ratio = f"{'>= ' if lower_bound else ''}{value / off['requests/s']:.2f}x"
            print(
                f"{head} ({how}): {'>= ' if lower_bound else ''}{value:.2f} requests/s -> {ratio} (goal >= 2x)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every token count")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help="chat conversations at once (1 4 16 64; --tiny 1 2 4)",
    )
    parser.add_argument(
        "--agent-concurrency", type=int, nargs="+", help="agents at once (1 4 16; --tiny 1 2 4)"
    )
    parser.add_argument(
        "--min-conversations", type=int, default=4, help="conversations a level runs, at least"
    )
    parser.add_argument(
        "--reference",
        type=int,
        help="caching off's level for the equal-TTFT line (default: the second highest)",
    )
    parser.add_argument("--max-num-seqs", type=int, help="default: the highest level")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="positions a sequence may take (default: the run's longest sequence)",
    )
    parser.add_argument(
        "--kv-cache-memory", type=float, default=8.0, help="paged cache GiB per setting"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: a tiny model, short workloads"
    )
    args = parser.parse_args()
    args.concurrency = sorted(set(args.concurrency or ([1, 2, 4] if args.tiny else [1, 4, 16, 64])))
    args.agent_concurrency = sorted(
        set(args.agent_concurrency or ([1, 2, 4] if args.tiny else [1, 4, 16]))
    )
    levels = args.concurrency + args.agent_concurrency
    if min(levels) < 1 or args.min_conversations < 1:
        parser.error(
            f"concurrency levels and --min-conversations must be >= 1, got {levels} and {args.min_conversations}"
        )
    args.max_num_seqs = args.max_num_seqs or max(levels)
    if args.tiny and args.kv_cache_memory == parser.get_default("kv_cache_memory"):
        args.kv_cache_memory = 0.125
    (results,) = spawn(run, 1, args, device="cpu" if args.tiny else "cuda", timeout_s=3600)
    print_tables(results, args.reference, args.min_conversations)


if __name__ == "__main__":
    main()
