"""`spmoe serve`: check the options, start every rank with `serve_rank` (`engine/rank.py`); rank 0
runs the engine loop and starts the HTTP front end process(es) (`frontend/process.py`), which serve
under uvicorn until the server is stopped.

What can be checked before any rank starts is: the model folder, its tokenizer, and the address to
listen on. Stopping: SIGTERM to the `spmoe serve` process is passed on to rank 0 and from there to
the front ends, which drain (`frontend/supervisor.py`: new requests get 503, open ones may finish
for --shutdown-timeout, then end with an error chunk and `[DONE]`); rank 0 then stops the other
ranks and the command exits 0. Under torchrun the agent signals every worker; rank 0 does the same.
SIGINT (Ctrl-C) ends every rank at once (the launcher does that). An engine that fails or stalls for
--engine-timeout ends the open requests with an error and the command exits 1.
"""

import errno
import os
import signal
import socket
import sys
from pathlib import Path

from spmoe.distributed import launch
from spmoe.distributed.simulated import banner
from spmoe.engine.args import EngineArgs
from spmoe.entrypoints.engine_flags import add_engine_args, engine_args_from_cli
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.model_source import resolve_model
from spmoe.entrypoints.options import help_groups
from spmoe.entrypoints.serve.engine.front_ends import FrontEndCommand
from spmoe.entrypoints.serve.engine.rank import (
    MIN_MAX_NUM_WAITING,
    WAITING_PER_RUNNING,
    check_serve,
    serve_rank,
)
from spmoe.entrypoints.serve.frontend.chat import ChatOptions
from spmoe.entrypoints.serve.frontend.middleware import DEFAULT_MAX_REQUEST_BYTES, FrontEndLimits
from spmoe.entrypoints.serve.frontend.parsers.chat_output import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
)
from spmoe.entrypoints.serve.frontend.process import FrontEndOptions
from spmoe.entrypoints.serve.frontend.supervisor import StopPolicy
from spmoe.entrypoints.serve.frontend.tokenizer import read_chat_template
from spmoe.entrypoints.tokenizer import load_tokenizer
from spmoe.entrypoints.vllm_flags import OneOfSeveral, add_vllm_flags
from spmoe.entrypoints.vllm_values import argparse_type, parse_json_object, served_model_names

CONTENT_FORMATS = ("auto", "string", "openai")  # --chat-template-content-format; auto is string
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

DRAIN_MARGIN_S = 15.0  # beyond --shutdown-timeout: ending the streams left and stopping every rank


# Under --simulate-rank the first served name (the one responses and metrics report) carries this
# suffix.
SIMULATED_SUFFIX = "-SIMULATED-RANK"


