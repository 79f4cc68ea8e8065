"""The `spmoe` command line."""

import argparse
import json
import re
import signal
import sys
from functools import partial

import spmoe
from spmoe.config import ModelConfig
from spmoe.distributed import RankFailed, Stopped, spawn
from spmoe.distributed.selfcheck import layout_selfcheck
from spmoe.entrypoints.engine_flags import LAYOUT_OPTIONS, add_engine_args, engine_args_from_cli
from spmoe.entrypoints.jobs import write_atomically
from spmoe.entrypoints.serve.server import add_serve_args, cmd_serve
from spmoe.entrypoints.vllm_flags import dotted_options, vllm_argv, with_config_file
from spmoe.entrypoints.vllm_values import fold_dotted


def cmd_selfcheck(args) -> int:
    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    print(f"spmoe layout self-check on {args.ranks} local ranks (gloo, CPU)", flush=True)
    rows = spawn(layout_selfcheck, args.ranks)[0]
    print(f"{'dtype':<9}{'N':>4}{'n':>4}  {'max_err':>8}  collectives (count/bytes on rank 0)")
    failed = 0
    for row in rows:
        c = row["collectives"]
        ok = row["max_err"] == 0.0
        failed += not ok
        print(
            f"{row['dtype']:<9}{row['N']:>4}{row['n']:>4}  {row['max_err']:>8.1e}  "
            f"all_gather {c['all_gather']['count']}/{c['all_gather']['bytes']}  "
            f"reduce_scatter {c['reduce_scatter']['count']}/{c['reduce_scatter']['bytes']}  "
            f"{'ok' if ok else 'MISMATCH'}"
        )
    print(f"{len(rows) - failed} of {len(rows)} cases exact")
    return 1 if failed else 0


