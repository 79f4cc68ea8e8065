"""The OpenAI-compatible HTTP API as a FastAPI app, built around an engine client.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (`stream` false: one JSON
body; true: server-sent events ending with `data: [DONE]`), `GET /health`, `GET /metrics`. Every error is an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

The app waits for a request's first text before it answers, so a request the engine refuses (a full queue:
503, one that can never fit: 400) gets its status even when it asked for a stream.

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
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from spmoe.engine.grammar import GrammarSpec
from spmoe.engine.request import Request as EngineRequest
from spmoe.engine.sampling import SamplingParams
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.chat import ChatChoices, ChatOptions, effective_tool_choice, reasoning_end_ids
from spmoe.entrypoints.serve.client import QueueFull
from spmoe.entrypoints.serve.constraints import STRUCTURED_OUTPUT_FIELDS, grammar_for_request
from spmoe.entrypoints.serve.metrics import CONTENT_TYPE, ServeMetrics
from spmoe.entrypoints.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    decode_json,
    parse,
)
from spmoe.entrypoints.serve.streaming import Piece, TextGeneration
from spmoe.entrypoints.serve.tokenizer import chat_prompt_text, eos_token_ids, longest_token_bytes

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
OPEN_ROUTES = ("/health", "/metrics")  # the routes that need no API key
END_WAIT_S = 5.0  # how long `stop` waits for the requests it ended to send their last chunk
log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class ApiSettings:
    served_model_names: list[str]  # the names clients may ask for; the first is reported in responses
    defaults: GenerationDefaults = GenerationDefaults()  # the model's, for the fields a request leaves out
    chat_template_content_format: str = "string"  # how the template sees content (ChatMessage.as_template_input)
    seed: int | None = None  # seeds the seeds of requests that give none (reproducible runs); None: random
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


def build_app(client, tokenizer, settings: ApiSettings, limits: FrontEndLimits = FrontEndLimits()) -> FastAPI:
    """`client`: an EngineClient (async `generate(request)`, `metrics()`, `max_model_len`, `vocab_size`,
    `eos_token_ids`, `num_speculative_tokens`, `error`); `tokenizer`: a transformers tokenizer. The app's
    `OpenAIApi` is `app.state.api` (its `stop` ends serving)."""
    app = FastAPI(title="spmoe", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIApi(client, tokenizer, settings, limits.max_request_bytes)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        # after a 413 the connection closes: the rest of the body is not read (and parsed) for nothing
        return JSONResponse(
            e.body(), status_code=e.status, headers={"Connection": "close"} if e.status == 413 else None
        )

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return JSONResponse(_internal_error(f"{request.method} {request.url.path}").body(), status_code=500)

    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics_text)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    if limits.api_key is not None:
        app.add_middleware(RequireApiKey, api_key=limits.api_key)
    return app


def _internal_error(what: str) -> ApiError:
    """Log the exception being handled under a new id; -> the 500 the client gets, which names only that id."""
    error_id = uuid.uuid4().hex
    log.exception("internal error %s in %s", error_id, what)
    return ApiError(500, f"internal server error (id {error_id}); the details are in the server's log")


class RequireApiKey:
    """ASGI middleware: every HTTP route but OPEN_ROUTES answers 401 unless the request carries
    `Authorization: Bearer <api_key>` (compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIApi:
    def __init__(self, client, tokenizer, settings: ApiSettings, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.client, self.tokenizer, self.model_names = client, tokenizer, settings.served_model_names
        self.model_name = self.model_names[0]
        self.defaults, self.content_format = settings.defaults, settings.chat_template_content_format
        self.seeds = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self.chat = settings.chat
        self.max_request_bytes = max_request_bytes
        self.eos_token_ids = eos_token_ids(tokenizer, tuple(client.eos_token_ids))
        self.token_bytes = longest_token_bytes(tokenizer)
        self.max_prompt_bytes = client.max_model_len * self.token_bytes  # more cannot fit (see _check_text_size)
        self.metrics = ServeMetrics(client, self.model_name)
        self.created = int(time.time())
        # One worker: a tokenizer is not safe to use from several threads at once, and one thread keeps the
        # event loop free, which is what matters.
        self.text_work = ThreadPoolExecutor(1, thread_name_prefix="spmoe-tokenize")
        self.unavailable: str | None = None  # why new requests get 503 (`stop`)
        self.open_requests = 0  # requests between their admission and their last piece
        self._ended: asyncio.Future | None = None  # done once `stop` ends the requests still open

    async def health(self) -> Response:
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable)
        if self.client.error is not None:
            raise ApiError(503, "the engine has stopped; the server's log says why")
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "spmoe",
                    "max_model_len": self.client.max_model_len,
                }
                for name in self.model_names
            ],
        }

    async def completions(self, http: Request):
        raw = await self._json_body(http)
        if isinstance(raw, dict) and isinstance(raw.get("prompt"), list):  # before validating a huge list
            self._max_new_tokens(len(raw["prompt"]), None, None)
        body = parse(CompletionRequest, raw)
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            self._check_text_size([body.prompt], "prompt")
            prompt = await self._off_loop(self.tokenizer.encode, body.prompt)
        else:
            prompt = self._checked_ids(body.prompt)
        default = self.defaults.values.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        max_new = self._max_new_tokens(len(prompt), body.max_tokens, default)
        grammar = await self._grammar(body, {}, None)
        return await self._respond(
            http, body, prompt, max_new, "cmpl", "text_completion", _completion_choice, grammar, ()
        )

    async def chat_completions(self, http: Request):
        body = parse(ChatCompletionRequest, await self._json_body(http))
        self._check_model(body.model)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
        try:
            tool_choice = effective_tool_choice(tools, choice, self.chat)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None
        texts = [
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ()) for m in body.messages
        ]
        self._check_text_size(texts, "messages")
        try:
            messages = [m.as_template_input(self.content_format) for m in body.messages]
            text = await self._off_loop(chat_prompt_text, self.tokenizer, messages, tools, body.chat_template_kwargs)
            choices = ChatChoices.for_request(self.chat, text, body.chat_template_kwargs, tools, tool_choice)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        prompt = await self._off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=False))
        max_new = self._max_new_tokens(len(prompt), body.max_new_tokens, self.defaults.values.get("max_tokens"))
        tool_fields = {"tool_choice": tool_choice, "parallel_tool_calls": body.parallel_tool_calls}
        grammar = await self._grammar(body, tool_fields, tools)
        start_after = reasoning_end_ids(self.chat, body.chat_template_kwargs, self.tokenizer) if grammar else ()
        return await self._respond(
            http, body, prompt, max_new, "chatcmpl", "chat.completion", choices, grammar, start_after
        )

    async def _grammar(self, body: SamplingFields, extra: dict, tools: list[dict] | None) -> GrammarSpec | None:
        """The grammar the request's output must follow (None: none), compiled now, off the event loop, so that
        a bad one is a 400 here and the engine's compile is a cache hit."""
        fields = {name: getattr(body, name) for name in STRUCTURED_OUTPUT_FIELDS} | extra
        try:
            spec = grammar_for_request(fields, tools)
            if spec is not None:  # the engine's compiler on rank 0: its own compile is then a cache hit
                await asyncio.to_thread(self.client.grammars.compile, spec)
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
                raise ApiError(400, f"the Content-Length header must be a number of bytes, got {declared[:40]!r}")
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
            raise ApiError(404, f"the model '{model}' does not exist; this server serves {served}", "model")

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

    def _checked_ids(self, prompt: list[int]) -> list[int]:
        vocab = self.client.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt")
        return prompt

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

    async def _respond(
        self,
        http: Request,
        body: SamplingFields,
        prompt: list[int],
        max_new: int,
        id_prefix: str,
        kind: str,
        choice,
        grammar: GrammarSpec | None,
        grammar_start_after: tuple[int, ...],
    ):
        if self.unavailable is not None:  # it began stopping while this request was tokenized
            raise ApiError(503, self.unavailable)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        seed = body.seed if body.seed is not None else self.seeds.getrandbits(63)
        given = {name for name in body.model_fields_set if getattr(body, name) is not None}
        fields = self.defaults.apply({"temperature": body.temperature, "top_p": body.top_p}, given)
        temperature = 1.0 if fields["temperature"] is None else fields["temperature"]  # OpenAI's default
        try:
            sampling = SamplingParams(temperature, fields["top_p"], seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        eos = () if body.ignore_eos else self.eos_token_ids
        request = EngineRequest(request_id, prompt, max_new, sampling, eos, grammar, grammar_start_after)
        generation = TextGeneration(self.client.generate(request), self.tokenizer, prompt, body.stop, eos, self.metrics)
        pieces = self._until_stopped(generation.pieces())
        first = await _first_piece(pieces)
        self.metrics.prompt_tokens.inc(len(prompt))
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:  # a client that goes away cancels the stream, which aborts the request
            return StreamingResponse(
                _events(pieces, first, generation, head, kind, choice, body.include_usage),
                media_type="text/event-stream",
            )
        async with aclosing(pieces):
            texts, piece = [first.text], first
            while piece.finish_reason is None:
                if await http.is_disconnected():  # leaving the loop aborts the request
                    return Response(status_code=499)
                piece = await anext(pieces)
                texts.append(piece.text)
        return {
            **head,
            "object": kind,
            "choices": [choice("".join(texts), piece.finish_reason, stream=False)],
            "usage": generation.usage,
        }

    async def _until_stopped(self, pieces):
        """`pieces`, counted in `open_requests`, until `stop` ends the requests still open: then ApiError 503
        (the engine's request is aborted as the inner iterator closes)."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        self.open_requests += 1
        try:
            async with aclosing(pieces):
                while True:
                    following = asyncio.ensure_future(anext(pieces))
                    try:
                        await asyncio.wait((following, self._ended), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        if not following.done():
                            following.cancel()
                            await asyncio.wait((following,))  # the cancellation lands before `pieces` closes
                    if following.cancelled():
                        raise ApiError(503, f"{self.unavailable}; this request was ended before it finished")
                    piece = following.result()
                    yield piece
                    if piece.finish_reason is not None:
                        return
        finally:
            self.open_requests -= 1

    async def stop(self, reason: str, grace_s: float) -> None:
        """From now on new requests (and /health) get 503 with `reason`; the open requests may finish for up to
        `grace_s` seconds, then those left are ended. Returns once none is open (or END_WAIT_S later)."""
        self.unavailable = reason
        log.warning("%s: %d requests open, which may finish for %.0f s", reason, self.open_requests, grace_s)
        deadline = time.monotonic() + grace_s
        while self.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
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


async def _events(pieces, first: Piece, generation: TextGeneration, head: dict, kind: str, choice, include_usage: bool):
    """Server-sent events: a chunk per piece (chat: first a chunk with the role), the usage chunk if asked,
    then `[DONE]`. An error after the stream started comes as a chunk with an `error` object."""
    chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
    usage = {"usage": None} if include_usage else {}

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async with aclosing(pieces):
        try:
            if kind == "chat.completion":
                yield event({**head, "object": chunk_kind, "choices": [_chat_role_delta()], **usage})
            piece = first
            while True:
                yield event(
                    {
                        **head,
                        "object": chunk_kind,
                        "choices": [choice(piece.text, piece.finish_reason, stream=True)],
                        **usage,
                    }
                )
                if piece.finish_reason is not None:
                    break
                piece = await anext(pieces)
            if include_usage:
                yield event({**head, "object": chunk_kind, "choices": [], "usage": generation.usage})
        except ApiError as e:
            yield event(e.body())
        except Exception:  # noqa: BLE001 - the client gets the error chunk and [DONE], the log the details
            yield event(_internal_error(f"the stream of {head['id']}").body())
    yield "data: [DONE]\n\n"


def _completion_choice(text: str, finish_reason: str | None, stream: bool) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chat_role_delta() -> dict:
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
