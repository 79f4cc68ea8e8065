"""Rank 0's engine process as a front end process sees it: `EngineClient`, on the front end's event
loop, talking to the engine over the wire (`wire.py`).

Requests and aborts are gathered as they come and sent in one message per turn of the event loop;
the engine's one message per step is read by a task on the event loop, which hands each output to
its request's mailbox (`Outputs`). A stream takes everything its mailbox holds at once: the outputs
of the steps that ran since it last looked come as one output (`merged`), so a front end that falls
behind the engine sends fewer, larger chunks instead of falling further behind. The client never
imports the engine or the model: what it must know of them (`EngineFacts`) comes with the front
end's launch.

The engine is watched from here: `stalled_for()` is the time since its last message (it sends one
after every step, and a heartbeat at least every second while idle), and `error` is set when it
reports a failure or when its process is gone (this process's parent changed).
"""

import asyncio
import os
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from spmoe.engine.request import EngineMetrics, Request, RequestOutput
from spmoe.entrypoints.serve.wire import Codec, EngineFacts, ToEngine


class QueueFull(RuntimeError):
    """`max_num_waiting` requests already wait to start (the front end answers 503)."""


class Outputs:
    """One request's mailbox: the outputs (or the exception that ends it) its stream has not
    taken."""

    __slots__ = ("items", "ready")

    def __init__(self):
        self.items: list = []
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list:
        """Everything put since the last take (waits for at least one), merged (`merged`)."""
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return merged(items)


def merged(items: list) -> list:
    """Consecutive outputs of one request as one: the tokens and their logprobs in order, the
    first's prompt logprobs and engine seconds, the last's finish (reason, stop token). An
    exception, an output that ends the request as "abort" or "error" (the text before it still goes
    out first), and whatever follows a finished output stay apart. The outputs are the wire's,
    decoded for this request alone: the first of a run is extended in place."""
    out = []
    for item in items:
        last = out[-1] if out else None
        if (
            isinstance(item, Exception)
            or item.finish_reason in ("abort", "error")
            or not isinstance(last, RequestOutput)
            or last.finish_reason is not None
        ):
            out.append(item)
            continue
        last.new_token_ids += item.new_token_ids
        if item.logprobs is not None:
            last.logprobs = (last.logprobs or []) + item.logprobs
        if last.prompt_logprobs is None:
            last.prompt_logprobs = item.prompt_logprobs
        if last.queue_s is None:
            last.queue_s, last.prefill_s = item.queue_s, item.prefill_s
        last.finish_reason, last.stop_token = item.finish_reason, item.stop_token
        last.prompt_tokens = item.prompt_tokens or last.prompt_tokens
    return out


