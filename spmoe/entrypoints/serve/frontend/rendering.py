"""Response rendering: the JSON of a whole response's choices and the server-sent events of a
stream, from the pieces of text the engine's requests produce (`Render`, `events`); the engine's
refusal of a request as the HTTP error a client gets (`first_piece`)."""

import asyncio
import json
from contextlib import AsyncExitStack, aclosing

from spmoe.entrypoints.serve.frontend.engine_client import QueueFull
from spmoe.entrypoints.serve.frontend.protocol import ApiError, SamplingFields, internal_error
from spmoe.entrypoints.serve.frontend.request_reader import Choice
from spmoe.entrypoints.serve.frontend.streaming import Piece, TextGeneration, usage
from spmoe.entrypoints.serve.frontend.tokenizer import TokenTexts


async def first_piece(pieces) -> Piece:
    """The first text, or the engine's refusal as an HTTP error."""
    try:
        return await anext(pieces)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}") from None
    except ValueError as e:  # the engine can never fit the request
        raise ApiError(400, str(e).strip().splitlines()[0]) from None
    except RuntimeError:  # the engine loop has stopped (its error is in the log)
        raise ApiError(503, "the engine has stopped; the server's log says why") from None


class Render:
    """The JSON of the choices: text, finish_reason and, when asked, logprobs in the completions or
    chat shape (`echo` puts the prompt and its logprobs first; chat choices come from their
    ChatChoices parser)."""

    def __init__(
        self,
        token_texts: TokenTexts,
        kind: str,
        choices: list[Choice],
        generations: list[TextGeneration],
        parsers: list | None,
        token_ids: bool = False,
    ):
        self.token_texts, self.kind, self.choices, self.generations = (
            token_texts,
            kind,
            choices,
            generations,
        )
        self.parsers = parsers
        self.token_ids = token_ids  # name tokens by id (`return_tokens_as_token_ids`)
        self.offsets = [0] * len(choices)  # completions' text_offset so far, per choice
        self.held: list[tuple[list[int], list]] = [([], [])] * len(
            choices
        )  # per choice: tokens not sent yet

    def whole(self, i: int, pieces: list[Piece]) -> dict:
        merged = Piece(
            "".join(p.text for p in pieces),
            pieces[-1].finish_reason,
            tuple(t for p in pieces for t in p.token_ids),
            tuple(lp for p in pieces for lp in p.logprobs),
        )
        return self.choice(i, merged, first=True, stream=False)

    def choice(self, i: int, piece: Piece, first: bool, stream: bool) -> dict | None:
        """The choice of a whole response, or of a stream chunk; None for a chunk that would carry
        nothing (a chat parser holds its text back, no finish_reason): its tokens' logprobs go with
        the next chunk."""
        choice, generation = self.choices[i], self.generations[i]
        text, ids, logprobs = piece.text, list(piece.token_ids), list(piece.logprobs)
        if first and choice.prompt_text is not None:
            text = choice.prompt_text + text
            if choice.sampling.prompt_logprobs is not None:
                ids = choice.prompt + ids
                logprobs = (
                    list(generation.prompt_logprobs or [None] * len(choice.prompt)) + logprobs
                )
        wanted = choice.sampling.logprobs is not None
        if self.kind == "text_completion":
            return {
                "index": choice.index,
                "text": text,
                "logprobs": self._completion_logprobs(i, ids, logprobs) if wanted else None,
                "finish_reason": piece.finish_reason,
            }
        body = self.parsers[i](text, piece.finish_reason, stream)
        if stream:
            held_ids, held_logprobs = self.held[i]
            ids, logprobs = held_ids + ids, held_logprobs + logprobs
            if not body["delta"] and body["finish_reason"] is None:
                self.held[i] = ids, logprobs
                return None
            self.held[i] = [], []
        body["index"] = choice.index
        body["logprobs"] = {"content": self._chat_logprobs(ids, logprobs)} if wanted else None
        return body

    def role_delta(self, i: int) -> dict:
        delta = {"role": "assistant", "content": ""}
        return {
            "index": self.choices[i].index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
        }

    def _names(self, ids: list[int], logprobs: list) -> dict[int, str]:
        """Every token of `ids` and of their top logprobs -> how logprobs name it, decoded
        together."""
        every = list(
            dict.fromkeys([*ids, *(t for lp in logprobs if lp is not None for t, _ in lp[1])])
        )
        return dict(
            zip(
                every,
                [f"token_id:{t}" for t in every] if self.token_ids else self.token_texts(every),
            )
        )

    def _completion_logprobs(self, i: int, ids: list[int], logprobs: list) -> dict:
        names = self._names(ids, logprobs)
        tokens = [names[t] for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[0] for lp in logprobs],
            "top_logprobs": [
                None if lp is None else {names[t]: v for t, v in lp[1]} for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, ids: list[int], logprobs: list) -> list[dict]:
        names = self._names(ids, logprobs)

        def entry(token_id: int, value: float) -> dict:
            token = names[token_id]
            return {"token": token, "logprob": value, "bytes": list(token.encode())}

        return [
            {**entry(t, lp[0]), "top_logprobs": [entry(tt, v) for tt, v in lp[1]]}
            for t, lp in zip(ids, logprobs)
        ]


