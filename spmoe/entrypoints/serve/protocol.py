"""The OpenAI (and vLLM) request bodies the server accepts, validated, and the error they turn into when they
are bad. Which fields do what: docs/openai-api.md.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ApiError(Exception):
    """An error for the client: HTTP `status`, and the OpenAI error body's message, type and param."""

    TYPES = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
        500: "internal_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        error_type = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.status}}


class Lenient(BaseModel):
    """Fields the server does not know are kept aside (`model_extra`) and logged once per name, not refused:
    clients written for OpenAI or vLLM send fields that change nothing here (as vLLM ignores them)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) in every chunk


MAX_N = 16  # choices per request


class SamplingFields(Lenient):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo (completions)
    temperature: float | None = Field(None, ge=0)  # None: 1 (OpenAI's default), or 0 on a speculating server
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[int, float] | None = None  # token id (a JSON key: a string) -> bias in [-100, 100]
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
    ignore_eos: bool = False  # an extension (as in vLLM), for benchmarks: generate max_tokens whatever comes
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" instead of their text

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if isinstance(stops, list) and "" in stops:
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias):
        bad = next(((t, b) for t, b in (bias or {}).items() if t < 0 or not -100 <= b <= 100), None)
        if bad is not None:
            raise ValueError(f"expected token ids >= 0 mapped to biases in [-100, 100], got {bad[0]}: {bad[1]}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


TokenIds = list[int]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]  # text, texts, token ids, lists of token ids
    echo: bool = False  # the prompt before the completion (and its logprobs, when logprobs are asked)
    logprobs: int | None = Field(None, ge=0, le=20)  # the chosen token's logprob and this many most likely
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt):
        def ids(value) -> bool:
            return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

        texts = isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
        id_lists = isinstance(prompt, list) and all(ids(p) for p in prompt)
        if not (isinstance(prompt, str) or ids(prompt) or texts or id_lists):
            raise ValueError("expected a string, a list of strings, a list of token ids or a list of such lists")
        if not prompt or (isinstance(prompt, list) and any(isinstance(p, str | list) and not p for p in prompt)):
            raise ValueError("the prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self, content_format: str = "string") -> dict:
        """The message as the chat template sees it: its content as one string ("string"), or as a list of
        `{"type": "text", "text"}` parts ("openai", vLLM's name). `developer` (OpenAI's newer name for the
        instructions a system message gives) is written as `system`: chat templates know that role."""
        role = "system" if self.role == "developer" else self.role
        content = self.content or ""
        if content_format == "openai":
            parts = [content] if isinstance(content, str) else [part.text for part in content]
            return {"role": role, "content": [{"type": "text", "text": text} for text in parts]}
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        return {"role": role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins if both
    logprobs: bool = False  # the chosen tokens' logprobs
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many most likely tokens at each position
    chat_template_kwargs: dict | None = None  # passed to the chat template (e.g. enable_thinking)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body) -> BaseModel:
    """A decoded JSON body -> the validated request; `ApiError` 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        if first["type"] == "missing":
            raise ApiError(400, f"missing required parameter '{where}'", where) from None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {message}, got {first['input']!r}"[:300], where) from None