def cmd_forward(args) -> int:
    from safetensors.torch import save_file

    from spmoe.entrypoints.forward import check_forward, run_forward
    from spmoe.entrypoints.jobs import read_input_ids

    engine_args = engine_args_from_cli(args, args.model)
    cfg = ModelConfig.from_file(args.model)
    parallel = engine_args.parallel_config()
    seqs = read_input_ids(args.input_ids, cfg.vocab_size)
    check_forward(
        cfg,
        parallel,
        seqs,
        engine_args.device,
        {"--save-logits": args.save_logits, **({"--stats": args.stats} if args.stats else {})},
    )
    print(
        f"spmoe forward: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, tp={args.tp}, "
        f"dp={args.dp}, sequence-parallel MoE "
        f"{'on' if parallel.use_sequence_parallel_moe else 'off'} (--sp {args.sp}, scope "
        f"{args.sp_scope}), {engine_args.dtype} on {engine_args.device}",
        file=sys.stderr,
        flush=True,
    )
    result = run_forward(args.model, parallel, seqs, engine_args.dtype, engine_args.device)
    if result is None:  # a torchrun rank other than 0
        return 0
    logits, stats = result
    write_atomically(args.save_logits, partial(save_file, {"logits": logits.float().contiguous()}))
    if args.stats:
        write_atomically(args.stats, lambda path: path.write_text(json.dumps(stats, indent=2)))
    print(f"wrote logits {tuple(logits.shape)} to {args.save_logits}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from spmoe.engine.build import describe
    from spmoe.engine.request import SamplingParams
    from spmoe.entrypoints.generate import GenerateOptions, check_generate, run_generate
    from spmoe.entrypoints.jobs import read_input_ids

    notes = []
    engine_args = engine_args_from_cli(args, args.model, notes)
    for note in notes:
        print(f"spmoe generate: {note}", file=sys.stderr, flush=True)
    cfg = engine_args.model_config(args.model)
    prompts = read_input_ids(args.input_ids, cfg.vocab_size)
    opts = GenerateOptions(
        args.max_new_tokens,
        SamplingParams(args.temperature, args.top_p, args.seed),
        tuple(args.eos_id) if args.eos_id is not None else None,
        engine=engine_args,
    )
    check_generate(cfg, prompts, opts, {"--output": args.output})
    parallel = engine_args.parallel_config()
    print(
        f"spmoe generate: {len(prompts)} prompts, up to {args.max_new_tokens} new tokens each, "
        f"{describe(engine_args, parallel)}",
        file=sys.stderr,
        flush=True,
    )
    gen = run_generate(args.model, prompts, opts)
    if gen is None:  # a torchrun rank other than 0
        return 0
    gen.stats["parallel"] = {
        "tp": args.tp,
        "dp": args.dp,
        "use_sequence_parallel_moe": parallel.use_sequence_parallel_moe,
        "sp_scope": args.sp_scope,
        "ep_backend": args.ep_backend,
    }
    result = json.dumps({"outputs": gen.outputs, "stats": gen.stats}, indent=2)
    write_atomically(args.output, lambda path: path.write_text(result))
    spec = gen.stats.get("speculative")
    print(
        f"wrote {gen.stats['generated_tokens']} tokens to {args.output}: "
        f"{gen.stats['tokens_per_s']:.1f} tokens/s"
        + (
            f", draft acceptance {spec['acceptance_rate']:.1%}, mean accepted length "
            f"{spec['mean_accepted_length']:.2f}"
            if spec
            else ""
        ),
        file=sys.stderr,
    )
    return 0


def cmd_demo(args) -> int:
    from spmoe.entrypoints.demo import run_demo

    return run_demo(args.device, args.dp)


def add_model_args(p, engine_options: tuple[str, ...] | None = None) -> None:
    """The options `forward` and `generate` share: the checkpoint, the engine options
    (`engine_options`: only those), the input."""
    p.add_argument("--model", required=True, help="folder with config.json and *.safetensors")
    p.add_argument(
        "--input-ids", required=True, help="JSON list of token-id lists, one per sequence"
    )
    add_engine_args(p, engine_options)


# JSON options spmoe reads, which vLLM also takes as dotted keys
DOTTED_OPTIONS = (
    "--speculative-config",
    "--hf-overrides",
)


def prepare_argv(argv: list[str]) -> list[str]:
    """The command line as the parser reads it: a `--config` file's options spliced in
    (`with_config_file`), vLLM's spellings rewritten (`vllm_argv`), and the dotted forms of JSON
    options folded into one JSON value each (`fold_dotted`)."""
    argv = vllm_argv(with_config_file(argv))
    return fold_dotted(argv, (*DOTTED_OPTIONS, *dotted_options(argv)))


class AliasHelpFormatter(argparse.HelpFormatter):
    """`--help` names an option's aliases together and its value once: `--tp,
    --tensor-parallel-size, -tp TP`."""

    def _format_action_invocation(self, action):
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"


# argparse's words for a value outside `choices`
_INVALID_CHOICE = re.compile(r"invalid choice: (?P<got>.*) \(choose from (?P<choices>.*)\)$")


class OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line on stderr (`spmoe serve: error: ...`), exit status 2: no usage dump; a
    value outside an option's choices is said as the project says it (`expected one of a, b, got
    'c'`). `--help` shows each option's aliases once (AliasHelpFormatter)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", AliasHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        head, _, tail = message.partition(": ")
        if match := _INVALID_CHOICE.match(tail):
            choices = match["choices"].replace("'", "")
            message = f"{head}: expected one of {choices}, got {match['got']}"
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    parser = OneLineParser(prog="spmoe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"spmoe {spmoe.__version__}")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = prepare_argv(argv)
    except ValueError as e:
        parser.error(str(e))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "selfcheck", help="check the sequence-parallel layout primitives on local ranks"
    )
    p.add_argument("--ranks", type=int, default=2, help="number of local ranks (default 2)")
    p.set_defaults(func=cmd_selfcheck)
    p = sub.add_parser(
        "demo", help="generate with a built-in tiny GLM-5.2-shaped model on 2 ranks, SP off and on"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size: 2 * dp ranks (default 1)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser(
        "forward", help="one forward pass of a checkpoint on local ranks; save the logits"
    )
    add_model_args(p, LAYOUT_OPTIONS)
    p.add_argument(
        "--save-logits", required=True, help="output .safetensors with one tensor 'logits' [N, V]"
    )
    p.add_argument("--stats", help="output JSON: rank 0's collectives {kind: {count, bytes}}")
    p.set_defaults(func=cmd_forward)
    p = sub.add_parser(
        "generate", help="generate tokens after prompts on local ranks (or under torchrun)"
    )
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed (prompt i samples from seed + i)"
    )
    p.add_argument(
        "--eos-id", type=int, action="append", help="stop token (repeatable; default: the config's)"
    )
    p.add_argument(
        "--output", required=True, help='output JSON: {"outputs": [[ids...], ...], "stats": {...}}'
    )
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server on local ranks (default: the demo model)"
    )
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RankFailed, ValueError, FileNotFoundError, OSError, FloatingPointError) as e:
        print(f"spmoe {args.command}: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    except (
        Stopped
    ) as e:  # SIGTERM / SIGINT while ranks ran: the launcher has ended every one of them
        print(f"spmoe {args.command}: {e}; every rank was ended", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C with no rank running (or in a torchrun worker)
        print(f"spmoe {args.command}: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
