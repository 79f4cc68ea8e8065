"""One decode step (or one short prompt chunk after a cached context) against its bytes roofline on one GPU
(TP 1), with the fused Triton kernels (add + RMSNorm, rope in place, the router, absorbed MLA's per-head
projections, among others; cos/sin looked up in the model's table) and with their torch references
(`spmoe.layers.fused.ENABLED` off), in one run.

The model: GLM-5.2 widths (H 6144, 64 heads, q_lora 2048, kv_lora 512, DSA indexer) in 4 layers, 1 dense and
3 MoE of 64 experts top-8 + 1 shared, vocab 32768, random bf16 weights, Triton experts, the paged latent
cache (sparse absorbed MLA) as large as the largest case needs. `--weights fp8` writes the model's FP8
block-128 twin (every linear but the indexer's head weights; `write_fp8_checkpoint`) and loads it as spmoe
loads an FP8 checkpoint, so every linear runs its FP8 kernels; `--weights bf16 fp8` times both in one run
and prints the FP8 speed-up per case. Each case prefills B sequences of `context` tokens (in forwards of at
most `PREFILL_TOKENS` tokens), then times the step that decodes one more token per sequence (model + LM
head), launched eagerly and replayed from a CUDA graph (CUDA-event median). "busy ms" sums the device time
of the kernels one eager step launches: graph ms minus busy ms is the time the GPU sits between kernels.

A case "BxC" decodes one token for each of B sequences of C cached tokens; "BxC+T" feeds T prompt tokens per
sequence after its C cached ones and computes the logits of each sequence's last one; parts joined by ","
make one step ("63x1024,1x0+128": 63 sequences decoding beside a 128-token prompt). The "graph" column
captures exactly the case's rows; the engine replays every step of up to 512 tokens from a graph too (a
decode step's, or a mixed step's), but pads the rows to its graph sizes and its tables are max_model_len
wide.

Each case's block tables are as wide as `--widths` says: by default a power of 2 of blocks covering the
context and the new tokens. Up to index_topk positions the indexer selects every visible row without scoring;
"1x4096" takes the path that scores and takes the top-k.

The roofline: the bytes the step must read (as the weights are stored: FP8 weights count 1 byte and their
scales) over 4.3 TB/s (the H200's measured copy bandwidth): every weight but
the routed experts' and the embedding's, the routed experts the step's tokens pick (counted), B embedding
rows, and the cache rows the step attends (above index_topk positions the indexer scores all `context` rows;
MLA reads at most index_topk). Also the GPU operations one eager step launches, per decoder layer, and the top
kernels.

Block tables: `--widths` lists how wide each case's tables are: "pow2" (the default), a power of 2 of blocks
covering the context and the new token (what the engine's graphs used when they were captured per (batch,
width)), and/or max_model_len values, to whose blocks the tables are padded with the scratch block (what the
engine's one graph per batch size does: the kernels read each row's real position). Up to index_topk positions
in the tables the indexer selects every visible row without scoring; wider tables score and take the top-k.

    python benchmarks/bench_decode_step.py [--cases 1x16 8x512 1x4096] [--weights bf16 fp8] [--kernels fused]
    python benchmarks/bench_decode_step.py --cases 1x1024 48x1024 64x1024 128x1024 256x1024 256x4096
    python benchmarks/bench_decode_step.py --cases 1x2048 64x1024 256x1024 --widths pow2 32768 --kernels fused
    python benchmarks/bench_decode_step.py --cases 1x8192+64 63x1024,1x0+128 15x1024,1x8192+256 --kernels fused
"""

import argparse
import tempfile
from pathlib import Path

import torch
from bench_dp import GLM, random_weights
from timing import cuda_ms, gpu_ops, graphed, launch_count, layer_ops

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import spawn
from spmoe.engine.cache.paged import BLOCK_SIZE, PagedKVCache
from spmoe.engine.runner.graphs import padded_tables
from spmoe.layers import fused
from spmoe.layers.moe.moe import MoE
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM
from spmoe.models.deepseek_v32.weights import load_model, write_fp8_checkpoint

MODEL = {
    **GLM,
    "num_hidden_layers": 4,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "indexer_types": ["full", "shared", "full", "shared"],
    "n_routed_experts": 64,
    "vocab_size": 32768,
}
BANDWIDTH = 4.3e12  # bytes/s
# the sequences of a case are prefilled in forwards of at most this many tokens
PREFILL_TOKENS = 16384
TOP = 40  # kernels listed per profile


