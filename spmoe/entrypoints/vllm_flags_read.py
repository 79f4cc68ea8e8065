"""The options of `vllm serve` read from a vLLM release's wheel, statically: its Python files are
parsed with `ast` straight from the zip; no vLLM code runs and nothing of vLLM is installed.

    pip download --no-deps vllm==0.6.0 -d wheels
    python -m spmoe.entrypoints.vllm_flags_read wheels/vllm-0.6.0-*.whl > rows-0.6.0.txt
    rm wheels/vllm-0.6.0-*.whl
    ... (one wheel at a time, for each release)
    python -m spmoe.entrypoints.vllm_flags_read rows-*.txt   # OPTIONS of vllm_flags_before_0_34

Given a wheel it prints the release's options, one a line, as `vllm_flags_0_34.OPTIONS` holds them:
the names (long, short, then the forms `--help` hides) and the arity. Given the rows of several
releases it prints their union less what the pinned release (`vllm_flags_0_34`) has, with the first
and last release each was read in: `vllm_flags_before_0_34.OPTIONS`.

What is read: the `serve` subcommand's own `add_argument` calls (`vllm/scripts.py`,
`vllm/entrypoints/cli/serve.py`), then `make_arg_parser` of the server's CLI module, following its
`X.add_cli_args(parser)` calls into the front end's and the engine's argument classes. A flag that
vLLM builds from a config dataclass's field (`**get_kwargs(Config)["field"]`, or a loop over
`get_kwargs(cls)`) gets the arity vLLM's `get_kwargs` gives the field's type: bool a switch with
its `--no-` form (and `--enable-x` paired with `--disable-x` where the release pairs them), a list,
tuple or set `values`, a dict or (later releases) a config dataclass `json`, `bool | str | None`
(later releases) an optional value, anything else one value; the keyword overrides the parser
makes (`kwargs["f"]["type"] = json.loads`, `del kwargs["f"]["nargs"]`) apply. Read from vLLM
0.34.0's wheel this gives `vllm_flags_0_34.OPTIONS` exactly, which that file records from vLLM's
own parser.
"""

import ast
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# the module with `make_arg_parser`, newest layout first
SERVER_MODULES = (
    "vllm/entrypoints/common/cli_args.py",
    "vllm/entrypoints/launchers/cli_args.py",
    "vllm/entrypoints/openai/cli_args.py",
)
SUBCOMMAND_MODULES = ("vllm/entrypoints/cli/serve.py", "vllm/scripts.py")
ENGINE_MODULE = "vllm/engine/arg_utils.py"
SWITCH_ACTIONS = ("store_true", "store_false", "store_const", "count", "help", "version")
# a type's name -> the kind get_kwargs tells apart
KINDS = {
    "bool": "bool",
    "str": "str",
    "int": "int",
    "float": "float",
    "dict": "dict",
    "Dict": "dict",
    "Mapping": "dict",
    "list": "list",
    "List": "list",
    "Sequence": "list",
    "tuple": "tuple",
    "Tuple": "tuple",
    "set": "set",
    "Set": "set",
    "Literal": "Literal",
}
UNIONS = ("Optional", "Union")
WRAPPERS = ("Annotated", "SkipValidation")  # X[T, ...] is T to argparse
Row = tuple[tuple[str, ...], str]  # an option's names and arity


def _name(node: ast.AST) -> str:
    """The last name of `a.b.c`, `c` or `c[...]`; "" for anything else."""
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


