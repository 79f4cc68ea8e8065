"""Long-context generation on one GPU, TP 1 with CUDA graphs: the engine over the paged cache
(sparse DSA attention, bf16 and FP8 cache) side by side with the dense reference (slot cache, dense
attention), at contexts from 2k to 128k tokens.

The model is GLM-5.2 wide with a few layers (default 4: 1 dense, 3 MoE of 64 experts top-8, 1 shared
expert, vocab 32768), random bf16 weights generated on the device. Per cache kind and context: one
sequence whose prompt is the context, prefilled in chunks of `--max-num-batched-tokens`, then
`--new-tokens` greedy decode steps (the first two warm up: they capture the step's CUDA graph).
Printed per row:
- prefill ms (wall, to the first token) and prefill tokens/s, with % of the FLOP roofline (790
  TFLOP/s bf16 dense; each row runs twice and the second is timed, as the first prefill of a size
  pays one-off costs: the allocator's first blocks of that size, cuBLAS's first call of a shape);
  FLOPs = 2 x active parameters per token (the LM head's once per step) + the attention actually
  computed (dense: every earlier position; sparse: min(position, index_topk) selected rows in latent
  space, plus the indexer over every earlier position);
- decode ms/step (wall median, graph replay plus the host's step) and tokens/s, with % of the
  bandwidth roofline (4.3 TB/s): bytes = the weights one token reads (dense weights, 8 routed + 1
  shared expert per MoE layer, the LM head) + the cache rows it reads;
- peak GPU memory (torch's allocator) over the row;
- with `--weights bf16 fp8`, each row for the random bf16 weights and for their FP8 block-128 twin
  (written with `write_fp8_checkpoint` and loaded as an FP8 checkpoint is: every linear runs FP8),
  and the FP8 / bf16 ratios of prefill and decode tokens/s; the bandwidth roofline counts the bytes
  as stored (FP8: 1 per weight + scales);
- KV bytes per token and layer;
- the GPU operations each decoder layer launches in one decode step (one extra, untimed step run
  eagerly);
- for FP8 rows, the share of greedy tokens equal to the bf16 cache's at the same context.
A dense row that runs out of memory prints OOM (and larger contexts are skipped for it).

    python benchmarks/bench_generate.py [--layers 4] [--contexts 2048 8192 32768 131072]
        [--kinds paged fp8 dense] [--weights bf16 fp8]
"""

import argparse
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import torch
from bench_dp import random_weights
from timing import launch_count, layer_ops

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import spawn
from spmoe.entrypoints.engine_flags import add_engine_args, engine_args_from_cli

PEAK_FLOPS = 790e12  # H200 dense bf16
PEAK_BYTES = 4.3e12  # H200 HBM3e
KINDS = ("paged", "fp8", "dense")


def glm_config(layers: int) -> dict:
    """GLM-5.2 widths, `layers` layers: the first dense, the rest MoE of 64 experts."""
    return dict(
        model_type="glm_moe_dsa",
        vocab_size=32768,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        indexer_types=["full"] * layers,
        num_attention_heads=64,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_topk=2048,
        index_n_heads=32,
        index_head_dim=128,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=0,
    )


def active_params(model, cfg: ModelConfig) -> tuple[int, int]:
    """(parameters one token multiplies by, outside the LM head; the LM head's): routed experts
    count `num_experts_per_tok` of `n_routed_experts`, the embedding not at all."""
    body = head = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        if "lm_head" in name:
            head += p.numel()
        elif ".experts." in name:
            body += p.numel() * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            body += p.numel()
    return body, head


