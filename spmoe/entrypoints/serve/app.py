"""The OpenAI-compatible HTTP API as a FastAPI app, built around an engine client.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`
(`stream` false: one JSON body; true: server-sent events ending with `data: [DONE]`), `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET|HEAD /health`, `GET /metrics`. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` with its HTTP status (503s with `Retry-After`). Every
response carries `X-Request-Id`: the client's, or one made here; log lines about a request name it.

A request becomes one engine request per choice: each prompt of a batch, n times (choice index
`prompt_index * n + i`, seed `seed + index`). The app waits for every choice's first text before it answers,
so a request the engine refuses (a full queue: 503, one that can never fit: 400) gets its status even when
it asked for a stream. Which request fields do what: docs/openai-api.md.
"""

import asyncio
import json
import logging
import random
import time
import uuid
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import spmoe
from spmoe.engine.request import Request as EngineRequest
from spmoe.engine.sampling import SamplingParams
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.client import QueueFull
from spmoe.entrypoints.serve.metrics import CONTENT_TYPE, ServeMetrics
from spmoe.entrypoints.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    parse,
)
from spmoe.entrypoints.serve.streaming import Piece, TextGeneration, usage
from spmoe.entrypoints.serve.tokenizer import chat_prompt_ids, eos_token_ids

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
RETRY_AFTER_S = "1"  # what a 503 (a full queue) tells the client to wait
log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class ApiSettings:
    served_model_names: list[str]  # the names clients may ask for; the first is reported in responses
    defaults: GenerationDefaults = GenerationDefaults()  # the model's, for the fields a request leaves out
    chat_template_content_format: str = "string"  # how the template sees content (ChatMessage.as_template_input)
    seed: int | None = None  # seeds the seeds of requests that give none (reproducible runs); None: random


