"""Request parsing: an HTTP request's body read within the front end's limits, validated and turned
into what to generate (`ParsedRequest`: one `Choice` per engine request, with its prompt's tokens,
sampling and grammar). Bad input is an ApiError naming what was expected and what came.

A request becomes one engine request per choice: each prompt of a batch, n times (choice index
`prompt_index * n + i`, seed `seed + index`). A text prompt longer in bytes than `max_model_len`
tokens could ever cover is refused before it is tokenized; tokenizing and chat templating run in a
worker thread, not on the event loop.
"""

import asyncio
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from spmoe.engine.request import GrammarSpec, SamplingParams
from spmoe.entrypoints.generation_defaults import GenerationDefaults
from spmoe.entrypoints.serve.frontend.chat import (
    ChatChoices,
    ChatOptions,
    ToolUse,
    forced_call_parser,
    grammar_start_after,
    reasoning_end_ids,
)
from spmoe.entrypoints.serve.frontend.constraints import (
    STRUCTURED_OUTPUT_FIELDS,
    grammar_for_request,
)
from spmoe.entrypoints.serve.frontend.metrics import ServeMetrics
from spmoe.entrypoints.serve.frontend.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    decode_json,
    internal_error,
    parse,
)
from spmoe.entrypoints.serve.frontend.schema_policy import KNOWN_KEYWORDS, Unenforced
from spmoe.entrypoints.serve.frontend.tokenizer import chat_prompt_text, longest_token_bytes

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the room left
MAX_LOGGED_FIELDS = 256  # unknown request field names logged (and remembered) at most, ever
MAX_NAMES_A_LINE = 8  # of them named in one request's log line
log = logging.getLogger("spmoe.serve")


@dataclass(frozen=True)
class ApiSettings:
    # the names clients may ask for; the first is reported in responses
    served_model_names: list[str]
    # the model's, for the fields a request leaves out
    defaults: GenerationDefaults = GenerationDefaults()
    # how the template sees content (ChatMessage.as_template_input)
    chat_template_content_format: str = "string"
    # seeds the seeds of requests that give none (reproducible runs); None: random
    seed: int | None = None
    chat: ChatOptions = ChatOptions()  # the reasoning and tool-call parsers


@dataclass
class Choice:
    """One engine request of an HTTP request: its place in the answer, its prompt and how to
    generate."""

    index: int
    prompt: list[int]
    prompt_text: str | None  # the text `echo` puts before the completion; None: no echo
    max_new_tokens: int
    sampling: SamplingParams
    discard_output: bool = False  # echo with max_tokens 0


@dataclass(frozen=True)
class ParsedRequest:
    """What a request asks to generate."""

    body: SamplingFields
    choices: list[Choice]
    grammar: GrammarSpec | None  # what every choice's output must follow; None: free text
    parsers: list | None = None  # chat: one ChatChoices per choice (reasoning, tool calls)
    start_after: tuple[int, ...] = ()  # the grammar starts after one of these (reasoning's end)