def active_bytes(model, cfg: ModelConfig) -> int:
    """The bytes of the weights one token multiplies by, as stored (`active_params`' parameters, the
    LM head's included)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in name else 1
        total += int(p.numel() * p.element_size() * share)
    return total


def attention_flops(cfg: ModelConfig, start: int, count: int, sparse: bool) -> float:
    """FLOPs of attention (and the indexer) for positions start .. start + count - 1, summed over
    layers."""
    heads, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    total = 0.0
    # keys each position attends
    positions = torch.arange(start, start + count, dtype=torch.float64) + 1
    if sparse:
        keys = positions.clamp(max=cfg.index_topk)
        total += float((2 * heads * keys * (2 * c + r)).sum())
        total += float((2 * cfg.index_n_heads * cfg.index_head_dim * positions).sum())
    else:
        total += float((2 * heads * positions * (cfg.qk_head_dim + cfg.v_head_dim)).sum())
        total += float((2 * cfg.index_n_heads * cfg.index_head_dim * positions).sum())
    return total * cfg.num_hidden_layers


def decode_bytes(
    model, cfg: ModelConfig, context: int, kind: str, cache_bytes_per_token: int
) -> float:
    """Bytes one decode token reads: the weights it multiplies by and the cache rows it reads."""
    weights = active_bytes(model, cfg)
    layers = cfg.num_hidden_layers
    per_layer = cache_bytes_per_token / layers
    index_bytes = cfg.index_head_dim * (1 if kind == "fp8" else 2) + (4 if kind == "fp8" else 0)
    if kind == "dense":
        return weights + context * cache_bytes_per_token
    return weights + layers * (
        min(context, cfg.index_topk) * (per_layer - index_bytes) + context * index_bytes
    )


def run_case(model, cfg, kind: str, context: int, args) -> dict:
    from spmoe.engine.cache.paged import PagedKVCache
    from spmoe.engine.cache.slots import KVCache
    from spmoe.engine.engine import Engine
    from spmoe.engine.request import Request

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if kind == "dense":
        cache = KVCache.for_model(model, 1, context + args.new_tokens)
    else:
        cache = PagedKVCache.for_model(
            model, int(args.kv_cache_memory * 2**30), "fp8" if kind == "fp8" else "auto"
        )
    engine = Engine(
        model,
        cache,
        cuda_graphs=True,
        max_num_seqs=1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=context
        + args.new_tokens,  # the graphs' block tables: as wide as this case needs
    )
    prompt = torch.randint(
        0, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(context)
    ).tolist()
    engine.add_request(Request(f"{kind}-{context}", prompt, args.new_tokens))
    tokens, steps = [], []
    began = time.perf_counter()
    while not tokens:
        for out in engine.step():
            tokens += out.new_token_ids
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - began
    layer_launches = []
    while engine.has_unfinished():
        # one untimed eager step: the GPU ops of each decoder layer
        if len(steps) == 2 and not layer_launches:
            graphs, engine.runner.graphs = engine.runner.graphs, None
            per_layer, outs = layer_ops(model.model.layers, engine.step)
            engine.runner.graphs, layer_launches = graphs, [launch_count(ops) for ops in per_layer]
            tokens += [t for out in outs for t in out.new_token_ids]
            continue
        began = time.perf_counter()
        for out in engine.step():
            tokens += out.new_token_ids
        steps.append(time.perf_counter() - began)
    decode_ms = statistics.median(steps[2:] or steps) * 1e3
    body, head = active_params(model, cfg)
    chunks = -(-context // args.max_num_batched_tokens)
    flops = (
        2 * body * context + 2 * head * chunks + attention_flops(cfg, 0, context, kind != "dense")
    )
    layer_bytes = cache.bytes_per_token // cfg.num_hidden_layers
    return {
        "kind": kind,
        "context": context,
        "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": context / prefill_s,
        "prefill_roofline": flops / prefill_s / PEAK_FLOPS,
        "decode_ms": decode_ms,
        "decode_tok_s": 1e3 / decode_ms,
        "decode_roofline": decode_bytes(model, cfg, context, kind, cache.bytes_per_token)
        / (decode_ms / 1e3)
        / PEAK_BYTES,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kv_bytes_layer": layer_bytes,
        "tokens": tokens,
        "layer_launches": layer_launches,
    }


def run(args) -> list[dict]:
    from spmoe.models.deepseek_v32.weights import build_model, load_model, write_fp8_checkpoint

    raw = glm_config(args.layers)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(
        cfg, ParallelConfig(tensor_parallel_size=1), False, set(), torch.bfloat16, "cuda"
    ).eval()
    random_weights(model)
    models = {"bf16": model}
    if "fp8" in args.weights:
        with tempfile.TemporaryDirectory() as folder:
            write_fp8_checkpoint(model, raw, Path(folder))
            models["fp8"] = load_model(
                folder, ParallelConfig(tensor_parallel_size=1), torch.bfloat16, "cuda"
            )
    rows = []
    for weights in args.weights:
        print(f"weights: {weights}", flush=True)
        rows += [{**row, "weights": weights} for row in run_model(models[weights], cfg, args)]
    for row in rows:
        twin = [
            r
            for r in rows
            if r["weights"] == "bf16"
            and r["kind"] == row["kind"]
            and r["context"] == row["context"]
        ]
        if row["weights"] == "fp8" and twin and "decode_ms" in row and "decode_ms" in twin[0]:
            print(
                f"FP8 / bf16 weights, {row['kind']} {row['context']}: prefill tokens/s "
                f"{row['prefill_tok_s'] / twin[0]['prefill_tok_s']:.2f}x, decode tokens/s "
                f"{row['decode_tok_s'] / twin[0]['decode_tok_s']:.2f}x"
            )
    return rows


def run_model(model, cfg, args) -> list[dict]:
    print(
        f"model: {args.layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, experts "
        f"{model.model.experts_backend.name}; {torch.cuda.memory_allocated() / 2**30:.1f} GiB",
        flush=True,
    )
    # compile and tune every kernel of the shapes timed below, once: at a context past index_topk,
    # so that the indexer's scoring kernels (which a shorter context skips: it keeps every position)
    # compile here too
    for kind in args.kinds:
        run_case(model, cfg, kind, max(min(args.contexts), 2 * cfg.index_topk), args)
    if args.profile:
        profile_prefill(model, cfg, args)
    rows, oom = [], set()
    for context in args.contexts:
        for kind in args.kinds:
            if kind in oom:
                rows.append(
                    {"kind": kind, "context": context, "skipped": "OOM at a smaller context"}
                )
                continue
            try:
                # untimed: the first prefill of a size pays one-off costs
                run_case(model, cfg, kind, context, args)
                rows.append(run_case(model, cfg, kind, context, args))
            except torch.cuda.OutOfMemoryError as e:
                oom.add(kind)
                rows.append({"kind": kind, "context": context, "oom": str(e).splitlines()[0][:90]})
            torch.cuda.empty_cache()
            print_row(rows[-1], rows)
    decode = {(r["kind"], r["context"]): r["decode_ms"] for r in rows if "decode_ms" in r}
    for kind in args.kinds:
        if (kind, 2048) in decode and (kind, 32768) in decode:
            print(
                f"{kind}: decode ms/step at 32k / at 2k = {decode[kind, 32768] / decode[kind, 2048]:.2f}"
            )
    return rows


def profile_prefill(model, cfg, args) -> None:
    """The CUDA kernels of one paged prefill of `max_num_batched_tokens` tokens, by total time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_case(
            model,
            cfg,
            "paged",
            args.max_num_batched_tokens,
            Namespace(**{**vars(args), "new_tokens": 3}),
        )
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=30, max_name_column_width=60
        ),
        flush=True,
    )


