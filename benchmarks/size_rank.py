"""Size one rank of a deployment: rank 0 of a TP x DP x EP layout run for real on this one device with the
other ranks simulated (`--simulate-rank`, `spmoe.distributed.simulated`), at the model's real widths and any
depth, with dummy weights of the checkpoint's types (FP8 block-128 where its config says FP8).

It reports, per depth in `--layers`:
- weights: bytes on this rank, per dense and per MoE layer, and projected to the config's full depth;
- KV capacity in tokens: bytes a token takes on this rank (every attention layer and the MTP layer; TP
  attention keeps every sequence's latent on every TP rank, DP attention one copy per DP group), how many
  fit beside the full-depth weights in `--memory-gib` less `--reserve-gib`, and so the node's;
- warm-up (`--warmup`): the engine's build (its CUDA graphs for up to `--graph-sizes` sequences) and
  `warm_up`, in seconds, with its graph captures and kernel compiles;
- per case (batch x context x MTP drafts k): the decode step as the engine runs it (the target's verify step
  over B x (k + 1) rows, then the drafter's k MTP passes), each captured in a CUDA graph of its own on CUDA
  (eager on the CPU), median ms; the target step's bytes floor (`bench_decode_step.step_bytes`: weights as
  stored, the experts this rank computes, the cache rows attended) over `--bandwidth`; its collectives
  (kind, path, count, bytes); the experts this rank computes per MoE layer against the uniform expectation;
  with `--kernels` (CUDA), the device time by kernel family of one eager target step and the FP8 linears'
  and routed experts' share of their bytes roofline inside it (`step_kernels.py`);
- a prefill of `--prefill` tokens (one sequence, chunks of `--chunk`), eager.

Cache rows are random (timing only). A case whose sequences need more blocks than the timing cache holds
shares blocks between sequences (`blocks_shared`: reads may hit in L2, so its time is optimistic); whether a
case fits the KV capacity is the projection's concern (`project_node.py`).

Raw output: JSON to `--out`. On the CPU at tiny widths (`--hf-overrides`) it proves the path end to end:

    python benchmarks/size_rank.py --tp 8 --layers 4 --batches 1 4 --contexts 64 --mtp 0 1 --prefill 64 \\
        --hf-overrides '{"hidden_size": 64, ...}' --device cpu --out /tmp/rank.json

On an H200 (see docs/deployment-sizing.md for the commands and their time):

    python benchmarks/size_rank.py --tp 8 --layers 78 --batches 1 64 --contexts 8192 --mtp 0 3 \\
        --out rank.json
"""

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_decode_step import step_bytes
from step_kernels import kernel_report

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.config.model import read_config
from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.distributed.simulated import banner
from spmoe.engine.args import EngineArgs
from spmoe.engine.build import build_engine
from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache, cache_layout, token_bytes
from spmoe.engine.runner.static_step import decode_hidden, draft_tokens, padded_tables
from spmoe.engine.warmup import warm_up
from spmoe.layers.moe.work import count_moe_work
from spmoe.models.deepseek_v32.weights import load_model, weight_bytes

CONFIG = Path(__file__).parent / "configs" / "glm-5.2" / "config.json"
H200_GIB = 139.8  # HBM3e an H200 reports (141 GB)


def depth_overrides(raw: dict, layers: int) -> dict:
    """--hf-overrides that cut the config to its first `layers` layers (their dense / MoE and indexer kinds)."""
    if not 1 <= layers <= raw["num_hidden_layers"]:
        raise ValueError(f"--layers must be in [1, {raw['num_hidden_layers']}], got {layers}")
    cut = {"num_hidden_layers": layers}
    for name in ("mlp_layer_types", "indexer_types"):
        if raw.get(name):
            cut[name] = raw[name][:layers]
    return cut


