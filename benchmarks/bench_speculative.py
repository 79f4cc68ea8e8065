"""MTP speculation against plain decoding, on one GPU or on `--tp` GPUs (TP attention, the experts split over
the ranks): decode tokens/s with k = 1, 2, 3 drafts per step at batch 1, 16 and 64, greedy and sampled, against
no speculation (eager, and replayed from CUDA graphs).

The model is GLM-5.2 wide with a few layers (default 4: 1 dense, 3 MoE of `--experts` experts top-8, vocab
`--vocab`) and its MTP layer, random bf16 weights generated on the device, built so that the MTP layer agrees
with the target often (as the demo's checkpoint is): the LM head is a permutation of the embedding, the MTP
layer's eh_proj passes the next token's embedding through, and every layer's output projections are scaled
down (`--residual-scale`), so the hidden state stays close to the token's embedding and each token has one
likely successor that both the target and the MTP layer predict. The acceptance rate printed per row says how
often they did agree. With `--tp N` every rank runs the same generations, as `spmoe generate` does under TP;
at batch 1 a step is then set by the collectives and their latency more than by one GPU's weight bytes.

`--sources` adds the other draft sources at each k (`ngram`, `suffix`: the lookup alone; `mtp+ngram`,
`mtp+suffix`: the hybrid). `--workload edit` makes each answer copy its prompt, as a code edit does: the
prompt is a random prefix R, the model's own greedy continuation G of R (`--new-tokens` long, from a plain
run), then R again, so that the answer is G again (the random model's next token hardly depends on more
than the last one). The random model copies by construction: the figure measures what the lookups and
the drafter's graph cost and what longer accepted runs give on the GPU, not GLM-5.2's acceptance
(`eval_draft_sources.py` measures acceptance on real text).

Per row: `--new-tokens` tokens after a `--prompt-len` random prompt per sequence, on the paged cache; decode
tokens/s = tokens committed by decode steps / (the decode steps' seconds + the MTP draft steps' seconds), from
the engine's own phase timings (rank 0's), and its ratio to k = 0 in the same mode (eager or CUDA graphs);
"target ms": one decode step of the target (with k drafts: the verification of k + 1 tokens per sequence, with
the choice of tokens), and its ratio to the plain decode step (goal at batch 1-16: <= 1 + 0.1 k); "draft ms":
the MTP drafter's seconds per decode step, and "MTP fwd" its forwards per decode step (k, or fewer where
the hybrid's lookup drafted a step alone: `Speculator.lookup_fills`). Each configuration runs once
untimed first (Triton's JIT, graph capture).

    python benchmarks/bench_speculative.py [--layers 4] [--batches 1 16 64] [--drafts 1 2 3] [--temperatures 0 1]
    python benchmarks/bench_speculative.py --tp 8 --experts 256 --vocab 154880 --layers 16 --batches 1 16 \\
        --drafts 1 3 --temperatures 0          # GLM-5.2's shape on 8 GPUs, expert parallel
    python benchmarks/bench_speculative.py --device cpu --tp 2 --layers 2 --experts 8 --batches 1 --drafts 1 \\
        --temperatures 0 --prompt-len 16 --new-tokens 8   # the script itself, on the CPU (float32, gloo)
    python benchmarks/bench_speculative.py --workload edit --batches 1 16 --drafts 3 --temperatures 0 \\
        --sources mtp mtp+ngram ngram --prompt-len 256 --new-tokens 256   # code editing: hybrid vs MTP
"""

import argparse
import zlib

import torch
from bench_generate import glm_config

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.config.parallel import SP_MODES
from spmoe.distributed import get_parallel_state, spawn
from spmoe.engine.args import check_device
from spmoe.engine.ranks import channel, generate


