"""The source's layout, read from the files (no import, no process): one concept a folder, no
import circle between folders, the library below the CLI, no private name taken across
folders, a docstring in every folder's __init__.py whose "Imports:" line lists exactly the
folders it imports, no torch.distributed collective outside comm/, and the size budgets.

Every import counts, lazy ones inside functions and `if TYPE_CHECKING:` ones included: a lazy
import hides a circle from Python, not from a reader.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowcomm"
# The library: what a loop of your own (wrap, make_run) is built from, with storage/ (files written
# whole) and lazy/ (names imported on first use) that every folder may use. It imports nothing above
# it (megatron/core vs megatron/training): no config, cli, train, launch, ...
LIBRARY = {"contract", "engines", "strategies", "comm", "compress", "models", "data", "run", "storage", "lazy",
           "robust"}
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
STRATEGY_LINES, STRATEGIES_OVER = 200, set()
# An engine is one piece a paper is built from: every engines/*.py within 300 lines but these.
ENGINE_LINES, ENGINES_OVER = 300, set()
FOLDER_BUDGETS = {"strategies/": (STRATEGY_LINES, STRATEGIES_OVER), "engines/": (ENGINE_LINES, ENGINES_OVER)}


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


FOLDERS = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))


def folder_doc(package: str) -> str | None:
    return ast.get_docstring(parsed(SRC / package / "__init__.py"))


@pytest.mark.parametrize("package", FOLDERS)
def test_every_folder_says_what_it_is_and_what_it_may_import(package):
    doc = folder_doc(package)
    assert doc and "Imports:" in doc, f"{package}/__init__.py: a docstring that says what the folder is and " \
                                      f"what it may import ('Imports: ...')"


def declared_imports(doc: str) -> set[str]:
    """The folders an "Imports:" sentence names: `Imports: a, b (why) and errors.` -> {a, b, errors}.
    A reason in brackets is skipped; the sentence ends at a full stop or a dash (" -- never x");
    `Imports: nothing.` is the empty set; `lowcomm` is the package's face (its __init__.py)."""
    sentence = re.sub(r"\([^()]*\)", "", doc.split("Imports:", 1)[1])
    sentence = re.split(r"\.(?:\s|$)|\s--\s", sentence, maxsplit=1)[0]
    names = {word.strip() for word in re.split(r",|\band\b", sentence)} - {""}
    return set() if names == {"nothing"} else names


def import_line_faults(declared: dict[str, set[str]], real: dict[str, dict[str, list[str]]],
                       known: set[str]) -> list[str]:
    """Each folder's Imports line against its real imports (folder -> imported folder -> where):
    an import the line does not name, a name the line lists that the folder never imports, and a
    name that is none of the `known` folders (prose such as "the library" is not a list)."""
    faults = []
    for package, listed in sorted(declared.items()):
        imported = real.get(package, {})
        for target in sorted(imported.keys() - listed):
            faults.append(f"{package}/__init__.py: its Imports line lacks {target} ({imported[target][0]})")
        for target in sorted(listed - imported.keys()):
            what = "which is no folder of lowcomm" if target not in known else f"which {package}/ never imports"
            faults.append(f"{package}/__init__.py: its Imports line names {target}, {what}")
    return faults


def test_import_lines_are_read_and_compared():
    doc = "What it is.\n\nImports: comm (the ring, the link), metrics\nand errors -- never cli. Or bench."
    assert declared_imports(doc) == {"comm", "metrics", "errors"}
    assert declared_imports("Imports: config, strategies (what each declares). Never train.") == {"config", "strategies"}
    assert declared_imports("A leaf.\nImports: nothing. Every folder may import it.") == set()
    real = {"a": {"b": ["a/x.py:3 imports lowcomm.b"], "d": ["a/y.py:9 imports lowcomm.d.z"]}}
    assert import_line_faults({"a": {"b", "c", "the library"}, "e": set()}, real, {"a", "b", "c", "d", "e"}) == [
        "a/__init__.py: its Imports line lacks d (a/y.py:9 imports lowcomm.d.z)",
        "a/__init__.py: its Imports line names c, which a/ never imports",
        "a/__init__.py: its Imports line names the library, which is no folder of lowcomm"]
    assert import_line_faults({"a": {"b", "d"}}, real, {"b", "d"}) == []


def test_every_imports_line_is_true():
    """A folder's Imports line lists exactly the folders it imports, lazy imports included: a new
    edge is a decision the line records, and a name left after its last import goes."""
    real = defaultdict(dict)
    for (a, b), where in edges().items():
        real[a][b] = where
    declared = {package: declared_imports(folder_doc(package))
                for package in FOLDERS if "Imports:" in (folder_doc(package) or "")}
    faults = import_line_faults(declared, real, {*FOLDERS, "errors", "lowcomm"})
    assert not faults, "\n".join(faults)


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


def folder_budget(rel: str) -> int:
    """The lines a file may have by its folder (strategies/, engines/), its named exceptions aside."""
    for prefix, (lines, over) in FOLDER_BUDGETS.items():
        if rel.startswith(prefix) and rel not in over:
            return lines
    return MAX_FILE_LINES


def test_folder_budgets_name_files_that_exist_and_are_over():
    """An exception that no longer exists or fits its folder's budget is stale: it goes."""
    stale = [f"{rel}: {len((SRC / rel).read_text().splitlines()) if (SRC / rel).is_file() else 'no such file'}"
             for _, (lines, over) in FOLDER_BUDGETS.items() for rel in sorted(over)
             if not (SRC / rel).is_file() or len((SRC / rel).read_text().splitlines()) <= lines]
    assert not stale, "exceptions to a folder's budget that are not over it (remove them): " + "; ".join(stale)


def test_size_budgets():
    over = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(SRC).as_posix()
        limit = BUDGETS.get(rel, folder_budget(rel))
        if len(text.splitlines()) > limit:
            over.append(f"{rel}: {len(text.splitlines())} lines (budget {limit})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{rel}:{node.lineno} {node.name}: {length} lines (budget {MAX_FUNCTION_LINES})")
    assert not over, "\n".join(over)
