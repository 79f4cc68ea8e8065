"""The OpenAI request bodies the server accepts, validated, and the error they turn into when they
are bad.

Unknown fields are accepted and kept aside (`model_extra`; the app logs each name once), as vLLM
ignores them: clients written for OpenAI or vLLM send fields that change nothing here
(docs/openai-api.md lists every field and what it does). Types are strict: a number sent as a string
(`"max_tokens": "16"`) or a bool where a number goes (`"seed": true`) is refused, not converted.

`decode_json` turns the raw body into Python values and refuses what the models never see but that
could still hurt: JSON nested deeper than `MAX_JSON_DEPTH`, NaN / Infinity literals, and strings
that are not Unicode text (a lone surrogate such as `"\\ud800"` decodes to a `str` that no tokenizer
can take).
"""

import json
import logging
import re
import reprlib
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger("spmoe.serve")


class ApiError(Exception):
    """An error for the client: HTTP `status`, and the OpenAI error body's message, type and
    param."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        500: "internal_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        error_type = self.TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.status,
            }
        }


def internal_error(what: str) -> ApiError:
    """Log the exception being handled under a new id; -> the 500 the client gets, which names only
    that id."""
    error_id = uuid.uuid4().hex
    log.exception("internal error %s in %s", error_id, what)
    return ApiError(
        500, f"internal server error (id {error_id}); the details are in the server's log"
    )


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; an OpenAI request needs a handful
_short = reprlib.Repr()  # a bad value, cut short, in an error message
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 60, 60, 6, 6, 3


def decode_json(raw: bytes):
    """The request body -> its JSON value; `ApiError` 400 if it is not JSON, is nested deeper than
    MAX_JSON_DEPTH, holds NaN / Infinity, or has a string that is not valid Unicode (a lone
    surrogate)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(
            400, f"the request body nests arrays / objects more than {MAX_JSON_DEPTH} deep"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, or _no_constant's
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    todo = [(body, 1)]
    while todo:  # a walk without recursion: depth and strings
        value, depth = todo.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(
                    400, f"the request body nests arrays / objects more than {MAX_JSON_DEPTH} deep"
                )
            items = value if isinstance(value, list) else [*value.keys(), *value.values()]
            todo.extend((item, depth + 1) for item in items if isinstance(item, (str, list, dict)))
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(text: str) -> None:
    if text.isascii():  # a flag CPython keeps on the string: no scan
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("utf-8", "backslashreplace").decode()
        raise ApiError(
            400, f"the request body has a string that is not Unicode text: lone surrogate {bad}"
        ) from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) in every chunk


MAX_N = 16  # choices per request