def check_address(host: str, port: int) -> None:
    """A one-line error unless `host:port` can be listened on now."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as uvicorn: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            reason = (
                "is in use"
                if e.errno == errno.EADDRINUSE
                else f"cannot be listened on: {e.strerror}"
            )
            raise ValueError(f"--host {host} --port {port}: the address {reason}") from None


def run_serve(
    model_dir: str, args: EngineArgs, max_num_waiting: int | None, front: FrontEndOptions
) -> int | None:
    """Validate, settle serve's defaults (`check_serve`), then serve until stopped. -> SIGTERM if it
    reached rank 0 itself (under torchrun), else None."""
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(
            f"--model {model_dir}: expected a checkpoint folder with config.json, found none"
        )
    from spmoe.engine.build import describe

    args, max_num_waiting = check_serve(model_dir, args, max_num_waiting)
    load_tokenizer(front.tokenizer_dir, front.chat_template)
    check_address(front.host, front.port)
    parallel = args.parallel_config()
    print(
        f"spmoe serve: max_num_seqs {args.max_num_seqs} per DP group, "
        f"max_model_len {args.max_model_len}, max_num_waiting {max_num_waiting} "
        f"(on {args.device}, the defaults where no flag gives them)",
        file=sys.stderr,
        flush=True,
    )
    print(
        f"spmoe serve: {model_dir} on {parallel.world_size} local ranks "
        f"({describe(args, parallel)}); loading the weights",
        file=sys.stderr,
        flush=True,
    )
    return launch(
        serve_rank,
        parallel.world_size,
        model_dir,
        args,
        max_num_waiting,
        FrontEndCommand.with_args(
            "spmoe.entrypoints.serve.frontend.process:serve_http",
            front,
            count=front.api_server_count,
        ),
        front.tokenizer_dir,
        config=parallel,
        device=args.device,
        drain_s=front.policy.shutdown_timeout_s + DRAIN_MARGIN_S,
    )


def add_serve_args(p) -> None:
    groups = help_groups(p)
    model, chat, server = groups["model"], groups["chat and tools"], groups["server"]
    model.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="a checkpoint folder (config.json, *.safetensors, the tokenizer) or a Hugging Face "
        "model id, as in `vllm serve MODEL` (default: the demo checkpoint shipped with spmoe)",
    )
    model.add_argument("--model", help="the same as MODEL")
    model.add_argument(
        "--tokenizer", help="a folder or Hugging Face id with the tokenizer (default: the model's)"
    )
    model.add_argument(
        "--revision", help="the Hugging Face branch, tag or commit of MODEL (default: main)"
    )
    model.add_argument(
        "--download-dir", help="the Hugging Face cache folder (default: HF_HUB_CACHE / HF_HOME's)"
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names clients may ask for; the first is reported in responses "
        "(default: MODEL as given)",
    )
    server.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    chat.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split the model's thinking into reasoning_content (glm45: GLM's <think>...</think>)",
    )
    chat.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help="read the model's tool calls into tool_calls (glm47, glm45: GLM's <tool_call> format)",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call a tool (tool_choice "auto"); '
        "needs --tool-call-parser",
    )
    server.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        metavar="N",
        help="HTTP front end processes, sharing the port (default 1); each serves rank 0's engine",
    )
    server.add_argument(
        "--api-key",
        action=OneOfSeveral,  # vLLM takes several keys
        metavar="KEY",
        default=os.environ.get("SPMOE_API_KEY"),
        help="every route but /health, /ping and /metrics needs 'Authorization: Bearer <key>' "
        "(default: env SPMOE_API_KEY; none: no key needed); one key: several, as vLLM takes them, "
        "are an error",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="a request body longer than this gets 413 "
        f"(default {DEFAULT_MAX_REQUEST_BYTES}, 32 MiB)",
    )
    policy = StopPolicy()
    server.add_argument(
        "--engine-timeout",
        type=float,
        default=policy.engine_timeout_s,
        metavar="S",
        help="an engine step (or idle heartbeat) that takes longer fails every request and stops "
        f"the server with an error (default {policy.engine_timeout_s:g} s)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=policy.shutdown_timeout_s,
        metavar="S",
        help=f"after SIGTERM, how long open requests may still run before they are ended "
        f"(default {policy.shutdown_timeout_s:g} s)",
    )
    server.add_argument(
        "--max-num-waiting",
        type=int,
        help="requests that may wait to start; one more gets 503 "
        f"(default {WAITING_PER_RUNNING} x --max-num-seqs x --dp, at least {MIN_MAX_NUM_WAITING})",
    )
    model.add_argument(
        "--seed",
        type=int,
        help="seeds the sampling seeds of requests that give none (default: random)",
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,FOLDER}",
        help="sampling defaults for the fields a request leaves out: auto (default) the model's "
        "generation_config.json, vllm none, or that of FOLDER",
    )
    model.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help="generation_config.json fields set over the file's",
    )
    chat.add_argument(
        "--chat-template",
        help="a Jinja chat template file, or the template itself (default: the tokenizer's)",
    )
    chat.add_argument(
        "--default-chat-template-kwargs",
        type=argparse_type(
            lambda text: parse_json_object(text, "--default-chat-template-kwargs"),
            "--default-chat-template-kwargs",
        ),
        metavar="JSON",
        help="chat template arguments for every request, under its own chat_template_kwargs: "
        '{"enable_thinking": false} turns GLM\'s thinking off server-wide',
    )
    chat.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="message content as the template sees it: string (auto, default) or openai "
        "(a list of text parts)",
    )
    groups["logging"].add_argument(
        "--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="warning", help="default warning"
    )
    add_engine_args(p)
    add_vllm_flags(p)


def check_speculative_model(draft: str | None, named: str | None, engine_args: EngineArgs) -> None:
    """vLLM 0.7's `--speculative-model`: the served model itself (its MTP layer drafts, as many as
    --num-speculative-tokens says); a separate draft model is refused."""
    if draft is None:
        return
    if draft != named:
        raise ValueError(
            f"--speculative-model {draft}: spmoe does not support a separate draft model; "
            "it drafts "
            f"with the checkpoint's own MTP layer: --num-speculative-tokens N, or "
            f'--speculative-config \'{{"method": "mtp", "num_speculative_tokens": N}}\''
        )
    if not engine_args.drafts:
        raise ValueError(
            f"--speculative-model {draft} needs --num-speculative-tokens N (drafts per step)"
        )


def cmd_serve(args) -> int:
    chat = ChatOptions(
        args.reasoning_parser,
        args.tool_call_parser,
        args.enable_auto_tool_choice,
        args.default_chat_template_kwargs or {},
    )
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(
            f"MODEL {args.model_tag} and --model {args.model} disagree; give the model once"
        )
    named = args.model_tag or args.model
    if named is None:
        from spmoe.entrypoints.demo import CHECKPOINT

        model = str(CHECKPOINT)
    else:
        option = "MODEL" if args.model is None else "--model"
        weights, tokenizer = args.load_format != "dummy", args.tokenizer is None
        model = str(
            resolve_model(
                named,
                args.revision,
                args.download_dir,
                weights=weights,
                tokenizer=tokenizer,
                option=option,
            )
        )
    tokenizer = model
    if args.tokenizer is not None:
        tokenizer = str(
            resolve_model(
                args.tokenizer, None, args.download_dir, weights=False, option="--tokenizer"
            )
        )
    device_chosen = args.device is None
    notes = list(args.vllm_notes)
    engine_args = engine_args_from_cli(args, model, notes)
    check_speculative_model(getattr(args, "speculative_model", None), named, engine_args)
    overrides = None
    if args.override_generation_config is not None:
        overrides = parse_json_object(
            args.override_generation_config, "--override-generation-config"
        )
    defaults = GenerationDefaults.load(args.generation_config, model, overrides)
    names = served_model_names(args.served_model_name, named or "spmoe-demo")
    if engine_args.simulate_rank:  # every response and metric names the model as simulated
        print(banner(engine_args.parallel_config()), file=sys.stderr, flush=True)
        names = [names[0] + SIMULATED_SUFFIX, *names]
    front = FrontEndOptions(
        tokenizer,
        names,
        args.host,
        args.port,
        read_chat_template(args.chat_template) if args.chat_template is not None else None,
        "openai" if args.chat_template_content_format == "openai" else "string",
        defaults,
        args.seed,
        args.uvicorn_log_level,
        chat,
        FrontEndLimits(args.max_request_bytes, args.api_key),
        StopPolicy(args.engine_timeout, args.shutdown_timeout),
        args.api_server_count,
    )
    if device_chosen:
        found = "a GPU is visible" if engine_args.device == "cuda" else "no GPU is visible"
        notes.append(f"device {engine_args.device}: {found} (--device overrides)")
    if engine_args.enable_expert_parallel:
        notes.append(
            "--enable-expert-parallel: spmoe's routed experts are always expert-parallel "
            "over all ranks"
        )
    notes.append(defaults.describe())
    for note in notes:
        print(f"spmoe serve: {note}", file=sys.stderr, flush=True)
    stop = run_serve(model, engine_args, args.max_num_waiting, front)
    if stop is not None:  # a drained SIGTERM is a clean stop
        print(f"spmoe serve: stopped by {signal.Signals(stop).name}", file=sys.stderr)
    return 0
