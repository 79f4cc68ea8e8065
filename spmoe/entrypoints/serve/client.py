"""The engine seen from the asyncio front end (`EngineClient`), and what `spmoe serve` runs on every rank
(`serve_rank`).

Rank 0's engine loop runs in a thread beside the front end's event loop; each iteration it drains its inbox
(new requests from `EngineClient.generate`, aborts from consumers that went away, the shutdown) into the
next step plan, runs it on every rank through the engine's serving loop (`spmoe.engine.ranks`), and
hands the step's outputs to their requests' asyncio queues in one call onto the event loop
(`loop.call_soon_threadsafe`): the engine loop never waits for the front end, and wakes it once a step, not
once a stream (each wake-up is a write to the event loop's pipe and a hand-over of the GIL).

When nothing is live, rank 0 waits on its inbox for up to `HEARTBEAT_S` and then sends an idle plan anyway,
so the other ranks, blocked on the next plan, never reach the process group's timeout.
"""

import asyncio
import queue
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial

import torch

from spmoe.config import ModelConfig
from spmoe.distributed import get_parallel_state
from spmoe.engine.args import EngineArgs
from spmoe.engine.build import build_engine, load_model
from spmoe.engine.engine import Engine
from spmoe.engine.ranks import ServingLoop, worker_loop
from spmoe.engine.request import EngineMetrics, Request, RequestOutput
from spmoe.engine.sampling.grammar import GrammarCompiler
from spmoe.engine.warmup import warm_up
from spmoe.entrypoints.serve.tokenizer import load_tokenizer

HEARTBEAT_S = 1.0  # the longest rank 0 stays silent while idle
# serve's defaults for what the command line leaves out (`for_model`, `default_max_num_waiting`). On CUDA, as
# vLLM's: 256 requests running at once per DP group and the model's whole context. On the CPU (the tests, the
# demo) small ones: there the paged cache without a size holds max_num_seqs x max_model_len tokens.
CUDA_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 8
CPU_MAX_MODEL_LEN = (
    2048  # at most; also the length for a config that states no max_position_embeddings
)
WAITING_PER_RUNNING = (
    4  # max_num_waiting: this many per request that can run at once, so a burst still queues,
)
MIN_MAX_NUM_WAITING = 64  # and at least this many; one more waiting request gets QueueFull (503)


class QueueFull(RuntimeError):
    """`max_num_waiting` requests already wait to start (the front end answers 503)."""


def for_model(args: EngineArgs, cfg: ModelConfig) -> EngineArgs:
    """The engine options with serve's defaults settled for the model on `args.device` (settled too): on CUDA
    `CUDA_MAX_NUM_SEQS` requests at once and the model's max_position_embeddings; on the CPU `CPU_MAX_NUM_SEQS`
    and at most `CPU_MAX_MODEL_LEN`. An option the command line gives stays."""
    positions = cfg.max_position_embeddings or CPU_MAX_MODEL_LEN
    on_cuda = args.device == "cuda"
    return replace(
        args,
        max_num_seqs=args.max_num_seqs or (CUDA_MAX_NUM_SEQS if on_cuda else CPU_MAX_NUM_SEQS),
        max_model_len=args.max_model_len
        or (positions if on_cuda else min(CPU_MAX_MODEL_LEN, positions)),
    )


def default_max_num_waiting(args: EngineArgs) -> int:
    """--max-num-waiting's default for settled `args`: `WAITING_PER_RUNNING` per request that can run at once
    over all DP groups (rank 0's front end feeds every group), at least `MIN_MAX_NUM_WAITING`."""
    return max(MIN_MAX_NUM_WAITING, WAITING_PER_RUNNING * args.max_num_seqs * args.dp)


def check_serve(
    model_dir: str, args: EngineArgs, max_num_waiting: int | None = None
) -> tuple[EngineArgs, int]:
    """What can be checked before starting any rank: the engine options, serve's defaults settled
    (`for_model`), against the checkpoint (`EngineArgs.check`), and the queue's limit (None: its default,
    `default_max_num_waiting`). -> the settled options and queue limit, as `serve_rank` takes them."""
    cfg = args.model_config(model_dir)
    args = for_model(args, cfg)
    args.check(cfg, args.max_model_len)
    if max_num_waiting is None:
        max_num_waiting = default_max_num_waiting(args)
    if max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be >= 1, got {max_num_waiting}")
    return args, max_num_waiting