async def cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel the tasks and wait until they are done (a choice's pieces can only be closed then)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def rest(pieces, first: Piece) -> list[Piece]:
    got = [first]
    while got[-1].finish_reason is None:
        got.append(await anext(pieces))
    return got


async def _choice_pieces(i: int, pieces, firsts, label: str):
    """Choice i's pieces as (i, piece, whether it is the first), from its first to the one with a
    finish_reason; an error ends them as (i, ApiError, False)."""
    try:
        piece = firsts[i]
        yield i, piece, True
        while piece.finish_reason is None:
            piece = await anext(pieces[i])
            yield i, piece, False
    except ApiError as e:
        yield i, e, False
    # the client gets the error chunk and [DONE], the log the details
    except Exception:  # noqa: BLE001
        yield i, internal_error(f"the stream of {label}"), False


async def _merged(pieces, firsts, label: str):
    """Every choice's `_choice_pieces`, merged in the order they come. One choice is read as it is
    (no task and queue between its pieces and the stream); several through a task each."""
    if len(pieces) == 1:
        async with aclosing(_choice_pieces(0, pieces, firsts, label)) as only:
            async for item in only:
                yield item
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def follow(i: int) -> None:
        async with aclosing(_choice_pieces(i, pieces, firsts, label)) as choice:
            async for item in choice:
                merged.put_nowait(item)

    tasks = [asyncio.ensure_future(follow(i)) for i in range(len(pieces))]
    try:
        open_choices = len(pieces)
        while open_choices:
            item = await merged.get()
            yield item
            piece = item[1]
            open_choices -= isinstance(piece, ApiError) or piece.finish_reason is not None
    finally:
        await cancel(tasks)


async def events(
    streams: AsyncExitStack,
    pieces,
    firsts,
    render: Render,
    head,
    body: SamplingFields,
    prompt_tokens,
):
    """Server-sent events: chunks from every choice as they come (chat: first a chunk with the role
    per choice; later no chunk with an empty delta but the one with the finish_reason), the usage
    chunk if asked (with `continuous_usage_stats`, usage so far in every chunk), then `[DONE]`. An
    error after the stream started comes as a chunk with an `error` object."""
    chunk_kind = render.kind + ".chunk" if render.kind == "chat.completion" else render.kind
    generations = render.generations

    def event(choices: list[dict]) -> str:
        payload = {**head, "object": chunk_kind, "choices": choices}
        if body.continuous_usage:
            payload["usage"] = usage(prompt_tokens, sum(g.completion_tokens for g in generations))
        elif body.include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async with streams:
        if render.kind == "chat.completion":
            yield event([render.role_delta(i) for i in range(len(pieces))])
        open_choices = len(pieces)
        async with aclosing(_merged(pieces, firsts, head["id"])) as merged:
            async for i, piece, first in merged:
                if isinstance(piece, ApiError):
                    yield f"data: {json.dumps(piece.body())}\n\n"
                    break
                choice = render.choice(i, piece, first, stream=True)
                if choice is not None:
                    yield event([choice])
                open_choices -= piece.finish_reason is not None
        if not open_choices and body.include_usage:
            total = usage(prompt_tokens, sum(g.completion_tokens for g in generations))
            last = {**head, "object": chunk_kind, "choices": [], "usage": total}
            yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"
