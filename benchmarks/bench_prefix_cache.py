"""Prefix caching off and on, side by side in one run, on workloads whose prompts repeat what earlier requests
sent: time to first token (TTFT) and throughput.

Workloads (token ids random; `--scale` multiplies every length; `--tiny`: a CPU smoke run, `Workload.smoke`):
- repeat: one prompt of 8192 + 64 tokens, then a second with the same 8192-token head and another 64-token
  tail; TTFT of each, one at a time.
- chat: 16 conversations under one 1024-token system prompt, 4 turns each: a turn's prompt is the
  conversation so far (system prompt, earlier user messages and replies) plus a new 256-token user message;
  the reply has 64 tokens. All conversations run at once; each sends its next turn when its reply ends.
- agent: 8 agents sharing 8192 tokens of tool definitions, 4 turns each adding a 512-token tool result, with
  64-token replies (tool calls), the same way.
Every request decodes greedily to its length (no eos). Per workload and setting: requests, prompt tokens,
the prompt tokens the engine computed (the rest came from the cache) and the hit rate, TTFT p50 / p90 (from
adding the request to the step that returns its first token), wall seconds, requests/s and output tokens/s.

The model: GLM-5.2 widths with `--layers` layers (default 4: 1 dense, 3 MoE of 64 experts top-8), random
bf16 weights, one GPU, CUDA graphs for decode steps; one engine per setting, each with a paged cache of
`--kv-cache-memory` GiB, both warmed up by one untimed pass of a small chat workload longer than `index_topk`;
the workloads then run on them in turn, off before on (each workload has its own random tokens, so nothing
hits across workloads).

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
    """`agents` conversations of `turns` turns under one shared head of `shared` tokens: a turn adds `user`
    tokens to the conversation and its reply `output` tokens. `concurrent`: the conversations run at once
    (else one request at a time)."""

    shared: int
    agents: int
    turns: int
    user: int
    output: int
    concurrent: bool = True

    def scaled(self, factor: float) -> "Workload":
        size = lambda n: max(1, round(n * factor))  # noqa: E731
        return replace(self, shared=size(self.shared), user=size(self.user), output=size(self.output))

    def smoke(self) -> "Workload":
        """A CPU-sized version: lengths / 16, at most 3 conversations of 3 turns with 4-token replies."""
        small = self.scaled(1 / 16)
        return replace(small, agents=min(3, self.agents), turns=min(3, self.turns), output=min(4, small.output))


WORKLOADS = {
    "repeat": Workload(shared=8192, agents=2, turns=1, user=64, output=1, concurrent=False),
    "chat": Workload(shared=1024, agents=16, turns=4, user=256, output=64),
    "agent": Workload(shared=8192, agents=8, turns=4, user=512, output=64),
}


def run_workload(engine, work: Workload, vocab: int, seed: int) -> dict:
    """Drive the engine through the workload (closed loop: a conversation's next turn is added when its reply
    ends). -> the figures of one table column."""
    from spmoe.engine.request import Request

    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    shared = tokens(work.shared)
    history = [list(shared) for _ in range(work.agents)]
    turns_done = [0] * work.agents
    added, first, outputs, ttft, prompt_tokens = {}, {}, {}, [], 0
    before = engine.metrics()

    def send(agent: int) -> None:
        nonlocal prompt_tokens
        history[agent] += tokens(work.user)
        request_id = f"{agent}-{turns_done[agent]}"
        engine.add_request(Request(request_id, list(history[agent]), work.output))
        added[request_id], outputs[request_id] = time.perf_counter(), []
        prompt_tokens += len(history[agent])

    began = time.perf_counter()
    queue = list(range(work.agents))
    for agent in queue if work.concurrent else queue[:1]:
        send(agent)
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
            agent = int(request_id.split("-")[0])
            history[agent] += outputs[request_id]
            turns_done[agent] += 1
            if turns_done[agent] < work.turns:
                send(agent)
            elif not work.concurrent and agent + 1 < work.agents:
                send(agent + 1)
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
        "TTFT p50 ms": statistics.median(ttft) * 1e3,
        "TTFT p90 ms": sorted(ttft)[min(len(ttft) - 1, round(0.9 * (len(ttft) - 1)))] * 1e3,
        "TTFT first ms": ttft[0] * 1e3,
        "TTFT last ms": ttft[-1] * 1e3,
        "seconds": seconds,
        "requests/s": len(outputs) / seconds,
        "output tok/s": generated / seconds,
    }


def run(args) -> list[tuple[str, dict, dict]]:
    from spmoe.engine.engine import Engine
    from spmoe.engine.paged_cache import PagedKVCache
    from spmoe.models.deepseek_v32.weights import build_model

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    cfg = ModelConfig.from_dict({**glm_config(args.layers), **(TINY if args.tiny else {})})
    model = build_model(cfg, ParallelConfig(tensor_parallel_size=1), False, set(), dtype, device).eval()
    random_weights(model)
    caches = {caching: PagedKVCache.for_model(model, int(args.kv_cache_memory * 2**30)) for caching in (False, True)}
    cache = caches[True]
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(
        f"model: {args.layers} layers, hidden {cfg.hidden_size}, {params:.2f} B parameters on {device}; paged cache "
        f"{cache.num_blocks} blocks of {cache.block_size} tokens per setting",
        flush=True,
    )

    engines = {
        caching: Engine(
            model,
            caches[caching],
            cuda_graphs=device == "cuda",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=caching,
        )
        for caching in (False, True)
    }

    workloads = {
        name: WORKLOADS[name].smoke() if args.tiny else WORKLOADS[name].scaled(args.scale) for name in args.workloads
    }
    # past index_topk, so that the indexer's scoring kernels (which shorter contexts skip) compile here too
    warm = Workload(shared=2 * cfg.index_topk + 64, agents=4, turns=2, user=64, output=8)
    for engine in engines.values():
        run_workload(engine, warm, cfg.vocab_size, seed=-1)
    rows = []
    for index, (name, work) in enumerate(workloads.items()):  # each workload its own tokens: no hits across them
        off = run_workload(engines[False], work, cfg.vocab_size, args.seed + index)
        on = run_workload(engines[True], work, cfg.vocab_size, args.seed + index)
        rows.append((name, work, off, on))
    return rows


def print_table(rows) -> None:
    for name, work, off, on in rows:
        print(
            f"\n{name}: shared {work.shared} tokens, {work.agents} conversations x {work.turns} turns, "
            f"+{work.user} tokens a turn, {work.output}-token replies"
            f"{'' if work.concurrent else ', one request at a time'}"
        )
        print(f"{'':>16}{'caching off':>14}{'caching on':>14}{'on / off':>10}")
        for key in off:
            ratio = f"{on[key] / off[key]:>10.2f}" if off[key] else ""
            fmt = ".1%" if key == "hit rate" else (".0f" if isinstance(off[key], int) else ".2f")
            print(f"{key:>16}{off[key]:>14{fmt}}{on[key]:>14{fmt}}{ratio}")
        if not work.concurrent:
            print(
                f"second request's TTFT / first's: caching off {off['TTFT last ms'] / off['TTFT first ms']:.1%}, "
                f"on {on['TTFT last ms'] / on['TTFT first ms']:.1%}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every token count")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory", type=float, default=8.0, help="paged cache GiB per setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, short workloads")
    args = parser.parse_args()
    if args.tiny and args.kv_cache_memory == parser.get_default("kv_cache_memory"):
        args.kv_cache_memory = 0.125
    (rows,) = spawn(run, 1, args, device="cpu" if args.tiny else "cuda", timeout_s=3600)
    print_table(rows)


if __name__ == "__main__":
    main()