class EngineClient:
    """Rank 0's engine, seen from the asyncio front end. `generate` and `metrics` are called on the event
    loop; the engine loop runs in its own thread (`start` / `close`)."""

    def __init__(self, engine: Engine, max_model_len: int, max_num_waiting: int):
        self.engine = engine
        self.max_model_len = max_model_len
        self.max_num_waiting = max_num_waiting
        self.vocab_size = engine.model.cfg.vocab_size
        self.eos_token_ids = engine.model.cfg.eos_token_ids
        self.num_speculative_tokens = engine.k
        self.grammars = (
            engine.grammars
        )  # the front end compiles a request's grammar here first (a cache hit then)
        self.error: str | None = None  # why the engine loop stopped, if it failed
        self._iteration_began: float | None = (
            None  # when the loop iteration under way began (monotonic)
        )
        self._abandoned = False  # `fail` gave up on a stuck loop: `close` does not wait for it
        self.front_end_stopped = (
            threading.Event()
        )  # set by serve_rank once start_front_end has returned
        self._closing = False
        # ("add", request, event loop, asyncio queue), ("abort", request id) or ("shutdown",)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._metrics = engine.metrics()
        self._open: set[str] = set()  # request ids with a live stream (event loop side)
        self._not_started = 0  # of those, requests that have no output yet (event loop side)
        self._thread = threading.Thread(target=self._run, name="spmoe-engine-loop", daemon=True)

    # The asyncio side.

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the steps produce them, up to and including the one with a
        `finish_reason`. Raises on the first iteration, before anything runs: ValueError (the request is
        invalid or its id is in use), QueueFull, RuntimeError (the engine loop has stopped). If the consumer
        stops iterating (a cancelled task, `aclose`), the request is aborted and its cache freed."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.error}")
        self.engine.validate(request)
        if request.request_id in self._open:
            raise ValueError(f"request id {request.request_id!r} is in use; expected a new id")
        if self._not_started >= self.max_num_waiting:
            raise QueueFull(
                f"{self._not_started} requests wait to start; the server takes at most "
                f"{self.max_num_waiting} (max_num_waiting)"
            )
        outputs: asyncio.Queue = asyncio.Queue()
        self._open.add(request.request_id)
        self._not_started += 1
        started = finished = False
        self._inbox.put(("add", request, asyncio.get_running_loop(), outputs))
        try:
            while not finished:
                out = await outputs.get()
                if not started:
                    started = True
                    self._not_started -= 1
                finished = out.finish_reason is not None
                yield out
        finally:
            if not started:
                self._not_started -= 1
            self._open.discard(request.request_id)
            if not finished:
                self._inbox.put(("abort", request.request_id))

    def metrics(self) -> EngineMetrics:
        """Every DP group's engine after the last loop iteration."""
        return self._metrics

    def stalled_for(self) -> float:
        """Seconds the loop iteration under way (a plan sent to every rank and run) has taken so far; 0
        between iterations."""
        began = self._iteration_began
        return 0.0 if began is None else time.monotonic() - began

    def fail(self, reason: str) -> None:
        """Give up on a loop that is stuck (in a collective with a rank that no longer answers): new requests
        are refused with `reason`, and `close` leaves the thread where it is."""
        self.error, self._abandoned = reason, True

    # The engine loop thread.

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the loop: every rank leaves its loop; open streams end with finish_reason "abort"."""
        self._closing = True
        self._inbox.put(("shutdown",))
        if not self._abandoned:
            self._thread.join()

    def _run(self) -> None:
        streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        try:
            state = get_parallel_state()
            if state.device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(state.device)
            self._loop(state, streams)
        except BaseException as e:  # noqa: BLE001 - the front end must learn of it, not hang
            self.error = f"{type(e).__name__}: {e}"
            loops = {loop for loop, _ in streams.values()}
            self._hand_out(
                streams,
                [
                    RequestOutput(request_id, [], "error", error=self.error)
                    for request_id in streams
                ],
            )
            if (
                not self._closing
            ):  # stop the front end as Ctrl-C would; serve_rank then raises the error
                for loop in loops:  # once each event loop has run its streams' error outputs
                    try:
                        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=1)
                    except (RuntimeError, TimeoutError):  # closed, or too busy to wait for
                        pass
                # Repeated until the front end has returned: a first SIGINT was seen to go unnoticed now and
                # then (asyncio.run turns the first one into cancelling its task, the second into an exception).
                while True:
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                    if self.front_end_stopped.wait(1.0):
                        break
            return
        self._hand_out(streams, [RequestOutput(request_id, [], "abort") for request_id in streams])

    def _loop(self, state, streams: dict) -> None:
        loop = ServingLoop(self.engine)
        while True:
            plan = self._next_plan(loop, streams)
            self._iteration_began = time.monotonic()
            outputs, self._metrics = loop.step(plan)
            self._iteration_began = None
            self._hand_out(streams, outputs)
            if plan.command == "shutdown":
                return

    def _next_plan(self, loop: ServingLoop, streams: dict):
        """Drain the inbox (waiting up to a heartbeat when nothing is live) into the next plan."""
        items = []
        try:
            items.append(
                self._inbox.get(timeout=HEARTBEAT_S)
                if not loop.has_live()
                else self._inbox.get_nowait()
            )
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        new, aborts, shutdown = [], [], False
        for kind, *args in items:
            if kind == "add":
                request, event_loop, outputs = args
                streams[request.request_id] = (event_loop, outputs)
                new.append(request)
            elif kind == "abort":
                streams.pop(args[0], None)
                aborts.append(args[0])
            else:
                shutdown = True
        return loop.plan(new, aborts, shutdown)

    @staticmethod
    def _hand_out(streams: dict, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their requests' queues (an output whose consumer has gone is dropped): one
        `call_soon_threadsafe` per event loop with all of them."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = (
                streams.pop(out.request_id, None)
                if out.finish_reason is not None
                else streams.get(out.request_id)
            )
            if target is not None:
                per_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # the event loop has closed
                pass


def _put_each(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the event loop: each output into its request's queue."""
    for outputs, out in items:
        outputs.put_nowait(out)