def agreeing_weights(model, residual_scale: float) -> None:
    """On a model of random weights (`random_model`: the same whatever the number of ranks), the structure the
    MTP layer finds: LM head = a permutation of the embedding, eh_proj = [identity, 0] (the next token's
    embedding passes through), output projections of attention and MLPs scaled by `residual_scale` (the
    residual stream stays near the token's embedding). Under TP the embedding and the LM head hold a slice of
    the vocab rows each: every rank draws the same full `[V, H]` embedding and copies its own rows of it and of
    its permutation."""
    with torch.no_grad():
        embed, head = model.model.embed_tokens, model.lm_head
        vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
        device, dtype = embed.weight.device, embed.weight.dtype
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(b"embed"))
        full = torch.empty(vocab, hidden, dtype=dtype, device=device).normal_(
            0, hidden**-0.5, generator=gen
        )
        perm = torch.randperm(
            vocab, generator=torch.Generator().manual_seed(zlib.crc32(b"perm"))
        ).to(device)
        embed.weight.copy_(full[embed.start : embed.start + embed.weight.shape[0]])
        head.weight.copy_(full[perm[head.start : head.start + head.weight.shape[0]]])
        del full
        for name, p in model.named_parameters():
            if name.endswith("eh_proj.weight"):  # [H, 2H], replicated
                p.zero_()
                p[:, :hidden].copy_(torch.eye(hidden, dtype=p.dtype, device=p.device))
            elif "o_proj" in name or "down_proj" in name:
                p.mul_(residual_scale)


def speculation(source: str, k: int):
    """The engine's draft sources for a `--sources` name and k."""
    from spmoe.engine.speculation import NgramConfig, Speculation, SuffixConfig

    lookup = source.removeprefix("mtp").removeprefix("+") or None
    config = {
        None: None,
        "ngram": NgramConfig(prompt_lookup_min=2, prompt_lookup_max=5),
        "suffix": SuffixConfig(),
    }[lookup]
    return Speculation(num_speculative_tokens=k, mtp=source.startswith("mtp"), lookup=config)


def engine_for(model, args, batch: int, k: int, source: str, graphs: bool):
    from spmoe.engine.cache.paged import build_paged_cache
    from spmoe.engine.engine import Engine

    longest = prompt_len(args) + args.new_tokens + k
    cache = build_paged_cache(model, args.kv_cache_memory, None, "auto", batch, longest)
    return Engine(
        model,
        cache,
        cuda_graphs=graphs,
        max_num_seqs=batch,
        max_model_len=longest,
        enable_prefix_caching=False,
        ranks=channel(),
        speculation=speculation(source, k),
    )


def prompt_len(args) -> int:
    return args.prompt_len * 2 + args.new_tokens if args.workload == "edit" else args.prompt_len


def prompts_for(model, args, batch: int) -> list[list[int]]:
    """`batch` random prompts, or with `--workload edit` each R + G + R (see the module)."""
    from spmoe.engine.ranks import generate

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(
        0, model.cfg.vocab_size, (batch, args.prompt_len), generator=gen
    ).tolist()
    if args.workload != "edit":
        return prompts
    engine = engine_for(model, args, batch, 0, "mtp", graphs=False)
    answers = generate(engine, prompts, args.new_tokens).outputs
    del engine
    return [r + g + r for r, g in zip(prompts, answers)]


def decode_rate(
    model, args, batch: int, k: int, temperature: float, graphs: bool, source: str, prompts
) -> dict:
    from spmoe.engine.request import SamplingParams

    engine = engine_for(model, args, batch, k, source, graphs)
    sampling = SamplingParams(temperature=temperature, seed=1)
    # untimed, as long as the timed run: compiles, captures
    generate(engine, prompts, args.new_tokens, sampling)
    stats = generate(engine, prompts, args.new_tokens, sampling).stats
    spec = stats.get("speculative", {})
    target, drafter = stats["phases"]["decode"], stats["phases"]["draft"]
    del engine
    torch.cuda.empty_cache()
    return {
        "tok_s": stats["decode_tokens_per_s"],
        "target_ms": 1e3
        * target["seconds"]
        / max(target["forwards"], 1),  # one decode (verification) step
        # the MTP layer's time and forwards per decode step
        "draft_ms": 1e3 * drafter["seconds"] / max(target["forwards"], 1)
        if k and source.startswith("mtp")
        else None,
        "mtp_forwards": drafter["forwards"] / max(target["forwards"], 1),
        "accept": spec.get("acceptance_rate"),
        "length": spec.get("mean_accepted_length"),
    }


def model_config(args) -> ModelConfig:
    """GLM-5.2 widths, `--layers` layers, `--experts` routed experts, `--vocab` tokens, one MTP layer."""
    raw = glm_config(args.layers)
    return ModelConfig.from_dict(
        {
            **raw,
            "n_routed_experts": args.experts,
            "vocab_size": args.vocab,
            "num_nextn_predict_layers": 1,
        }
    )


def parallel_config(args) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=args.tp, sp=args.sp)