@dataclass
class Source:
    """A release's Python files in its wheel, parsed on first use, by path in the wheel."""

    wheel: zipfile.ZipFile
    trees: dict[str, ast.Module | None] = field(default_factory=dict)

    def has(self, path: str) -> bool:
        return path in self.wheel.NameToInfo

    def text(self, path: str) -> str:
        return self.wheel.read(path).decode()

    def tree(self, path: str) -> ast.Module | None:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.text(path)) if self.has(path) else None
        return self.trees[path]

    def module_path(self, module: str, importer: str, level: int) -> str | None:
        """The file of `module` as `importer` imports it (`level` dots: relative)."""
        parts = importer.split("/")[:-level] if level else []
        parts += module.split(".") if module else []
        stem = "/".join(parts)
        return next((p for p in (stem + ".py", stem + "/__init__.py") if self.has(p)), None)

    def definition(self, name: str, path: str, seen=None) -> tuple[ast.AST, str] | None:
        """The class, or the value of the module-level assignment, that `name` means in module
        `path` (its imports followed), with the module it is in."""
        seen = set() if seen is None else seen
        tree = self.tree(path)
        if tree is None or not name or (name, path) in seen:
            return None
        seen.add((name, path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node, path
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node.value, path
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    module = self.module_path(node.module or "", path, node.level)
                    found = module and self.definition(alias.name, module, seen)
                    if found:
                        return found
        return None

    def cls(self, name: str, path: str) -> tuple[ast.ClassDef, str] | None:
        found = self.definition(name, path)
        return found if found and isinstance(found[0], ast.ClassDef) else None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    """Decorated `@dataclass`, pydantic's `@dataclass(...)` or vLLM's `@config`."""
    return any(
        _name(d.func if isinstance(d, ast.Call) else d) in ("dataclass", "config")
        for d in cls.decorator_list
    )


def type_kinds(node: ast.AST, src: Source, path: str, depth: int = 0) -> set[str]:
    """The kinds a type annotation in module `path` is a union of: a value of KINDS, dataclass,
    None, or other (what vLLM reads as a string: an enum, a class, Any)."""
    again = lambda n, p=path: type_kinds(n, src, p, depth + 1) if depth < 20 else {"other"}
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):  # a forward reference
            return again(ast.parse(node.value, mode="eval").body)
        return {"None"} if node.value is None else {"other"}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return again(node.left) | again(node.right)
    if isinstance(node, ast.Subscript):
        head = _name(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head in UNIONS:
            kinds = set().union(*map(again, items))
            return kinds | {"None"} if head == "Optional" else kinds
        return again(items[0]) if head in WRAPPERS else {KINDS.get(head, "other")}
    name = _name(node)
    if name in KINDS or name == "None":
        return {KINDS.get(name, "None")}
    found = src.definition(name, path)
    if found is None:
        return {"other"}
    definition, where = found
    if isinstance(definition, ast.ClassDef):
        if _is_dataclass(definition):
            return {"dataclass"}
        return {"dict"} if {"dict", "Dict"} & set(map(_name, definition.bases)) else {"other"}
    if isinstance(definition, ast.Call):  # TypeVar, NewType, ...
        return {"other"}
    return again(definition, where)


@dataclass(frozen=True)
class Rules:
    """How the release turns a field's type into argparse keywords (vLLM's rules moved)."""

    dataclass_is_json: bool  # a config dataclass is a JSON value
    bool_or_str_is_optional: bool  # `bool | str | None` is an optional value
    enable_disable: bool  # a switch `--enable-x` is also `--disable-x`, and back

    @classmethod
    def of(cls, src: Source) -> "Rules":
        engine = src.text(ENGINE_MODULE)
        utils = [p for p in src.wheel.namelist() if re.fullmatch(r"vllm/utils(/\w+)?\.py", p)]
        return cls(
            dataclass_is_json="is_dataclass(" in engine,
            bool_or_str_is_optional="{bool, str, type(None)}" in engine,
            enable_disable=any("class EnableDisableAction" in src.text(p) for p in utils),
        )

    def keywords(self, kinds: set[str]) -> dict[str, str]:
        """The argparse keywords that decide the arity, as get_kwargs derives them from a type."""
        if self.dataclass_is_json and "dataclass" in kinds:
            return {"type": "json"}
        if self.bool_or_str_is_optional and kinds == {"bool", "str", "None"}:
            return {"nargs": "?"}
        if "bool" in kinds:
            return {"action": "BooleanOptionalAction"}
        if "Literal" in kinds or kinds & {"int", "float"}:
            return {}
        if kinds & {"list", "tuple", "set"}:
            return {"nargs": "+"}
        return {"type": "json"} if "dict" in kinds else {}


@dataclass
class Reader:
    """The options of one release, in the order its parser adds them."""

    src: Source
    rules: Rules
    rows: list[Row] = field(default_factory=list)

    def fields(self, cls_name: str, path: str) -> dict[str, tuple[ast.AST, str]]:
        """A dataclass's fields in order, its bases' first: name -> (annotation, its module)."""
        found = self.src.cls(cls_name, path)
        if found is None:
            raise ValueError(f"{path}: no class {cls_name}")
        cls, where = found
        out = {}
        for base in map(_name, cls.bases):
            if self.src.cls(base, where):
                out.update(self.fields(base, where))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if _name(node.annotation) != "ClassVar":
                    out[node.target.id] = (node.annotation, where)
        return out

    def field_keywords(self, cls_name: str, name: str, path: str) -> dict[str, str]:
        annotation, where = self.fields(cls_name, path)[name]
        return self.rules.keywords(type_kinds(annotation, self.src, where))

    def read_function(self, fn, path: str, cls: str | None = None, receiver: str = "") -> None:
        """`fn`'s add_argument calls (on `receiver` only, if given) in order, with the overrides
        `fn` and the class's `_customize_cli_kwargs` make to get_kwargs' dicts; a call
        `X.add_cli_args(parser)` (or super()'s) is read where it stands."""
        kwargs_of = {}  # variable -> (class, field or None), from `v = get_kwargs(C)[["f"]]`
        overrides = {}  # (variable, field) -> {keyword: source text, "" when deleted}
        for body in [fn, *self.customizers(cls, path)]:
            for node in ast.walk(body):
                _note_kwargs(node, kwargs_of, cls)
                _note_override(node, overrides)
        for node in _in_order(fn):
            if isinstance(node, ast.For):
                self.read_loop(node, kwargs_of, overrides, path)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if node.func.attr == "add_argument" and receiver in ("", _name(owner)):
                self.read_call(node, kwargs_of, overrides, path)
            elif node.func.attr == "add_cli_args" and isinstance(owner, ast.Call):
                self.read_method(cls, path, "add_cli_args", bases_only=True)  # super()
            elif node.func.attr == "add_cli_args" and _name(owner) not in ("", "cls"):
                self.read_method(_name(owner), path, "add_cli_args")

    def read_method(self, cls: str, path: str, name: str, bases_only: bool = False) -> None:
        """Read method `name` as class `cls` has it: its own, else its nearest base's."""
        found = self.src.cls(cls, path)
        if found is None:
            raise ValueError(f"{path}: no class {cls}")
        owners = [(base, found[1]) for base in map(_name, found[0].bases)]
        owners = owners if bases_only else [(cls, path)]
        while owners:
            owner = self.src.cls(*owners.pop(0))
            if owner is None:
                continue
            for item in owner[0].body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return self.read_function(item, owner[1], cls)
            owners += [(base, owner[1]) for base in map(_name, owner[0].bases)]
        raise ValueError(f"{path}: class {cls} has no method {name}")

    def customizers(self, cls: str | None, path: str) -> list[ast.FunctionDef]:
        """`_customize_cli_kwargs` of class `cls` and of its bases, bases first."""
        found = self.src.cls(cls, path) if cls else None
        if found is None:
            return []
        out = [m for base in found[0].bases for m in self.customizers(_name(base), found[1])]
        return out + [
            node
            for node in found[0].body
            if isinstance(node, ast.FunctionDef) and node.name == "_customize_cli_kwargs"
        ]

    def read_loop(self, loop: ast.For, kwargs_of, overrides, path) -> None:
        """`for key, value in v.items(): ...add_argument(f"--{key}", **value)`: an option per
        field of v's class, with the short names its overrides add (`["flags"]`)."""
        call = loop.iter
        owner = (
            call.func.value if isinstance(call, ast.Call) and _name(call.func) == "items" else None
        )
        adds = any(
            isinstance(n, ast.Call) and _name(n.func) == "add_argument" for n in ast.walk(loop)
        )
        if not (adds and isinstance(owner, ast.Name) and owner.id in kwargs_of):
            return
        cls, _ = kwargs_of[owner.id]
        for name, (annotation, where) in self.fields(cls, path).items():
            override = overrides.get((owner.id, name), {})
            keywords = self.rules.keywords(type_kinds(annotation, self.src, where))
            short = ast.literal_eval(override["flags"]) if override.get("flags") else []
            self.add(["--" + name.replace("_", "-"), *short], {**keywords, **override})

    def read_call(self, call: ast.Call, kwargs_of, overrides, path) -> None:
        names = [a.value for a in call.args if isinstance(a, ast.Constant)]
        if not names or len(names) < len(call.args) or not names[0].startswith("-"):
            return  # a positional (model_tag), or a loop's f-string names
        keywords = {}
        for kw in call.keywords:
            if kw.arg is not None:
                keywords[kw.arg] = ast.unparse(kw.value)
            else:
                keywords.update(self.spread(kw.value, kwargs_of, overrides, path))
        self.add(names, keywords)

    def spread(self, value, kwargs_of, overrides, path) -> dict[str, str]:
        """The keywords of `**value`: `v["f"]`, `v` (a `get_kwargs(C)["f"]`), `{**v["f"], ...}`."""
        if isinstance(value, ast.Dict):
            out = {}
            for key, item in zip(value.keys, value.values):
                if key is None:
                    out.update(self.spread(item, kwargs_of, overrides, path))
                elif isinstance(key, ast.Constant):
                    out[key.value] = ast.unparse(item)
            return out
        variable, name = _name(value), None
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
            name = value.slice.value
        if variable not in kwargs_of:
            return {}
        cls, key = kwargs_of[variable]
        name = key if name is None else name
        return {**self.field_keywords(cls, name, path), **overrides.get((variable, name), {})}

    def add(self, names: list[str], keywords: dict[str, str]) -> None:
        """One option: its arity from the keywords argparse gets."""
        action = keywords.get("action", "").strip("'\"")
        nargs = keywords.get("nargs", "").strip("'\"")
        kind = keywords.get("type", "")
        if action.rpartition(".")[2] == "BooleanOptionalAction":
            self.rows.append((self.boolean_names(names), "switch"))
            return
        if action in SWITCH_ACTIONS:
            arity = "switch"
        elif nargs in ("+", "*") or nargs.isdigit():
            arity = "values"
        elif nargs == "?":
            arity = "optional"
        elif "json" in kind or "union_dict_and_str" in kind:
            arity = "json"
        else:
            arity = "value"
        self.rows.append((tuple(names), arity))

    def boolean_names(self, names: list[str]) -> tuple[str, ...]:
        """A BooleanOptionalAction's names as `--help` shows them, long before short, then those it
        hides: where `--enable-x` is paired with `--disable-x` (and back) the `--no-` forms are
        hidden, else shown."""
        long = [n for n in names if n.startswith("--")]
        short = [n for n in names if not n.startswith("--")]
        negated = ["--no-" + n[2:] for n in long]
        pairs = {"--enable-": "--disable-", "--disable-": "--enable-"}
        paired = [
            to + n.removeprefix(at)
            for n in long
            for at, to in pairs.items()
            if self.rules.enable_disable and n.startswith(at)
        ]
        return (*long, *paired, *short, *negated) if paired else (*long, *negated, *short)


def _note_kwargs(node: ast.AST, kwargs_of: dict, cls: str | None) -> None:
    """`v = get_kwargs(C)` or `v = get_kwargs(C)["f"]` -> kwargs_of[v] = (C, f or None)."""
    if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
        return
    value, key = node.value, None
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
        value, key = value.value, value.slice.value
    if isinstance(value, ast.Call) and _name(value.func) == "get_kwargs" and value.args:
        named = _name(value.args[0])
        kwargs_of[node.targets[0].id] = (cls if named == "cls" else named, key)


def _keyword_at(target: ast.AST) -> tuple[tuple[str, str], str] | None:
    """`v["f"]["k"]` -> ((v, f), k)."""
    if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Subscript)):
        return None
    inner = target.value
    constants = isinstance(inner.slice, ast.Constant) and isinstance(target.slice, ast.Constant)
    if isinstance(inner.value, ast.Name) and constants:
        return (inner.value.id, inner.slice.value), target.slice.value
    return None


