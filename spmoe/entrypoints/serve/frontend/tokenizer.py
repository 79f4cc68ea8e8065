"""Text in and out of the server: the checkpoint's chat template (its tokenizer is loaded by
`spmoe.entrypoints.tokenizer`), and the incremental detokenizer that turns the engine's token ids
into text pieces for streaming.

A byte-level tokenizer can split one character over several tokens (`é` is two bytes, two tokens).
Decoding such a prefix gives U+FFFD (the replacement character) at the end, so the detokenizer holds
those tokens back until the character is complete, and only at the end of the generation lets an
unfinished one out as U+FFFD.
"""

from pathlib import Path

from jinja2 import TemplateError

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with
# prompt tokens decoded before the output, for tokenizers that drop a leading space
CONTEXT_TOKENS = 4


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja chat template, or the template itself (as vLLM
    takes it)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value}: expected a Jinja template file or a template, found neither"
    )


# the chat template's arguments the server sets itself
SERVER_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "tokenize", "add_generation_prompt", "conversation"}
)


def chat_prompt_text(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """Messages `[{"role", "content", ...}, ...]` (and the request's tools and
    `chat_template_kwargs`) -> the prompt's text through the checkpoint's chat template, ending with
    the assistant's turn opened. The template writes any special tokens it wants itself."""
    if not tokenizer.chat_template:
        raise ValueError(
            "this model's tokenizer has no chat template (tokenizer_config.json 'chat_template'); "
            "use /v1/completions"
        )
    kwargs = dict(template_kwargs or {})
    reserved = sorted(SERVER_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs must not set {', '.join(reserved)}: the server sets them"
        )
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except (
        TemplateError,
        TypeError,
        KeyError,
        AttributeError,
    ) as e:  # the template's own error, or its raise
        raise ValueError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}"[:400]
        ) from None


def longest_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the longest entry of the vocabulary (special tokens included): no token
    stands for more bytes of text than this, so a text of more than `n` times as many bytes has more
    than `n` tokens. (A byte-level vocabulary writes each byte as one character of 1 or 2 bytes, a
    SentencePiece one a space as 3-byte U+2581: both over-count, never under-count.)"""
    return max(len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab())


def eos_token_ids(tokenizer, model_eos: tuple[int, ...]) -> tuple[int, ...]:
    """Where generation stops: the model config's eos ids and the tokenizer's eos token."""
    extra = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return tuple(dict.fromkeys(model_eos + extra))


class TokenTexts:
    """Each token's own text, `tokenizer.decode([id])` (how logprobs name tokens), remembered for
    the server's life (at most one string per vocabulary entry): the ids not seen before are decoded
    in one batched call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        new = list(dict.fromkeys(t for t in ids if t not in self.known))
        if new:
            self.known.update(zip(new, self.tokenizer.batch_decode([[t] for t in new])))
        return [self.known[t] for t in ids]


class IncrementalDetokenizer:
    """Token ids in, text out, a piece at a time, never a broken character.

    `push(ids)` returns the text that the new ids complete (possibly ""), `flush()` what is still
    held at the end. Each push decodes only a short window: the tokens since the last emitted
    boundary plus the previous step's tokens as context, whose text is subtracted (context keeps a
    tokenizer's leading-space rule right).
    """

    def __init__(self, tokenizer, prompt: list[int] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        context = list(prompt[-CONTEXT_TOKENS:])
        # a prompt that ends inside a character: no context
        if self._decode(context).endswith(REPLACEMENT):
            context = []
        self.ids = context
        self.start = 0  # the window's first token (context)
        self.done = len(context)  # tokens before this one have been emitted (or are context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.done == len(self.ids):
            return ""
        text = self._decode(self.ids[self.start :])
        if text.endswith(REPLACEMENT) and not final:  # the last character is not complete yet
            return ""
        context = self._decode(self.ids[self.start : self.done])
        self.start, self.done = self.done, len(self.ids)
        return text[len(context) :]
