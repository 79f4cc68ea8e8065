"""The shape of the code (docs/architecture.md, "The floors"): every module imports only from its
own floor or the floors below it (config < distributed < layers < models < engine < entrypoints <
testing), the engine's modules likewise over the engine's own floors (`ENGINE_FLOORS`), no import
cycle anywhere in spmoe, function-level imports included, and torch.distributed used only inside
spmoe/distributed/."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spmoe"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The spmoe modules `path` imports, at any depth of its code. `from a.b import c` is a.b.c when
    that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            }
    return {name for name in found if name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []  # state: 1 on the DFS stack, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    assert len(graph) > 40 and graph["spmoe.models.deepseek_v32.model"]  # the walk sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# lowest first; `testing`: what the tests and benchmarks share, above everything it may exercise
FLOORS = ("config", "distributed", "layers", "models", "engine", "entrypoints", "testing")


def floor(module: str) -> int | None:
    """The floor of an spmoe module (None: the package's own `spmoe`, `spmoe.__main__`)."""
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported' for every import from a higher floor than the importer's."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if floor(name) is not None and floor(target) is not None and floor(target) > floor(name)
    )


def test_upward_imports_are_found():
    graph = {
        "spmoe.layers.a": {"spmoe.engine.b", "spmoe.config.c"},
        "spmoe.engine.b": {"spmoe.layers.a"},
    }
    assert upward_imports(graph) == ["spmoe.layers.a -> spmoe.engine.b"]


def test_every_module_has_a_floor():
    assert sorted(name for name in MODULES if floor(name) is None) == ["spmoe", "spmoe.__main__"]


def test_no_upward_import():
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    assert upward_imports(graph) == []


def uses_torch_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
            a.name.startswith("torch.distributed") for a in node.names
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (
                node.module.startswith("torch.distributed")
                or node.module == "torch"
                and any(a.name == "distributed" for a in node.names)
            )
        ):
            return True
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            return True
    return False


def test_torch_distributed_only_in_the_distributed_package():
    users = sorted(name for name, path in MODULES.items() if uses_torch_distributed(path))
    assert "spmoe.distributed.comm" in users  # the scan sees it where it is
    assert [u for u in users if not u.startswith("spmoe.distributed")] == []


# The engine's own floors, lowest first: each engine module imports only from its own floor or
# below.
ENGINE_FLOORS = (
    ("request",),  # what goes in and comes out: plain records, no torch (the server's wire)
    ("cache",),  # the KV caches: slots, paged, blocks
    ("sampling",),  # processors, sampler, noise, rejection, grammar and their kernels
    # sequences and the step's records; what speculates
    ("sequence", "speculation"),
    ("stats",),
    ("runner",),  # the forward and the choice, the drafter, the graphs
    ("rooms", "scheduler"),
    ("engine",),
    ("ranks", "warmup"),  # everything about ranks; warming up drives the batch job
    ("args",),  # the options and their checks
    ("build",),  # what the options build
)


def engine_floor(module: str) -> int | None:
    """The engine floor of an spmoe.engine module (None: outside the engine, or the package
    itself)."""
    parts = module.split(".")
    if parts[:2] != ["spmoe", "engine"] or len(parts) < 3:
        return None
    return next((i for i, names in enumerate(ENGINE_FLOORS) if parts[2] in names), None)


def upward_engine_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported' for every engine import from a higher engine floor than the
    importer's."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if engine_floor(name) is not None
        and engine_floor(target) is not None
        and engine_floor(target) > engine_floor(name)
    )


def test_upward_engine_imports_are_found():
    graph = {
        "spmoe.engine.engine": {"spmoe.engine.ranks", "spmoe.engine.sequence"},
        "spmoe.engine.ranks": {"spmoe.engine.engine"},
    }
    assert upward_engine_imports(graph) == ["spmoe.engine.engine -> spmoe.engine.ranks"]


def test_every_engine_module_has_an_engine_floor():
    engine = [name for name in MODULES if name.startswith("spmoe.engine.")]
    assert len(engine) > 20 and all(engine_floor(name) is not None for name in engine)


def test_no_upward_engine_import():
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    assert graph["spmoe.engine.engine"]  # the walk sees the engine's imports
    assert upward_engine_imports(graph) == []


def test_the_command_line_is_not_the_engines():
    """Flags, `--help` and vLLM's value forms live with the entry points: no engine module reads a
    command line."""
    readers = sorted(
        name
        for name, path in MODULES.items()
        if name.startswith("spmoe.engine") and "argparse" in imported_names(path)
    )
    assert "argparse" in imported_names(PACKAGE / "entrypoints" / "engine_flags.py")
    assert readers == []