def _note_override(node: ast.AST, overrides: dict) -> None:
    """`v["f"]["k"] = x`, `del v["f"]["k"]` or `v["f"].pop("k")` -> overrides[(v, f)][k]."""
    if isinstance(node, ast.Assign) and (at := _keyword_at(node.targets[0])):
        overrides.setdefault(at[0], {})[at[1]] = ast.unparse(node.value)
    elif isinstance(node, ast.Delete) and (at := _keyword_at(node.targets[0])):
        overrides.setdefault(at[0], {})[at[1]] = ""
    elif isinstance(node, ast.Call) and _name(node.func) == "pop" and node.args:
        popped = ast.Subscript(value=node.func.value, slice=node.args[0])
        if isinstance(node.func, ast.Attribute) and (at := _keyword_at(popped)):
            overrides.setdefault(at[0], {})[at[1]] = ""


def _in_order(fn: ast.AST) -> list[ast.AST]:
    """`fn`'s nodes in source order (ast.walk goes breadth first)."""
    nodes = [n for n in ast.walk(fn) if hasattr(n, "lineno")]
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


def read_wheel(wheel: Path) -> list[Row]:
    """Every option `vllm serve` of the release in `wheel` takes, in its parser's order."""
    with zipfile.ZipFile(wheel) as archive:
        src = Source(archive)
        reader = Reader(src, Rules.of(src))
        reader.rows.append((("--help", "-h"), "switch"))
        for path in SUBCOMMAND_MODULES:
            for fn in ast.walk(src.tree(path) or ast.Module(body=[], type_ignores=[])):
                if isinstance(fn, ast.FunctionDef) and "serve_parser.add_argument" in ast.unparse(
                    fn
                ):
                    reader.read_function(fn, path, receiver="serve_parser")
        server = next(path for path in SERVER_MODULES if src.has(path))
        make = next(
            n
            for n in src.tree(server).body
            if isinstance(n, ast.FunctionDef) and n.name == "make_arg_parser"
        )
        reader.read_function(make, server)
    seen, rows = set(), []
    for names, arity in reader.rows:  # an option read twice (a docs copy of the parser) once
        if names[0] not in seen:
            seen.update(names)
            rows.append((names, arity))
    return rows


