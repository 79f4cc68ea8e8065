"""One keyword policy for every JSON schema that becomes a grammar: `response_format`, the Responses
API's `text.format`, `guided_json`, `structured_outputs.json` and the tools' parameters.

- The grammar enforces what xgrammar can; `unenforced` names every keyword it would leave
  unenforced, with its JSON path.
- Under `strict: true` (a json_schema's or a tool's), such a keyword is a ValueError (a 400) naming
  it and its path (`checked`).
- Without it, as vLLM does, the schema is accepted and enforced as far as the grammar goes; the
  keywords left unenforced go back with the grammar (`OutputGrammar.unenforced`) for the server's
  log and metric.

How xgrammar 0.2.9 reads a schema node, found by experiment
(tests/entrypoints/serve/frontend/test_schema_policy.py checks every rule with a value that breaks
the keyword, refused where enforced, accepted where not):
- The first of `$ref`, `const`, `enum`, `anyOf`, `oneOf`, `allOf` present decides the node; its
  other validation keywords are dropped. A `type` beside them holds when every value they allow has
  that type.
- `oneOf` is read as `anyOf`: exact when no branch's values can match another branch (their types or
  constant values differ, as a discriminated union's tags do, or a branch requires a property the
  other cannot write). `allOf` with more than one schema allows any value.
- Otherwise the node's `type` says which keywords apply; without one, `properties`,
  `additionalProperties` or `unevaluatedProperties` make it an object and `items`, `prefixItems` or
  `unevaluatedItems` an array, and with neither every type's keywords are dropped.
- Strings: `pattern`, `minLength`, `maxLength` and a `format` of FORMATS; a known `format` drops the
  `pattern` and lengths beside it (an unknown one is dropped itself). Numbers: the bounds;
  `multipleOf` on integers only. Arrays: `items`, `prefixItems`, `minItems`, `maxItems`,
  `unevaluatedItems`; not `contains`, `minContains`, `maxContains`, nor `uniqueItems` but where
  spmoe's rewrite enforces it (json_schema.py: a set of an enum's values). Objects: `properties`,
  `required`, `additionalProperties`, `patternProperties`, `propertyNames`, `minProperties`,
  `maxProperties`, `unevaluatedProperties`; not `dependentRequired`, `dependentSchemas`,
  `dependencies`.
- Never: `not`, `if` / `then` / `else`, `$dynamicRef`, `$recursiveRef`, OpenAPI's `nullable`, or any
  keyword not named here. Annotations (ANNOTATIONS, `discriminator` among them) constrain nothing.
"""

import json
from dataclasses import dataclass

from spmoe.engine.request import GrammarSpec
from spmoe.entrypoints.serve.frontend.json_schema import resolve_ref, unique_item_values

ANNOTATIONS = frozenset(
    (
        *("title", "description", "default", "examples", "example", "deprecated", "readOnly"),
        *("writeOnly", "$schema", "$id", "$anchor", "$comment", "$vocabulary", "discriminator"),
        *("contentMediaType", "contentEncoding", "contentSchema"),
    )
)
DEFINITIONS = ("$defs", "definitions")  # schemas a `$ref` may name; read through the `$ref`
# the keywords that decide a node, in the order xgrammar reads them
KINDS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# per type: (the keywords the grammar enforces, those it drops)
TYPE_KEYWORDS = {
    "string": (("minLength", "maxLength", "pattern", "format"), ()),
    "integer": (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), ()),
    "number": (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), ("multipleOf",)),
    "array": (
        ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"),
        ("uniqueItems", "contains", "minContains", "maxContains"),
    ),
    "object": (
        (
            *("properties", "required", "additionalProperties", "patternProperties"),
            *("propertyNames", "minProperties", "maxProperties", "unevaluatedProperties"),
        ),
        ("dependentRequired", "dependentSchemas", "dependencies"),
    ),
}
NEVER = ("not", "if", "then", "else", "$dynamicRef", "$recursiveRef", "nullable")
# a schema without `type` is taken for an object / an array when it has one of these
INFERRED = {
    "object": ("properties", "additionalProperties", "unevaluatedProperties"),
    "array": ("items", "prefixItems", "unevaluatedItems"),
}
ALL_TYPES = frozenset(("string", "integer", "number", "boolean", "null", "array", "object"))
FORMATS = frozenset(
    (
        *("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri"),
        *("uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid"),
    )
)
# every keyword a metric may name (any other is counted as "other")
KNOWN_KEYWORDS = frozenset(
    (*KINDS, *NEVER, *(k for kept, dropped in TYPE_KEYWORDS.values() for k in kept + dropped))
)


@dataclass(frozen=True)
class Unenforced:
    """A keyword the grammar does not enforce: `path`, where it is (`properties.tags`), and why
    (empty when the keyword is never enforced)."""

    keyword: str
    path: str
    why: str = ""

    def __str__(self) -> str:
        return f"'{self.keyword}' at {self.path}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class OutputGrammar:
    """The grammar a request's output follows, and the schema keywords it leaves unenforced."""

    spec: GrammarSpec
    unenforced: tuple[Unenforced, ...] = ()