class EngineClient:
    """The engine process behind one front end. `generate` and `metrics` are called on the event
    loop, between `start()` and `close()`."""

    def __init__(
        self,
        address: str,
        facts: EngineFacts,
        engine_pid: int,
        identity: bytes | None = None,
    ):
        """`identity`: this front end's on the engine's socket (None: one ZeroMQ makes up)."""
        self.address, self.engine_pid = address, engine_pid
        self.identity = identity
        self.max_model_len = facts.max_model_len
        self.max_num_waiting = facts.max_num_waiting
        self.vocab_size = facts.vocab_size
        self.eos_token_ids = facts.eos_token_ids
        self.num_speculative_tokens = facts.num_speculative_tokens
        self._error: str | None = None
        self._codec = Codec()
        self._socket = None
        self._receiver: asyncio.Task | None = None
        self._streams: dict[str, Outputs] = {}  # open requests' outputs (and refusals)
        self._not_started = 0  # of those, requests that have no output yet
        self._adds: list[Request] = []  # not sent yet
        self._aborts: list[str] = []
        self._flush_due = False
        self._metrics = EngineMetrics()
        self._heard = time.monotonic()  # the engine's last message
        self.exchange_s = self.idle_s = 0.0  # the engine's seconds on the exchange, idle (so far)
        self.front_ends = 0  # the engine's front ends that listen (have said hello)

    async def start(self) -> None:
        """Connect, and say hello (once this front end listens): the engine sends it a message after
        each step from now."""
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if self.identity is not None:
            self._socket.setsockopt(zmq.IDENTITY, self.identity)
        self._socket.connect(self.address)
        self._heard = time.monotonic()
        await self._socket.send(self._codec.encode(ToEngine()))
        self._receiver = asyncio.create_task(self._receive())
        if self._adds or self._aborts:  # requests that came before
            self._flush()

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        if self._socket is not None:
            self._socket.close()

    @property
    def error(self) -> str | None:
        """Why the engine stopped serving (None while it serves)."""
        if self._error is None and os.getppid() != self.engine_pid:
            self._error = "the engine process has exited"
        return self._error

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the steps produce them (those of several steps merged into
        one when they came before this iterator was read again: `Outputs`), up to and including the
        one with a `finish_reason`. Raises on the first iteration: ValueError (the engine refused
        it: it can never run there, its grammar does not compile, or its id is in use), QueueFull,
        RuntimeError (the engine has stopped). If the consumer stops iterating, the request is
        aborted and its cache freed. Request ids are unique by construction (the server's are a
        uuid4 each): the engine alone checks."""
        if self.error is not None:
            raise RuntimeError(f"the engine has stopped: {self.error}")
        if self._not_started >= self.max_num_waiting:
            raise QueueFull(
                f"{self._not_started} requests wait to start; the server takes at most "
                f"{self.max_num_waiting} (max_num_waiting)"
            )
        outputs = Outputs()
        self._streams[request.request_id] = outputs
        self._not_started += 1
        started = finished = False
        self._send_soon(add=request)
        try:
            while not finished:
                for out in await outputs.take():
                    if isinstance(out, Exception):  # refused by the engine, or it has stopped
                        finished = True
                        raise out
                    if not started:
                        started = True
                        self._not_started -= 1
                    finished = out.finish_reason is not None
                    yield out
                    if finished:
                        break
        finally:
            if not started:
                self._not_started -= 1
            self._streams.pop(request.request_id, None)
            if not finished:
                self._send_soon(abort=request.request_id)

    def metrics(self) -> EngineMetrics:
        """Every DP group's engine after its last step, with this front end's open requests among
        the request tables."""
        tables = {**self._metrics.request_tables, "front_end_streams": len(self._streams)}
        return msgspec.structs.replace(self._metrics, request_tables=tables)

    def stalled_for(self) -> float:
        """Seconds since the engine's last message."""
        return time.monotonic() - self._heard

    def fail(self, reason: str) -> None:
        """Give up on a stalled engine: new requests are refused with `reason`."""
        self._error = reason

    def _send_soon(self, add: Request | None = None, abort: str | None = None) -> None:
        """Queue an add or abort; everything queued goes out in one message on the loop's next
        turn."""
        if add is not None:
            self._adds.append(add)
        if abort is not None:
            self._aborts.append(abort)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what is queued (kept until `start` if not connected yet)."""
        self._flush_due = False
        if self._socket is None or self._socket.closed:
            return
        message = ToEngine(adds=self._adds, aborts=self._aborts)
        self._adds, self._aborts = [], []
        self._socket.send(self._codec.encode(message), zmq.NOBLOCK)

    async def _receive(self) -> None:
        """Each engine message: outputs to their queues, refusals as ValueError, a failure to every
        stream."""
        decode = self._codec.from_engine.decode
        while True:
            message = decode(await self._socket.recv())
            self._heard = time.monotonic()
            self._metrics = message.metrics
            self.exchange_s, self.idle_s = message.exchange_s, message.idle_s
            self.front_ends = message.front_ends
            for request_id, why in message.rejected:
                outputs = self._streams.get(request_id)
                if outputs is not None:
                    outputs.put(ValueError(why))
            for out in message.outputs:
                outputs = self._streams.get(out.request_id)
                if outputs is not None:
                    outputs.put(out)
            if message.error is not None:
                self._error = message.error
                for outputs in self._streams.values():
                    outputs.put(RuntimeError(f"the engine has stopped: {message.error}"))
