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

What a client can send is bounded before it costs much (`FrontEndLimits`): the body is counted as it arrives
and refused with 413 past `max_request_bytes`; a text prompt longer in bytes than `max_model_len` tokens could
ever cover is refused before it is tokenized; tokenizing and chat templating run in a worker thread, not on the
event loop; an error the app did not foresee is a 500 that names only a request id (the details go to the log).
With an `api_key`, every route but /health and /metrics needs `Authorization: Bearer <key>`.

`OpenAIApi.stop` ends serving in order: new requests get 503, the requests under way get `grace_s` to finish,
then every one still open ends (a stream with an error chunk and `data: [DONE]`, a whole response with 503).
"""

import asyncio
import json
import logging
import random
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import spmoe
from spmoe.engine.request import Request as EngineRequest
from spmoe.engine.sampling.grammar import GrammarSpec
from spmoe.engine.sampling.sampler import SamplingParams
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.chat import (
    ChatChoices,
    ChatOptions,
    effective_tool_choice,
    grammar_start_after,
    reasoning_end_ids,
)
from spmoe.entrypoints.serve.client import QueueFull
from spmoe.entrypoints.serve.constraints import STRUCTURED_OUTPUT_FIELDS, grammar_for_request
from spmoe.entrypoints.serve.metrics import CONTENT_TYPE, ServeMetrics
from spmoe.entrypoints.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    decode_json,
    parse,
)
from spmoe.entrypoints.serve.streaming import Piece, TextGeneration, usage
from spmoe.entrypoints.serve.tokenizer import (
    TokenTexts,
    chat_prompt_text,
    eos_token_ids,
    longest_token_bytes,
)

COMPLETION_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the room left
)
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
OPEN_ROUTES = ("/health", "/metrics")  # the routes that need no API key
END_WAIT_S = 5.0  # how long `stop` waits for the requests it ended to send their last chunk
RETRY_AFTER_S = "1"  # what a 503 tells the client to wait
MAX_LOGGED_FIELDS = (
    256  # unknown request field names logged (and remembered) at most, over the server's life
)
MAX_NAMES_A_LINE = 8  # of them named in one request's log line
log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class ApiSettings:
    served_model_names: list[
        str
    ]  # the names clients may ask for; the first is reported in responses
    defaults: GenerationDefaults = (
        GenerationDefaults()
    )  # the model's, for the fields a request leaves out
    chat_template_content_format: str = (
        "string"  # how the template sees content (ChatMessage.as_template_input)
    )
    seed: int | None = (
        None  # seeds the seeds of requests that give none (reproducible runs); None: random
    )
    chat: ChatOptions = ChatOptions()  # the reasoning and tool-call parsers


@dataclass(frozen=True)
class FrontEndLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a longer body gets 413
    api_key: str | None = None  # None: no key needed

    def __post_init__(self):
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key (or SPMOE_API_KEY) must not be empty")


def build_app(
    client, tokenizer, settings: ApiSettings, limits: FrontEndLimits = FrontEndLimits()
) -> FastAPI:
    """`client`: an EngineClient (async `generate(request)`, `metrics()`, `max_model_len`, `vocab_size`,
    `eos_token_ids`, `num_speculative_tokens`, `error`); `tokenizer`: a transformers tokenizer. The app's
    `OpenAIApi` is `app.state.api` (its `stop` ends serving)."""
    app = FastAPI(title="spmoe", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIApi(client, tokenizer, settings, limits.max_request_bytes)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        # after a 413 the connection closes: the rest of the body is not read (and parsed) for nothing
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
    async def internal_error(request: Request, e: Exception):
        return JSONResponse(
            _internal_error(f"{request.method} {request.url.path}").body(), status_code=500
        )

    app.api_route("/health", methods=["GET", "HEAD"])(api.health)
    app.get("/metrics")(api.metrics_text)
    app.get("/version")(api.version)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    if limits.api_key is not None:
        app.add_middleware(RequireApiKey, api_key=limits.api_key)
    app.add_middleware(RequestIdMiddleware)  # the outermost: a 401 carries the id too
    return app


def _internal_error(what: str) -> ApiError:
    """Log the exception being handled under a new id; -> the 500 the client gets, which names only that id."""
    error_id = uuid.uuid4().hex
    log.exception("internal error %s in %s", error_id, what)
    return ApiError(
        500, f"internal server error (id {error_id}); the details are in the server's log"
    )


class RequireApiKey:
    """ASGI middleware: every HTTP route but OPEN_ROUTES answers 401 unless the request carries
    `Authorization: Bearer <api_key>` (compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next(
                (value for name, value in scope["headers"] if name == b"authorization"), b""
            )
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                )
                response = JSONResponse(
                    error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
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
    def __init__(
        self,
        client,
        tokenizer,
        settings: ApiSettings,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.client, self.tokenizer, self.model_names = (
            client,
            tokenizer,
            settings.served_model_names,
        )
        self.model_name = self.model_names[0]
        self.defaults, self.content_format = (
            settings.defaults,
            settings.chat_template_content_format,
        )
        self.seeds = (
            random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        )
        self.chat = settings.chat
        self.reasoning_end_ids = reasoning_end_ids(
            settings.chat, tokenizer
        )  # where a chat grammar may start
        self.max_request_bytes = max_request_bytes
        self.eos_token_ids = eos_token_ids(tokenizer, tuple(client.eos_token_ids))
        self.token_bytes = longest_token_bytes(tokenizer)
        self.token_texts = TokenTexts(tokenizer)  # how logprobs name tokens
        self.max_prompt_bytes = (
            client.max_model_len * self.token_bytes
        )  # more cannot fit (see _check_text_size)
        self.metrics = ServeMetrics(client, self.model_name)
        self.created = int(time.time())
        self.logged_fields: set[str] = (
            set()
        )  # unknown request fields already logged (at most MAX_LOGGED_FIELDS)
        # One worker: a tokenizer is not safe to use from several threads at once, and one thread keeps the
        # event loop free, which is what matters.
        self.text_work = ThreadPoolExecutor(1, thread_name_prefix="spmoe-tokenize")
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
        self._check_model(model_id)
        return self._card(model_id)

    async def tokenize(self, http: Request) -> dict:
        body = self._parse(TokenizeRequest, await self._json_body(http), http)
        if body.model is not None:
            self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "expected exactly one of 'prompt' and 'messages'")
        if body.prompt is not None:
            self._check_text_size([body.prompt], "prompt")
            ids = await self._off_loop(
                lambda: self.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens
                )
            )
        else:
            try:
                messages = [m.as_template_input(self.content_format) for m in body.messages]
                text = await self._off_loop(
                    chat_prompt_text, self.tokenizer, messages, None, body.chat_template_kwargs
                )
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
            ids = await self._off_loop(
                lambda: self.tokenizer.encode(text, add_special_tokens=False)
            )
        return {
            "count": len(ids),
            "max_model_len": self.client.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    async def detokenize(self, http: Request) -> dict:
        body = self._parse(DetokenizeRequest, await self._json_body(http), http)
        if body.model is not None:
            self._check_model(body.model)
        self._checked_ids(body.tokens, "tokens")
        return {"prompt": await self._off_loop(self.tokenizer.decode, body.tokens)}

    async def completions(self, http: Request):
        raw = await self._json_body(http)
        prompt = raw.get("prompt") if isinstance(raw, dict) else None
        if (
            isinstance(prompt, list) and prompt and not isinstance(prompt[0], str)
        ):  # token ids, before validating
            batch = isinstance(prompt[0], list)  # a list of id lists: the longest counts
            longest = (
                max((len(p) for p in prompt if isinstance(p, list)), default=0)
                if batch
                else len(prompt)
            )
            self._max_new_tokens(longest, None, None)
        body = self._parse(CompletionRequest, raw, http)
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
        grammar = await self._grammar(body, {}, None)
        choices, seed = [], self._seed(body)
        default_max = self.defaults.values.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        for p, prompt in enumerate(body.prompts):
            if isinstance(prompt, str):
                self._check_text_size([prompt], "prompt")
                ids = await self._off_loop(self.tokenizer.encode, prompt)
            else:
                ids = self._checked_ids(prompt)
            echo = None
            if body.echo:
                echo = (
                    prompt
                    if isinstance(prompt, str)
                    else await self._off_loop(self.tokenizer.decode, ids)
                )
            discard = body.max_tokens == 0
            max_new = 1 if discard else self._max_new_tokens(len(ids), body.max_tokens, default_max)
            if discard:
                self._max_new_tokens(len(ids), 1, None)
            logprobs, prompt_logprobs = body.logprobs, body.logprobs if body.echo else None
            for i in range(body.n):
                index = p * body.n + i
                sampling = self._sampling(body, seed, index, logprobs, prompt_logprobs, max_new)
                choices.append(Choice(index, ids, echo, max_new, sampling, discard))
        return await self._respond(
            http, body, choices, "cmpl", "text_completion", None, grammar, ()
        )

    async def chat_completions(self, http: Request):
        body = self._parse(ChatCompletionRequest, await self._json_body(http), http)
        self._check_model(body.model)
        if body.max_tokens == 0:
            raise ApiError(
                400, "max_tokens: expected >= 1 for chat completions, got 0", "max_tokens"
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        choice = (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, BaseModel)
            else body.tool_choice
        )
        try:
            tool_choice = effective_tool_choice(tools, choice, self.chat)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None
        texts = [
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
            for m in body.messages
        ]
        self._check_text_size(texts, "messages")
        try:
            messages = [m.as_template_input(self.content_format) for m in body.messages]
            text = await self._off_loop(
                chat_prompt_text, self.tokenizer, messages, tools, body.chat_template_kwargs
            )
            parsers = [
                ChatChoices.for_request(
                    self.chat, text, body.chat_template_kwargs, tools, tool_choice
                )
                for _ in range(body.n)
            ]
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        prompt = await self._off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=False))
        max_new = self._max_new_tokens(
            len(prompt), body.max_new_tokens, self.defaults.values.get("max_tokens")
        )
        tool_fields = {"tool_choice": tool_choice, "parallel_tool_calls": body.parallel_tool_calls}
        grammar = await self._grammar(body, tool_fields, tools)
        start_after = (
            grammar_start_after(self.reasoning_end_ids, body.chat_template_kwargs)
            if grammar
            else ()
        )
        logprobs, seed = (body.top_logprobs or 0) if body.logprobs else None, self._seed(body)
        choices = [
            Choice(i, prompt, None, max_new, self._sampling(body, seed, i, logprobs, None, max_new))
            for i in range(body.n)
        ]
        return await self._respond(
            http, body, choices, "chatcmpl", "chat.completion", parsers, grammar, start_after
        )

    async def _grammar(
        self, body: SamplingFields, extra: dict, tools: list[dict] | None
    ) -> GrammarSpec | None:
        """The grammar the request's output must follow (None: none), compiled now, off the event loop, so that
        a bad one is a 400 here and the engine's compile is a cache hit."""
        fields = {name: getattr(body, name) for name in STRUCTURED_OUTPUT_FIELDS} | extra

        def build() -> GrammarSpec | None:  # tool grammars build with xgrammar
            spec = grammar_for_request(fields, tools)
            if (
                spec is not None
            ):  # the engine's compiler on rank 0: its own compile is then a cache hit
                self.client.grammars.compile(spec)
            return spec

        try:
            spec = await asyncio.to_thread(build)  # one hop off the event loop for both
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return spec

    async def _json_body(self, http: Request):
        """The body as JSON, refused with 503 while stopping and with 413 once it passes max_request_bytes:
        by its Content-Length before any byte is read, else as the bytes arrive."""
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable)
        limit, declared = self.max_request_bytes, http.headers.get("content-length")
        too_long = f"the request body is longer than the server's --max-request-bytes {limit}"
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(
                    400,
                    f"the Content-Length header must be a number of bytes, got {declared[:40]!r}",
                )
            if int(declared) > limit:
                raise ApiError(413, f"{too_long}: Content-Length {declared}")
        parts, size = [], 0
        async for part in http.stream():
            size += len(part)
            if size > limit:
                raise ApiError(413, too_long)
            parts.append(part)
        return decode_json(b"".join(parts))

    async def _off_loop(self, fn, *args):
        """`fn(*args)` on the tokenizer's worker thread. A failure that is not the client's is a 500."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.text_work, fn, *args)
        except ValueError:
            raise
        except Exception:  # noqa: BLE001 - the tokenizer's own errors are not the client's to read
            raise _internal_error("tokenizing") from None

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise ApiError(
                404, f"the model '{model}' does not exist; this server serves {served}", "model"
            )

    def _check_text_size(self, texts: list[str], param: str) -> None:
        """No token covers more than `token_bytes` bytes of text, so texts of more than max_model_len times
        that many bytes cannot fit, whatever their tokens: refused without tokenizing them. (A character is at
        least one byte: a text of more characters than the bound is refused without encoding it.)"""
        chars, ascii_only = sum(map(len, texts)), all(t.isascii() for t in texts)
        if ascii_only or chars > self.max_prompt_bytes:  # bytes = chars, or more than chars
            num_bytes, more_than = chars, not ascii_only
        else:
            num_bytes, more_than = sum(len(t.encode()) for t in texts), False
        if num_bytes > self.max_prompt_bytes:
            raise ApiError(
                400,
                f"the {param} text has {'more than ' if more_than else ''}{num_bytes} bytes; --max-model-len "
                f"{self.client.max_model_len} tokens of at "
                f"most {self.token_bytes} bytes each hold at most {self.max_prompt_bytes}",
                param,
            )

    def _checked_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = self.client.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param} token ids must be in [0, {vocab}), got {bad}", param)
        return ids

    def _parse(self, model, raw, http: Request):
        """`parse`, and the field names the server does not know logged once each, in one line per request (the
        request still runs). A client sending new names without end is logged for the first MAX_LOGGED_FIELDS."""
        body = parse(model, raw)
        room = MAX_LOGGED_FIELDS - len(self.logged_fields)
        new = [name for name in body.model_extra or {} if name not in self.logged_fields][:room]
        if new:
            self.logged_fields.update(new)
            log.warning(
                "[%s] request fields not supported and ignored (each name logged once%s): %s",
                http.state.request_id,
                f"; no more after {MAX_LOGGED_FIELDS} names"
                if len(self.logged_fields) == MAX_LOGGED_FIELDS
                else "",
                ", ".join(repr(name[:64]) for name in new[:MAX_NAMES_A_LINE])
                + (
                    f" and {len(new) - MAX_NAMES_A_LINE} more"
                    if len(new) > MAX_NAMES_A_LINE
                    else ""
                ),
            )
        return body

    def _seed(self, body: SamplingFields) -> int:
        """The request's seed (choice i samples from seed + i), or one from the server's seeds."""
        return body.seed if body.seed is not None else self.seeds.getrandbits(63)

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
            {
                name: getattr(body, name)
                for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            },
            given,
        )
        temperature = fields["temperature"]
        if temperature is None:
            temperature = 1.0  # OpenAI's default, with speculation as without
        if body.min_tokens > max_new:
            raise ApiError(
                400,
                f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_new})",
                "min_tokens",
            )
        bias = body.token_bias
        self._checked_ids(list(bias), "logit_bias")
        try:
            return SamplingParams(
                temperature,
                1.0 if fields["top_p"] is None else fields["top_p"],
                (seed + index) % 2**63,
                top_k=max(fields["top_k"] or 0, 0),
                min_p=fields["min_p"] or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if fields["repetition_penalty"] is None
                else fields["repetition_penalty"],
                logit_bias=tuple(bias.items()),
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None

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
            eos + stop_ids,
            self.metrics,
            eos_token_ids=eos,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            discard_output=choice.discard_output,
        )

    async def _respond(
        self,
        http: Request,
        body: SamplingFields,
        choices: list[Choice],
        id_prefix: str,
        kind: str,
        parsers: list | None,
        grammar: GrammarSpec | None,
        grammar_start_after: tuple[int, ...],
    ):
        """`parsers`: chat only, one ChatChoices per choice (reasoning and tool calls out of the text)."""
        if self.unavailable is not None:  # it began stopping while this request was tokenized
            raise ApiError(503, self.unavailable)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        log.info(
            "[%s] %s: %d choice(s) as %s", http.state.request_id, kind, len(choices), request_id
        )
        generations = [
            self._generation(body, c, request_id, grammar, grammar_start_after) for c in choices
        ]
        streams = AsyncExitStack()  # closing a choice's pieces aborts its engine request
        pieces = [
            await streams.enter_async_context(aclosing(self._until_stopped(g.pieces())))
            for g in generations
        ]
        firsts = await asyncio.gather(*(_first_piece(p) for p in pieces), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            await streams.aclose()
            raise failed
        prompt_tokens = sum(len(c.prompt) for c in choices if c.index % body.n == 0)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        render = Render(
            self.token_texts, kind, choices, generations, parsers, body.return_tokens_as_token_ids
        )
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:  # a client that goes away cancels the stream, which aborts the requests
            events = _events(streams, pieces, firsts, render, head, body, prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream")
        async with streams:
            collect = [asyncio.ensure_future(_rest(p, f)) for p, f in zip(pieces, firsts)]
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

    async def _until_stopped(self, pieces):
        """`pieces`, counted in `open_requests`, until `stop` ends the requests still open: then ApiError 503
        (the engine's request is aborted as the inner iterator closes). `stop` cancels the tasks waiting here
        (`_waiting`); a piece costs no task of its own."""
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
        """From now on new requests (and /health) get 503 with `reason`; the open requests may finish for up to
        `grace_s` seconds, then those left are ended. Returns once none is open (or END_WAIT_S later)."""
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


async def _first_piece(pieces) -> Piece:
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
    """The JSON of the choices: text, finish_reason and, when asked, logprobs in the completions or chat shape
    (`echo` puts the prompt and its logprobs first; chat choices come from their ChatChoices parser)."""

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
        """The choice of a whole response, or of a stream chunk; None for a chunk that would carry nothing (a
        chat parser holds its text back, no finish_reason): its tokens' logprobs go with the next chunk."""
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
        """Every token of `ids` and of their top logprobs -> how logprobs name it, decoded together."""
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
    except Exception:  # noqa: BLE001 - the client gets the error chunk and [DONE], the log the details
        yield i, _internal_error(f"the stream of {label}"), False


async def _merged(pieces, firsts, label: str):
    """Every choice's `_choice_pieces`, merged in the order they come. One choice is read as it is (no task
    and queue between its pieces and the stream); several through a task each."""
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
        await _cancel(tasks)


async def _events(
    streams: AsyncExitStack,
    pieces,
    firsts,
    render: Render,
    head,
    body: SamplingFields,
    prompt_tokens,
):
    """Server-sent events: chunks from every choice as they come (chat: first a chunk with the role per
    choice; later no chunk with an empty delta but the one with the finish_reason), the usage chunk if asked
    (with `continuous_usage_stats`, usage so far in every chunk), then `[DONE]`. An error after the stream
    started comes as a chunk with an `error` object."""
    chunk_kind = render.kind + ".chunk" if render.kind == "chat.completion" else render.kind
    generations = render.generations

    def event(choices: list[dict], with_usage: bool = True) -> str:
        payload = {**head, "object": chunk_kind, "choices": choices}
        if body.continuous_usage and with_usage:
            payload["usage"] = usage(prompt_tokens, sum(g.completion_tokens for g in generations))
        elif body.include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async with streams:
        if render.kind == "chat.completion":
            yield event([render.role_delta(i) for i in range(len(pieces))], with_usage=False)
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
            yield f"data: {json.dumps({**head, 'object': chunk_kind, 'choices': [], 'usage': total})}\n\n"
    yield "data: [DONE]\n\n"
