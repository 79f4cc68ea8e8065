"""The OpenAI-compatible HTTP API as a FastAPI app, built around an engine client: the routes.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`
(`stream` false: one JSON body; true: server-sent events ending with `data: [DONE]`),
`POST /v1/responses` and `GET /v1/responses/{id}` (OpenAI's Responses API, read as chat requests:
`responses_request`), `POST /tokenize`, `POST /detokenize`, `GET /version`, `GET|HEAD /health`,
`GET|POST /ping` (the same, as vLLM answers it), `GET /metrics`. Every error is an OpenAI-style
body `{"error": {"message", "type", "param", "code"}}` with its HTTP status (503s with
`Retry-After`). Every response carries `X-Request-Id`: the client's, or
one made here; log lines about a request name it.

Requests are read by `request_reader` (validated, tokenized, one engine request per choice) and
answered by `rendering`. The app waits for every choice's first text before it answers, so a request
the engine refuses (a full queue: 503, one that can never fit: 400) gets its status even when it
asked for a stream. Which request fields do what: docs/openai-api.md.

A client's body is bounded (`middleware.FrontEndLimits`: 413 past `max_request_bytes`, and the API
key); an error the app did not foresee is a 500 that names only a request id (the details go to the
log).

`OpenAIApi.stop` ends serving in order: new requests get 503, the requests under way get `grace_s`
to finish, then every one still open ends (a stream with an error chunk and `data: [DONE]`, a whole
response with 503).
"""

import asyncio
import logging
import time
import uuid
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import spmoe
from spmoe.engine.request import Request as EngineRequest
from spmoe.entrypoints.serve.frontend.metrics import CONTENT_TYPE, ServeMetrics
from spmoe.entrypoints.serve.frontend.middleware import (
    DEFAULT_MAX_REQUEST_BYTES,
    FrontEndLimits,
    RequestIdMiddleware,
    RequireApiKey,
)
from spmoe.entrypoints.serve.frontend.protocol import (
    ApiError,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    internal_error,
)
from spmoe.entrypoints.serve.frontend.rendering import Render, cancel, events, first_piece, rest
from spmoe.entrypoints.serve.frontend.request_reader import (
    ApiSettings,
    Choice,
    ParsedRequest,
    RequestReader,
)
from spmoe.entrypoints.serve.frontend.response_store import ResponseStore
from spmoe.entrypoints.serve.frontend.responses_rendering import ResponseAnswer
from spmoe.entrypoints.serve.frontend.responses_request import ResponsesReader
from spmoe.entrypoints.serve.frontend.streaming import Piece, TextGeneration, usage
from spmoe.entrypoints.serve.frontend.tokenizer import TokenTexts, chat_prompt_text, eos_token_ids

END_WAIT_S = 5.0  # how long `stop` waits for the requests it ended to send their last chunk
RETRY_AFTER_S = "1"  # what a 503 tells the client to wait
log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class Started:
    """A request whose choices the engine took: their generations, their pieces (closing `streams`
    aborts them) and each one's first piece."""

    request_id: str
    generations: list[TextGeneration]
    streams: AsyncExitStack
    pieces: list
    firsts: list[Piece]
    prompt_tokens: int


def build_app(
    client,
    tokenizer,
    settings: ApiSettings,
    limits: FrontEndLimits = FrontEndLimits(),
    store: ResponseStore | None = None,
) -> FastAPI:
    """`client`: an EngineClient (async `generate(request)`, `metrics()`, `max_model_len`,
    `vocab_size`, `eos_token_ids`, `num_speculative_tokens`, `error`); `tokenizer`: a transformers
    tokenizer; `store`: the server's stored responses (None: a store of this app's own). The app's
    `OpenAIApi` is `app.state.api` (its `stop` ends serving)."""
    app = FastAPI(title="spmoe", docs_url=None, redoc_url=None, openapi_url=None)
    store = ResponseStore() if store is None else store
    api = OpenAIApi(client, tokenizer, settings, store, limits.max_request_bytes)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        # after a 413 the connection closes: the rest of the body is not read (and parsed) for
        # nothing
        headers = (
            {"Connection": "close"}
            if e.status == 413
            else {"Retry-After": RETRY_AFTER_S}
            if e.status == 503
            else None
        )
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(
            ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code
        )

    @app.exception_handler(Exception)
    async def unforeseen_error(request: Request, e: Exception):
        return JSONResponse(
            internal_error(f"{request.method} {request.url.path}").body(), status_code=500
        )

    app.api_route("/health", methods=["GET", "HEAD"])(api.health)
    app.api_route("/ping", methods=["GET", "POST"])(api.health)  # vLLM's (SageMaker's) name
    app.get("/metrics")(api.metrics_text)
    app.get("/version")(api.version)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/responses")(api.responses)
    app.get("/v1/responses/{response_id}")(api.stored_response)
    if limits.api_key is not None:
        app.add_middleware(RequireApiKey, api_key=limits.api_key)
    app.add_middleware(RequestIdMiddleware)  # the outermost: a 401 carries the id too
    return app


