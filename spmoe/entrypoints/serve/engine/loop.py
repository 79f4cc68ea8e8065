"""Rank 0's engine loop (`EngineLoop`), which runs in rank 0's own process and serves the HTTP front
end process(es) it starts.

Rank 0's main thread runs the engine loop: each iteration it reads every message the front ends sent
since the last one (new requests, aborts: `wire.ToEngine`), plans the step, runs it on every rank
through the engine's serving loop (`spmoe.engine.ranks`), and sends each front end one message
(`wire.FromEngine`: its outputs, the engine's counters, the time spent on the exchange). The engine
never waits for a front end; while nothing runs it waits for a message for up to `HEARTBEAT_S`, then
runs an idle step anyway, so the other ranks, blocked on the next plan, never reach the process
group's timeout, and the front ends hear from it (their watchdog).

A request's grammar arrives as its spec; the engine compiles it on a worker thread (cached by spec),
and the request joins a step once it has compiled, so a compile never holds up the steps of the
others.

The front ends are child processes (`front_ends.py`), started once the engine is warm. A SIGTERM to
rank 0 is passed on to them: they drain, exit 0, and rank 0 then stops every rank. A front end that
exits with an error is replaced (its requests aborted), a bounded number of times; past that the
others are stopped (SIGINT), every rank shuts down and rank 0 fails. If the engine loop is stuck in
a step (a rank stopped answering) when a front end dies, rank 0 exits 1 after `STUCK_GRACE_S`. A
front end whose engine process is gone stops and exits 1 (`EngineClient.error`).
"""

import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from spmoe.engine.engine import Engine
from spmoe.engine.ranks import ServingLoop
from spmoe.engine.request import EngineMetrics, GrammarSpec, Request, RequestOutput
from spmoe.entrypoints.serve.engine.front_ends import FRONT_END_EXIT_S, FrontEndCommand, FrontEnds
from spmoe.entrypoints.serve.wire import Codec, EngineFacts, FromEngine, PrivateAddress

# the longest rank 0 stays silent while idle
HEARTBEAT_S = 1.0
# while idle with grammars compiling: how often the loop looks at them
COMPILE_POLL_MS = 5
# how often rank 0 looks at its front end processes while idle, and from its watch thread
WATCH_PERIOD_S = 0.2
# a front end exited and the engine loop has not ended since: rank 0 exits 1
STUCK_GRACE_S = 5.0
# after the engine failed: how long the front ends may take to end their streams
FAILED_EXIT_S = 3.0


