"""Structured output: a grammar a sequence's tokens must follow, compiled with xgrammar; a matcher
per sequence that walks the grammar with each committed token; and the token bitmask that sets every
token the grammar does not allow next to -inf in the logits before sampling.

A `GrammarSpec` is plain text (a kind and its text), so rank 0 sends it with the request and every
rank compiles the same grammar from its own cache: the masks, and so the sampled tokens, are the
same on every rank. Compiling takes milliseconds to seconds (a large schema); the server's engine
loop compiles a request's grammar on a worker thread before the request joins a step
(`grammar_text.py` and `tool_call_grammar.py` write a spec's text as xgrammar takes it).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from spmoe.engine.request import GRAMMAR_KINDS, GrammarSpec
from spmoe.engine.sampling.grammar_text import (
    choice_ebnf,
    compile_error_reason,
    json_schema_grammar,
    xgrammar,
)
from spmoe.engine.sampling.tool_call_grammar import ToolParametersError, tool_calls_ebnf

if TYPE_CHECKING:
    import xgrammar as xgr

# compiled grammars kept, the most recently used: each client's schema is a new one, and each kept
# grammar holds memory (about 0.2 MiB for a small schema over GLM-5.2's vocabulary)
GRAMMAR_CACHE_SIZE = 128


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer: the `cache_size` most recently used are kept,
    keyed by the spec (an older one is compiled again when it comes back). Thread-safe (the server
    compiles in worker threads). The tokenizer's vocabulary is read at the first compile, through
    `load_tokenizer()` (reading a large one takes about a second: a server that never gets a grammar
    never pays it, and a checkpoint without a tokenizer serves everything else)."""

    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ):
        """`load_tokenizer`: -> a transformers tokenizer; `vocab_size`: the model's (the LM head's
        rows, which may pad the tokenizer's vocabulary)."""
        self.load_tokenizer, self.vocab_size = load_tokenizer, vocab_size
        self.compiler: xgr.GrammarCompiler | None = None
        self.cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> GrammarCompiler:
        return cls(lambda: tokenizer, vocab_size)

    def _xgrammar(self) -> xgr.GrammarCompiler:
        xgr = xgrammar()
        with self.lock:
            if self.compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.load_tokenizer(), vocab_size=self.vocab_size
                )
                # cached here, by spec
                self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self.compiler

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """-> the compiled grammar; ValueError naming the kind and what is wrong when it does not
        compile."""
        with self.lock:
            compiled = self.cache.get(spec)
            if compiled is not None:
                self.cache.move_to_end(spec)
                return compiled
        try:
            compiled = self._compile(spec)
        except ToolParametersError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(
                f"the {spec.kind} grammar does not compile: {compile_error_reason(e)}"[:400]
            ) from None
        with self.lock:
            compiled = self.cache.setdefault(spec, compiled)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind not in GRAMMAR_KINDS:
            raise ValueError(f"expected a kind of {', '.join(GRAMMAR_KINDS)}")
        compiler = self._xgrammar()
        if spec.kind == "json_schema":
            json.loads(spec.text)  # a ValueError that says where the JSON is broken
            return compiler.compile_grammar(json_schema_grammar(spec.text))
        if spec.kind == "json_object":
            return compiler.compile_grammar(json_schema_grammar('{"type": "object"}'))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.text)))
        if spec.kind == "tool_calls":
            return compiler.compile_grammar(tool_calls_ebnf(spec.text))
        return compiler.compile_grammar(spec.text)

    def matcher(self, spec: GrammarSpec, start_after: tuple[int, ...] = ()) -> SequenceGrammar:
        return SequenceGrammar(self.compile(spec), start_after)


class SequenceGrammar:
    """One sequence's position in its grammar. With `start_after` (token ids, e.g. those of
    `</think>`), the grammar applies only once the sequence has generated them: the reasoning before
    is free."""

    def __init__(self, compiled: xgr.CompiledGrammar, start_after: tuple[int, ...] = ()):
        self.matcher = xgrammar().GrammarMatcher(compiled)
        self.start_after = list(start_after)
        self.recent: list[int] = []  # the last generated tokens, while waiting for `start_after`
        self.active = not start_after
        self.matched = 0  # tokens the matcher has taken (what `rewind` rolls it back by)

    def accept(self, token: int) -> bool:
        """Advance by a token; False if the grammar does not allow it (the matcher does not
        move)."""
        if self.active:
            taken = self.matcher.accept_token(token)
            self.matched += taken
            return taken
        self.recent = (self.recent + [token])[-len(self.start_after) :]
        self.active = self.recent == self.start_after
        return True

    def position(self) -> tuple[int, list[int], bool]:
        """Where it stands now, for `rewind`: walking over drafts is undone once their rows are
        masked."""
        return self.matched, self.recent, self.active

    def rewind(self, position: tuple[int, list[int], bool]) -> None:
        """Back to a `position` taken before: the matcher rolls back the tokens it took since."""
        matched, self.recent, self.active = position
        self.matcher.rollback(self.matched - matched)
        self.matched = matched

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (`[W]` int32, bit t % 32 of word t //
        32 for token t; all allowed while the grammar has not started). One sequence at a time: the
        reference that `fill_bitmask`'s batched fill is tested against."""
        if self.active:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)

    @property
    def finished(self) -> bool:
        """The grammar has accepted a stop token: the sequence must end."""
        return self.matcher.is_terminated()