# The server, one folder per process (docs/architecture.md, "The server's processes"): a front end
# process imports no torch and nothing of the engine but its records, a rank process no HTTP
# framework; each folder imports nothing of the other's, and the wire between them is plain records.
SERVE = "spmoe.entrypoints.serve"
FRONT_END, RANK_SIDE, WIRE = f"{SERVE}.frontend", f"{SERVE}.engine", f"{SERVE}.wire"
# what a front end may import of spmoe outside its folder: the wire, the records it carries, and the
# entry points' modules that the jobs share and that import no torch
FRONT_END_MAY_IMPORT = (
    WIRE,
    "spmoe.engine.request",
    "spmoe.entrypoints.tokenizer",
    "spmoe.entrypoints.generation_defaults",
)
NOT_IN_A_FRONT_END = ("torch", "triton", "xgrammar", "safetensors")
NOT_IN_A_RANK = ("fastapi", "starlette", "uvicorn")


def imported_names(path: Path) -> set[str]:
    """Every module name `path` imports, at any depth of its code (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def process_breaches() -> list[str]:
    """'importer -> imported' for every import that crosses the server's process folders."""
    breaches = []
    for name, path in MODULES.items():
        names = imported_names(path)
        spmoe = {n for n in names if within(n, ("spmoe",))}
        other = {n for n in names if not within(n, ("spmoe",))}
        if within(name, (FRONT_END,)):
            bad = {
                n for n in spmoe - {"spmoe"} if not within(n, (FRONT_END, *FRONT_END_MAY_IMPORT))
            }
            bad |= {n for n in other if within(n, NOT_IN_A_FRONT_END)}
        elif within(name, (RANK_SIDE,)):
            bad = {n for n in spmoe if within(n, (FRONT_END,))}
            bad |= {n for n in other if within(n, NOT_IN_A_RANK)}
        elif name == WIRE:
            bad = {n for n in spmoe if not within(n, ("spmoe.engine.request",))}
            bad |= {n for n in other if within(n, NOT_IN_A_FRONT_END + NOT_IN_A_RANK)}
        else:
            bad = set()
        breaches += [f"{name} -> {n}" for n in sorted(bad)]
    return breaches


def test_the_server_folders_hold_one_process_each():
    assert any(within(name, (FRONT_END,)) for name in MODULES)
    assert any(within(name, (RANK_SIDE,)) for name in MODULES)
    assert process_breaches() == []


def loaded_by(module: str) -> set[str]:
    """The modules in `sys.modules` after a fresh interpreter imports `module`."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return set(done.stdout.split())


def test_a_front_end_process_loads_neither_torch_nor_the_engine():
    """What `python -m spmoe.entrypoints.serve.frontend` has loaded before it reads its launch."""
    loaded = loaded_by(f"{FRONT_END}.__main__")
    assert {"fastapi", "uvicorn", f"{FRONT_END}.app"} <= loaded
    assert sorted(m for m in loaded if within(m, NOT_IN_A_FRONT_END)) == []
    outside = ("spmoe", "spmoe.engine", "spmoe.entrypoints", SERVE, FRONT_END)
    assert (
        sorted(
            m
            for m in loaded
            if within(m, ("spmoe",)) and m not in outside
            if not within(m, (FRONT_END, *FRONT_END_MAY_IMPORT))
        )
        == []
    )


def test_a_rank_process_loads_no_http_framework():
    """What a rank has loaded once it can run `serve_rank`."""
    loaded = loaded_by(f"{RANK_SIDE}.rank")
    assert {"torch", f"{RANK_SIDE}.loop", "spmoe.engine.engine"} <= loaded
    assert sorted(m for m in loaded if within(m, NOT_IN_A_RANK)) == []


def test_the_long_line_list_holds_only_files_with_long_lines():
    """`ruff-long-lines.toml` lets the files written before E501 held lines to 100 columns keep
    their longer lines; a file that has none left (or is gone) leaves the list, so that the limit
    holds there."""
    listed = re.findall(
        r'^"([^"]+)" = \["E501"\]$', (ROOT / "ruff-long-lines.toml").read_text(), re.M
    )
    assert len(listed) > 100
    wrapped = [
        name
        for name in listed
        if not (ROOT / name).is_file()
        or all(len(line) <= 100 for line in (ROOT / name).read_text().splitlines())
    ]
    assert wrapped == []