class OpenAIApi:
    def __init__(
        self,
        client,
        tokenizer,
        settings: ApiSettings,
        store: ResponseStore,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.client, self.tokenizer = client, tokenizer
        self.model_names = settings.served_model_names
        self.model_name = self.model_names[0]
        self.metrics = ServeMetrics(client, self.model_name)
        self.reader = RequestReader(client, tokenizer, settings, max_request_bytes, self.metrics)
        self.stored = store  # responses made with `store`, for previous_response_id
        self.responses_reader = ResponsesReader(self.reader, self.stored)
        self.eos_token_ids = eos_token_ids(tokenizer, tuple(client.eos_token_ids))
        self.token_texts = TokenTexts(tokenizer)  # how logprobs name tokens
        self.created = int(time.time())
        self.unavailable: str | None = None  # why new requests get 503 (`stop`)
        self.open_requests = 0  # requests between their admission and their last piece
        self._waiting: set[asyncio.Task] = set()  # tasks waiting for an open request's next piece
        self._ending = False  # True once `stop` ends the requests still open
        self._ending_tasks: set[asyncio.Task] = set()  # the tasks `stop` cancelled to end them

    async def health(self) -> Response:
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable)
        if self.client.error is not None:
            raise ApiError(503, "the engine has stopped; the server's log says why")
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
        self.reader.check_model(model_id)
        return self._card(model_id)

    async def tokenize(self, http: Request) -> dict:
        body = self.reader.parse(TokenizeRequest, await self._json_body(http), http)
        if body.model is not None:
            self.reader.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "expected exactly one of 'prompt' and 'messages'")
        if body.prompt is not None:
            self.reader.check_text_size([body.prompt], "prompt")
            ids = await self.reader.off_loop(
                lambda: self.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens
                )
            )
        else:
            try:
                messages = [m.as_template_input(self.reader.content_format) for m in body.messages]
                kwargs = self.reader.chat_options.template_kwargs(body.chat_template_kwargs)
                text = await self.reader.off_loop(
                    chat_prompt_text, self.tokenizer, messages, None, kwargs
                )
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
            ids = await self.reader.off_loop(
                lambda: self.tokenizer.encode(text, add_special_tokens=False)
            )
        return {
            "count": len(ids),
            "max_model_len": self.client.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    async def detokenize(self, http: Request) -> dict:
        body = self.reader.parse(DetokenizeRequest, await self._json_body(http), http)
        if body.model is not None:
            self.reader.check_model(body.model)
        self.reader.checked_ids(body.tokens, "tokens")
        return {"prompt": await self.reader.off_loop(self.tokenizer.decode, body.tokens)}

    async def completions(self, http: Request):
        parsed = await self.reader.completion(await self._json_body(http), http)
        return await self._respond(http, parsed, "cmpl-", "text_completion")

    async def chat_completions(self, http: Request):
        parsed = await self.reader.chat(await self._json_body(http), http)
        return await self._respond(http, parsed, "chatcmpl-", "chat.completion")

    async def responses(self, http: Request):
        read = await self.responses_reader.read(await self._json_body(http), http)
        started = await self._start(http, read.parsed, "resp_", "response")
        answer = ResponseAnswer(read, started, self.model_name, self.stored)
        if read.body.stream:  # a client that goes away cancels the stream, which aborts the request
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        got = await self._gather(http, started)
        return got if isinstance(got, Response) else await answer.whole(got[0])

    async def stored_response(self, response_id: str) -> dict:
        return (await self.stored.get(response_id))[1]

    async def _json_body(self, http: Request):
        """The body as JSON (`RequestReader.json_body`), refused with 503 while stopping."""
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable)
        return await self.reader.json_body(http)

    def _generation(
        self, body: SamplingFields, choice: Choice, request_id: str, grammar, start_after
    ) -> TextGeneration:
        stop_ids = tuple(body.stop_token_ids or ())
        eos = () if body.ignore_eos else self.eos_token_ids
        engine_request = EngineRequest(
            f"{request_id}-{choice.index}",
            choice.prompt,
            choice.max_new_tokens,
            choice.sampling,
            eos + stop_ids,
            grammar,
            start_after,
        )
        return TextGeneration(
            self.client.generate(engine_request),
            self.tokenizer,
            choice.prompt,
            body.stop,
            self.metrics,
            eos_token_ids=eos,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            discard_output=choice.discard_output,
        )

    async def _respond(self, http: Request, parsed: ParsedRequest, id_prefix: str, kind: str):
        started = await self._start(http, parsed, id_prefix, kind)
        body, request_id = parsed.body, started.request_id
        render = Render(
            self.token_texts,
            kind,
            parsed.choices,
            started.generations,
            parsed.parsers,
            body.return_tokens_as_token_ids,
        )
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:  # a client that goes away cancels the stream, which aborts the requests
            s = started
            stream = events(s.streams, s.pieces, s.firsts, render, head, body, s.prompt_tokens)
            return StreamingResponse(stream, media_type="text/event-stream")
        got = await self._gather(http, started)
        if isinstance(got, Response):
            return got
        completion_tokens = sum(g.completion_tokens for g in started.generations)
        return {
            **head,
            "object": kind,
            "choices": [render.whole(i, collected) for i, collected in enumerate(got)],
            "usage": usage(started.prompt_tokens, completion_tokens),
        }

    async def _start(
        self, http: Request, parsed: ParsedRequest, id_prefix: str, kind: str
    ) -> Started:
        """Hand every choice of `parsed` to the engine and wait for each one's first text (the
        engine's refusal is the HTTP error); the request's id is `id_prefix` and a fresh hex id."""
        body, choices = parsed.body, parsed.choices
        if self.unavailable is not None:  # it began stopping while this request was tokenized
            raise ApiError(503, self.unavailable)
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        log.info(
            "[%s] %s: %d choice(s) as %s", http.state.request_id, kind, len(choices), request_id
        )
        generations = [
            self._generation(body, c, request_id, parsed.grammar, parsed.start_after)
            for c in choices
        ]
        streams = AsyncExitStack()  # closing a choice's pieces aborts its engine request
        pieces = [
            await streams.enter_async_context(aclosing(self._open_while_serving(g.pieces())))
            for g in generations
        ]
        firsts = await asyncio.gather(*(first_piece(p) for p in pieces), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            await streams.aclose()
            raise failed
        prompt_tokens = sum(len(c.prompt) for c in choices if c.index % body.n == 0)
        self.metrics.observe_request(prompt_tokens, body.n, max(c.max_new_tokens for c in choices))
        return Started(request_id, generations, streams, pieces, firsts, prompt_tokens)

    async def _gather(self, http: Request, started: Started) -> list[list[Piece]] | Response:
        """Every choice's pieces, to the last; a 499 response if the client went away first (which
        aborts the engine's requests)."""
        async with started.streams:
            collect = [
                asyncio.ensure_future(rest(p, f)) for p, f in zip(started.pieces, started.firsts)
            ]
            try:
                while not all(task.done() for task in collect):
                    await asyncio.wait(collect, timeout=0.25)
                    failed = next(
                        (t.exception() for t in collect if t.done() and t.exception()), None
                    )
                    if failed is not None:  # the others may still run: the failure is the answer
                        raise failed
                    if await http.is_disconnected():  # leaving aborts the requests
                        return Response(status_code=499)
                return [task.result() for task in collect]
            finally:
                await cancel(collect)

    async def _open_while_serving(self, pieces):
        """`pieces`, counted in `open_requests`, until `stop` ends the requests still open: then
        ApiError 503 (the engine's request is aborted as the inner iterator closes). `stop` cancels
        the tasks waiting here (`_waiting`); a piece costs no task of its own."""
        self.open_requests += 1
        try:
            async with aclosing(pieces):
                while True:
                    if (
                        self._ending
                    ):  # `stop` ended the open requests while this one was not waiting
                        raise ApiError(
                            503, f"{self.unavailable}; this request was ended before it finished"
                        )
                    task = asyncio.current_task()
                    self._waiting.add(task)
                    try:
                        piece = await anext(pieces)
                    except asyncio.CancelledError:
                        if task not in self._ending_tasks:
                            raise
                        task.uncancel()  # the cancellation was `stop`'s, not the task's owner's
                        raise ApiError(
                            503, f"{self.unavailable}; this request was ended before it finished"
                        ) from None
                    finally:
                        self._waiting.discard(task)
                    yield piece
                    if piece.finish_reason is not None:
                        return
        finally:
            self.open_requests -= 1

    async def stop(self, reason: str, grace_s: float) -> None:
        """From now on new requests (and /health) get 503 with `reason`; the open requests may
        finish for up to `grace_s` seconds, then those left are ended. Returns once none is open (or
        END_WAIT_S later)."""
        self.unavailable = reason
        log.warning(
            "%s: %d requests open, which may finish for %.0f s", reason, self.open_requests, grace_s
        )
        deadline = time.monotonic() + grace_s
        while self.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._ending = True
        self._ending_tasks.update(self._waiting)
        for task in self._ending_tasks:
            task.cancel()
        deadline = time.monotonic() + END_WAIT_S
        while self.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
