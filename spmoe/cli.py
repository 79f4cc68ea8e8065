"""The `spmoe` command line."""

import argparse
import json
import sys

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import RankFailed, spawn
from spmoe.distributed.selfcheck import layout_selfcheck


def cmd_selfcheck(args) -> int:
    print(f"spmoe layout self-check on {args.ranks} local ranks (gloo, CPU)", flush=True)
    rows = spawn(layout_selfcheck, args.ranks)[0]
    print(f"{'dtype':<9}{'N':>4}{'n':>4}  {'max_err':>8}  collectives (count/bytes on rank 0)")
    failed = 0
    for row in rows:
        c = row["collectives"]
        ok = row["max_err"] == 0.0
        failed += not ok
        print(f"{row['dtype']:<9}{row['N']:>4}{row['n']:>4}  {row['max_err']:>8.1e}  "
              f"all_gather {c['all_gather']['count']}/{c['all_gather']['bytes']}  "
              f"reduce_scatter {c['reduce_scatter']['count']}/{c['reduce_scatter']['bytes']}  "
              f"{'ok' if ok else 'MISMATCH'}")
    print(f"{len(rows) - failed} of {len(rows)} cases exact")
    return 1 if failed else 0


def cmd_forward(args) -> int:
    from safetensors.torch import save_file

    from spmoe.forward import read_input_ids, run_forward

    cfg = ModelConfig.from_file(args.model)
    parallel = ParallelConfig(tensor_parallel_size=args.tp, sequence_parallel_moe=args.sp, sp_scope=args.sp_scope)
    seqs = read_input_ids(args.input_ids, cfg.vocab_size)
    print(f"spmoe forward: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, tp={args.tp}, "
          f"sequence-parallel MoE {'on' if parallel.use_sequence_parallel_moe else 'off'} "
          f"(--sp {args.sp}, scope {args.sp_scope}), {args.dtype} on {args.device}", file=sys.stderr, flush=True)
    logits, stats = run_forward(args.model, parallel, seqs, args.dtype, args.device)
    save_file({"logits": logits.float().contiguous()}, args.save_logits)
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(stats, f, indent=2)
    print(f"wrote logits {tuple(logits.shape)} to {args.save_logits}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selfcheck", help="check the sequence-parallel layout primitives on local ranks")
    p.add_argument("--ranks", type=int, default=2, help="number of local ranks (default 2)")
    p.set_defaults(func=cmd_selfcheck)
    p = sub.add_parser("demo", help="the main job on the embedded default (for now: the layout self-check, 2 ranks)")
    p.set_defaults(func=cmd_selfcheck, ranks=2)
    p = sub.add_parser("forward", help="one forward pass of a checkpoint on local ranks; save the logits")
    p.add_argument("--model", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (number of local ranks)")
    p.add_argument("--sp", choices=["on", "off", "auto"], required=True, help="sequence-parallel MoE")
    p.add_argument("--sp-scope", choices=["moe", "all"], default="moe", help="which layers are SP (default moe)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--input-ids", required=True, help="JSON list of token-id lists, one per sequence")
    p.add_argument("--save-logits", required=True, help="output .safetensors with one tensor 'logits' [N, V]")
    p.add_argument("--stats", help="output JSON: rank 0's collectives {kind: {count, bytes}}")
    p.set_defaults(func=cmd_forward)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RankFailed, ValueError, FileNotFoundError, OSError) as e:
        print(f"spmoe {args.command}: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