def version_key(release: str) -> tuple[int, ...]:
    """`0.8.5.post1` -> (0, 8, 5, 1): releases in order."""
    return tuple(int(part) for part in re.findall(r"\d+", release))


def before_pinned(releases: dict[str, list[Row]], pinned: list[Row]) -> list[tuple]:
    """What the options of `releases` (release -> rows) add to the pinned release's: per option,
    the names the pinned release lacks (a row per widest arity they had), and the names it has in
    a form whose arity cannot read an older one's (with that older arity); each with the first and
    the last release those names were read in. In order of first release, then of parser."""
    pinned_arity = {name: arity for names, arity in pinned for name in names}
    options: dict[str, list] = {}  # an option, by its first name -> [(release, names, arity)]
    for release in sorted(releases, key=version_key):
        for names, arity in releases[release]:
            options.setdefault(names[0], []).append((release, names, arity))
    out = []
    for forms in options.values():
        names = list(dict.fromkeys(n for _, row_names, _ in forms for n in row_names))
        by_arity: dict[str, list[str]] = {}  # new names by the widest arity they had
        for name in (n for n in names if n not in pinned_arity):
            arities = list(dict.fromkeys(arity for _, found, arity in forms if name in found))
            by_arity.setdefault(_widest(arities), []).append(name)
        for arity, new in by_arity.items():
            having = [form for form in forms if set(new) & set(form[1])]
            out.append((tuple(new), arity, having[0][0], having[-1][0]))
        unread = [
            (release, tuple(n for n in row_names if n in pinned_arity), arity)
            for release, row_names, arity in forms
            if any(not _reads(pinned_arity[n], arity) for n in row_names if n in pinned_arity)
        ]
        if unread:
            arities = list(dict.fromkeys(arity for _, _, arity in unread))
            out.append((unread[0][1], _widest(arities), unread[0][0], unread[-1][0]))
    return out


