"""The import graph of the two packages, read with `ast` (nothing is imported): `dgemma_compile` (the compiler and
the generators) never imports `dgemma_runtime` (the top-level `runtime/`, serving) except in the CLI's lazy `serve`
dispatch, inside a function; `dgemma_compile/compile/` imports nothing of serving; `dgemma_runtime` is a user of
dgemma_compile's public API: no underscore name imported, no private attribute read off its objects. Also: the
packages pyproject.toml lists are every package directory, so `pip install .` ships them all; each folder imports only
the folders it may (`ALLOWED`, issue 41), and no module imports, at module level, one that imports it back."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".venv", ".git", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache"}


def _py_files(*parts: str) -> list[Path]:
    base = ROOT.joinpath(*parts)
    return sorted(p for p in base.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts)
                  and not any(s.endswith(".egg-info") for s in p.parts))


def _imports(path: Path) -> list[tuple[str, list[tuple[str, str]], int, bool, int]]:
    """(absolute module, imported (name, bound name) pairs, relative level, inside a function, line) of every import
    in `path`; relative imports are resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "runtime":
        parts[0] = "dgemma_runtime"
    package = parts[:-1]
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append((a.name, [], 0, in_function, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                mod = child.module or ""
                if child.level:
                    base = package[:len(package) - (child.level - 1)] if child.level > 1 else package
                    mod = ".".join(base + ([mod] if mod else []))
                out.append((mod, [(a.name, a.asname or a.name) for a in child.names], child.level, in_function,
                            child.lineno))
            visit(child, inner)

    visit(tree, False)
    return out


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_dgemma_compile_imports_runtime_only_in_the_cli_serve_dispatch():
    bad, lazy = [], []
    for path in _py_files("dgemma_compile"):
        for mod, _, _, in_function, line in _imports(path):
            if mod == "dgemma_runtime" or mod.startswith("dgemma_runtime.") or mod.startswith("dgemma_compile.runtime"):
                if _rel(path) == "dgemma_compile/cli/serve.py" and in_function:
                    lazy.append(line)
                else:
                    bad.append(f"{_rel(path)}:{line} imports {mod}")
    assert not bad, bad
    assert lazy, "the CLI's serve command should import dgemma_runtime (lazily)"


def test_compile_imports_nothing_of_serving():
    serving = ("dgemma_runtime", "fastapi", "uvicorn", "sse_starlette", "prometheus_client")
    bad = [f"{_rel(p)}:{line} imports {mod}" for p in _py_files("dgemma_compile", "compile")
           for mod, _, _, _, line in _imports(p) if mod.split(".")[0] in serving]
    assert not bad, bad


def test_runtime_uses_only_public_names_of_dgemma_compile():
    bad = []
    for path in _py_files("runtime"):
        own = {"self", "cls"}
        for mod, names, level, _, line in _imports(path):
            if level and not (mod == "dgemma_runtime" or mod.startswith("dgemma_runtime.")):
                bad.append(f"{_rel(path)}:{line}: a relative import beyond dgemma_runtime ({'.' * level}{mod})")
            if mod.startswith("dgemma_runtime"):
                own |= {bound for _, bound in names}
            if mod == "dgemma_compile" or mod.startswith("dgemma_compile."):
                private = [p for p in mod.split(".") if p.startswith("_")] + \
                          [n for n, _ in names if n.startswith("_")]
                if private:
                    bad.append(f"{_rel(path)}:{line}: private name(s) {private} of {mod}")
        for node in ast.walk(ast.parse(path.read_text())):
            # a private attribute read off anything but the runtime's own objects and modules
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if not (isinstance(base, ast.Name) and base.id in own):
                    bad.append(f"{_rel(path)}:{node.lineno}: private attribute {ast.unparse(node)}")
    assert not bad, bad


def test_pyproject_lists_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"dgemma_compile": "dgemma_compile", "dgemma_runtime": "runtime"}
    found = set()
    for base in ("dgemma_compile", "runtime"):
        for init in (ROOT / base).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                parts = list(init.parent.relative_to(ROOT).parts)
                found.add(".".join(["dgemma_runtime" if parts[0] == "runtime" else parts[0], *parts[1:]]))
    assert set(cfg["packages"]) == found
    assert not (ROOT / "dgemma_compile" / "runtime").exists()



def _module_level_imports(path: Path, modules: set[str], types: bool) -> set[str]:
    """The modules of `modules` that `path` imports at module level (outside functions; with `types`, the
    `if TYPE_CHECKING:` imports too). `from x import name` is an import of `x.name` where that is a module, else of
    `x`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if not types and isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.ImportFrom):
                base = package[:len(package) - (child.level - 1)] if child.level > 1 else package
                mod = ".".join((base if child.level else []) + ([child.module] if child.module else []))
                out.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in child.names)
            elif isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            visit(child)

    visit(tree)
    return out & modules


def test_the_model_imports_no_caller_of_itself():
    """`model.py` is only the forward: no module it imports (directly or through others) refers to the model, not
    even for a type (issue 38: `model.py` imported `forwards.py`, whose passes call the model's forward)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in _py_files("dgemma_compile")}
    imports = {m: _module_level_imports(p, set(modules), types=False) - {m} for m, p in modules.items()}
    refers = {m: _module_level_imports(p, set(modules), types=True) - {m} for m, p in modules.items()}
    seen, todo = set(), ["dgemma_compile.model.backbone"]
    while todo:
        for dep in imports[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert not [m for m in seen if "dgemma_compile.model.backbone" in refers[m]]
    assert "dgemma_compile.model.backbone" in refers["dgemma_compile.model.forwards"]  # the caller refers to the model, not back


_MESSAGE_READS = re.compile(r"(str\((e|exc|err|error)\)|\bmessage)\s*\.\s*(split|startswith|removeprefix|partition)\(")


def test_errors_are_read_by_type_not_by_message():
    """Issue 41 item 4: the CLI and the HTTP layer map an error by its class and fields (`ConfigError.param`, `.code`,
    `ParallelError`), never by parsing its text: no module of either package splits or prefix-matches an exception's
    message. (xgrammar's out-of-memory, a library's text with no type of its own, is matched by substring in
    `runtime/http/grammar_worker.py`, not by these forms.)"""
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in _py_files("dgemma_compile") + _py_files("runtime")
             for i, line in enumerate(p.read_text().splitlines(), 1) if _MESSAGE_READS.search(line)]
    assert not found, found
    # and the pattern does catch what it forbids
    assert _MESSAGE_READS.search('param = str(e).split(":", 1)[0]')
    assert _MESSAGE_READS.search('if message.startswith("tokenizer:"):')


# Issue 41: the folders show the path of a request (docs/design.md, "Where things are"). Each room (a folder of a
# package, or one of dgemma_compile's top-level modules) may import only the rooms listed here, at module level or
# inside a function alike; everything else is a wrong turn of the path.
ALLOWED = {
    "kernels": {"step"},  # the oracle math each kernel replaces (step/sampler.py, step/rng.py)
    "model": {"kernels", "quant"},  # the ops the forward calls; the loader reads quantized checkpoints
    "quant": {"kernels", "model"},  # the experts' weight formats; the model's layers it quantizes
    "inputs": {"model"},  # configs, and the image prefix's own encoder forwards
    "step": {"inputs", "model"},  # constraints and image prefills of the rows it drives
    "oracle": {"inputs", "kernels", "model", "step"},
    "compile": {"inputs", "kernels", "model", "quant", "step"},
    "parallel": {"kernels", "model", "oracle", "quant", "step"},  # oracle: the traffic count's eager steps
    "experimental": {"kernels"},
    "demo": set(),
    "cli": {"dgemma_compile", "compile", "demo", "inputs", "model", "oracle", "parallel", "quant", "step",
            "dgemma_runtime", "dgemma_runtime/http"},  # runtime: only `dgemma serve`, lazily (test above)
    "dgemma_runtime": {"compile", "inputs", "model", "parallel", "step", "dgemma_runtime/kv"},
    "dgemma_runtime/kv": {"inputs", "model"},
    "dgemma_runtime/http": {"inputs", "model", "step", "dgemma_runtime"},
}


def _room(module: str) -> str | None:
    """The room of a module of ours (None for anything else): a folder of dgemma_compile or of dgemma_runtime, a
    top-level module of dgemma_compile, or the package itself (its public names)."""
    parts = module.split(".")
    if parts[0] == "dgemma_runtime":
        sub = parts[1] if len(parts) > 1 else None
        return f"dgemma_runtime/{sub}" if sub and (ROOT / "runtime" / sub).is_dir() else "dgemma_runtime"
    if parts[0] != "dgemma_compile":
        return None
    return parts[1] if len(parts) > 1 else "dgemma_compile"


def _is_module(package: str, name: str) -> bool:
    base = ROOT / ("runtime" if package == "dgemma_runtime" else package) / name
    return base.is_dir() or base.with_suffix(".py").is_file()


def test_each_folder_imports_only_the_rooms_it_may():
    bad, seen = [], set()
    for path in _py_files("dgemma_compile") + _py_files("runtime"):
        rel = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        if len(rel) == 1:
            continue  # a package's own __init__: its public names
        mine = _room(".".join(["dgemma_runtime" if rel[0] == "runtime" else rel[0], *rel[1:]]))
        for mod, names, _, _, line in _imports(path):
            # `from .. import kernels` imports the room of the name, `from ..step import rng` the room of the module
            targets = [f"{mod}.{n}" if _is_module(mod, n) else mod for n, _ in names] \
                if mod in ("dgemma_compile", "dgemma_runtime") else [mod]
            for target in targets:
                room = _room(target)
                if room is None or room == mine:
                    continue
                seen.add((mine, room))
                if room not in ALLOWED.get(mine, set()):
                    bad.append(f"{_rel(path)}:{line}: {mine} imports {target} ({room})")
    assert not bad, bad
    # every allowance is used: a rule nothing needs is a rule that hides the next wrong turn
    unused = {(r, a) for r, allowed in ALLOWED.items() for a in allowed} - seen
    assert not unused, unused


def test_the_module_import_graph_has_no_cycles():
    """No module of either package imports, at module level, a module that imports it back, directly or through
    others (an import inside a function, or under TYPE_CHECKING, runs later and is not an edge; a module's own
    packages are not edges either: Python imports them first)."""
    modules = {}
    for base in ("dgemma_compile", "runtime"):
        for p in _py_files(base):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            parts[0] = "dgemma_runtime" if parts[0] == "runtime" else parts[0]
            modules[".".join(parts).removesuffix(".__init__")] = p
    graph = {}
    for name, p in modules.items():
        deps = set()
        for dep in _module_level_imports(p, set(modules) | {d.rsplit(".", 1)[0] for d in modules}, types=False):
            parts = dep.split(".")
            deps |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # importing a.b.c imports a.b too
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(d + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles
    assert graph["dgemma_compile.step.row_table"] >= {"dgemma_compile.step.mixed_step", "dgemma_compile.model.plan"}


def test_the_tests_mirror_the_folders():
    """tests/ has one folder per room of the path (tests/model/ for dgemma_compile/model/, ..., tests/demo/,
    tests/runtime/, tests/bench/), plus the tests of the repository as a whole (layout, docs, tools) and of the oracle
    (`oracle.py`, a module of its own) at its top; test modules are imported by name (conftest puts every folder on
    sys.path), so no two share one."""
    tests = ROOT / "tests"
    rooms = {d.name for d in tests.iterdir() if d.is_dir() and d.name not in ("fixtures", "__pycache__")
             and not d.name.startswith(".")}
    package = {d.name for d in (ROOT / "dgemma_compile").iterdir() if (d / "__init__.py").is_file()}
    assert rooms <= package | {"runtime", "bench"}, rooms - package
    assert {"model", "step", "inputs", "compile", "kernels", "cli", "demo", "runtime"} <= rooms
    assert sorted(p.name for p in tests.glob("test_*.py")) == ["test_docs.py", "test_generate.py", "test_layout.py",
                                                               "test_tools.py"]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
