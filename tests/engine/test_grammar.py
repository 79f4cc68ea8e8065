"""Structured output's grammar layer: constrained sampling from random logits always gives a
schema-valid answer (checked with `jsonschema`), one batch mixing grammars and unconstrained rows;
xgrammar's bitmask kernel against the torch reference; compile errors and the cache."""

import json

import jsonschema
import pytest
import torch

from spmoe.engine.request import GrammarSpec
from spmoe.engine.sampling.grammar import (
    GrammarCompiler,
    SequenceGrammar,
    apply_bitmask,
    fill_bitmask,
)

VOCAB = 264  # the demo tokenizer: 256 bytes + 8 special tokens, "<|end|>" (256) the eos
SCHEMAS = [
    {  # flat, every property required
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
    },
    {  # nested objects, a pattern, a bounded array
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "profile": {
                        "type": "object",
                        "properties": {
                            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                            "tags": {
                                "type": "array",
                                "items": {"type": "string", "maxLength": 6},
                                "maxItems": 3,
                            },
                        },
                        "required": ["email", "tags"],
                    },
                },
                "required": ["id", "profile"],
            }
        },
        "required": ["user"],
    },
    {  # an array of objects with bounded numbers
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
            "required": ["x"],
        },
        "minItems": 1,
        "maxItems": 4,
    },
    {  # enums of strings and of numbers
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
    },
    {  # numbers with inclusive and exclusive bounds
        "type": "object",
        "properties": {
            "temp": {"type": "number", "minimum": -40.5, "maximum": 60},
            "count": {"type": "integer", "minimum": 10, "maximum": 99},
            "prob": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["temp", "count", "prob"],
    },
    {
        "anyOf": [
            {"type": "integer", "minimum": -5, "maximum": 5},
            {"type": "string", "maxLength": 5},
        ]
    },
    {  # arrays of arrays
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
        "maxItems": 3,
    },
    {  # optional properties, no others allowed
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 4},
            "b": {"type": "null"},
            "c": {"type": "boolean"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {  # const, an array of enums, an unbounded string
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "modes": {"type": "array", "items": {"enum": ["fast", "safe"]}, "maxItems": 4},
            "label": {"type": "string"},
        },
        "required": ["version", "modes", "label"],
    },
    {  # definitions and references
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
]


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """`apply_bitmask` in torch: the bits unpacked to a `[len(rows), V]` boolean mask."""
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.to(logits.device)[index]  # [r, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # [r, W * 32] -> [r, V]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def sample_batch(
    compiler, specs: list[GrammarSpec | None], seed: int, max_steps: int = 4000
) -> list[list[int]]:
    """Sample every row from random logits, the constrained rows under their grammar, all rows in
    one batch per step (a row without a grammar stops after 20 tokens) -> each row's tokens, its
    stop token excluded."""
    generator = torch.Generator().manual_seed(seed)
    grammars = [compiler.matcher(spec) if spec else None for spec in specs]
    outputs: list[list[int]] = [[] for _ in specs]
    running = list(range(len(specs)))
    for _ in range(max_steps):
        if not running:
            return outputs
        logits = torch.randn(len(running), VOCAB, generator=generator) * 2
        masks = fill_bitmask([grammars[i] for i in running], VOCAB)
        if masks is not None:
            apply_bitmask(logits, masks.bitmask, masks.rows)
        tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1).tolist()
        for i, token in zip(list(running), tokens):
            grammar = grammars[i]
            if grammar is None:
                outputs[i].append(token)
                done = len(outputs[i]) == 20
            else:
                assert grammar.accept(token), (
                    f"row {i}: the grammar refused token {token}, which its mask allowed"
                )
                done = grammar.finished
                if not done:
                    outputs[i].append(token)
            if done:
                running.remove(i)
    raise AssertionError(f"rows {running} did not finish in {max_steps} steps")


