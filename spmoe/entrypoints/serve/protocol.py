"""The OpenAI request bodies the server accepts, validated, and the error they turn into when they are bad.

Unknown fields are refused rather than ignored: a client that sends `logprobs` or `presence_penalty` learns
that they are not applied instead of getting an answer that silently lacks them.
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


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # None: 1 (OpenAI's default), or 0 on a speculating server
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = []  # also accepted: one string, or null
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # recorded by OpenAI for abuse monitoring; no effect on the output
    ignore_eos: bool = False  # an extension (as in vLLM), for benchmarks: generate max_tokens whatever comes

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n = 1 is supported, got {n}")
        return n

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


class CompletionRequest(SamplingFields):
    prompt: str | list[int]  # text, or token ids

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_ids(cls, prompt):
        ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or ids):
            raise ValueError("expected a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt must not be empty")
        return prompt


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self, content_format: str = "string") -> dict:
        """The message as the chat template sees it: its content as one string ("string"), or as a list of
        `{"type": "text", "text"}` parts ("openai", vLLM's name)."""
        if content_format == "openai":
            parts = [self.content] if isinstance(self.content, str) else [part.text for part in self.content]
            return {"role": self.role, "content": [{"type": "text", "text": text} for text in parts]}
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins if both

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[BaseModel], body) -> BaseModel:
    """A decoded JSON body -> the validated request; `ApiError` 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"unsupported parameter '{where}'", where) from None
        if first["type"] == "missing":
            raise ApiError(400, f"missing required parameter '{where}'", where) from None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {message}, got {first['input']!r}"[:300], where) from None
