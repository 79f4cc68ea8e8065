"""From one request's engine outputs to text pieces: incremental detokenizing, stop strings, token counts and
the latency metrics.

A stop string ends the text before it, with finish_reason "stop"; the text after the last piece that could be
the start of a stop string is held back until it is known not to be one. Leaving the pieces early (a stop
string, a client that went away, an error) closes the engine's output iterator, which aborts the request and
frees its cache.
"""

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from spmoe.entrypoints.serve.metrics import ServeMetrics
from spmoe.entrypoints.serve.parsers.markers import partial_marker_length
from spmoe.entrypoints.serve.protocol import ApiError
from spmoe.entrypoints.serve.tokenizer import IncrementalDetokenizer

log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None = None  # set on the last piece: "stop" or "length"


class StopStrings:
    """Cuts text at the first stop string. `feed(text)` -> (text safe to emit, whether a stop string ended
    it); `flush()` -> the held-back text, at the end."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""  # text fed but not yet emitted: it could be the start of a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        pending = self.pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return pending[: min(hits)], True
        held = partial_marker_length(pending, self.stops)
        self.pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], False

    def flush(self) -> str:
        pending, self.pending = self.pending, ""
        return pending


class TextGeneration:
    """One request in flight. `pieces()` yields its text; `prompt_tokens` and `completion_tokens` count as it
    goes (completion tokens are every token the engine generated for it, an eos id included)."""

    def __init__(
        self,
        outputs: AsyncIterator,
        tokenizer,
        prompt: list[int],
        stops: list[str],
        eos_token_ids: tuple[int, ...],
        metrics: ServeMetrics,
    ):
        self.outputs, self.eos_token_ids, self.metrics = outputs, set(eos_token_ids), metrics
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        self.stops = StopStrings(stops)
        self.prompt_tokens, self.completion_tokens = len(prompt), 0
        self.last_event = time.perf_counter()  # the arrival, then the latest tokens

    async def pieces(self) -> AsyncIterator[Piece]:
        async with aclosing(self.outputs):
            async for out in self.outputs:
                if out.finish_reason in ("error", "abort"):  # the reason stays in the log: it may name files
                    log.error("the engine ended request %s (%s): %s", out.request_id, out.finish_reason, out.error)
                    raise ApiError(
                        500, f"the engine ended this request ({out.finish_reason}); the server's log says why"
                    )
                ids = out.new_token_ids
                self._count(len(ids))
                if out.finish_reason == "stop" and ids and ids[-1] in self.eos_token_ids:
                    ids = ids[:-1]  # the eos token ends the text without being part of it
                text = self.detokenizer.push(ids)
                if out.finish_reason:
                    text += self.detokenizer.flush()
                text, stopped = self.stops.feed(text)
                if stopped:
                    self.metrics.finished.labels("stop").inc()
                    yield Piece(text, "stop")
                    return
                if out.finish_reason:
                    self.metrics.finished.labels(out.finish_reason).inc()
                    yield Piece(text + self.stops.flush(), out.finish_reason)
                    return
                if text:
                    yield Piece(text)
        raise ApiError(500, "the engine's outputs for this request ended without a finish_reason")

    def _count(self, new_tokens: int) -> None:
        if not new_tokens:
            return
        now = time.perf_counter()
        self.metrics.observe_tokens(new_tokens, now - self.last_event, first=self.completion_tokens == 0)
        self.last_event = now
        self.completion_tokens += new_tokens

    @property
    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