def _reads(arity: str, older: str) -> bool:
    """Whether an option of `arity` parses what one of arity `older` took: one value reads one
    value or a JSON object; several values read one."""
    one = ("value", "json")
    return arity == older or (arity in (*one, "values") and older in one)


def _widest(arities: list[str]) -> str:
    """The arity that reads every form of `arities`: several values read one; a JSON object is
    one value; an optional true/false reads a switch."""
    for arity in ("optional", "values", "json"):
        if arity in arities:
            return arity
    if len(set(arities)) > 1:
        raise ValueError(f"no arity reads all of {arities}")
    return arities[0]


def _rows_file(path: Path) -> tuple[str, list[Row]]:
    """A file this module printed for one wheel: its first line `# vllm VERSION`, then rows."""
    head, *lines = path.read_text().splitlines()
    rows = [(tuple(line.split()[:-1]), line.split()[-1]) for line in lines if line.strip()]
    return head.removeprefix("# vllm "), rows


if __name__ == "__main__":
    paths = [Path(arg) for arg in sys.argv[1:]]
    if len(paths) == 1 and paths[0].suffix == ".whl":
        print(f"# vllm {paths[0].name.split('-')[1]}")
        for names, arity in read_wheel(paths[0]):
            print(" ".join(names), arity)
    else:
        from spmoe.entrypoints import vllm_flags_0_34

        releases = dict(map(_rows_file, paths))
        for names, arity, first, last in before_pinned(releases, vllm_flags_0_34.options()):
            print(" ".join(names), arity, first, last)
