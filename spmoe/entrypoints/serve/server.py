"""`spmoe serve`: check the options, start every rank with `serve_rank`, and on rank 0 run the HTTP front end
under uvicorn until the server is stopped.

What can be checked before any rank starts is: the model folder, its tokenizer, and the address to listen on.
Stopping: SIGTERM to the `spmoe serve` process is passed on to rank 0, which drains (`supervisor.py`: new
requests get 503, open ones may finish for --shutdown-timeout, then end with an error chunk and `[DONE]`);
`serve_rank` then stops the other ranks and the command exits 0. Under torchrun the agent signals every
worker; rank 0 does the same. SIGINT (Ctrl-C) ends every rank at once (the launcher does that). An engine that
fails or stalls for --engine-timeout ends the open requests with an error and the command exits 1.
"""

import asyncio
import errno
import os
import signal
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from spmoe.config import ParallelConfig
from spmoe.config.parallel import EP_BACKENDS, MOE_BACKENDS, SP_MODES, SP_SCOPES
from spmoe.distributed import launch
from spmoe.entrypoints.cache_options import add_kv_cache_args, kv_cache_options
from spmoe.entrypoints.serve.app import DEFAULT_MAX_REQUEST_BYTES, FrontEndLimits
from spmoe.entrypoints.serve.ranks import DEFAULT_MAX_MODEL_LEN, ServeOptions, check_serve, serve_rank
from spmoe.entrypoints.serve.supervisor import StopPolicy
from spmoe.entrypoints.serve.tokenizer import load_tokenizer

DRAIN_MARGIN_S = 15.0  # beyond --shutdown-timeout: ending the streams left and stopping every rank


@dataclass(frozen=True)
class FrontEndOptions:
    model_dir: str  # where the tokenizer is
    served_model_name: str
    host: str
    port: int
    limits: FrontEndLimits = field(default_factory=FrontEndLimits)
    policy: StopPolicy = field(default_factory=StopPolicy)


def start_front_end(options: FrontEndOptions, client) -> int | None:
    """Rank 0, main thread: serve the app for `client` until `supervise` ends it (a stop signal, a failed or
    stalled engine); print the URL once it listens. -> SIGTERM if that is what ended it, else None."""
    import uvicorn

    from spmoe.entrypoints.serve.app import build_app
    from spmoe.entrypoints.serve.supervisor import supervise

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):  # the stop signals go to `supervise`, which drains before uvicorn stops
            yield

    app = build_app(client, load_tokenizer(options.model_dir), options.served_model_name, options.limits)
    server = Server(
        uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", timeout_graceful_shutdown=5)
    )

    async def serve() -> int | None:
        signals: asyncio.Queue = asyncio.Queue()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, signals.put_nowait, signum)
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if not server.started:
            await task
            return None
        print(
            f"spmoe serve: ready: http://{options.host}:{options.port}/v1 (model '{options.served_model_name}')"
            f"; stop with Ctrl-C or SIGTERM",
            file=sys.stderr,
            flush=True,
        )
        watch = asyncio.create_task(supervise(app.state.api, client, options.policy, signals))
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        ending = None
        if watch.done():
            ending = watch.result()
        else:  # uvicorn stopped on its own
            watch.cancel()
        await task
        return ending

    # Outside the event loop (before it starts, after it ends) a stop signal is only noted; inside it the loop's
    # handlers pass it to `supervise`.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ending = asyncio.run(serve())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not server.started:
        raise RuntimeError(f"the HTTP server did not start on {options.host}:{options.port}")
    return ending


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


