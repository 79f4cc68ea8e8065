"""Serving across ranks: the engine loop on rank 0, the worker loop on the others, and the client the asyncio
front end talks to.

Rank 0 decides everything. Its engine loop runs in a thread beside the front end's event loop; each
iteration it
1. drains its inbox (new requests from `EngineClient.generate`, aborts from consumers that went away, the
   shutdown), and gives each new request to the least loaded DP group;
2. sends that `StepPlan` to every rank over the gloo control group;
3. every rank applies it (adds the requests of its own DP group, aborts) and, if anything is live anywhere,
   runs one engine step, so that all ranks run the same steps (TP ranks the same batch, DP ranks each their
   own); under DP > 1 TP rank 0 of each DP group sends its outputs and metrics back to rank 0;
4. rank 0 hands each output to its request's asyncio queue (`loop.call_soon_threadsafe`).

When nothing is live, rank 0 waits on its inbox for up to `HEARTBEAT_S` and then sends an idle plan anyway,
so the other ranks, blocked on the next plan, never reach the process group's timeout.
"""

import asyncio
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import broadcast_object, gather_object
from spmoe.engine.cuda_graphs import deployment_problems
from spmoe.engine.engine import Engine, check_positions
from spmoe.engine.paged_cache import check_paged_budget
from spmoe.engine.request import EngineMetrics, Request, RequestOutput
from spmoe.entrypoints.cache_options import build_kv_cache
from spmoe.entrypoints.jobs import DTYPES, check_device

HEARTBEAT_S = 1.0  # the longest rank 0 stays silent while idle
DEFAULT_MAX_MODEL_LEN = 2048  # positions per request unless asked, or fewer if the model has fewer


class QueueFull(RuntimeError):
    """`max_num_waiting` requests already wait to start (the front end answers 503)."""