class EngineLoop:
    """Rank 0's engine loop and the front end processes it serves (`run`)."""

    def __init__(self, engine: Engine, front_end: FrontEndCommand, facts: EngineFacts):
        self.engine, self.front_end, self.facts = engine, front_end, facts
        self.codec = Codec()
        self.serving = ServingLoop(engine)
        # front end identity -> its outputs this step
        self.peers: dict[bytes, list[RequestOutput]] = {}
        # the identities of front ends that died: what they sent last is not read
        self.gone: set[bytes] = set()
        self.rejected: dict[bytes, list[tuple[str, str]]] = {}
        self.owner: dict[str, bytes] = {}  # live or compiling request -> its front end
        self.compiling: list[tuple[Future, Request]] = []  # in arrival order
        self.compiles: dict[GrammarSpec, Future] = {}
        self.compile_work = ThreadPoolExecutor(1, thread_name_prefix="spmoe-grammar")
        self.exchange_s = self.idle_s = 0.0
        self.metrics = EngineMetrics()
        self.sigterm = False
        self.done = threading.Event()  # set when the loop has left its last step

    def run(self) -> int | None:
        """Start the front ends and serve them until they have all exited, restarting one that dies
        (`front_ends.py`). -> SIGTERM if one reached this process (the front ends drained), else
        None; RuntimeError if the engine loop failed or the front ends kept dying."""
        address = PrivateAddress()
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address.url)
        self.front_ends = FrontEnds(self.front_end, address.url, self.facts)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        failure = None
        try:
            self.front_ends.start()
            threading.Thread(target=self._watch, name="spmoe-front-end-watch", daemon=True).start()
            failure = self._serve()
        finally:
            self.done.set()
            grace_s = FRONT_END_EXIT_S if self.sigterm else FAILED_EXIT_S
            # front ends that kept dying: the others are stopped at once
            self.front_ends.end(0 if self.front_ends.failure else grace_s)
            signal.signal(signal.SIGTERM, previous)
            self.socket.close()
            address.remove()
        # after a SIGTERM (under torchrun it reaches every rank) a failed loop is a peer that the
        # signal ended
        if failure is not None and not self.sigterm:
            raise RuntimeError(failure)
        return signal.SIGTERM if self.sigterm else None

    def _on_sigterm(self, signum, frame) -> None:
        """Pass the SIGTERM on: the front ends drain, then exit."""
        self.sigterm = True
        self.front_ends.signal(signal.SIGTERM)

    def _serve(self) -> str | None:
        """The loop. -> why it failed, or None once every front end has exited cleanly."""
        try:
            while True:
                new, aborts = self._receive()
                dead, failure = self.front_ends.replace_dead(stopping=self.sigterm)
                aborts += self._forget(dead)
                shutdown = failure is not None or self.front_ends.all_exited()
                plan = self.serving.plan(new, aborts, shutdown)
                done = self.serving.step(plan)
                # the loop's own tables beside the engine's
                loop_tables = {"engine_loop_owners": len(self.owner)}
                loop_tables["engine_loop_compiling"] = len(self.compiling)
                self.metrics = msgspec.structs.replace(
                    done.metrics, request_tables={**done.metrics.request_tables, **loop_tables}
                )
                for request_id, why in done.refused:
                    peer = self.owner.pop(request_id, None)
                    if peer is not None:
                        self.rejected.setdefault(peer, []).append((request_id, why))
                self._send(done.outputs)
                if plan.command == "shutdown":
                    return failure
        except Exception as e:  # noqa: BLE001 - the front ends must learn of it, not hang
            error = f"{type(e).__name__}: {e}"
            for request_id in list(self.owner):
                self.peers[self.owner[request_id]].append(
                    RequestOutput(request_id, [], "error", error=error)
                )
            self._send([], error)
            return f"the engine loop failed: {error}"

    def _forget(self, dead: list[bytes]) -> list[str]:
        """The front ends `dead` are gone: nothing more is sent to them, or read from them. -> the
        ids of their requests, to abort (their clients' connections closed with them)."""
        self.gone.update(dead)
        for peer in dead:
            self.peers.pop(peer, None)
            self.rejected.pop(peer, None)
        aborts = [request_id for request_id, peer in self.owner.items() if peer in self.gone]
        for request_id in aborts:
            del self.owner[request_id]
        return aborts

    def _receive(self) -> tuple[list[Request], list[str]]:
        """Every message waiting (while nothing is live, the first one waited for up to a heartbeat,
        or until a front end dies), and the grammars compiled since. -> the requests that may join
        the next step, and the aborts."""
        if not self.serving.has_live():
            began = time.perf_counter()
            wait_ms = COMPILE_POLL_MS if self.compiling else HEARTBEAT_S * 1000
            while not self.socket.poll(min(wait_ms, WATCH_PERIOD_S * 1000)):
                wait_ms -= WATCH_PERIOD_S * 1000
                if wait_ms <= 0 or self.front_ends.dead() is not None:
                    break
            self.idle_s += time.perf_counter() - began
        began = time.perf_counter()
        new, aborts = [], []
        while True:
            try:
                peer, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if peer in self.gone:
                continue
            message = self.codec.to_engine.decode(data)
            self.peers.setdefault(peer, [])
            for request in message.adds:
                self._admit(peer, request, new)
            for request_id in message.aborts:
                if self.owner.pop(request_id, None) is not None:
                    aborts.append(request_id)
        self.exchange_s += time.perf_counter() - began
        return self._compiled(new), aborts

    def _admit(self, peer: bytes, request: Request, new: list[Request]) -> None:
        """A request from `peer` into `new`, or into `compiling` while its grammar compiles. The
        engines refuse what cannot run (`Engine.add_request`, on every rank): the refusals come
        back with the step."""
        self.owner[request.request_id] = peer
        if request.grammar is None or self.engine.grammars is None:
            new.append(request)
            return
        compiled = self.compiles.get(request.grammar)
        if compiled is None:
            compiled = self.compile_work.submit(self.engine.grammars.compile, request.grammar)
            self.compiles[request.grammar] = compiled
        self.compiling.append((compiled, request))

    def _compiled(self, new: list[Request]) -> list[Request]:
        """`new` and, in arrival order, the compiling requests whose grammar is ready (one that does
        not compile is refused; one aborted meanwhile is dropped)."""
        waiting = []
        for compiled, request in self.compiling:
            peer = self.owner.get(request.request_id)
            if peer is None:
                continue
            if not compiled.done():
                waiting.append((compiled, request))
            elif compiled.exception() is not None:
                del self.owner[request.request_id]
                why = str(compiled.exception())
                self.rejected.setdefault(peer, []).append((request.request_id, why))
            else:
                new.append(request)
        self.compiling = waiting
        self.compiles = {spec: f for spec, f in self.compiles.items() if not f.done()}
        return new

    def _send(self, outputs: list[RequestOutput], error: str | None = None) -> None:
        """One message to each front end: its outputs of the step, its refused requests, the
        counters."""
        began = time.perf_counter()
        for out in outputs:
            if out.finish_reason is None:
                peer = self.owner.get(out.request_id)
            else:
                peer = self.owner.pop(out.request_id, None)
            if peer is not None:
                self.peers[peer].append(out)
        for peer, mine in self.peers.items():
            message = FromEngine(
                outputs=mine,
                metrics=self.metrics,
                rejected=self.rejected.pop(peer, []),
                error=error,
                exchange_s=self.exchange_s,
                idle_s=self.idle_s,
                front_ends=len(self.peers),
            )
            self.socket.send_multipart((peer, self.codec.encode(message)), zmq.NOBLOCK)
            self.peers[peer] = []
        self.exchange_s += time.perf_counter() - began

    def _watch(self) -> None:
        """A front end that dies while the engine loop is stuck in a step (a rank stopped answering)
        is never replaced, and its clients' requests would wait forever: after `STUCK_GRACE_S` this
        process exits 1 instead."""
        while not self.done.is_set():
            dead = self.front_ends.dead()
            if dead is not None and not self.done.wait(STUCK_GRACE_S):
                if dead in self.front_ends.procs.values():
                    print(
                        f"spmoe serve: the front end process {dead.pid} exited with code "
                        f"{dead.returncode} and the engine loop has been stuck in a step since (a "
                        "rank stopped answering); exiting",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)
            self.done.wait(WATCH_PERIOD_S)
