"""The `spmoe` command line."""

import argparse
import sys

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selfcheck", help="check the sequence-parallel layout primitives on local ranks")
    p.add_argument("--ranks", type=int, default=2, help="number of local ranks (default 2)")
    p.set_defaults(func=cmd_selfcheck)
    p = sub.add_parser("demo", help="the main job on the embedded default (for now: the layout self-check, 2 ranks)")
    p.set_defaults(func=cmd_selfcheck, ranks=2)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RankFailed, ValueError) as e:
        print(f"spmoe {args.command}: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
