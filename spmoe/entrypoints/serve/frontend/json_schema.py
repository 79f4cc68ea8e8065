"""A JSON schema as the grammar compiles it: `$ref`s resolved (`resolve_ref`), and `uniqueItems`
where it can be enforced.

xgrammar drops `uniqueItems`. An array whose items take a few known values (an enum's, a const's, or
true / false: a `set[Enum]` field) can still have it: the schema the front end sends the engine to
compile has each such array replaced by the `anyOf` of the arrays it may be, its values in their
order, each at most once (`with_unique_items`): the set, in that order. At most MAX_ARRAYS arrays; a
larger one, or one with any other keyword, stays unenforced. Everything else in the schema, its
order included, is as the client wrote it.
"""

import json
from itertools import combinations
from math import comb

MAX_ARRAYS = 64  # the arrays an `anyOf` may list: all subsets of 6 values, or more in short arrays
# the keywords an array whose `uniqueItems` is enforced may have
UNIQUE_ARRAY_KEYWORDS = frozenset(
    ("type", "items", "uniqueItems", "minItems", "maxItems", "title", "description", "default")
)
NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not schemas: never rewritten


def resolve_ref(root, ref) -> object | None:
    """A local `$ref` ("#", "#/$defs/Name", any JSON pointer into `root`) -> the schema it names,
    or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def unique_item_values(array: dict, root) -> tuple[list, int, int] | None:
    """(the values its items take, in order; its fewest and most items) for an `array` (a schema in
    `root`) whose `uniqueItems` can be enforced: `type` array, `items` an enum, a const or a boolean
    (after `$ref`s), no keyword but UNIQUE_ARRAY_KEYWORDS, and at most MAX_ARRAYS arrays; else
    None."""
    if array.get("uniqueItems") is not True or array.get("type") != "array":
        return None
    if not UNIQUE_ARRAY_KEYWORDS.issuperset(array):
        return None
    items, seen = array.get("items"), set()
    while isinstance(items, dict) and "$ref" in items and items["$ref"] not in seen:
        seen.add(items["$ref"])
        items = resolve_ref(root, items["$ref"])
    if not isinstance(items, dict):
        return None
    if "const" in items:
        values = [items["const"]]
    elif isinstance(items.get("enum"), list):
        values = items["enum"]
    elif items.get("type") == "boolean":
        values = [True, False]
    else:
        return None
    values = list({json.dumps(v, sort_keys=True): v for v in values}.values())
    low, high = array.get("minItems", 0), array.get("maxItems", len(values))
    if not (isinstance(low, int) and isinstance(high, int)):
        return None
    high = min(high, len(values))
    arrays = sum(comb(len(values), k) for k in range(low, high + 1))
    return (values, low, high) if 0 < arrays <= MAX_ARRAYS else None


def with_unique_items(schema):
    """A copy of `schema` in which every array whose `uniqueItems` `unique_item_values` enforces is
    the `anyOf` of its arrays: each choice of its values, in their order, within min / maxItems."""

    def rewritten(node):
        if isinstance(node, list):
            return [rewritten(inner) for inner in node]
        if not isinstance(node, dict):
            return node
        unique = unique_item_values(node, schema)
        if unique is not None:
            return _choices(*unique)
        return {k: v if k in NOT_SCHEMAS else rewritten(v) for k, v in node.items()}

    return rewritten(schema)


def _choices(values: list, low: int, high: int) -> dict:
    """The arrays of `low` to `high` of `values`, each in their order, as an `anyOf`."""
    arrays = [
        {"type": "array", "prefixItems": [{"const": v} for v in chosen], "items": False}
        for size in range(low, high + 1)
        for chosen in combinations(values, size)
    ]
    return {"anyOf": arrays}
