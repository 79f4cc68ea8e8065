"""The OpenAI-compatible HTTP API as a FastAPI app, built around an engine client.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (`stream` false: one JSON
body; true: server-sent events ending with `data: [DONE]`), `GET /health`, `GET /metrics`. Every error is an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

The app waits for a request's first text before it answers, so a request the engine refuses (a full queue:
503, one that can never fit: 400) gets its status even when it asked for a stream.
"""

import json
import logging
import random
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from spmoe.engine.request import Request as EngineRequest
from spmoe.engine.sampling import SamplingParams
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.client import QueueFull
from spmoe.entrypoints.serve.metrics import CONTENT_TYPE, ServeMetrics
from spmoe.entrypoints.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from spmoe.entrypoints.serve.streaming import Piece, TextGeneration
from spmoe.entrypoints.serve.tokenizer import chat_prompt_ids, eos_token_ids

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
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

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        log.exception("request failed")
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics_text)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


class OpenAIApi:
    def __init__(self, client, tokenizer, settings: ApiSettings):
        self.client, self.tokenizer, self.model_names = client, tokenizer, settings.served_model_names
        self.model_name = self.model_names[0]
        self.defaults, self.content_format = settings.defaults, settings.chat_template_content_format
        self.seeds = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self.eos_token_ids = eos_token_ids(tokenizer, tuple(client.eos_token_ids))
        self.metrics = ServeMetrics(client, self.model_name)
        self.created = int(time.time())

    async def health(self) -> Response:
        if self.client.error is not None:
            raise ApiError(503, f"the engine has stopped: {self.client.error}")
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
        body = parse(CompletionRequest, await _json_body(http))
        self._check_model(body.model)
        prompt = self._prompt_ids(body.prompt)
        default = self.defaults.values.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        max_new = self._max_new_tokens(len(prompt), body.max_tokens, default)
        return await self._respond(http, body, prompt, max_new, "cmpl", "text_completion", _completion_choice)

    async def chat_completions(self, http: Request):
        body = parse(ChatCompletionRequest, await _json_body(http))
        self._check_model(body.model)
        try:
            prompt = chat_prompt_ids(self.tokenizer, [m.as_template_input(self.content_format) for m in body.messages])
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        max_new = self._max_new_tokens(len(prompt), body.max_new_tokens, self.defaults.values.get("max_tokens"))
        return await self._respond(http, body, prompt, max_new, "chatcmpl", "chat.completion", _chat_choice)

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise ApiError(404, f"the model '{model}' does not exist; this server serves {served}", "model")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
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
        self, http: Request, body: SamplingFields, prompt: list[int], max_new: int, id_prefix: str, kind: str, choice
    ):
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
        request = EngineRequest(request_id, prompt, max_new, sampling, eos)
        generation = TextGeneration(self.client.generate(request), self.tokenizer, prompt, body.stop, eos, self.metrics)
        pieces = generation.pieces()
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
    yield "data: [DONE]\n\n"


def _completion_choice(text: str, finish_reason: str | None, stream: bool) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chat_choice(text: str, finish_reason: str | None, stream: bool) -> dict:
    if stream:
        return {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }


def _chat_role_delta() -> dict:
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
