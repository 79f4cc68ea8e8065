"""`spmoe serve`: check the options, start every rank with `serve_rank`, and on rank 0 run the HTTP front end
under uvicorn until the server is stopped.

What can be checked before any rank starts is: the model folder, its tokenizer, and the address to listen on.
Stopping: SIGTERM or SIGINT to the `spmoe serve` process ends every rank (the launcher does that). A stop
signal that reaches rank 0 itself (under torchrun, whose agent signals every worker) makes uvicorn finish its
open responses and return, and `serve_rank` then stops the other ranks.
"""

import asyncio
import errno
import signal
import socket
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from spmoe.distributed import launch
from spmoe.engine.args import EngineArgs
from spmoe.entrypoints.serve.chat import ChatOptions
from spmoe.entrypoints.serve.client import DEFAULT_MAX_NUM_WAITING, check_serve, serve_rank
from spmoe.entrypoints.serve.parsers.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS
from spmoe.entrypoints.serve.tokenizer import load_tokenizer


@dataclass(frozen=True)
class FrontEndOptions:
    model_dir: str  # where the tokenizer is
    served_model_name: str
    host: str
    port: int
    chat: ChatOptions = ChatOptions()  # the reasoning and tool-call parsers


def start_front_end(options: FrontEndOptions, client) -> int | None:
    """Rank 0, main thread: serve the app for `client` until a stop signal; print the URL once it listens.
    -> SIGTERM if one reached this process (under torchrun, whose agent signals every worker), else None."""
    import uvicorn

    from spmoe.entrypoints.serve.app import build_app

    app = build_app(client, load_tokenizer(options.model_dir), options.served_model_name, options.chat)
    server = uvicorn.Server(
        uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", timeout_graceful_shutdown=5)
    )

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(
                f"spmoe serve: ready: http://{options.host}:{options.port}/v1 (model '{options.served_model_name}')"
                f"; stop with Ctrl-C or SIGTERM",
                file=sys.stderr,
                flush=True,
            )
        await task

    # uvicorn catches SIGINT / SIGTERM while it serves, shuts down gracefully, then raises the signal again
    # for the handler it found: this one, which only notes it, so that serve_rank's own teardown runs afterwards.
    received = []
    previous = {s: signal.signal(s, lambda signum, _: received.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(serve())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not server.started:
        raise RuntimeError(f"the HTTP server did not start on {options.host}:{options.port}")
    # SIGTERM comes from outside; a SIGINT may be the engine loop's own stop after it failed (`serve_rank`)
    return signal.SIGTERM if signal.SIGTERM in received else None


def check_address(host: str, port: int) -> None:
    """A one-line error unless `host:port` can be listened on now."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            reason = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on: {e.strerror}"
            raise ValueError(f"--host {host} --port {port}: the address {reason}") from None


def run_serve(model_dir: str, args: EngineArgs, max_num_waiting: int, front: FrontEndOptions) -> int | None:
    """Validate, then serve until stopped. -> SIGTERM if it reached rank 0 itself (under torchrun), else None."""
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"--model {model_dir}: expected a checkpoint folder with config.json, found none")
    check_serve(model_dir, args, max_num_waiting)
    load_tokenizer(model_dir)
    check_address(front.host, front.port)
    parallel = args.parallel_config()
    print(
        f"spmoe serve: {model_dir} on {parallel.world_size} local ranks (TP {args.tp} x DP {args.dp}, "
        f"{args.device}); loading the weights",
        file=sys.stderr,
        flush=True,
    )
    return launch(
        serve_rank,
        parallel.world_size,
        model_dir,
        args,
        max_num_waiting,
        partial(start_front_end, front),
        config=parallel,
        device=args.device,
    )


def add_serve_args(p) -> None:
    p.add_argument(
        "--model",
        help="checkpoint folder with config.json, *.safetensors and the tokenizer "
        "(default: the demo checkpoint, written on first use)",
    )
    p.add_argument("--served-model-name", help="the model name clients ask for (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split the model's thinking into reasoning_content (glm45: GLM's <think>...</think>)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help="read the model's tool calls into tool_calls (glm47, glm45: GLM's <tool_call> format)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call a tool (tool_choice "auto"); needs --tool-call-parser',
    )
    p.add_argument(
        "--max-num-waiting",
        type=int,
        default=DEFAULT_MAX_NUM_WAITING,
        help=f"requests that may wait to start; one more gets 503 (default {DEFAULT_MAX_NUM_WAITING})",
    )
    EngineArgs.add_cli_args(p)


def cmd_serve(args) -> int:
    engine_args = EngineArgs.from_cli(args)
    chat = ChatOptions(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)
    model = args.model
    if model is None:
        from spmoe.entrypoints.demo import checkpoint_dir, ensure_checkpoint

        model = str(checkpoint_dir())
        ensure_checkpoint(checkpoint_dir())
    name = args.served_model_name or (args.model if args.model is not None else "spmoe-demo")
    front = FrontEndOptions(model, name, args.host, args.port, chat)
    stop = run_serve(model, engine_args, args.max_num_waiting, front)
    if stop is None:
        return 0
    print(f"spmoe serve: stopped by {signal.Signals(stop).name}", file=sys.stderr)
    return 128 + stop