def weights_report(model, full: ModelConfig) -> dict:
    """Bytes of this rank's weights, per layer kind, and projected to `full`'s depth."""
    layers = model.model.layers
    per_layer = [weight_bytes(layer) for layer in layers]
    dense = [b for b, layer in zip(per_layer, layers) if not layer.is_moe]
    moe = [b for b, layer in zip(per_layer, layers) if layer.is_moe]
    total = weight_bytes(model)
    rest = total - sum(per_layer)  # embedding, head, final norm, MTP layers
    dense_full = sum(not full.layer_is_moe(i) for i in range(full.num_hidden_layers))
    moe_full = full.num_hidden_layers - dense_full
    projected = None
    if (dense or not dense_full) and (moe or not moe_full):
        projected = (
            rest + dense_full * (dense[0] if dense else 0) + moe_full * (moe[0] if moe else 0)
        )
    return {
        "bytes": total,
        "dense_layer_bytes": dense[0] if dense else None,
        "moe_layer_bytes": moe[0] if moe else None,
        "other_bytes": rest,
        "full_depth_bytes": projected,
    }


def kv_report(
    model,
    full: ModelConfig,
    parallel: ParallelConfig,
    memory_gib: float,
    reserve_gib: float,
    weights_full: int | None,
    kv_cache_dtype: str,
) -> dict:
    """KV bytes per token on this rank (at the run's depth and at full depth) and the tokens that fit."""
    cfg, layers, dtype, _ = cache_layout(model)
    full_layers = {i: full.layer_has_indexer(i) for i in range(full.num_hidden_layers)}
    for i in range(full.num_hidden_layers, full.num_hidden_layers + len(model.mtp)):
        full_layers[i] = True  # the MTP layer keeps its own rows, and its own indexer
    per_token = token_bytes(cfg, layers, dtype, kv_cache_dtype)
    per_token_full = token_bytes(full, full_layers, dtype, kv_cache_dtype)
    room = None if weights_full is None else memory_gib * 2**30 - reserve_gib * 2**30 - weights_full
    tokens = None if room is None else max(0, int(room // per_token_full))
    return {
        "bytes_per_token": per_token,
        "bytes_per_token_full_depth": per_token_full,
        "memory_gib": memory_gib,
        "reserve_gib": reserve_gib,
        "rank_tokens_full_depth": tokens,
        # TP attention: every TP rank holds every sequence of its DP group; DP groups hold their own
        "node_tokens_full_depth": None if tokens is None else tokens * parallel.data_parallel_size,
    }


class Timer:
    """Median ms of a step: CUDA graph replays timed with CUDA events, or eager calls on the CPU."""

    def __init__(self, device: torch.device, reps: int):
        self.cuda, self.reps = device.type == "cuda", reps

    def __call__(self, fn) -> float:
        if not self.cuda:
            fn()
            times = []
            for _ in range(self.reps):
                began = time.perf_counter()
                fn()
                times.append((time.perf_counter() - began) * 1e3)
            return statistics.median(times)
        from timing import cuda_ms, graphed

        replay = graphed(fn)  # this case alone, captured now and released after
        try:
            return cuda_ms(replay, self.reps, warmup=2)
        finally:
            del replay
            torch.cuda.empty_cache()


def expert_hits(calls: list[torch.Tensor], tokens: int, cfg: ModelConfig) -> list[dict]:
    """Per MoE call: experts of this rank that computed rows, and the uniform expectation when `tokens`
    tokens each pick k distinct of E experts: E_r * (1 - (1 - k / E) ** tokens)."""
    miss = (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** tokens
    return [
        {
            "experts_hit": int((rows > 0).sum()),
            "expected": round(len(rows) * (1 - miss), 2),
            "rows": int(rows.sum()),
        }
        for rows in calls
    ]


def decode_case(model, cache, timer, batch: int, context: int, k: int, width: int, opts) -> dict:
    """One decode step of `batch` sequences with `context` cached tokens and k drafts each."""
    device, cfg, per_seq = cache.device, model.cfg, k + 1
    used = -(
        -(context + 2 * per_seq) // BLOCK_SIZE
    )  # the drafter's steps write past the verified rows
    shared = batch * used > cache.num_blocks
    tables = [[(i * used + j) % cache.num_blocks for j in range(used)] for i in range(batch)]
    block_tables = torch.from_numpy(padded_tables(tables, batch + 1, width, cache.scratch_block))
    block_tables = block_tables.to(device)
    gen = torch.Generator(device="cpu").manual_seed(batch * 7919 + context)
    inputs = torch.stack(
        [
            torch.randint(0, cfg.vocab_size, (batch * per_seq,), generator=gen),
            torch.arange(batch).repeat_interleave(per_seq),
            (context + torch.arange(per_seq)).repeat(batch),
        ]
    ).to(device)

    def target():
        hidden = decode_hidden(model, cache, inputs, block_tables)
        return model.compute_logits(hidden), hidden

    with torch.no_grad(), count_collectives() as counted, count_moe_work() as work:
        _, hidden = target()
    result = {
        "batch": batch,
        "context": context,
        "mtp_k": k,
        "blocks_shared": shared,
        "target_ms": timer(target),
        "collectives": counted.path_rows(),
        "experts": expert_hits(
            work.calls, batch * per_seq * model.parallel.data_parallel_size, cfg
        ),
    }
    touched = [hit["experts_hit"] for hit in result["experts"]]
    rows = [(batch, context + j) for j in range(per_seq)]
    result["floor_ms"] = step_bytes(model, cache, rows, touched) / opts.bandwidth * 1e3
    if opts.kernels and device.type == "cuda":
        result["kernels"] = kernel_report(target, model, touched, opts.bandwidth)
    result["drafter_ms"] = 0.0
    if k:
        next_ids = inputs[0].roll(-1)
        last = torch.arange(batch, device=device) * per_seq + k  # every draft verified
        where = torch.arange(batch, device=device)
        first = torch.full((batch,), context + per_seq, device=device)
        forced = torch.full((batch, k), -1, device=device)  # MTP drafts every slot

        def drafter():
            return draft_tokens(
                model, cache, inputs, block_tables, hidden, next_ids, last, where, first, forced
            )

        with torch.no_grad(), count_collectives() as counted:
            drafter()
        result["drafter_ms"] = timer(drafter)
        result["drafter_collectives"] = counted.path_rows()
    result["step_ms"] = result["target_ms"] + result["drafter_ms"]
    return result


def prefill_case(model, cache, tokens: int, chunk: int) -> dict:
    """One sequence's prompt of `tokens` tokens in chunks of `chunk`, eager (as the engine runs prompts)."""
    device, cfg = cache.device, model.cfg
    used = -(-tokens // BLOCK_SIZE)
    if used > cache.num_blocks:
        return {"tokens": tokens, "fits_timing_cache": False}
    table = [list(range(used))]
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def prefill():
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            view = cache.view(table, [start], [n])
            hidden = model.forward_hidden(ids[start : start + n], view.positions, [n], view)
            model.compute_logits(hidden, torch.tensor([n - 1], device=device))

    with torch.no_grad(), count_collectives() as counted:
        prefill()
        times = []
        for _ in range(3):  # host-timed: prompts run eagerly
            began = time.perf_counter()
            prefill()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
    ms = statistics.median(times)
    return {"tokens": tokens, "chunk": chunk, "ms": ms, "collectives": counted.path_rows()}


def warmup_report(model, opts, parallel: ParallelConfig) -> dict:
    """The engine's build (its graphs) and warm-up over this model, timed."""
    args = EngineArgs(
        tp=parallel.tensor_parallel_size,
        dp=parallel.data_parallel_size,
        sp=parallel.sp,
        simulate_rank=True,
        simulated_load=parallel.simulated_load,
        load_format="dummy",
        device=opts.device,
        dtype=opts.dtype,
        max_num_seqs=opts.graph_sizes,
        max_model_len=opts.max_model_len,
        kv_cache_memory=opts.warmup_kv_gib,
        speculative="mtp" if opts.warmup_mtp else None,
        num_speculative_tokens=opts.warmup_mtp or None,
        # as `spmoe serve` leaves it: CUDA graphs wherever they apply (the field's default is off)
        cuda_graphs=None,
    )
    began = time.perf_counter()
    engine = build_engine(args, model, opts.graph_sizes, opts.max_model_len)
    built = time.perf_counter() - began
    report = warm_up(engine)
    return {
        "build_s": built,
        "warm_up_s": report["seconds"],
        "total_s": built + report["seconds"],
        "graph_sizes": opts.graph_sizes,
        "mtp_k": opts.warmup_mtp,
        **{key: report[key] for key in ("kernel_compiles", "graph_captures") if key in report},
    }


def deployment(opts) -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=opts.tp,
        data_parallel_size=opts.dp,
        sp=opts.sp,
        simulate_rank=True,
        simulated_load=opts.load,
    )


def size_rank(opts) -> list[dict]:
    """Every depth of `opts.layers` on this rank -> one record each."""
    state, parallel = get_parallel_state(), deployment(opts)
    print(banner(parallel), file=sys.stderr, flush=True)
    raw = read_config(opts.config, opts.hf_overrides)
    full = ModelConfig.from_dict(raw)
    dtype, device = getattr(torch, opts.dtype), state.device
    timer = Timer(device, opts.reps)
    records = []
    for layers in opts.layers:
        overrides = {**(opts.hf_overrides or {}), **depth_overrides(raw, layers)}
        began = time.perf_counter()
        model = load_model(
            opts.config,
            parallel,
            dtype,
            device,
            with_mtp=max(*opts.mtp, opts.warmup_mtp) > 0,
            load_format="dummy",
            overrides=overrides,
        )
        record = {
            "layers": layers,
            "load_s": time.perf_counter() - began,
            "weights": weights_report(model, full),
        }
        record["kv"] = kv_report(
            model,
            full,
            parallel,
            opts.memory_gib,
            opts.reserve_gib,
            record["weights"]["full_depth_bytes"],
            opts.kv_cache_dtype,
        )
        if opts.warmup:
            record["warmup"] = warmup_report(model, opts, parallel)
        width = -(-opts.max_model_len // BLOCK_SIZE)
        cache = PagedKVCache.for_model(model, int(opts.timing_kv_gib * 2**30), opts.kv_cache_dtype)
        for layer in cache.layers.values():  # random rows (timing only), FP8 ones through bf16
            for t in (layer.latent, layer.rope, layer.index_key):
                if t is not None:
                    t.copy_(torch.randn(t.shape, dtype=torch.bfloat16, device=t.device))
        print(f"layers {layers}: {json.dumps(record)}", file=sys.stderr, flush=True)
        record["decode"] = []
        for c, b, k in itertools.product(opts.contexts, opts.batches, opts.mtp):
            case = decode_case(
                model, cache, timer, b, c, k, max(width, -(-(c + k + 1) // BLOCK_SIZE)), opts
            )
            record["decode"].append(case)
            print(f"layers {layers}: {json.dumps(case)}", file=sys.stderr, flush=True)
        record["prefill"] = [prefill_case(model, cache, n, opts.chunk) for n in opts.prefill]
        records.append(record)
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def sized_without_grad(opts) -> list[dict]:
    with torch.no_grad():
        return size_rank(opts)


def summary(run: dict) -> str:
    lines = [
        f"simulated rank 0 of tp={run['tp']} x dp={run['dp']}, sp {run['sp']}, load {run['load']}"
    ]
    for record in run["records"]:
        w, kv = record["weights"], record["kv"]
        full = w["full_depth_bytes"]
        lines.append(
            f"{record['layers']} layers: weights {w['bytes'] / 2**30:.2f} GiB"
            + (f" ({full / 2**30:.2f} GiB at full depth)" if full else "")
            + f"; KV {kv['bytes_per_token_full_depth']} B/token at full depth, "
            f"{kv['rank_tokens_full_depth']} tokens a rank, {kv['node_tokens_full_depth']} a node"
        )
        if "warmup" in record:
            lines.append(f"  warm-up: {record['warmup']['total_s']:.1f} s {record['warmup']}")
        for case in record["decode"]:
            lines.append(
                f"  decode B={case['batch']} ctx={case['context']} k={case['mtp_k']}: "
                f"{case['step_ms']:.3f} ms (target {case['target_ms']:.3f}, floor "
                f"{case['floor_ms']:.3f}); collectives "
                + ", ".join(f"{c['kind']}/{c['path']} x{c['count']}" for c in case["collectives"])
                + (" [blocks shared]" if case["blocks_shared"] else "")
            )
            kernels = case.get("kernels", {})
            if kernels:
                lines.append(
                    f"    device busy {kernels['busy_us'] / 1e3:.3f} ms; "
                    + ", ".join(
                        f"{name} {row['us'] / 1e3:.3f} ms"
                        + (f" ({row['roofline']:.0%} of roofline)" if "roofline" in row else "")
                        for name, row in kernels.items()
                        if name != "busy_us"
                    )
                )
                lines.extend(
                    f"      other: {top['kernel'][:80]} x{top['launches']} {top['us'] / 1e3:.3f} ms"
                    for top in kernels.get("other", {}).get("top", [])
                )
            hits = case["experts"]
            if hits:
                lines.append(
                    "    experts hit per MoE layer (this rank / uniform): "
                    + " ".join(f"{h['experts_hit']}/{h['expected']}" for h in hits)
                )
        for case in record["prefill"]:
            lines.append(f"  prefill {case['tokens']}: {case.get('ms', float('nan')):.1f} ms")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(CONFIG), help="a config.json or checkpoint folder")
    p.add_argument(
        "--hf-overrides", type=json.loads, default=None, help="JSON merged into the config"
    )
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--load", choices=("rank0", "busiest"), default="busiest")
    p.add_argument(
        "--layers", type=int, nargs="+", default=[78], help="depths, each a model of its own"
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192])
    p.add_argument("--mtp", type=int, nargs="+", default=[0], help="MTP drafts k per step")
    p.add_argument("--prefill", type=int, nargs="*", default=[8192])
    p.add_argument("--chunk", type=int, default=8192, help="prompt tokens a forward takes")
    p.add_argument("--max-model-len", type=int, default=32768 + 1024)
    p.add_argument("--warmup", action="store_true", help="time the engine's build and warm-up")
    p.add_argument("--graph-sizes", type=int, default=64, help="warm-up: graphs up to this batch")
    p.add_argument("--warmup-mtp", type=int, default=0, help="warm-up: MTP drafts k")
    p.add_argument("--warmup-kv-gib", type=float, default=4.0)
    p.add_argument("--timing-kv-gib", type=float, default=8.0, help="the cache the cases read")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument(
        "--memory-gib", type=float, default=H200_GIB, help="device memory of the node's GPUs"
    )
    p.add_argument("--reserve-gib", type=float, default=8.0, help="kept back from the KV cache")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s of the floor")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--kernels",
        action="store_true",
        help="per case, device time by kernel family and the weight streams' share of --bandwidth",
    )
    p.add_argument("--out", required=True, help="the raw output, JSON")
    opts = p.parse_args(argv)
    if max(opts.contexts) + max(opts.mtp) + 1 > opts.max_model_len:
        p.error(f"--max-model-len {opts.max_model_len} is shorter than the longest case")
    parallel = deployment(opts)
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records = spawn(sized_without_grad, 1, opts, config=parallel, device=opts.device)[0]
    run = {
        "date": began,
        "device": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu",
        "tp": opts.tp,
        "dp": opts.dp,
        "sp": "on" if parallel.use_sequence_parallel_moe else "off",
        "load": opts.load,
        "config": str(opts.config),
        "full_layers": ModelConfig.from_dict(
            read_config(opts.config, opts.hf_overrides)
        ).num_hidden_layers,
        "hf_overrides": opts.hf_overrides,
        "bandwidth": opts.bandwidth,
        "argv": sys.argv[1:] if argv is None else argv,
        "records": records,
    }
    Path(opts.out).write_text(json.dumps(run, indent=1))
    print(summary(run))


if __name__ == "__main__":
    main()