def run(args) -> list[tuple] | None:
    """One rank's share: every rank builds its part of the model and runs the same generations (as
    `spmoe generate` does under TP) -> rank 0's rows, None on the others."""
    from spmoe.models.deepseek_v32.weights import random_model

    state = get_parallel_state()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(
        model_config(args), parallel_config(args), dtype, state.device, with_mtp=True
    )
    agreeing_weights(model, args.residual_scale)
    rows = []
    modes = ("eager", "graphs") if args.device == "cuda" else ("eager",)  # graphs: CUDA only
    for temperature in args.temperatures:
        for batch in args.batches:
            prompts = prompts_for(model, args, batch)
            for mode in modes:
                plain = None
                runs = [("mtp", 0)] + [(s, k) for k in args.drafts for s in args.sources]
                for source, k in runs:
                    graphs = mode == "graphs"
                    got = decode_rate(model, args, batch, k, temperature, graphs, source, prompts)
                    plain = plain or got
                    label = f"{k}" if source == "mtp" or not k else f"{k} {source}"
                    rows.append((temperature, batch, mode, label, got, plain))
                    if state.rank == 0:
                        print(
                            f"T={temperature} batch {batch} {mode} k={label}: {got['tok_s']:.1f} tokens/s",
                            flush=True,
                        )
    return rows if state.rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="ranks (one GPU each): TP attention, experts split over them",
    )
    parser.add_argument("--sp", choices=SP_MODES, default="auto", help="sequence-parallel MoE")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--experts", type=int, default=64, help="routed experts per MoE layer (GLM-5.2: 256)"
    )
    parser.add_argument("--vocab", type=int, default=32768, help="vocab size (GLM-5.2: 154880)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--drafts", type=int, nargs="+", default=[1, 2, 3], help="k values besides 0"
    )
    parser.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0: greedy"
    )
    parser.add_argument(
        "--sources",
        nargs="+",
        default=["mtp"],
        choices=("mtp", "ngram", "suffix", "mtp+ngram", "mtp+suffix"),
        help="draft sources run at each k",
    )
    parser.add_argument(
        "--workload", choices=("random", "edit"), default="random", help="see the module"
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--residual-scale", type=float, default=0.05)
    parser.add_argument(
        "--kv-cache-memory",
        type=float,
        help="GiB for the paged cache (default: 8 on CUDA, on the CPU room for the batch)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (bf16), or cpu (float32) to check the script",
    )
    args = parser.parse_args()
    if args.kv_cache_memory is None and args.device == "cuda":
        args.kv_cache_memory = 8.0
    parallel = parallel_config(args)
    try:
        model_config(args).check_parallel(parallel)
        check_device(args.device, args.tp)
    except ValueError as e:
        parser.error(str(e))
    rows = spawn(run, args.tp, args, config=parallel, device=args.device)[0]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{device} x{args.tp}: TP {args.tp}, {args.experts // args.tp} of {args.experts} experts per rank, "
        f"sequence-parallel MoE {'on' if parallel.use_sequence_parallel_moe else 'off'} (--sp {args.sp}); GLM-5.2 "
        f"widths, {args.layers} layers + MTP, vocab {args.vocab}, {'bf16' if args.device == 'cuda' else 'float32'}"
    )
    print(
        f"{'T':>4}{'batch':>7}{'mode':>8}{'k':>16}{'tokens/s':>11}{'vs k=0':>8}{'target ms':>11}{'vs k=0':>8}"
        f"{'draft ms':>10}{'MTP fwd':>9}{'accept':>9}{'length':>8}"
    )
    for temperature, batch, mode, k, got, plain in rows:
        accept = f"{got['accept']:.1%}" if got["accept"] is not None else "-"
        length = f"{got['length']:.2f}" if got["length"] is not None else "-"
        draft = f"{got['draft_ms']:.3f}" if got["draft_ms"] is not None else "-"
        print(
            f"{temperature:>4g}{batch:>7}{mode:>8}{k:>16}{got['tok_s']:>11.1f}{got['tok_s'] / plain['tok_s']:>7.2f}x"
            f"{got['target_ms']:>11.3f}{got['target_ms'] / plain['target_ms']:>7.2f}x{draft:>10}"
            f"{got['mtp_forwards']:>9.2f}{accept:>9}{length:>8}"
        )


if __name__ == "__main__":
    main()