def step_bytes(
    model, cache: PagedKVCache, rows: list[tuple[int, int]], experts_touched: list[int]
) -> int:
    """The bytes one step must read (see the module docstring): `rows` lists (tokens, the context each
    attends) of its parts: a chunk's token j after c cached ones attends c + j positions, each a row of its own."""
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    routed = {id(p) for m in moe for p in m.experts.parameters()}
    embedding = model.model.embed_tokens.weight
    total = nbytes(p for p in model.parameters() if id(p) not in routed and p is not embedding)
    total += sum(n for n, _ in rows) * embedding.shape[1] * embedding.element_size()
    for m, touched in zip(moe, experts_touched):
        total += nbytes(m.experts.parameters()) // m.experts.count * touched
    for layer in cache.layers.values():
        latent_row = nbytes(
            t[0] for t in (layer.latent, layer.latent_scale, layer.rope) if t is not None
        )
        index_row = nbytes(t[0] for t in (layer.index_key, layer.index_scale) if t is not None)
        for n, context in rows:
            # the rows the indexer scores: none when it keeps every visible row
            scored = context + 1 if context + 1 > model.cfg.index_topk else 0
            total += n * (scored * index_row + min(context + 1, model.cfg.index_topk) * latent_row)
    return total


def touched_experts(model, step) -> list[int]:
    """Distinct routed experts each MoE layer's router picks in one eager `step`."""
    picked = []
    hooks = [
        m.gate.register_forward_hook(
            lambda _m, _in, out: picked.append(int(out[0].unique().ge(0).sum()))
        )
        for m in model.modules()
        if isinstance(m, MoE)
    ]
    step()
    for hook in hooks:
        hook.remove()
    return picked


def models(weights: list[str]) -> dict:
    """weights kind -> the model: random bf16 weights, and (fp8) its FP8 twin written and loaded."""
    cfg = ModelConfig.from_dict(MODEL)
    model = DeepseekV32ForCausalLM(cfg, ParallelConfig(), torch.bfloat16, "cuda").eval()
    random_weights(model)
    out = {"bf16": model}
    if "fp8" in weights:
        with tempfile.TemporaryDirectory() as folder:
            write_fp8_checkpoint(model, MODEL, Path(folder))
            out["fp8"] = load_model(folder, ParallelConfig(), torch.bfloat16, "cuda")
    return {kind: out[kind] for kind in weights}


def parse_case(case: str) -> list[tuple[int, int, int]]:
    """ "BxC", "BxC+T", or parts joined by "," (one step) -> [(B sequences, C cached tokens each, T tokens each
    feeds)]."""
    parts = []
    for part in case.split(","):
        batch, rest = part.split("x")
        context, _, tokens = rest.partition("+")
        parts.append((int(batch), int(context), int(tokens or 1)))
    return parts


def run(
    cases: list[list[tuple[int, int, int]]],
    weights: list[str],
    kernel_kinds: list[str],
    widths: list[str],
):
    rows = []
    for kind, model in models(weights).items():
        rows += run_model(model, kind, cases, kernel_kinds, widths)
    return rows