class GrammarMasks(NamedTuple):
    """What `fill_bitmask` gives for a step: `bitmask` `[R, ceil(V / 32)]` int32 on the CPU (R:
    every logits row of the step), `rows`: the rows that have a grammar, and per sequence
    `most_tokens`: the most tokens it can commit this step (1 + its drafts, or fewer when its
    grammar takes its stop token among the drafts: it ends there)."""

    bitmask: torch.Tensor
    rows: list[int]
    most_tokens: list[int]


def fill_bitmask(
    grammars: list[SequenceGrammar | None], vocab_size: int, drafts: list[list[int]] | None = None
) -> GrammarMasks | None:
    """The step's committing sequences (None: no grammar) and the MTP drafts each fed (None: no
    drafts) -> their masks, or None when no sequence has a grammar. Sequence i has 1 +
    len(drafts[i]) rows, one after another.

    Row j of sequence i holds what its grammar allows after its first j drafts: the mask it would
    get without speculation once it had committed them. The grammars walk over the drafts, one draft
    position at a time, and the rows of each position are filled together by xgrammar's batch
    matcher (its threads): k + 1 batched fills for k drafts. Then every grammar is rewound to where
    it was: the tokens the step commits advance it (`Sequence.commit`). A sequence stops walking at
    a draft its grammar refuses, or once its grammar has taken its stop token; its later rows allow
    every token and are never committed from (the row before a refused draft masks that draft, so
    the target's choice there rejects it; after the stop token it ends). Rows whose grammar has not
    started allow every token."""
    drafts = drafts if drafts is not None else [[] for _ in grammars]
    if all(g is None for g in grammars):
        return None
    firsts = [0]
    for fed in drafts:
        firsts.append(firsts[-1] + 1 + len(fed))
    # every bit set: every token allowed
    bitmask = xgrammar().allocate_token_bitmask(firsts[-1], vocab_size)
    walking = [i for i, g in enumerate(grammars) if g is not None]
    rows = [firsts[i] + j for i in walking for j in range(1 + len(drafts[i]))]
    most_tokens = [1 + len(fed) for fed in drafts]
    before = {i: grammars[i].position() for i in walking if drafts[i]}
    for j in range(1 + max(len(drafts[i]) for i in walking)):
        started = [i for i in walking if grammars[i].active]
        if started:
            indices = [firsts[i] + j for i in started]
            _batch_matcher().batch_fill_next_token_bitmask(
                [grammars[i].matcher for i in started], bitmask, indices
            )
        walking = [i for i in walking if j < len(drafts[i]) and grammars[i].accept(drafts[i][j])]
        for i in walking:
            # its draft j + 1 is the stop token: nothing after it is committed
            if grammars[i].finished:
                most_tokens[i] = j + 1
        walking = [i for i in walking if not grammars[i].finished]
    for i, position in before.items():
        grammars[i].rewind(position)
    return GrammarMasks(bitmask, rows, most_tokens)


def mask_allowed(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
    """logits `[S, V]`, one row per sequence -> in place, -inf at the tokens each row's grammar does
    not allow next (one batched fill and apply; rows without a grammar, or whose grammar has not
    started, untouched)."""
    started = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not started:
        return
    bitmask = xgrammar().allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    _batch_matcher().batch_fill_next_token_bitmask(
        [grammars[i].matcher for i in started], bitmask, started
    )
    apply_bitmask(logits, bitmask, started)


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgrammar().BatchGrammarMatcher()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits `[m, V]` (any device; float32 on the CPU) -> in place, -inf wherever `bitmask` `[m,
    ceil(V / 32)]` has a 0 bit, in `rows` only (the other rows have no grammar and are left as they
    are). xgrammar's kernels: Triton on a GPU (compiled at its first call), C++ on the CPU."""
    xgrammar().apply_token_bitmask_inplace(
        logits,
        bitmask.to(logits.device, non_blocking=True),
        vocab_size=logits.shape[-1],
        indices=rows,
    )