def build_app(client, tokenizer, settings: ApiSettings) -> FastAPI:
    """`client`: an EngineClient (async `generate(request)`, `metrics()`, `max_model_len`, `vocab_size`,
    `eos_token_ids`, `num_speculative_tokens`, `error`); `tokenizer`: a transformers tokenizer."""
    app = FastAPI(title="spmoe", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIApi(client, tokenizer, settings)

    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        headers = {"Retry-After": RETRY_AFTER_S} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(http: Request, e: Exception):
        log.exception("[%s] request failed", getattr(http.state, "request_id", "-"))
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    app.api_route("/health", methods=["GET", "HEAD"])(api.health)
    app.get("/metrics")(api.metrics_text)
    app.get("/version")(api.version)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


class RequestIdMiddleware:
    """Every HTTP request gets an id: the client's `X-Request-Id`, or a new one. It is `request.state.request_id`
    for the handlers (and their log lines) and goes back as the response's `X-Request-Id` header. Plain ASGI
    (no response wrapping), so that a handler still sees its client go away."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-request-id")
        request_id = sent.decode("latin-1") if sent else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass
class Choice:
    """One engine request of an HTTP request: its place in the answer, its prompt and how to generate."""

    index: int
    prompt: list[int]
    prompt_text: str | None  # the text `echo` puts before the completion; None: no echo
    max_new_tokens: int
    sampling: SamplingParams
    discard_output: bool = False  # echo with max_tokens 0


class OpenAIApi:
    def __init__(self, client, tokenizer, settings: ApiSettings):
        self.client, self.tokenizer, self.model_names = client, tokenizer, settings.served_model_names
        self.model_name = self.model_names[0]
        self.defaults, self.content_format = settings.defaults, settings.chat_template_content_format
        self.seeds = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self.eos_token_ids = eos_token_ids(tokenizer, tuple(client.eos_token_ids))
        self.metrics = ServeMetrics(client, self.model_name)
        self.created = int(time.time())
        self.logged_fields: set[str] = set()  # unknown request fields already logged

    async def health(self) -> Response:
        if self.client.error is not None:
            raise ApiError(503, f"the engine has stopped: {self.client.error}")
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def version(self) -> dict:
        return {"version": spmoe.__version__}

    def _card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "spmoe",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.client.max_model_len,
        }

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card(name) for name in self.model_names]}

    async def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self._card(model_id)

    async def tokenize(self, http: Request) -> dict:
        body = self._parse(TokenizeRequest, await _json_body(http), http)
        if body.model is not None:
            self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "expected exactly one of 'prompt' and 'messages'")
        if body.prompt is not None:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = self._chat_ids(body.messages, body.chat_template_kwargs)
        return {"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids, "token_strs": None}

    async def detokenize(self, http: Request) -> dict:
        body = self._parse(DetokenizeRequest, await _json_body(http), http)
        if body.model is not None:
            self._check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def completions(self, http: Request):
        body = self._parse(CompletionRequest, await _json_body(http), http)
        self._check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(
                400,
                f"best_of must equal n ({body.n}): choosing the best of more is not supported, "
                f"got best_of={body.best_of}",
                "best_of",
            )
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 is allowed only with echo, got 0", "max_tokens")
        choices, seed = [], self._seed(body)
        default_max = self.defaults.values.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        for p, prompt in enumerate(body.prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._check_ids(prompt, "prompt")
            echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if body.echo else None
            discard = body.max_tokens == 0
            max_new = 1 if discard else self._max_new_tokens(len(ids), body.max_tokens, default_max)
            if discard:
                self._max_new_tokens(len(ids), 1, None)
            logprobs, prompt_logprobs = body.logprobs, body.logprobs if body.echo else None
            for i in range(body.n):
                index = p * body.n + i
                sampling = self._sampling(body, seed, index, logprobs, prompt_logprobs, max_new)
                choices.append(Choice(index, ids, echo, max_new, sampling, discard))
        return await self._respond(http, body, choices, "cmpl", "text_completion")

    async def chat_completions(self, http: Request):
        body = self._parse(ChatCompletionRequest, await _json_body(http), http)
        self._check_model(body.model)
        if body.max_tokens == 0:
            raise ApiError(400, "max_tokens: expected >= 1 for chat completions, got 0", "max_tokens")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        prompt = self._chat_ids(body.messages, body.chat_template_kwargs)
        max_new = self._max_new_tokens(len(prompt), body.max_new_tokens, self.defaults.values.get("max_tokens"))
        logprobs, seed = (body.top_logprobs or 0) if body.logprobs else None, self._seed(body)
        choices = [
            Choice(i, prompt, None, max_new, self._sampling(body, seed, i, logprobs, None, max_new))
            for i in range(body.n)
        ]
        return await self._respond(http, body, choices, "chatcmpl", "chat.completion")

    # -- request checks ------------------------------------------------------------------------------------

    def _parse(self, model, raw, http: Request):
        body = parse(model, raw)
        for name in body.model_extra or {}:
            if name not in self.logged_fields:
                self.logged_fields.add(name)
                log.warning(
                    "[%s] the request field '%s' is not supported and is ignored (logged once per field name)",
                    http.state.request_id,
                    name,
                )
        return body

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise ApiError(404, f"the model '{model}' does not exist; this server serves {served}", "model")

    def _seed(self, body: SamplingFields) -> int:
        """The request's seed (choice i samples from seed + i), or one from the server's seeds."""
        return body.seed if body.seed is not None else self.seeds.getrandbits(63)

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.client.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param} token ids must be in [0, {vocab}), got {bad}", param)
        return ids

    def _chat_ids(self, messages, template_kwargs: dict | None) -> list[int]:
        try:
            messages = [m.as_template_input(self.content_format) for m in messages]
            return chat_prompt_ids(self.tokenizer, messages, template_kwargs)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e).strip().splitlines()[0], "messages") from None

    def _sampling(
        self,
        body: SamplingFields,
        seed: int,
        index: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        max_new: int,
    ) -> SamplingParams:
        given = {name for name in body.model_fields_set if getattr(body, name) is not None}
        fields = self.defaults.apply(
            {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
            given,
        )
        temperature = fields["temperature"]
        if temperature is None or self.client.num_speculative_tokens and "temperature" not in given:
            # OpenAI's default, except that a speculating server serves greedy requests only
            temperature = 0.0 if self.client.num_speculative_tokens else 1.0
        if body.min_tokens > max_new:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_new})", "min_tokens")
        try:
            return SamplingParams(
                temperature,
                1.0 if fields["top_p"] is None else fields["top_p"],
                (seed + index) % 2**63,
                top_k=max(fields["top_k"] or 0, 0),
                min_p=fields["min_p"] or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if fields["repetition_penalty"] is None else fields["repetition_penalty"],
                logit_bias=tuple(self._check_bias(body.logit_bias or {}).items()),
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def _check_bias(self, bias: dict[int, float]) -> dict[int, float]:
        self._check_ids(list(bias), "logit_bias")
        return bias

    def _max_new_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        """The output tokens that fit: the KV cache holds max_model_len positions per request, the prompt,
        the output and (when speculating) the drafts of the last step."""
        limit, drafts = self.client.max_model_len, self.client.num_speculative_tokens
        room = limit - drafts - prompt_len
        with_drafts = f" with {drafts} speculative tokens" if drafts else ""
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; the server's --max-model-len is {limit}, "
                f"which leaves no room for an output token{with_drafts}",
                "prompt",
            )
        if requested is None:
            return min(default or room, room)
        if requested > room:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens and max_tokens is {requested}"
                f"{with_drafts}: {prompt_len + requested + drafts} > --max-model-len {limit}",
                "max_tokens",
            )
        return requested

    # -- answering -----------------------------------------------------------------------------------------

    def _generation(self, body: SamplingFields, choice: Choice, request_id: str) -> TextGeneration:
        stop_ids = tuple(body.stop_token_ids or ())
        eos = () if body.ignore_eos else self.eos_token_ids
        engine_request = EngineRequest(
            f"{request_id}-{choice.index}", choice.prompt, choice.max_new_tokens, choice.sampling, eos + stop_ids
        )
        return TextGeneration(
            self.client.generate(engine_request),
            self.tokenizer,
            choice.prompt,
            body.stop,
            eos + stop_ids,
            self.metrics,
            eos_token_ids=eos,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            discard_output=choice.discard_output,
        )

    async def _respond(self, http: Request, body: SamplingFields, choices: list[Choice], id_prefix: str, kind: str):
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        log.info("[%s] %s: %d choice(s) as %s", http.state.request_id, kind, len(choices), request_id)
        generations = [self._generation(body, c, request_id) for c in choices]
        streams = AsyncExitStack()  # closing a choice's pieces aborts its engine request
        pieces = [await streams.enter_async_context(aclosing(g.pieces())) for g in generations]
        firsts = await asyncio.gather(*(_first_piece(p) for p in pieces), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            await streams.aclose()
            raise failed
        prompt_tokens = sum(len(c.prompt) for c in choices if c.index % body.n == 0)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        render = Render(self.tokenizer, kind, choices, generations, body.return_tokens_as_token_ids)
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:  # a client that goes away cancels the stream, which aborts the requests
            events = _events(streams, pieces, firsts, render, head, body, prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream")
        async with streams:
            collect = [asyncio.ensure_future(_rest(p, f)) for p, f in zip(pieces, firsts)]
            try:
                while not all(task.done() for task in collect):
                    await asyncio.wait(collect, timeout=0.25)
                    if any(t.done() and t.exception() for t in collect):
                        break
                    if await http.is_disconnected():  # leaving aborts the requests
                        return Response(status_code=499)
                got = [task.result() for task in collect]
            finally:
                await _cancel(collect)
        completion_tokens = sum(g.completion_tokens for g in generations)
        return {
            **head,
            "object": kind,
            "choices": [render.whole(i, collected) for i, collected in enumerate(got)],
            "usage": usage(prompt_tokens, completion_tokens),
        }


class Render:
    """The JSON of the choices: text, finish_reason and, when asked, logprobs in the completions or chat shape
    (`echo` puts the prompt and its logprobs first)."""

    def __init__(
        self, tokenizer, kind: str, choices: list[Choice], generations: list[TextGeneration], token_ids: bool = False
    ):
        self.tokenizer, self.kind, self.choices, self.generations = tokenizer, kind, choices, generations
        self.token_ids = token_ids  # name tokens by id (`return_tokens_as_token_ids`)
        self.offsets = [0] * len(choices)  # completions' text_offset so far, per choice

    def whole(self, i: int, pieces: list[Piece]) -> dict:
        merged = Piece(
            "".join(p.text for p in pieces),
            pieces[-1].finish_reason,
            tuple(t for p in pieces for t in p.token_ids),
            tuple(lp for p in pieces for lp in p.logprobs),
        )
        return self.choice(i, merged, first=True, stream=False)

    def choice(self, i: int, piece: Piece, first: bool, stream: bool) -> dict:
        choice, generation = self.choices[i], self.generations[i]
        text, ids, logprobs = piece.text, list(piece.token_ids), list(piece.logprobs)
        if first and choice.prompt_text is not None:
            text = choice.prompt_text + text
            if choice.sampling.prompt_logprobs is not None:
                ids = choice.prompt + ids
                logprobs = list(generation.prompt_logprobs or [None] * len(choice.prompt)) + logprobs
        wanted = choice.sampling.logprobs is not None
        if self.kind == "text_completion":
            return {
                "index": choice.index,
                "text": text,
                "logprobs": self._completion_logprobs(i, ids, logprobs) if wanted else None,
                "finish_reason": piece.finish_reason,
            }
        shaped = {"content": self._chat_logprobs(ids, logprobs)} if wanted else None
        if stream:
            delta = {"content": text} if text else {}
            return {"index": choice.index, "delta": delta, "logprobs": shaped, "finish_reason": piece.finish_reason}
        message = {"role": "assistant", "content": text}
        return {"index": choice.index, "message": message, "logprobs": shaped, "finish_reason": piece.finish_reason}

    def role_delta(self, i: int) -> dict:
        delta = {"role": "assistant", "content": ""}
        return {"index": self.choices[i].index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.token_ids else self.tokenizer.decode([token_id])

    def _completion_logprobs(self, i: int, ids: list[int], logprobs: list) -> dict:
        tokens = [self._token(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[0] for lp in logprobs],
            "top_logprobs": [None if lp is None else {self._token(t): v for t, v in lp[1]} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, ids: list[int], logprobs: list) -> list[dict]:
        def entry(token_id: int, value: float) -> dict:
            token = self._token(token_id)
            return {"token": token, "logprob": value, "bytes": list(token.encode())}

        return [{**entry(t, lp[0]), "top_logprobs": [entry(tt, v) for tt, v in lp[1]]} for t, lp in zip(ids, logprobs)]


async def _json_body(http: Request):
    raw = await http.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


async def _first_piece(pieces) -> Piece:
    """The first text, or the engine's refusal as an HTTP error."""
    try:
        return await anext(pieces)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}") from None
    except ValueError as e:  # the engine can never fit the request
        raise ApiError(400, str(e).strip().splitlines()[0]) from None


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel the tasks and wait until they are done (a choice's pieces can only be closed then)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _rest(pieces, first: Piece) -> list[Piece]:
    got = [first]
    while got[-1].finish_reason is None:
        got.append(await anext(pieces))
    return got


async def _events(streams: AsyncExitStack, pieces, firsts, render: Render, head, body: SamplingFields, prompt_tokens):
    """Server-sent events: chunks from every choice as they come (chat: first a chunk with the role per
    choice), the usage chunk if asked (with `continuous_usage_stats`, usage so far in every chunk), then
    `[DONE]`. An error after the stream started comes as a chunk with an `error` object."""
    chunk_kind = render.kind + ".chunk" if render.kind == "chat.completion" else render.kind
    generations = render.generations

    def event(choices: list[dict], with_usage: bool = True) -> str:
        payload = {**head, "object": chunk_kind, "choices": choices}
        if body.continuous_usage and with_usage:
            payload["usage"] = usage(prompt_tokens, sum(g.completion_tokens for g in generations))
        elif body.include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    merged: asyncio.Queue = asyncio.Queue()

    async def follow(i: int) -> None:
        try:
            piece = firsts[i]
            await merged.put((i, piece, True))
            while piece.finish_reason is None:
                piece = await anext(pieces[i])
                await merged.put((i, piece, False))
        except ApiError as e:
            await merged.put((i, e, False))

    async with streams:
        tasks = [asyncio.ensure_future(follow(i)) for i in range(len(pieces))]
        try:
            if render.kind == "chat.completion":
                yield event([render.role_delta(i) for i in range(len(pieces))], with_usage=False)
            open_choices = len(pieces)
            while open_choices:
                i, piece, first = await merged.get()
                if isinstance(piece, ApiError):
                    yield f"data: {json.dumps(piece.body())}\n\n"
                    break
                yield event([render.choice(i, piece, first, stream=True)])
                open_choices -= piece.finish_reason is not None
            else:
                if body.include_usage:
                    total = usage(prompt_tokens, sum(g.completion_tokens for g in generations))
                    yield f"data: {json.dumps({**head, 'object': chunk_kind, 'choices': [], 'usage': total})}\n\n"
        finally:
            await _cancel(tasks)
    yield "data: [DONE]\n\n"
