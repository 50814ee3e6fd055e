"""The source's layout, read from the files (no import, no process): one concept a folder, no
import circle between folders, the library below the CLI, no private name taken across
folders, a docstring in every folder's __init__.py, and the size budgets.

Every import counts, lazy ones inside functions and `if TYPE_CHECKING:` ones included: a lazy
import hides a circle from Python, not from a reader.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowcomm"
# The library: what a loop of your own (wrap, make_run) is built from. It imports nothing
# above it (megatron/core vs megatron/training): no config, cli, train, launch, ...
LIBRARY = {"contract", "engines", "strategies", "comm", "compress", "models", "data", "run", "robust"}
TOP = {"__init__.py", "__main__.py", "errors.py"}  # the face; every other module has a folder
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
BUDGETS = {"contract/base.py": 200,  # the Strategy base class: one screen or so
           "train/elastic.py": 250}  # an elastic member forms, heals, rolls back and commits; the rest is the rank life's
# torch.distributed's collectives: called only in comm/, where every byte is counted, recorded in the
# flight ring and paced by --link (the elastic heal and agreements included).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
               "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv"}
# A strategy is its paper: the schedule, pricing and elastic rules are its engine's. Every
# strategies/*.py but those named here, whose state is still declared inline.
STRATEGY_LINES, STRATEGIES_OVER = 200, {"strategies/acco.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder(module: str) -> str:
    """The folder a module lives in: lowcomm.comm.link -> comm; lowcomm.errors -> errors."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lowcomm"


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def imports(path: Path):
    """(imported module, imported name or None, line) for every import in the file, lazy ones too."""
    mods = modules()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield (sub, None, node.lineno) if sub in mods else (source, alias.name, node.lineno)


@lru_cache(maxsize=None)
def edges() -> dict[tuple[str, str], list[str]]:
    """(folder, folder it imports) -> where, for every import of lowcomm across folders."""
    out = defaultdict(list)
    for name, path in modules().items():
        for target, _, line in imports(path):
            if target.split(".")[0] == "lowcomm" and folder(target) != folder(name):
                out[(folder(name), folder(target))].append(f"{path.relative_to(SRC)}:{line} imports {target}")
    return out


def test_top_of_the_package_holds_only_its_face():
    loose = sorted(p.name for p in SRC.glob("*.py") if p.name not in TOP)
    assert not loose, f"modules outside a folder: {loose}"


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph ([] when it has none): take away what imports nothing that is
    left (Kahn's order) until nothing can go; what stays lies on or leads into a circle."""
    left = {a: set(bs) for a, bs in graph.items()}
    while True:
        leaves = {a for a, bs in left.items() if not bs & left.keys()}
        if not leaves:
            break
        left = {a: bs for a, bs in left.items() if a not in leaves}
    if not left:
        return []
    path = [min(left)]
    while path[-1] not in path[:-1]:
        path.append(min(left[path[-1]] & left.keys()))
    return path[path.index(path[-1]):]


def test_circle_finds_a_circle_and_only_one():
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle_between_folders():
    graph = defaultdict(set)
    for a, b in edges():
        graph[a].add(b)
        graph.setdefault(b, set())
    found = circle(graph)
    assert not found, " -> ".join(found) + "\n" + "\n".join(
        w for a, b in zip(found, found[1:]) for w in edges()[(a, b)][:3])


def test_errors_imports_nothing_of_lowcomm():
    assert not [t for t, _, _ in imports(SRC / "errors.py") if t.startswith("lowcomm")]


def test_the_library_imports_nothing_above_it():
    above = [w for (a, b), where in edges().items() if a in LIBRARY and b not in LIBRARY | {"errors"}
             for w in where]
    assert not above, "\n".join(above)


def test_no_private_name_is_taken_across_folders():
    """`from x import _y`, or `x._y` on a module x of another folder."""
    mods = modules()
    taken = []
    for name, path in mods.items():
        tree = parsed(path)
        other_modules = {}
        for target, imported, line in imports(path):
            if target.split(".")[0] != "lowcomm" or folder(target) == folder(name):
                continue
            if imported is not None and imported.startswith("_") and imported != "__version__":
                taken.append(f"{path.relative_to(SRC)}:{line} imports {target}.{imported}")
            if imported is None:
                other_modules[target.rpartition(".")[2]] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.value.id in other_modules):
                taken.append(f"{path.relative_to(SRC)}:{node.lineno} uses {other_modules[node.value.id]}.{node.attr}")
    assert not taken, "\n".join(taken)


@pytest.mark.parametrize("package", sorted(p.parent.name for p in SRC.glob("*/__init__.py")))
def test_every_folder_says_what_it_is_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text()))
    assert doc and "Imports:" in doc, f"{package}/__init__.py: a docstring that says what the folder is and " \
                                      f"what it may import ('Imports: ...')"


def raw_collectives(text: str) -> list[str]:
    """The torch.distributed collectives `text` calls (`dist.X(...)`, `torch.distributed.X(...)`)
    or imports by name (`from torch.distributed import X`), as 'line: X'."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed", "c10d"):
                found.append(f"{node.lineno}: {owner}.{node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in COLLECTIVES]
    return found


def test_raw_collectives_finds_every_spelling():
    text = ("import torch.distributed as dist\nfrom torch.distributed import all_gather_object\n"
            "dist.all_reduce(t)\ntorch.distributed.broadcast(t, 0)\ncomm.all_reduce(t)\ndist.get_rank()\n")
    assert sorted(raw_collectives(text)) == ["2: all_gather_object", "3: dist.all_reduce", "4: torch.distributed.broadcast"]


def test_no_collective_is_called_outside_comm():
    calls = [f"{path.relative_to(SRC)}:{where}" for path in sorted(SRC.rglob("*.py"))
             if path.relative_to(SRC).parts[0] != "comm" for where in raw_collectives(path.read_text())]
    assert not calls, "a collective outside comm/ (counted nowhere, not paced by --link): " + "; ".join(calls)


def test_size_budgets():
    over = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(SRC).as_posix()
        strategy = rel.startswith("strategies/") and rel not in STRATEGIES_OVER
        limit = BUDGETS.get(rel, STRATEGY_LINES if strategy else MAX_FILE_LINES)
        if len(text.splitlines()) > limit:
            over.append(f"{rel}: {len(text.splitlines())} lines (budget {limit})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{rel}:{node.lineno} {node.name}: {length} lines (budget {MAX_FUNCTION_LINES})")
    assert not over, "\n".join(over)
