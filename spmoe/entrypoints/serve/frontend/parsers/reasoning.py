"""`--reasoning-parser glm45`: GLM's thinking span, `<think>…</think>`, split off the generated text
into `reasoning_content`.

Where the output starts depends on the prompt. GLM-4.7 and later open the block in the prompt (the
assistant turn ends with `<think>`), so the output starts inside the reasoning and only its end tag
is generated; GLM-4.5 lets the model write `<think>` itself (after optional whitespace). With
thinking switched off (`chat_template_kwargs: {"enable_thinking": false}`, or `"thinking": false`)
the template closes the block in the prompt and everything generated is content.

The whitespace the model writes between `</think>` and its answer is dropped. A tag split over
chunks is held back until the chunk that completes it (or shows it is not one) arrives, so any split
of the text gives the same reasoning and content as the whole.
"""

from dataclasses import dataclass

from spmoe.entrypoints.serve.frontend.parsers.markers import partial_marker_length

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


def thinking_enabled(chat_template_kwargs: dict) -> bool:
    """Whether the request asks for thinking: `enable_thinking` (GLM's name) or `thinking`, default
    on."""
    value = chat_template_kwargs.get("enable_thinking", chat_template_kwargs.get("thinking", True))
    if not isinstance(value, bool):
        raise ValueError(
            f"chat_template_kwargs.enable_thinking must be true or false, got {value!r}"
        )
    return value


class Glm45ReasoningParser:
    """`feed(text)` -> the `ReasoningSplit` of the new text (what is certain so far); `flush()` ->
    what was held back, at the end of the generation."""

    OPENING, REASONING, CONTENT = "opening", "reasoning", "content"

    def __init__(self, prompt_text: str, thinking: bool = True):
        if not thinking:
            self.state = self.CONTENT
        elif prompt_text.rstrip().endswith(THINK_START):
            self.state = self.REASONING
        else:
            self.state = self.OPENING  # the model may open the block itself
        # text fed but not yet placed: the start of a tag, or whitespace before one
        self.pending = ""
        self.after_reasoning = False  # drop whitespace until the answer's first character

    def feed(self, text: str) -> ReasoningSplit:
        out = ReasoningSplit()
        text, self.pending = self.pending + text, ""
        while text:
            if self.state == self.OPENING:
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    self.state, text = self.REASONING, stripped[len(THINK_START) :]
                elif THINK_START.startswith(
                    stripped
                ):  # whitespace, or part of the tag: not known yet
                    self.pending = text
                    break
                else:
                    self.state = self.CONTENT
            elif self.state == self.REASONING:
                end = text.find(THINK_END)
                if end >= 0:
                    out.reasoning += text[:end]
                    text = text[end + len(THINK_END) :]
                    self.state, self.after_reasoning = self.CONTENT, True
                    continue
                keep = len(text) - partial_marker_length(text, (THINK_END,))
                out.reasoning += text[:keep]
                self.pending = text[keep:]
                break
            else:
                if self.after_reasoning:
                    text = text.lstrip()
                    self.after_reasoning = not text
                out.content += text
                break
        return out

    def flush(self) -> ReasoningSplit:
        pending, self.pending = self.pending, ""
        if self.state == self.REASONING:
            return ReasoningSplit(reasoning=pending)
        return ReasoningSplit(content=pending)