def serve_rank(
    model_dir: str,
    args: EngineArgs,
    max_num_waiting: int,
    start_front_end,
    tokenizer_dir: str | None = None,
):
    """Run on every rank: load the model and build the engine. Rank 0 starts the engine loop, calls
    `start_front_end(client)` (which blocks until the server stops; -> SIGTERM if it reached rank 0, else
    None), then shuts every rank's loop down and returns what `start_front_end` returned; the other ranks run
    the worker loop and return None. `args` and `max_num_waiting`: settled (`check_serve`); `tokenizer_dir`
    (default `model_dir`): for grammars."""
    state = get_parallel_state()
    model = load_model(args, model_dir, state.device)
    # every rank compiles the grammars of structured-output requests itself, the same from the same spec
    grammars = GrammarCompiler(
        partial(load_tokenizer, tokenizer_dir or model_dir), model.cfg.vocab_size
    )
    log = (
        (lambda line: print(f"spmoe serve: {line}", file=sys.stderr, flush=True))
        if state.rank == 0
        else None
    )
    engine = build_engine(args, model, args.max_num_seqs, args.max_model_len, grammars, log)
    warm_up(engine, log)  # before the front end starts: nothing compiles or captures after ready
    if state.rank != 0:
        worker_loop(engine)
        return None
    client = EngineClient(engine, args.max_model_len, max_num_waiting)
    # A failing engine loop stops the front end with SIGINT; a spawned rank ignores SIGINT (its launcher turns
    # a Ctrl-C into ending every rank), so rank 0 takes SIGINT back while the front end runs.
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    client.start()
    try:
        result = start_front_end(client)
    except KeyboardInterrupt:
        if client.error is None:
            raise
        result = None
    finally:
        signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # a repeated stop from a failed engine loop may still come
        client.front_end_stopped.set()
        client.close()
        signal.signal(signal.SIGINT, ignored)
    # after a SIGTERM (under torchrun it reaches every rank) a failed loop is a peer that the signal ended
    if client.error is not None and result is None:
        raise RuntimeError(f"the engine loop failed: {client.error}")
    return result