class SamplingFields(Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo (completions)
    temperature: float | None = Field(None, ge=0)  # None: the generation default, else 1 (OpenAI's)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    # token id (a JSON key: a string) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = []  # also accepted: one string, or null
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None  # recorded by OpenAI for abuse monitoring; no effect on the output
    # an extension (as in vLLM), for benchmarks: generate max_tokens whatever comes
    ignore_eos: bool = False
    # logprobs name tokens "token_id:<id>" instead of their text
    return_tokens_as_token_ids: bool = False
    # structured output (constraints.py checks them): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias):
        for token, value in (bias or {}).items():
            if not token.isdigit() or not -100 <= value <= 100:
                raise ValueError(
                    f"expected token ids >= 0 mapped to biases in [-100, 100], got {token}: {value}"
                )
        return bias

    @property
    def token_bias(self) -> dict[int, float]:
        """logit_bias with its token ids as numbers."""
        return {int(token): value for token, value in (self.logit_bias or {}).items()}

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if isinstance(stops, list) and "" in stops:
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


TokenIds = list[int]


class CompletionRequest(SamplingFields):
    prompt: (
        str | list[str] | TokenIds | list[TokenIds]
    )  # text, texts, token ids, lists of token ids
    # the prompt before the completion (and its logprobs, when logprobs are asked)
    echo: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=20
    )  # the chosen token's logprob and this many most likely
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt):
        def ids(value) -> bool:
            return isinstance(value, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value
            )

        texts = isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
        id_lists = isinstance(prompt, list) and all(ids(p) for p in prompt)
        if not (isinstance(prompt, str) or ids(prompt) or texts or id_lists):
            raise ValueError(
                "expected a string, a list of strings, a list of token ids or a list of such lists"
            )
        if not prompt or (
            isinstance(prompt, list) and any(isinstance(p, str | list) and not p for p in prompt)
        ):
            raise ValueError("the prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object's text

    def parsed(self) -> dict:
        """The arguments as an object; ValueError unless they are a JSON object's text (or
        empty)."""
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(
                "a tool call's function.arguments must be a JSON object's text, "
                f"got {self.arguments!r}"
            )
        return value


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# content parts of OpenAI's (and vLLM's) multimodal messages, none of which a text model takes
NOT_TEXT_PARTS = (
    "image_url", "input_image", "image", "image_pil", "image_embeds", "input_audio", "audio_url",
    "audio", "video_url", "video", "file", "input_file",
)  # fmt: skip


def text_parts_only(content):
    """A message's content before validation: a string, or a list of parts of which an image, audio,
    video or file part is refused as such ("this model takes text only")."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("expected a string or a list of text parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NOT_TEXT_PARTS:
            raise ValueError(
                f"this model takes text only, and the content has a {kind!r} part; send text "
                f'parts ({{"type": "text", "text": ...}}) or a string'
            )
    return content


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers (OpenAI requires it)
    reasoning_content: str | None = None  # an assistant turn's thinking, given back to the template

    _text_only = field_validator("content", mode="before")(text_parts_only)

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a '{self.role}' message needs 'content' "
                "(only an assistant turn with tool_calls may omit it)"
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError(
                f"only an assistant message may have tool_calls, not a '{self.role}' message"
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs 'tool_call_id': the id of the call it answers")
        return self

    def as_template_input(self, content_format: str = "string") -> dict:
        """The message as the chat template sees it: its fields as sent (None left out), its content
        as one string ("string") or as a list of `{"type": "text", "text"}` parts ("openai", vLLM's
        name), and each tool call's `arguments` (JSON text in the API) as the object the template
        writes out key by key; ValueError for arguments that are not a JSON object's text."""
        out = self.model_dump(exclude_none=True, exclude=set(self.model_extra or ()))
        if (
            self.role == "developer"
        ):  # OpenAI's newer name for a system message: chat templates know "system"
            out["role"] = "system"
        if self.content is not None:
            parts = (
                [self.content]
                if isinstance(self.content, str)
                else [part.text for part in self.content]
            )
            out["content"] = (
                [{"type": "text", "text": t} for t in parts]
                if content_format == "openai"
                else "".join(parts)
            )
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    **call.model_dump(),
                    "function": {"name": call.function.name, "arguments": call.function.parsed()},
                }
                for call in self.tool_calls
            ]
        return out


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


def named_or_listed_choice(choice, named: str):
    """`tool_choice` before validation: one of TOOL_CHOICES, or an object (a named function, in the
    shape `named` shows); anything else is refused in those words."""
    if choice is None or choice in TOOL_CHOICES or isinstance(choice, dict):
        return choice
    raise ValueError(f'expected "none", "auto", "required" or {named}')


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None, ge=1
    )  # the newer name of max_tokens; wins if both
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # passed to the chat template (enable_thinking: GLM's thinking switch)
    chat_template_kwargs: dict = {}

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, choice):
        return named_or_listed_choice(choice, '{"type": "function", "function": {"name": ...}}')

    logprobs: bool = False  # the chosen tokens' logprobs
    top_logprobs: int | None = Field(
        None, ge=0, le=20
    )  # and this many most likely tokens at each position

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict = {}


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# what pydantic puts in an error's location for the member of a union that failed: a type's name
# (`str`, `list[TextPart]`, `literal['none','auto']`, `NamedToolChoice`, `function-after[...]`);
# the request's own field names are lower case, without brackets
_UNION_MEMBER = re.compile(r"[A-Z]\w*|(str|int|float|bool|none)|[\w-]+\[.*\]")


def client_parts(loc: tuple, tags: frozenset = frozenset()) -> list:
    """An error's location less the union members pydantic names in it (`tags`: the tags of the
    model's discriminated unions, which pydantic names too)."""
    return [
        p for p in loc if isinstance(p, int) or not (p in tags or _UNION_MEMBER.fullmatch(str(p)))
    ]


def client_path(loc: tuple, tags: frozenset = frozenset()) -> str:
    """An error's location in the names the client sent: `messages[0].content`, not pydantic's
    `messages.0.content.str` (list indices in brackets, union members left out)."""
    parts = client_parts(loc, tags)
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).removeprefix(".")


def parse(model: type[BaseModel], body, tags: frozenset = frozenset()) -> BaseModel:
    """A decoded JSON body -> the validated request; `ApiError` 400 naming the first bad field in
    the client's names (`client_path`; `tags`: those of the model's discriminated unions)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # the deepest error: of a union's members, the one that got furthest into the value
        first = max(e.errors(), key=lambda error: len(client_parts(error["loc"], tags)))
        where = client_path(first["loc"], tags) or "body"
        if first["type"] == "missing":
            raise ApiError(400, f"missing required parameter '{where}'", where) from None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(
            400, f"{where}: {message}, got {_short.repr(first['input'])}", where
        ) from None
