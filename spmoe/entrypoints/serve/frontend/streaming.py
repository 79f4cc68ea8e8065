"""From one request's engine outputs to text pieces: incremental detokenizing, stop strings, token
counts and the latency metrics.

A stop string ends the text before it, with finish_reason "stop"; the text after the last piece that
could be the start of a stop string is held back until it is known not to be one. Leaving the pieces
early (a stop string, a client that went away, an error) closes the engine's output iterator, which
aborts the request and frees its cache.
"""

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from spmoe.entrypoints.serve.frontend.metrics import ServeMetrics
from spmoe.entrypoints.serve.frontend.parsers.markers import partial_marker_length
from spmoe.entrypoints.serve.frontend.protocol import ApiError
from spmoe.entrypoints.serve.frontend.tokenizer import IncrementalDetokenizer

log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None = None  # set on the last piece: "stop" or "length"
    token_ids: tuple[
        int, ...
    ] = ()  # the tokens that came since the previous piece (when logprobs are asked)
    logprobs: tuple = ()  # their (logprob, [(id, logprob), ...]), one per token id


class StopStrings:
    """Cuts text at the first stop string. `feed(text)` -> (text safe to emit, whether a stop string
    ended it); `flush()` -> the held-back text, at the end."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops, self.include = stops, include
        self.pending = ""  # text fed but not yet emitted: it could be the start of a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        pending = self.pending + text
        hits = [(i, i + len(s)) for i, s in ((pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            start, end = min(hits)
            return pending[: end if self.include else start], True
        held = partial_marker_length(pending, self.stops)
        self.pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], False

    def flush(self) -> str:
        pending, self.pending = self.pending, ""
        return pending


class TextGeneration:
    """One request (one choice) in flight. `pieces()` yields its text; `prompt_tokens` and
    `completion_tokens` count as it goes (completion tokens are every token the engine generated for
    it, an eos id included).

    The eos or stop id that ended a request (the output's `stop_token`) ends the text without being
    part of it, unless `include_stop`, which keeps a stop string or a stop id's text (never an eos
    id's); `discard_output`: the generated tokens are dropped (echo with max_tokens 0: the engine
    generates one token that nobody sees); `prompt_logprobs` is filled from the first output when
    the request asked for them."""

    def __init__(
        self,
        outputs: AsyncIterator,
        tokenizer,
        prompt: list[int],
        stops: list[str],
        metrics: ServeMetrics,
        eos_token_ids: tuple[int, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        discard_output: bool = False,
    ):
        self.outputs, self.metrics = outputs, metrics
        self.eos_token_ids = set(eos_token_ids)
        self.include_stop, self.discard_output = include_stop, discard_output
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        self.stops = StopStrings(stops, include_stop)
        self.prompt_tokens, self.completion_tokens = len(prompt), 0
        self.prompt_logprobs = None
        self.arrival = self.last_event = time.perf_counter()  # the arrival, then the latest tokens
        self.first_token_s = None
        self.engine_s = None  # its first output's (queue_s, prefill_s), the engine's durations

    async def pieces(self) -> AsyncIterator[Piece]:
        held_ids, held_logprobs = [], []  # tokens whose text is not out yet
        async with aclosing(self.outputs):
            async for out in self.outputs:
                if out.finish_reason in (
                    "error",
                    "abort",
                ):  # the reason stays in the log: it may name files
                    log.error(
                        "the engine ended request %s (%s): %s",
                        out.request_id,
                        out.finish_reason,
                        out.error,
                    )
                    raise ApiError(
                        500,
                        f"the engine ended this request ({out.finish_reason}); "
                        "the server's log says why",
                    )
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = out.prompt_logprobs
                if out.queue_s is not None:
                    self.engine_s = (out.queue_s, out.prefill_s)
                ids = [] if self.discard_output else out.new_token_ids
                if not self.discard_output:
                    self._count(len(ids))
                    held_ids += ids
                    held_logprobs += out.logprobs or []
                if ids and out.stop_token is not None:
                    if not self.include_stop or out.stop_token in self.eos_token_ids:
                        ids = ids[:-1]  # the stop token ends the text without being part of it
                text = self.detokenizer.push(ids)
                if out.finish_reason:
                    text += self.detokenizer.flush()
                text, stopped = self.stops.feed(text)
                reason = "stop" if stopped else out.finish_reason
                if reason is not None:
                    if not stopped:
                        text += self.stops.flush()
                    self._finish(reason)
                    yield Piece(text, reason, tuple(held_ids), tuple(held_logprobs))
                    return
                if text:
                    yield Piece(text, None, tuple(held_ids), tuple(held_logprobs))
                    held_ids, held_logprobs = [], []
        raise ApiError(500, "the engine's outputs for this request ended without a finish_reason")

    def _count(self, new_tokens: int) -> None:
        if not new_tokens:
            return
        now = time.perf_counter()
        first = self.completion_tokens == 0
        self.metrics.observe_tokens(new_tokens, now - self.last_event, first=first)
        if first:
            self.first_token_s = now - self.arrival
        self.last_event = now
        self.completion_tokens += new_tokens

    def _finish(self, reason: str) -> None:
        seconds = time.perf_counter() - self.arrival
        self.metrics.observe_finished(
            reason,
            seconds,
            self.first_token_s,
            self.prompt_tokens,
            self.completion_tokens,
            self.engine_s,
        )

    @property
    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