def table_width(name: str, context: int, tokens: int) -> int:
    """Blocks in a case's block tables: "pow2" (a power of 2 covering the context and the new tokens), or a
    max_model_len's."""
    used = -(-(context + tokens) // BLOCK_SIZE)
    return 1 << (used - 1).bit_length() if name == "pow2" else -(-int(name) // BLOCK_SIZE)


def run_model(
    model, weights: str, cases: list[list[tuple[int, int, int]]], kernel_kinds: list[str], widths
):
    cfg = model.cfg
    blocks = lambda c, t: -(-(c + t) // BLOCK_SIZE)  # noqa: E731
    block_bytes = PagedKVCache.for_model(model, 1 << 24).bytes_per_token * BLOCK_SIZE
    most = max(sum(b * blocks(c, t) for b, c, t in parts) for parts in cases)
    cache = PagedKVCache.for_model(model, (most + 1) * block_bytes)
    rows = []
    for parts in cases:
        tables, starts, lens, first = [], [], [], 0
        for batch, context, tokens in parts:
            used = blocks(context, tokens)
            tables += [list(range(first + i * used, first + (i + 1) * used)) for i in range(batch)]
            starts += [context] * batch
            lens += [tokens] * batch
            first += batch * used
        gen = torch.Generator(device="cuda").manual_seed(len(tables))
        next_ids = torch.randint(0, cfg.vocab_size, (sum(lens),), device="cuda", generator=gen)
        with torch.no_grad():
            first = 0
            # sequences of one part prefilled together, as an engine's token budget
            for (
                batch,
                context,
                _,
            ) in parts:
                group = max(1, PREFILL_TOKENS // max(context, 1))
                for at in range(first, first + batch if context else first, group):
                    part = tables[at : min(at + group, first + batch)]
                    prompt = cache.view(part, [0] * len(part), [context] * len(part))
                    ids = torch.randint(
                        0, cfg.vocab_size, (len(part) * context,), device="cuda", generator=gen
                    )
                    model.forward_hidden(ids, prompt.positions, [context] * len(part), prompt)
                first += batch
        seq_index = torch.arange(len(tables)).repeat_interleave(torch.tensor(lens)).cuda()
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(starts, lens)]).cuda()
        for width_name in widths:
            width = max(table_width(width_name, c, t) for _, c, t in parts)
            decode = cache.decode_view(
                torch.from_numpy(
                    padded_tables(tables, len(tables), width, cache.scratch_block)
                ).cuda(),
                seq_index,
                positions,
            )
            rows += time_step(
                model,
                cache,
                weights,
                parts,
                f"{width_name}:{width}",
                next_ids,
                decode,
                kernel_kinds,
            )
    fused.ENABLED = True
    return rows


def time_step(model, cache, weights, parts, width, next_ids, decode, kernel_kinds) -> list[tuple]:
    """One step over the view `decode` (parts: as `parse_case`), eager and replayed, per kernel kind -> the rows
    `run` returns."""
    rows = []
    lens = [t for b, _, t in parts for _ in range(b)]
    # each sequence's last fed token's logits (a decode token's, a prompt chunk's last): what a step commits from
    logit_rows = None if all(n == 1 for n in lens) else (torch.tensor(lens).cumsum(0) - 1).cuda()
    name = ",".join(f"{b}x{c}" + (f"+{t}" if t > 1 else "") for b, c, t in parts)
    with torch.no_grad():

        def step():
            hidden = model.forward_hidden(next_ids, decode.positions, [1] * sum(lens), decode)
            return model.compute_logits(hidden, logit_rows)

        touched = touched_experts(model, step)
        floor = (
            step_bytes(model, cache, [(b, c + j) for b, c, t in parts for j in range(t)], touched)
            / BANDWIDTH
            * 1e3
        )
        for kernels in kernel_kinds:
            fused.ENABLED = kernels == "fused"
            eager = cuda_ms(step, 20, warmup=2)
            replay = graphed(step)
            graph = cuda_ms(replay, 50, warmup=3)
            del replay
            ops = gpu_ops(step)
            busy = sum(micros for _, micros in ops.values()) / 1e3
            per_layer = layer_ops(model.model.layers, step)[0]
            rows.append(
                (
                    weights,
                    name,
                    width,
                    kernels,
                    eager,
                    graph,
                    floor,
                    busy,
                    launch_count(ops),
                    per_layer,
                    sorted(ops.items(), key=lambda kv: -kv[1][1])[:TOP],
                )
            )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases",
        nargs="*",
        default=["1x16", "8x512", "1x4096"],
        help="BxC, BxC+T, parts joined by ','",
    )
    p.add_argument(
        "--weights", nargs="+", choices=("bf16", "fp8"), default=["bf16"], help="weights to time"
    )
    p.add_argument("--kernels", nargs="+", choices=("torch", "fused"), default=["torch", "fused"])
    p.add_argument(
        "--widths",
        nargs="+",
        default=["pow2"],
        help="block-table widths: pow2 and/or max_model_len values",
    )
    args = p.parse_args()
    cases = [parse_case(case) for case in args.cases]
    rows = spawn(
        run,
        1,
        cases,
        args.weights,
        args.kernels,
        args.widths,
        config=ParallelConfig(),
        device="cuda",
    )[0]
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; GLM-5.2 widths, 4 layers (1 dense + 3 "
        f"MoE, 64 experts top-8), vocab 32768, bf16 activations, TP 1, paged cache; roofline = bytes read / 4.3 TB/s"
    )
    print(
        f"{'weights':>7} {'case':>18} {'width:blocks':>12} {'kernels':>7} {'eager ms':>9} "
        f"{'graph ms':>9} {'floor ms':>9} {'% roofline':>10} {'busy ms':>8} {'GPU ops/step':>12}  "
        "GPU ops per decoder layer"
    )
    for weights, case, width, kernels, eager, graph, floor, busy, ops, per_layer, _ in rows:
        print(
            f"{weights:>7} {case:>18} {width:>12} {kernels:>7} {eager:>9.3f} {graph:>9.3f} {floor:>9.3f} "
            f"{100 * floor / graph:>9.1f}% {busy:>8.3f} {ops:>12}  {[launch_count(layer) for layer in per_layer]}"
        )
    graph_ms = {(w, c, t, k): g for w, c, t, k, _, g, *_ in rows}
    for (weights, case, width, kernels), ms in graph_ms.items():
        if weights == "fp8" and ("bf16", case, width, kernels) in graph_ms:
            bf16 = graph_ms["bf16", case, width, kernels]
            print(
                f"FP8 speed-up, {case}, {width}, {kernels}, graphs: {bf16 / ms:.2f}x ({bf16:.3f} -> {ms:.3f} ms)"
            )
    for weights, case, width, kernels, *_, top in rows:
        print(
            f"\ntop kernels, {weights} weights, {case}, {width}, {kernels} (one eager step): launches, total us"
        )
        for name, (count, micros) in top:
            print(f"  {count:>4} {micros:>9.1f}  {name[:110]}")
    for weights, case, width, kernels, *_, per_layer, _ in rows:
        if kernels != "fused":
            continue
        print(f"\nGPU operations of each decoder layer, {weights}, {case}, {width}")
        for index, ops in enumerate(per_layer):
            print(
                f"layer {index}: "
                + ", ".join(f"{n} x {name[:60]}" for name, (n, _) in sorted(ops.items()))
            )


if __name__ == "__main__":
    main()