def print_row(row: dict, rows: list[dict]) -> None:
    label = f"{row['kind']:<6}{row['context']:>8}"
    if "oom" in row or "skipped" in row:
        print(f"{label}  {'OOM: ' + row['oom'] if 'oom' in row else row['skipped']}", flush=True)
        return
    agree = ""
    if row["kind"] == "fp8":
        same = [
            r
            for r in rows
            if r["kind"] == "paged" and r["context"] == row["context"] and "tokens" in r
        ]
        if same:
            matched = sum(a == b for a, b in zip(row["tokens"], same[0]["tokens"]))
            agree = f"  greedy = bf16 cache: {matched}/{len(row['tokens'])}"
    print(
        f"{label}  prefill {row['prefill_ms']:9.1f} ms {row['prefill_tok_s']:9.0f} tok/s "
        f"{row['prefill_roofline']:6.1%} FLOP roofline | decode {row['decode_ms']:7.2f} ms/step "
        f"{row['decode_tok_s']:7.1f} tok/s {row['decode_roofline']:6.1%} BW roofline | peak "
        f"{row['peak_gib']:6.1f} GiB | KV {row['kv_bytes_layer']} B/token/layer | GPU ops per layer "
        f"{row['layer_launches']}{agree}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--new-tokens", type=int, default=32)
    add_engine_args(parser, ("max_num_batched_tokens", "kv_cache_memory"))
    parser.set_defaults(kv_cache_memory=8.0)  # the paged kinds' budget in GiB
    parser.add_argument(
        "--profile", action="store_true", help="print the kernels of one paged prefill chunk"
    )
    parser.add_argument(
        "--weights", nargs="+", choices=("bf16", "fp8"), default=["bf16"], help="weights to run"
    )
    args = parser.parse_args()
    engine_args_from_cli(args)  # the engine options' checks
    spawn(run, 1, args, device="cuda", timeout_s=3600)


if __name__ == "__main__":
    main()
