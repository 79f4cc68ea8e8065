"""How serving ends, decided on the front end's event loop: a stop signal, or an engine that failed
or stalled.

- SIGTERM drains: new requests and /health get 503, the requests under way may finish for
  `shutdown_timeout_s`, then every one still open ends (a stream with an error chunk and `data:
  [DONE]`).
- SIGINT (Ctrl-C, or the engine loop's own stop after it failed) ends the open requests at once.
- The engine loop failing (a rank died) ends the open requests at once; the engine has already sent
  each of them an error.
- The watchdog: one iteration of the engine loop (a step, or the idle heartbeat) running for longer
  than `engine_timeout_s` means a rank has stopped answering (stopped, swapping, or stuck in a
  collective): the client is marked failed (new requests get 503), the open requests end at once,
  and serving stops so that the process exits with an error instead of hanging until the process
  group's own timeout.
"""

import asyncio
import logging
import signal
from dataclasses import dataclass

from spmoe.entrypoints.serve.frontend.app import OpenAIApi

POLL_S = 0.25  # how often the engine's state is looked at
log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class StopPolicy:
    engine_timeout_s: float = 60.0  # an engine iteration longer than this is a stalled engine
    shutdown_timeout_s: float = 30.0  # after SIGTERM, how long the open requests may still run

    def __post_init__(self):
        for flag, value in (
            ("--engine-timeout", self.engine_timeout_s),
            ("--shutdown-timeout", self.shutdown_timeout_s),
        ):
            if not 0 <= value < float("inf"):  # also refuses NaN
                raise ValueError(f"{flag} must be a number of seconds >= 0, got {value}")
        if self.engine_timeout_s == 0:
            raise ValueError("--engine-timeout must be > 0 seconds, got 0")


async def supervise(
    api: OpenAIApi, client, policy: StopPolicy, signals: asyncio.Queue
) -> int | None:
    """Watch `signals` (signal numbers put there by the caller's handlers) and `client` (`error`,
    `stalled_for()`, `fail(reason)`) until serving must end; end it through `api.stop`. -> SIGTERM
    if that is why it ended (a drain, which the caller reports as a clean stop), else None."""
    while True:
        try:
            signum = await asyncio.wait_for(signals.get(), POLL_S)
        except TimeoutError:
            signum = None
        if signum == signal.SIGTERM:
            await api.stop("the server is shutting down", policy.shutdown_timeout_s)
            return signal.SIGTERM
        if client.error is not None:
            await api.stop("the engine has stopped; the server's log says why", 0)
            return None
        stalled = client.stalled_for()
        if stalled > policy.engine_timeout_s:
            reason = (
                f"no engine step finished in {stalled:.0f} s "
                f"(--engine-timeout {policy.engine_timeout_s:g}): "
                "a rank has stopped answering"
            )
            log.error("%s; failing every request and stopping", reason)
            client.fail(reason)
            await api.stop("the engine has stopped; the server's log says why", 0)
            return None
        if signum == signal.SIGINT:
            await api.stop("the server is stopping", 0)
            return None