@dataclass(frozen=True)
class ServeOptions:
    dtype: str = "float32"  # one of DTYPES
    max_num_seqs: int = 8  # requests running at once per DP group
    max_model_len: int | None = None  # positions per request: prompt + generated tokens + drafts; None:
    # the model's max_position_embeddings, at most DEFAULT_MAX_MODEL_LEN (`for_model`)
    num_speculative_tokens: int = 0  # MTP drafts per step; 0 = no speculation (greedy requests only if > 0)
    max_num_waiting: int = 64  # requests waiting to start beyond which a new one gets QueueFull
    cuda_graphs: bool = False  # replay decode steps from CUDA graphs (CUDA, DP 1, no speculation)
    kv_cache: str = "paged"  # "paged" (sparse DSA attention) or "dense" (slots, dense attention: the reference)
    kv_cache_memory: float | None = None  # paged cache GiB per rank; None: see `build_paged_cache`
    gpu_memory_utilization: float | None = None  # paged cache as this share of free GPU memory (CUDA)
    kv_cache_dtype: str = "auto"  # paged cache: "auto" (the model dtype) or "fp8"
    max_num_batched_tokens: int = 8192  # tokens one step feeds; longer prompts are prefilled in chunks

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache not in ("paged", "dense"):
            raise ValueError(f"kv_cache must be 'paged' or 'dense', got {self.kv_cache!r}")
        if self.kv_cache == "dense" and (self.kv_cache_memory, self.gpu_memory_utilization, self.kv_cache_dtype) != (
            None,
            None,
            "auto",
        ):
            raise ValueError(
                "--kv-cache-memory, --gpu-memory-utilization and --kv-cache-dtype size the paged cache; "
                "got them with --kv-cache dense"
            )
        for name in ("max_num_seqs", "max_model_len", "max_num_waiting", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.num_speculative_tokens and self.cuda_graphs:
            raise ValueError(
                "CUDA graphs capture the plain decode step only; speculative decoding runs eagerly, "
                "so pass one or the other"
            )

    def for_model(self, cfg: ModelConfig) -> "ServeOptions":
        """These options with `max_model_len` settled for the model."""
        if self.max_model_len is not None:
            return self
        return replace(
            self, max_model_len=min(DEFAULT_MAX_MODEL_LEN, cfg.max_position_embeddings or DEFAULT_MAX_MODEL_LEN)
        )


def check_serve(model_dir: str, parallel: ParallelConfig, options: ServeOptions, device: str = "cpu") -> ModelConfig:
    """What can be checked before starting any rank: the checkpoint against the parallel layout, the device and
    the options (the same checks as `spmoe generate`'s where they apply). -> the model config."""
    cfg = ModelConfig.from_file(model_dir)
    cfg.check_parallel(parallel)
    check_device(device, parallel.world_size)
    if options.num_speculative_tokens and not cfg.num_nextn_predict_layers:
        raise ValueError(f"speculative decoding needs an MTP layer; {model_dir} has num_nextn_predict_layers = 0")
    if options.cuda_graphs:
        problems = deployment_problems(device, parallel.data_parallel_size, parallel.ep_backend)
        if problems:
            raise ValueError("--cuda-graphs needs " + "; ".join(problems))
    if options.max_model_len is not None:
        check_positions(options.max_model_len, cfg.max_position_embeddings, "--max-model-len")
    options = options.for_model(cfg)
    if options.kv_cache == "paged":
        check_paged_budget(
            cfg,
            options.num_speculative_tokens > 0,
            DTYPES[options.dtype],
            options.kv_cache_dtype,
            options.kv_cache_memory,
            options.gpu_memory_utilization,
            device,
            options.max_model_len,
        )
    return cfg


@dataclass
class StepPlan:
    """One iteration of the loop, the same on every rank."""

    command: str  # "step" (run one engine step), "idle" (the heartbeat: nothing to run), "shutdown"
    new: list[tuple[Request, int]] = field(default_factory=list)  # requests and the DP group that runs each
    aborts: list[str] = field(default_factory=list)  # request ids


def run_plan(engine: Engine, plan: StepPlan) -> tuple[list[RequestOutput], EngineMetrics] | None:
    """Apply the plan on this rank. -> on rank 0, every DP group's outputs and their metrics combined; None
    on the other ranks."""
    state = get_parallel_state()
    for request, dp_group in plan.new:
        if dp_group == state.dp_rank:
            engine.add_request(request)
    for request_id in plan.aborts:
        engine.abort(request_id)
    outputs = engine.step() if plan.command == "step" else []
    if state.dp_size == 1:
        return (outputs, engine.metrics()) if state.rank == 0 else None
    parts = gather_object((outputs, engine.metrics()) if state.tp_rank == 0 else None, state.control_group)
    if state.rank != 0:
        return None
    per_dp = parts[:: state.tp_size]  # TP rank 0 of each DP group
    return [out for outs, _ in per_dp for out in outs], EngineMetrics.combine([m for _, m in per_dp])


def worker_loop(engine: Engine) -> None:
    """The other ranks: apply rank 0's plans until the shutdown."""
    state = get_parallel_state()
    while True:
        plan = broadcast_object(None, state.control_group)
        run_plan(engine, plan)
        if plan.command == "shutdown":
            return


class EngineClient:
    """Rank 0's engine, seen from the asyncio front end. `generate` and `metrics` are called on the event
    loop; the engine loop runs in its own thread (`start` / `close`)."""

    def __init__(self, engine: Engine, options: ServeOptions):
        self.engine = engine
        self.max_model_len = options.max_model_len
        self.max_num_waiting = options.max_num_waiting
        self.vocab_size = engine.model.cfg.vocab_size
        self.eos_token_ids = engine.model.cfg.eos_token_ids
        self.num_speculative_tokens = engine.k
        self.error: str | None = None  # why the engine loop stopped, if it failed
        self._iteration_began: float | None = None  # when the loop iteration under way began (monotonic)
        self._abandoned = False  # `fail` gave up on a stuck loop: `close` does not wait for it
        self.front_end_stopped = threading.Event()  # set by serve_rank once start_front_end has returned
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
            for request_id in list(streams):
                self._deliver(streams, RequestOutput(request_id, [], "error", error=self.error))
            if not self._closing:  # stop the front end as Ctrl-C would; serve_rank then raises the error
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
        for request_id in list(streams):
            self._deliver(streams, RequestOutput(request_id, [], "abort"))

    def _loop(self, state, streams: dict) -> None:
        dp_of: dict[str, int] = {}  # live request -> its DP group
        while True:
            plan = self._next_plan(streams, dp_of, state.dp_size)
            self._iteration_began = time.monotonic()
            broadcast_object(plan, state.control_group)
            outputs, self._metrics = run_plan(self.engine, plan)
            self._iteration_began = None
            for out in outputs:
                if out.finish_reason is not None:
                    dp_of.pop(out.request_id, None)
                self._deliver(streams, out)
            if plan.command == "shutdown":
                return

    def _next_plan(self, streams: dict, dp_of: dict[str, int], dp_size: int) -> StepPlan:
        """Drain the inbox (waiting up to a heartbeat when nothing is live) into the next plan."""
        items = []
        try:
            items.append(self._inbox.get(timeout=HEARTBEAT_S) if not dp_of else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        plan, shutdown = StepPlan("idle"), False
        for kind, *args in items:
            if kind == "add":
                request, loop, outputs = args
                load = [0] * dp_size
                for group in dp_of.values():
                    load[group] += 1
                dp_of[request.request_id] = load.index(min(load))
                streams[request.request_id] = (loop, outputs)
                plan.new.append((request, dp_of[request.request_id]))
            elif kind == "abort":
                request_id = args[0]
                streams.pop(request_id, None)
                if dp_of.pop(request_id, None) is not None:
                    plan.aborts.append(request_id)
            else:
                shutdown = True
        plan.command = "shutdown" if shutdown else "step" if dp_of else "idle"
        return plan

    @staticmethod
    def _deliver(streams: dict, out: RequestOutput) -> None:
        """Hand an output to its request's queue (dropped if the consumer has gone)."""
        target = streams.pop(out.request_id, None) if out.finish_reason is not None else streams.get(out.request_id)
        if target is None:
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        except RuntimeError:  # the event loop has closed
            pass


def serve_rank(model_dir: str, parallel: ParallelConfig, options: ServeOptions, start_front_end):
    """Run on every rank: load the model and build the engine. Rank 0 starts the engine loop, calls
    `start_front_end(client)` (which blocks until the server stops; -> SIGTERM if it reached rank 0, else
    None), then shuts every rank's loop down and returns what `start_front_end` returned; the other ranks run
    the worker loop and return None."""
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    options = options.for_model(ModelConfig.from_file(model_dir))
    model = load_model(
        model_dir, parallel, DTYPES[options.dtype], state.device, with_mtp=options.num_speculative_tokens > 0
    )
    cache = build_kv_cache(model, options, options.max_num_seqs, options.max_model_len)
    engine = Engine(
        model,
        cache,
        options.num_speculative_tokens,
        options.cuda_graphs,
        options.max_num_seqs,
        options.max_num_batched_tokens,
        options.max_model_len,
    )
    if state.rank != 0:
        worker_loop(engine)
        return None
    client = EngineClient(engine, options)
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
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a repeated stop from a failed engine loop may still come
        client.front_end_stopped.set()
        client.close()
        signal.signal(signal.SIGINT, ignored)
    # after a SIGTERM (under torchrun it reaches every rank) a failed loop is a peer that the signal ended
    if client.error is not None and result is None:
        raise RuntimeError(f"the engine loop failed: {client.error}")
    return result