def test_constrained_sampling_is_schema_valid(compiler, tokenizer):
    """10 schemas x 5 samples and 2 unconstrained rows in one batch: every constrained answer parses
    and validates; the unconstrained rows are random bytes (most of them not JSON)."""
    specs = [GrammarSpec("json_schema", json.dumps(s)) for s in SCHEMAS for _ in range(5)] + [
        None,
        None,
    ]
    outputs = sample_batch(compiler, specs, seed=0)
    for spec, tokens in zip(specs, outputs):
        if spec is None:
            assert len(tokens) == 20
            continue
        text = tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), json.loads(spec.text))
    # sampled, not one fixed answer per schema
    assert len({tokenizer.decode(t) for t in outputs[:50]}) > 25


@pytest.mark.parametrize(
    "spec, check",
    [
        (GrammarSpec("json_object"), lambda text: isinstance(json.loads(text), dict)),
        (
            GrammarSpec("regex", r"[A-Z][a-z]{2,5}-\d{3}"),
            lambda text: __import__("re").fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", text),
        ),
        (
            GrammarSpec("choice", json.dumps(["yes", "no", "maybe so"])),
            lambda text: text in ("yes", "no", "maybe so"),
        ),
        (
            GrammarSpec("ebnf", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
            lambda text: text[0] == "(" and text[-1] == ")",
        ),
    ],
    ids=["json_object", "regex", "choice", "ebnf"],
)
def test_other_grammar_kinds(compiler, tokenizer, spec, check):
    for tokens in sample_batch(compiler, [spec] * 5, seed=1):
        assert check(tokenizer.decode(tokens)), tokenizer.decode(tokens)


def test_bitmask_kernel_matches_the_torch_reference():
    """Rows with a grammar are masked, the others untouched; V = 264 is not a multiple of 32."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=generator)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (5, (VOCAB + 31) // 32), dtype=torch.int32, generator=generator
    )
    rows = [0, 2, 3]
    fast, reference = logits.clone(), logits.clone()
    apply_bitmask(fast, bitmask, rows)
    apply_bitmask_reference(reference, bitmask, rows)
    assert torch.equal(fast, reference)
    assert torch.equal(fast[[1, 4]], logits[[1, 4]])
    for row in rows:  # bit t % 32 of word t // 32 says whether token t stays
        allowed = [bool((int(bitmask[row, t // 32]) >> (t % 32)) & 1) for t in range(VOCAB)]
        assert [bool(torch.isfinite(v)) for v in fast[row]] == allowed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bitmask_kernel_on_the_gpu():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 151552, generator=generator)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (64, 151552 // 32), dtype=torch.int32, generator=generator
    )
    rows = list(range(0, 64, 3))
    fast, reference = logits.cuda(), logits.clone()
    apply_bitmask(fast, bitmask, rows)
    apply_bitmask_reference(reference, bitmask, rows)
    assert torch.equal(fast.cpu(), reference)


def test_batched_fill_matches_one_at_a_time(compiler, tokenizer):
    """fill_bitmask (xgrammar's batch matcher, rows with and without a grammar, one not started yet)
    against SequenceGrammar.fill row by row, after each of several tokens."""
    specs = [GrammarSpec("json_schema", json.dumps(s)) for s in SCHEMAS[:4]]
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    grammars = [compiler.matcher(spec) for spec in specs] + [
        None,
        compiler.matcher(specs[0], start_after=end),
    ]
    texts = [
        '{"name": "ab',
        '{"user": {"id": 1',
        '[{"x": 0.5}',
        '{"color": "re',
        "",
        "no </think>{",
    ]
    for step in range(12):
        batched, rows, most_tokens = fill_bitmask(grammars, VOCAB)
        assert most_tokens == [1] * len(grammars)
        assert rows == [0, 1, 2, 3, 5]
        one = torch.full_like(batched, -1)
        for row in rows:
            grammars[row].fill(one, row)
        assert torch.equal(batched, one), step
        for grammar, text in zip(grammars, texts):
            if grammar is not None and step < len(text):
                assert grammar.accept(tokenizer.encode(text[step], add_special_tokens=False)[0])


def test_draft_rows_are_the_masks_after_committing_the_drafts(compiler, tokenizer):
    """With MTP drafts, row j of a sequence is the mask its grammar gives after committing its first
    j drafts (a fresh grammar walked over them, filled alone); rows past a draft the grammar
    refuses, or past its stop token, allow everything; the most tokens it can commit stop at its
    stop token; and every grammar is left where it was."""
    eos = tokenizer.eos_token_id
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    cases = [  # (spec, start_after, committed, drafts)
        (
            GrammarSpec("json_schema", json.dumps(SCHEMAS[0])),
            (),
            '{"na',
            ids('me": "'),
        ),  # all allowed
        (
            GrammarSpec("choice", '["yes", "no"]'),
            (),
            "",
            ids("yxe"),
        ),  # "x" refused: the rows after it are free
        (
            GrammarSpec("choice", '["ok"]'),
            (),
            "o",
            ids("k") + [eos] + ids("z"),
        ),  # it ends inside the drafts
        (None, (), "", ids("ab")),
        (
            GrammarSpec("choice", '["ok"]'),
            end,
            "</think",
            ids(">ok"),
        ),  # it starts inside the drafts
        (GrammarSpec("regex", "[0-9]+"), (), "1", []),  # no drafts
    ]
    grammars, drafts = [], []
    for spec, start_after, committed, fed in cases:
        grammar = compiler.matcher(spec, start_after) if spec else None
        for token in ids(committed):
            assert grammar.accept(token)
        grammars.append(grammar)
        drafts.append(fed)
    before = fill_bitmask(grammars, VOCAB)
    masks = fill_bitmask(grammars, VOCAB, drafts)
    assert masks.most_tokens == [7, 4, 2, 3, 4, 1]
    # the sequence without a grammar: rows 15-17
    assert masks.rows == list(range(15)) + list(range(18, 23))
    expected, first = torch.full_like(masks.bitmask, -1), 0
    for spec, start_after, committed, fed in cases:
        for j in range(1 + len(fed)):
            if spec is not None:
                walker = compiler.matcher(spec, start_after)
                walked = all(walker.accept(t) for t in ids(committed) + fed[:j])
                if walked and not walker.finished:
                    walker.fill(expected, first + j)
        first += 1 + len(fed)
    assert torch.equal(masks.bitmask, expected)
    assert (masks.bitmask[7:9] != -1).any(-1).all()  # "yes" or "no", then "es" after "y", ...
    # nothing allowed after "x"
    assert torch.equal(masks.bitmask[9:11], torch.full_like(masks.bitmask[9:11], -1))
    after = fill_bitmask(grammars, VOCAB)  # rewound: the same masks as before the drafts
    assert torch.equal(after.bitmask, before.bitmask) and after.rows == before.rows
    assert [g.active for g in grammars if g] == [True, True, True, False, True]
    assert grammars[2].accept(ids("k")[0]) and grammars[2].accept(eos) and grammars[2].finished


def test_grammar_starts_after_the_reasoning(compiler, tokenizer):
    """With `start_after` the tokens of "</think>", anything goes until they are generated; then the
    grammar."""
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    grammar = compiler.matcher(GrammarSpec("choice", '["ok"]'), start_after=end)
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for token in tokenizer.encode("free </think", add_special_tokens=False):
        grammar.fill(bitmask, 0)
        assert (bitmask == -1).all() and grammar.accept(token)
    assert grammar.accept(end[-1])
    grammar.fill(bitmask, 0)
    allowed = [t for t in range(VOCAB) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == tokenizer.encode("o", add_special_tokens=False)
    assert not grammar.accept(tokenizer.encode("x", add_special_tokens=False)[0])


def test_compile_errors_and_cache(compiler):
    for spec, message in [
        (
            GrammarSpec("json_schema", '{"type": "foo"}'),
            'the json_schema grammar does not compile: Unsupported type "foo"',
        ),
        (
            GrammarSpec("json_schema", '{"type": '),
            "the json_schema grammar does not compile: Expecting value",
        ),
        (GrammarSpec("regex", "(ab"), "the regex grammar does not compile: Regex parsing error"),
        (GrammarSpec("ebnf", "root ::= ("), "the ebnf grammar does not compile: EBNF parser error"),
        (
            GrammarSpec("choice", "[]"),
            "the choice grammar does not compile: a choice must be a non-empty list",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
            compiler.compile(spec)
    with pytest.raises(
        ValueError,
        match="the xml grammar does not compile: expected a kind of json_schema, json_object",
    ):
        compiler.compile(GrammarSpec("xml", ""))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    assert compiler.compile(spec) is compiler.compile(
        GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    )


def test_the_cache_keeps_the_most_recently_used_grammars(tokenizer):
    """Every client's schema may be new: the compiler keeps `cache_size` grammars, not one per
    schema ever seen, and drops the least recently used; a dropped one compiles again and still
    works."""

    compiler = GrammarCompiler(lambda: tokenizer, VOCAB, cache_size=3)
    specs = [GrammarSpec("json_schema", json.dumps({"enum": [f"word{i}"]})) for i in range(5)]
    first = [compiler.compile(spec) for spec in specs[:3]]
    assert compiler.compile(specs[0]) is first[0]
    compiler.compile(specs[3])
    compiler.compile(specs[4])
    assert list(compiler.cache) == [specs[0], specs[3], specs[4]]
    again = compiler.compile(specs[1])
    assert again is not first[1] and len(compiler.cache) == 3
    walk = tokenizer.encode('"word1"', add_special_tokens=False)
    grammar = SequenceGrammar(again)
    assert all(grammar.accept(t) for t in walk) and grammar.accept(256) and grammar.finished
    other = SequenceGrammar(again)
    assert not all(other.accept(t) for t in tokenizer.encode('"word2"', add_special_tokens=False))


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 12}])
def test_json_strings_hold_characters_only(compiler, schema):
    """No raw control character and no surrogate's UTF-8 bytes (no character: it decodes to U+FFFD)
    inside a JSON string, bounded or not; real characters of 1 to 4 bytes are fine. (xgrammar 0.2.9
    alone lets both through in a bounded string and the surrogates in any.)"""
    spec = GrammarSpec("json_schema", json.dumps(schema))

    def accepts(body: bytes) -> bool:
        grammar = compiler.matcher(spec)
        return all(grammar.accept(t) for t in b'"' + body + b'"') and grammar.matcher.is_completed()

    assert accepts("aé€🙂\u0096".encode())
    assert not accepts(b"a\x04") and not accepts(b"\x1f")
    # U+D800, a surrogate; U+D7FF, a character
    assert not accepts(b"\xed\xa0\x80") and accepts(b"\xed\x9f\xbf")


def test_the_engine_and_the_server_run_without_xgrammar():
    """A GPU image may lack xgrammar: everything imports, a step without grammars runs the mask
    path, and only a grammar asks for the package, in a one-line error."""
    import subprocess
    import sys

    code = """
import builtins
real = builtins.__import__
def without_xgrammar(name, *args, **kwargs):
    if name.split(".")[0] == "xgrammar":
        raise ImportError("no xgrammar here")
    return real(name, *args, **kwargs)
builtins.__import__ = without_xgrammar
import spmoe.engine.engine, spmoe.entrypoints.serve.frontend.app
from spmoe.engine.request import GrammarSpec
from spmoe.engine.sampling.grammar import GrammarCompiler, fill_bitmask
assert fill_bitmask([None, None], 264) is None
try:
    GrammarCompiler(lambda: None, 264).compile(GrammarSpec("json_object"))
except ValueError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "the json_object grammar does not compile: structured output needs the xgrammar package (pip install xgrammar)"
    )
