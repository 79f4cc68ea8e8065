"""A front end process of `spmoe serve`: the HTTP server (request parsing and validation, tokenizing
and chat templates, detokenizing, stop strings, parsers, SSE, metrics) in a process of its own,
serving rank 0's engine process over the wire (`engine_client.EngineClient`).

Rank 0 starts it once the engine is warm, as `python -m spmoe.entrypoints.serve.frontend`, with a
pickled `wire.FrontEndLaunch` on its standard input. Its exit code tells rank 0 how it ended: 0
after a drain (SIGTERM) or a stop that was asked for, 1 when the engine failed, stalled or went
away.
"""

import asyncio
import gc
import importlib
import os
import pickle
import signal
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn

from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.frontend.app import ApiSettings, build_app
from spmoe.entrypoints.serve.frontend.chat import ChatOptions
from spmoe.entrypoints.serve.frontend.engine_client import EngineClient
from spmoe.entrypoints.serve.frontend.middleware import FrontEndLimits
from spmoe.entrypoints.serve.frontend.response_store import RESPONSES_DATABASE, ResponseStore
from spmoe.entrypoints.serve.frontend.supervisor import StopPolicy, supervise
from spmoe.entrypoints.serve.wire import FrontEndLaunch
from spmoe.entrypoints.tokenizer import load_tokenizer

GC_YOUNG = 50_000  # container objects allocated between two collections of the young generation


@dataclass(frozen=True)
class FrontEndOptions:
    tokenizer_dir: str  # where the tokenizer is
    served_model_names: list[str]  # the first is reported in responses
    host: str
    port: int
    chat_template: str | None = None  # in place of the tokenizer's
    chat_template_content_format: str = "string"
    defaults: GenerationDefaults = GenerationDefaults()
    seed: int | None = None  # seeds the seeds of requests that give none
    uvicorn_log_level: str = "warning"
    chat: ChatOptions = ChatOptions()  # the reasoning and tool-call parsers
    limits: FrontEndLimits = field(default_factory=FrontEndLimits)
    policy: StopPolicy = field(default_factory=StopPolicy)
    api_server_count: int = 1  # front end processes sharing the port

    def __post_init__(self):
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.api_server_count}")


def listening_socket(host: str, port: int, shared: bool) -> socket.socket:
    """A TCP socket bound to `host:port`; `shared`: with SO_REUSEPORT, so that several front end
    processes listen on it and the kernel spreads the connections over them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def start_front_end(
    options: FrontEndOptions,
    client: EngineClient,
    store: ResponseStore,
    announce: bool = True,
) -> int | None:
    """Serve the app for `client`, with the server's stored responses `store`, until `supervise`
    ends it (a stop signal, a failed, stalled or vanished engine); print the URL once it listens,
    if it `announce`s. -> SIGTERM if that is what ended it, else None."""

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):  # the stop signals go to `supervise`, which drains first
            yield

    tokenizer = load_tokenizer(options.tokenizer_dir, options.chat_template)
    settings = ApiSettings(
        options.served_model_names,
        options.defaults,
        options.chat_template_content_format,
        options.seed,
        options.chat,
    )
    app = build_app(client, tokenizer, settings, options.limits, store)
    config = uvicorn.Config(app, log_level=options.uvicorn_log_level, timeout_graceful_shutdown=5)
    server = Server(config)
    sock = listening_socket(options.host, options.port, options.api_server_count > 1)

    async def serve() -> int | None:
        signals: asyncio.Queue = asyncio.Queue()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, signals.put_nowait, signum)
        for signum in early:
            signals.put_nowait(signum)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if not server.started:
            await task
            return None
        await client.start()
        while client.front_ends < options.api_server_count and client.error is None:
            await asyncio.sleep(0.05)  # every front end listens before the server says it is ready
        if announce:
            print(
                f"spmoe serve: ready: http://{options.host}:{options.port}/v1 (model "
                f"{', '.join(repr(name) for name in options.served_model_names)})"
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
        await client.close()
        return ending

    # Outside the event loop a stop signal is only noted (one before the loop starts is then passed
    # to `supervise`); inside it the loop's handlers pass it on.
    early: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, _: early.append(signum))
    # What start-up built (the tokenizer, transformers, the app: some 10^5 objects) lives as long as
    # the process: out of the collector's sight, so that its full collections look only at what
    # serving made; and a young generation of GC_YOUNG objects, not 700, so that the objects every
    # step allocates (each output, its token list) do not set off a collection a step. Without
    # these the collector took a fifth to a quarter of the front end's time at 256 streams
    # (bench_streaming.py under a profiler); with them, none of the samples.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    ending = asyncio.run(serve())
    if not server.started:
        raise RuntimeError(f"the HTTP server did not start on {options.host}:{options.port}")
    return ending


def serve_http(client: EngineClient, launch: FrontEndLaunch, options: FrontEndOptions) -> int:
    """`spmoe serve`'s front end. -> the exit code: 1 if the engine failed, stalled or went away."""
    store = ResponseStore(os.path.join(launch.shared_dir, RESPONSES_DATABASE))
    start_front_end(options, client, store, launch.index == 0 and launch.restart == 0)
    return 1 if client.error is not None else 0


def main() -> int:
    """Read the launch from stdin, run its target with a client of the engine. -> the target's exit
    code (a target that returns None: 0)."""
    launch: FrontEndLaunch = pickle.load(sys.stdin.buffer)
    module, name = launch.target.split(":")
    target = getattr(importlib.import_module(module), name)
    client = EngineClient(launch.address, launch.facts, launch.engine_pid, launch.identity)
    return target(client, launch, *pickle.loads(launch.args)) or 0