def run_serve(
    model_dir: str, parallel: ParallelConfig, options: ServeOptions, front: FrontEndOptions, device: str
) -> int | None:
    """Validate, then serve until stopped. -> SIGTERM if it reached rank 0 itself (under torchrun), else None."""
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"--model {model_dir}: expected a checkpoint folder with config.json, found none")
    check_serve(model_dir, parallel, options, device)
    load_tokenizer(model_dir)
    check_address(front.host, front.port)
    print(
        f"spmoe serve: {model_dir} on {parallel.world_size} local ranks (TP {parallel.tensor_parallel_size} x "
        f"DP {parallel.data_parallel_size}, {device}); loading the weights",
        file=sys.stderr,
        flush=True,
    )
    return launch(
        serve_rank,
        parallel.world_size,
        model_dir,
        parallel,
        options,
        partial(start_front_end, front),
        config=parallel,
        device=device,
        drain_s=front.policy.shutdown_timeout_s + DRAIN_MARGIN_S,
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
        "--api-key",
        default=os.environ.get("SPMOE_API_KEY"),
        help="every route but /health and /metrics needs 'Authorization: Bearer <key>' (default: env "
        "SPMOE_API_KEY; none: no key needed)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"a request body longer than this gets 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 32 MiB)",
    )
    policy = StopPolicy()
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=policy.engine_timeout_s,
        metavar="S",
        help=f"an engine step (or idle heartbeat) that takes longer fails every request and stops the server "
        f"with an error (default {policy.engine_timeout_s:g} s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=policy.shutdown_timeout_s,
        metavar="S",
        help=f"after SIGTERM, how long open requests may still run before they are ended "
        f"(default {policy.shutdown_timeout_s:g} s)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1): dp * tp ranks")
    p.add_argument("--sp", choices=SP_MODES, default="auto", help="sequence-parallel MoE (default auto)")
    p.add_argument("--sp-scope", choices=SP_SCOPES, default="moe", help="which layers are SP (default moe)")
    p.add_argument("--ep-backend", choices=EP_BACKENDS, default="allgather_reducescatter")
    p.add_argument("--moe-backend", choices=MOE_BACKENDS, default="auto")
    defaults = ServeOptions()
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help=f"requests decoded at once per DP group (default {defaults.max_num_seqs})",
    )
    p.add_argument(
        "--max-num-waiting",
        type=int,
        default=defaults.max_num_waiting,
        help=f"requests that may wait to start; one more gets 503 (default {defaults.max_num_waiting})",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help=f"positions per request: prompt + output + drafts (default: the model's "
        f"max_position_embeddings, at most {DEFAULT_MAX_MODEL_LEN})",
    )
    add_kv_cache_args(p, "--max-num-seqs x --max-model-len tokens")
    p.add_argument(
        "--speculative", choices=["mtp"], help="draft tokens with the checkpoint's MTP layer (greedy requests only)"
    )
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="MTP drafts per step (default 1)")
    p.add_argument(
        "--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (CUDA, DP 1, no speculation)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")


def cmd_serve(args) -> int:
    model = args.model
    if model is None:
        from spmoe.entrypoints.demo import checkpoint_dir, ensure_checkpoint

        model = str(checkpoint_dir())
        ensure_checkpoint(checkpoint_dir())
    drafts = args.num_speculative_tokens if args.speculative == "mtp" else 0
    if args.speculative == "mtp" and drafts < 1:
        raise ValueError(f"--speculative mtp needs --num-speculative-tokens >= 1, got {drafts}")
    parallel = ParallelConfig(
        tensor_parallel_size=args.tp,
        data_parallel_size=args.dp,
        sp=args.sp,
        sp_scope=args.sp_scope,
        ep_backend=args.ep_backend,
        moe_backend=args.moe_backend,
    )
    options = ServeOptions(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_speculative_tokens=drafts,
        max_num_waiting=args.max_num_waiting,
        cuda_graphs=args.cuda_graphs,
        **kv_cache_options(args),
    )
    name = args.served_model_name or (args.model if args.model is not None else "spmoe-demo")
    front = FrontEndOptions(
        model,
        name,
        args.host,
        args.port,
        FrontEndLimits(args.max_request_bytes, args.api_key),
        StopPolicy(args.engine_timeout, args.shutdown_timeout),
    )
    stop = run_serve(model, parallel, options, front, args.device)
    if stop is not None:  # a drained SIGTERM is a clean stop
        print(f"spmoe serve: stopped by {signal.Signals(stop).name}", file=sys.stderr)
    return 0