def checked(schema, where: str, strict: bool) -> tuple[Unenforced, ...]:
    """The keywords of `schema` (at `where` in the request) left unenforced; under `strict`, a
    ValueError naming them instead."""
    found = tuple(unenforced(schema, where))
    if strict and found:
        raise ValueError(
            "strict: true refuses a schema keyword the grammar cannot enforce: "
            f"{'; '.join(map(str, found))}. Remove it, or send strict: false to have it accepted "
            "unenforced (docs/glm-chat.md lists what is enforced)"
        )
    return found


def unenforced(schema, where: str = "schema") -> list[Unenforced]:
    """Every keyword of `schema` the grammar leaves unenforced, at `where` and below (the schemas a
    `$ref` names: where they are defined)."""
    return _Walk(schema, where).node(schema, where)


def value_type(value) -> str:
    """A JSON value's type, as a schema's `type` names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    names = {float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), "object")


def _covered(types: frozenset, by: frozenset) -> bool:
    """Every value of `types` has a type of `by` (an integer is a number)."""
    return all(t in by or (t == "integer" and "number" in by) for t in types)


class _Walk:
    """One walk over a schema; `$ref`s resolved against its root, each followed once."""

    def __init__(self, root, where: str):
        self.root, self.where, self.followed = root, where, set()

    def resolve(self, ref) -> tuple[object, str] | None:
        """A local `$ref` -> (the schema, its path); None for one that names nothing here (its
        compile error says so)."""
        target = resolve_ref(self.root, ref)
        return None if target is None else (target, self.where + ref[1:].replace("/", "."))

    def node(self, schema, path: str, untyped: frozenset = ALL_TYPES) -> list[Unenforced]:
        """`untyped`: the types of a schema without `type` here (a property name's: a string)."""
        if not isinstance(schema, dict):
            return []
        if "type" in schema:
            _check_type(schema["type"], path)
        kind = next((k for k in KINDS if k in schema), None)
        if kind is not None:
            return self.decided(schema, path, kind)
        found = []
        types = self.own_types(schema) if "type" in schema else untyped & self.own_types(schema)
        for key in schema:
            if key in ANNOTATIONS or key in DEFINITIONS or key == "type":
                continue
            if _type_of(key) is None:
                found.append(Unenforced(key, path))
            elif (why := self.type_keyword(schema, key, types)) is not None:
                found.append(Unenforced(key, path, why))
        return found + self.below(schema, path, types)

    def decided(self, schema, path: str, kind: str) -> list[Unenforced]:
        """A node decided by `kind` (KINDS): the other validation keywords are dropped."""
        found, value = [], schema[kind]
        for key in schema:
            if key == kind or key in ANNOTATIONS or key in DEFINITIONS:
                continue
            if key == "type" and _covered(self.types(schema), _declared(schema["type"])):
                continue
            found.append(Unenforced(key, path, f"beside '{kind}'"))
        if kind == "$ref":
            if value not in self.followed and (target := self.resolve(value)) is not None:
                self.followed.add(value)
                found += self.node(*target)
        elif kind in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
            if kind == "allOf" and len(value) > 1:
                return found + [Unenforced(kind, path, f"with {len(value)} schemas")]
            for i, branch in enumerate(value):
                found += self.node(branch, f"{path}.{kind}[{i}]")
            if kind == "oneOf":
                found += self.one_of(value, path)
        return found

    def one_of(self, branches: list, path: str) -> list[Unenforced]:
        for i, a in enumerate(branches):
            for j, b in enumerate(branches):
                if i != j and not self.excludes(a, b):
                    why = f"a value of branch {i} may also match branch {j}"
                    return [Unenforced("oneOf", path, why)]
        return []

    def below(self, schema: dict, path: str, types: frozenset) -> list[Unenforced]:
        """The keywords unenforced in the schemas inside a node that allows `types`: its values'
        schemas if it allows objects, its items' if it allows arrays."""
        found = []
        if "object" in types:
            for key in ("properties", "patternProperties"):
                for name, inner in (schema.get(key) or {}).items():
                    found += self.node(inner, f"{path}.{key}.{name}")
            for key in ("additionalProperties", "unevaluatedProperties"):
                found += self.node(schema.get(key), f"{path}.{key}")
            strings = frozenset(("string",))
            found += self.node(schema.get("propertyNames"), f"{path}.propertyNames", strings)
        if "array" in types:
            for key in ("items", "unevaluatedItems"):
                found += self.node(schema.get(key), f"{path}.{key}")
            for i, inner in enumerate(schema.get("prefixItems") or ()):
                found += self.node(inner, f"{path}.prefixItems[{i}]")
        return found

    def type_keyword(self, schema: dict, key: str, types: frozenset) -> str | None:
        """Why a type's keyword `key` is not enforced here, or None (enforced, not a type's keyword,
        or of a type the node does not allow)."""
        of_type = _type_of(key)
        if of_type is None or not (of_type & types):
            return None
        if types == ALL_TYPES:
            return "without a 'type'"
        known_format = schema.get("format") in FORMATS
        if key == "format" and not known_format:
            return f"the format {schema['format']!r} is not one the grammar knows"
        if key in ("pattern", "minLength", "maxLength") and known_format:
            return "beside 'format'"
        if key in ("minLength", "maxLength") and "pattern" in schema:
            return "beside 'pattern'"
        if key == "uniqueItems" and (
            schema[key] is False or unique_item_values(schema, self.root) is not None
        ):
            return None
        if not any(key in TYPE_KEYWORDS[t][1] for t in of_type & types):
            return None
        return "enforced on integers only" if key == "multipleOf" else ""

    def own_types(self, schema: dict) -> frozenset:
        """The types a node without KINDS keywords allows, as xgrammar reads it."""
        if "type" in schema:
            return _declared(schema["type"])
        inferred = [t for t, keys in INFERRED.items() if any(k in schema for k in keys)]
        return frozenset(inferred) if inferred else ALL_TYPES

    def types(self, schema, seen: frozenset = frozenset()) -> frozenset:
        """The types of the values the grammar of `schema` allows."""
        if not isinstance(schema, dict):
            return ALL_TYPES if schema is not False else frozenset()
        if "$ref" in schema:
            target = self.resolve(schema["$ref"]) if schema["$ref"] not in seen else None
            return self.types(target[0], seen | {schema["$ref"]}) if target else ALL_TYPES
        if "const" in schema:
            return frozenset((value_type(schema["const"]),))
        if "enum" in schema and isinstance(schema["enum"], list):
            return frozenset(map(value_type, schema["enum"]))
        for kind in ("anyOf", "oneOf", "allOf"):
            if isinstance(schema.get(kind), list):
                if kind == "allOf" and len(schema[kind]) != 1:
                    return ALL_TYPES
                return frozenset().union(*(self.types(b, seen) for b in schema[kind]))
        return self.own_types(schema)

    def values(self, schema) -> list | None:
        """The values a `const` / `enum` node allows (after `$ref`s), or None for any other."""
        schema = self.dereferenced(schema)
        if "const" in schema:
            return [schema["const"]]
        enum = schema.get("enum")
        return enum if isinstance(enum, list) else None

    def dereferenced(self, schema) -> dict:
        seen = set()
        while isinstance(schema, dict) and "$ref" in schema and schema["$ref"] not in seen:
            seen.add(schema["$ref"])
            target = self.resolve(schema["$ref"])
            if target is None:
                return {}
            schema = target[0]
        return schema if isinstance(schema, dict) else {}

    def excludes(self, a, b) -> bool:
        """No value the grammar of branch `a` writes is valid under branch `b`."""
        types_a, types_b = self.types(a), self.types(b)
        if not _overlap(types_a, types_b):
            return True
        values_a, values_b = self.values(a), self.values(b)
        if values_a is not None and values_b is not None:
            canonical = {json.dumps(v, sort_keys=True) for v in values_b}
            return not any(json.dumps(v, sort_keys=True) in canonical for v in values_a)
        a, b = self.dereferenced(a), self.dereferenced(b)
        if types_a != {"object"} or types_b != {"object"}:
            return False
        properties_a, properties_b = a.get("properties") or {}, b.get("properties") or {}
        required_a, required_b = set(a.get("required") or ()), set(b.get("required") or ())
        for name in required_a & required_b:
            if name in properties_a and name in properties_b:
                pa, pb = properties_a[name], properties_b[name]
                if self.excludes(pa, pb) and self.excludes(pb, pa):
                    return True
        open_a = any(a.get(k) not in (None, False) for k in INFERRED["object"][1:])
        open_a = open_a or bool(a.get("patternProperties"))
        return not open_a and any(name not in properties_a for name in required_b)


def _overlap(a: frozenset, b: frozenset) -> bool:
    """Some value has a type of `a` and one of `b` (an integer is a number)."""
    return bool(a & b) or any(_covered(frozenset((t,)), b) for t in a)


def _type_of(key: str) -> frozenset | None:
    """The types whose keyword `key` is, or None for a keyword of no type."""
    types = frozenset(t for t, (kept, dropped) in TYPE_KEYWORDS.items() if key in kept + dropped)
    return types or None


def _check_type(value, path: str) -> None:
    """A ValueError naming `path` unless a `type` keyword's value is a JSON type's name or a list of
    them: what the front end checks of a schema's syntax before the engine compiles it, so that such
    a request is a 400 whatever the queue holds."""
    names = value if isinstance(value, list) else [value]
    bad = next((name for name in names if name not in ALL_TYPES), None) if names else value
    if bad is not None:
        raise ValueError(
            f"{path}.type: expected one of {', '.join(sorted(ALL_TYPES))} (or a list of them), "
            f"got {bad!r}"[:300]
        )


def _declared(value) -> frozenset:
    """A `type` keyword's value -> the types it names."""
    return frozenset(value if isinstance(value, list) else (value,))