class RequestReader:
    """Reads requests for the server: `completion` and `chat` turn a body into a ParsedRequest; the
    rest are the checks and conversions they (and the other routes) share."""

    def __init__(
        self,
        client,
        tokenizer,
        settings: ApiSettings,
        max_request_bytes: int,
        metrics: ServeMetrics,
    ):
        self.client, self.tokenizer, self.metrics = client, tokenizer, metrics
        self.model_names, self.defaults = settings.served_model_names, settings.defaults
        self.content_format = settings.chat_template_content_format
        self.seeds = (
            random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        )
        self.chat_options = settings.chat
        # where a chat grammar may start
        self.reasoning_end_ids = reasoning_end_ids(settings.chat, tokenizer)
        self.forced_parser = forced_call_parser(tokenizer)  # without --tool-call-parser
        self.max_request_bytes = max_request_bytes
        self.token_bytes = longest_token_bytes(tokenizer)
        # more cannot fit (see check_text_size)
        self.max_prompt_bytes = client.max_model_len * self.token_bytes
        # unknown request fields already logged (at most MAX_LOGGED_FIELDS)
        self.logged_fields: set[str] = set()
        # schema keywords already logged as unenforced (KNOWN_KEYWORDS and "other")
        self.logged_keywords: set[str] = set()
        # One worker: a tokenizer is not safe to use from several threads at once, and one thread
        # keeps the event loop free, which is what matters.
        self.text_work = ThreadPoolExecutor(1, thread_name_prefix="spmoe-tokenize")

    async def completion(self, raw, http: Request) -> "ParsedRequest":
        """A /v1/completions body -> what to generate: a choice per prompt, n times."""
        prompt = raw.get("prompt") if isinstance(raw, dict) else None
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):  # token ids
            batch = isinstance(prompt[0], list)  # a list of id lists: the longest counts
            longest = (
                max((len(p) for p in prompt if isinstance(p, list)), default=0)
                if batch
                else len(prompt)
            )
            self.max_new_tokens(longest, None, None)
        body = self.parse(CompletionRequest, raw, http)
        self.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(
                400,
                f"best_of must equal n ({body.n}): choosing the best of more is not supported, "
                f"got best_of={body.best_of}",
                "best_of",
            )
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 is allowed only with echo, got 0", "max_tokens")
        grammar = await self.grammar(body, {}, None, http)
        choices, seed = [], self.seed(body)
        default_max = self.defaults.values.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        for p, prompt in enumerate(body.prompts):
            if isinstance(prompt, str):
                self.check_text_size([prompt], "prompt")
                ids = self.checked_ids(await self.off_loop(self.tokenizer.encode, prompt))
            else:
                ids = self.checked_ids(prompt)
            echo = None
            if body.echo:
                echo = (
                    prompt
                    if isinstance(prompt, str)
                    else await self.off_loop(self.tokenizer.decode, ids)
                )
            discard = body.max_tokens == 0
            max_new = 1 if discard else self.max_new_tokens(len(ids), body.max_tokens, default_max)
            if discard:
                self.max_new_tokens(len(ids), 1, None)
            logprobs, prompt_logprobs = body.logprobs, body.logprobs if body.echo else None
            for i in range(body.n):
                index = p * body.n + i
                sampling = self.sampling(body, seed, index, logprobs, prompt_logprobs, max_new)
                choices.append(Choice(index, ids, echo, max_new, sampling, discard))
        return ParsedRequest(body=body, choices=choices, grammar=grammar)

    async def chat(self, raw, http: Request) -> "ParsedRequest":
        """A /v1/chat/completions body -> what to generate: its n choices and their parsers."""
        body = self.parse(ChatCompletionRequest, raw, http)
        self.check_model(body.model)
        if body.max_tokens == 0:
            raise ApiError(
                400, "max_tokens: expected >= 1 for chat completions, got 0", "max_tokens"
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        choice = body.tool_choice
        choice = choice.model_dump() if isinstance(choice, BaseModel) else choice
        try:
            tool_use = ToolUse.for_request(
                tools, choice, body.parallel_tool_calls, self.chat_options, self.forced_parser
            )
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None
        texts = [
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
            for m in body.messages
        ]
        self.check_text_size(texts, "messages")
        template_kwargs = self.chat_options.template_kwargs(body.chat_template_kwargs)
        try:
            messages = [m.as_template_input(self.content_format) for m in body.messages]
            text = await self.off_loop(
                chat_prompt_text, self.tokenizer, messages, tools, template_kwargs
            )
            parsers = [
                ChatChoices.for_request(self.chat_options, text, template_kwargs, tool_use)
                for _ in range(body.n)
            ]
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        prompt = self.checked_ids(
            await self.off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=False))
        )
        max_new = self.max_new_tokens(
            len(prompt), body.max_new_tokens, self.defaults.values.get("max_tokens")
        )
        grammar = await self.grammar(body, tool_use.grammar_fields(), tools, http)
        start_after = (
            grammar_start_after(self.reasoning_end_ids, template_kwargs) if grammar else ()
        )
        logprobs, seed = (body.top_logprobs or 0) if body.logprobs else None, self.seed(body)
        choices = [
            Choice(i, prompt, None, max_new, self.sampling(body, seed, i, logprobs, None, max_new))
            for i in range(body.n)
        ]
        return ParsedRequest(
            body=body, choices=choices, grammar=grammar, parsers=parsers, start_after=start_after
        )

    async def grammar(
        self, body: SamplingFields, extra: dict, tools: list[dict] | None, http: Request
    ) -> GrammarSpec | None:
        """The grammar the request's output must follow (None: none), its spec read and checked off
        the event loop (a large schema's keyword policy takes a while): the engine process compiles
        it, once per spec, and refuses one that does not compile (a 400 all the same)."""
        fields = {name: getattr(body, name) for name in STRUCTURED_OUTPUT_FIELDS} | extra
        try:
            output = await asyncio.to_thread(grammar_for_request, fields, tools)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if output is None:
            return None
        if output.unenforced:
            self.note_unenforced(output.unenforced, http.state.request_id)
        return output.spec

    def note_unenforced(self, found: tuple[Unenforced, ...], request_id: str) -> None:
        """A request accepted with schema keywords its grammar leaves unenforced: counted once per
        keyword, each keyword logged the first time it comes."""
        named = {u.keyword if u.keyword in KNOWN_KEYWORDS else "other": u for u in found}
        self.metrics.observe_unenforced_keywords(set(named))
        new = [u for keyword, u in named.items() if keyword not in self.logged_keywords]
        if new:
            self.logged_keywords.update(named)
            log.warning(
                "[%s] schema keywords accepted without strict but not enforced by the grammar "
                "(each keyword logged once; counted in "
                "spmoe:structured_output_unenforced_keywords_total): %s",
                request_id,
                "; ".join(map(str, new)),
            )

    async def json_body(self, http: Request):
        """The body as JSON, refused with 413 once it passes max_request_bytes: by its
        Content-Length before any byte is read, else as the bytes arrive."""
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

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the tokenizer's worker thread. A failure that is not the client's is a
        500."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.text_work, fn, *args)
        except ValueError:
            raise
        except Exception:  # noqa: BLE001 - the tokenizer's own errors are not the client's to read
            raise internal_error("tokenizing") from None

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise ApiError(
                404, f"the model '{model}' does not exist; this server serves {served}", "model"
            )

    def check_text_size(self, texts: list[str], param: str) -> None:
        """No token covers more than `token_bytes` bytes of text, so texts of more than
        max_model_len times that many bytes cannot fit, whatever their tokens: refused without
        tokenizing them. (A character is at least one byte: a text of more characters than the bound
        is refused without encoding it.)"""
        chars, ascii_only = sum(map(len, texts)), all(t.isascii() for t in texts)
        if ascii_only or chars > self.max_prompt_bytes:  # bytes = chars, or more than chars
            num_bytes, more_than = chars, not ascii_only
        else:
            num_bytes, more_than = sum(len(t.encode()) for t in texts), False
        if num_bytes > self.max_prompt_bytes:
            raise ApiError(
                400,
                f"the {param} text has {'more than ' if more_than else ''}{num_bytes} bytes; "
                "--max-model-len "
                f"{self.client.max_model_len} tokens of at "
                f"most {self.token_bytes} bytes each hold at most {self.max_prompt_bytes}",
                param,
            )

    def checked_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = self.client.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param} token ids must be in [0, {vocab}), got {bad}", param)
        return ids

    def parse(self, model, raw, http: Request):
        """`parse`, and the field names the server does not know logged once each, in one line per
        request (the request still runs). A client sending new names without end is logged for the
        first MAX_LOGGED_FIELDS."""
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

    def seed(self, body: SamplingFields) -> int:
        """The request's seed (choice i samples from seed + i), or one from the server's seeds."""
        return body.seed if body.seed is not None else self.seeds.getrandbits(63)

    def sampling(
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
        self.checked_ids(list(bias), "logit_bias")
        try:
            params = SamplingParams(
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
            params.check()
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return params

    def max_new_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        """The output tokens that fit: the KV cache holds max_model_len positions per request, the
        prompt, the output and (when speculating) the drafts of the last step."""
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
