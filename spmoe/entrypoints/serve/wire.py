"""The wire between the HTTP front end process(es) and rank 0's engine process: plain records both
sides import (these, and the requests and outputs of `spmoe.engine.request`), nothing of torch.

One ZeroMQ socket pair over an `ipc://` path in a folder only the server's user may enter (mode
0700): the engine binds a ROUTER, each front end connects a DEALER under the identity rank 0 gave
it. Messages are MessagePack (msgspec), one each way per step at most:
- front end -> engine, `ToEngine`: the requests that arrived since the last message and the aborts
  (token ids only; a request's grammar travels as its spec, which the engine compiles, once per
  spec); an empty one says hello, once the front end listens;
- engine -> front end, `FromEngine`: after every step (or heartbeat, when idle), that front end's
  outputs, the requests the engine refused (they can never run, or their grammar does not compile),
  the engine's counters, and the engine's time on the exchange.

A front end process starts with a `FrontEndLaunch` on its standard input, and knows the engine by
its `EngineFacts`. `benchmarks/bench_wire.py` measures the codec (msgspec against msgpack) at 256
streams.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass

import msgspec

from spmoe.engine.request import EngineMetrics, Request, RequestOutput


@dataclass(frozen=True)
class EngineFacts:
    """What a front end knows of the engine it serves."""

    max_model_len: int
    # per front end
    max_num_waiting: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_speculative_tokens: int


@dataclass(frozen=True)
class FrontEndLaunch:
    """What rank 0 hands a front end process on its standard input (pickled): `target`
    ("module:function") is called with the engine client, this launch and the arguments `args` holds
    (pickled by the launcher: only the front end process unpickles them, so the rank side never
    loads the front end's classes), in the main thread; it returns once serving is over."""

    target: str
    args: bytes
    # the engine's socket, and this front end's identity on it
    address: str
    identity: bytes
    facts: EngineFacts
    engine_pid: int
    # a folder of the server's front ends alone (mode 0700), kept across their restarts and removed
    # when the server stops: their stored responses (`frontend/response_store.py`)
    shared_dir: str
    # which of rank 0's front ends this is (0 prints the ready line), and how many front ends were
    # restarted before it (a restarted one prints no ready line)
    index: int
    restart: int = 0


class ToEngine(msgspec.Struct, array_like=True):
    """What one front end sends: new requests (ids unique across front ends: the front end's prefix)
    and the ids of requests it no longer wants."""

    adds: list[Request] = []
    aborts: list[str] = []


class FromEngine(msgspec.Struct, array_like=True):
    """What the engine sends each front end after a step or heartbeat. `rejected`: (request id, why)
    for requests the engine refused before they ran (a 400: they can never run, their grammar does
    not compile, or their id is in use); `error`: the engine loop failed (every open request also
    got an output with finish_reason "error"); `exchange_s` / `idle_s`: the engine process's seconds
    so far on this exchange (receiving, decoding, encoding, sending) and waiting for work;
    `front_ends`: the front ends that have said hello (each does once it listens)."""

    outputs: list[RequestOutput]
    metrics: EngineMetrics
    rejected: list[tuple[str, str]] = []
    error: str | None = None
    exchange_s: float = 0.0
    idle_s: float = 0.0
    front_ends: int = 0


class Codec:
    """Encoders and typed decoders for both directions, built once per process."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.to_engine = msgspec.msgpack.Decoder(ToEngine)
        self.from_engine = msgspec.msgpack.Decoder(FromEngine)

    def encode(self, message: ToEngine | FromEngine) -> bytes:
        return self.encoder.encode(message)


class PrivateAddress:
    """An `ipc://` address in a fresh folder of mode 0700 (`tempfile.mkdtemp`): no other user can
    connect. `remove()` deletes the folder with the socket file."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="spmoe-serve-")
        self.url = f"ipc://{os.path.join(self.folder, 'engine')}"

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
