"""deepinfer's import graph is layered (design: worker -> models -> layers -> kernels, no cycles):
no two modules reach each other through imports, whether at module level or inside a function (a
function-level import that only dodges a cycle still ties the two modules together), and the model
math imports nothing from the serving side."""
from __future__ import annotations

import ast
from pathlib import Path

import deepinfer

ROOT = Path(deepinfer.__file__).parent

# Model math and what it is built from; none of them may reach into the serving side.
MATH = ("deepinfer.models", "deepinfer.layers", "deepinfer.state", "deepinfer.kernels", "deepinfer.formats")
# The math packages, lowest first: a module imports only from its own package or one below it.
MATH_LAYERS = ("deepinfer.formats", "deepinfer.kernels", "deepinfer.state", "deepinfer.layers", "deepinfer.models")
SERVING = ("deepinfer.worker", "deepinfer.engine", "deepinfer.loader", "deepinfer.tools", "deepinfer.llm",
           "deepinfer.entrypoints")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, packages named by their __init__.py."""
    out = {}
    for path in root.rglob("*.py"):
        parts = ("deepinfer",) + path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """deepinfer modules that `name` imports anywhere in its file (the parent packages that Python
    initialises on the way are not counted: every module would otherwise reach deepinfer/__init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for the package at `root`."""
    known = _modules(root)
    return {n: _imported(n, p, known) for n, p in known.items()}


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph of the package at `root`."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_the_finder_sees_a_function_level_cycle(tmp_path):
    pkg = tmp_path / "deepinfer"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("from deepinfer.models.b import B\n")
    (pkg / "models" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "models" / "c.py").write_text("from deepinfer.models import a\n")
    assert import_cycles(pkg) == [["deepinfer.models.a", "deepinfer.models.b"]]


def test_no_import_cycles_between_deepinfer_modules():
    cycles = import_cycles()
    assert not cycles, f"modules that import each other: {cycles}"


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_model_math_imports_nothing_from_the_serving_side():
    wrong = sorted((m, t) for m, targets in import_graph().items() if _under(m, MATH)
                   for t in targets if _under(t, SERVING))
    assert not wrong, f"model math importing worker / engine / loader / tools: {wrong}"


def _layer(name: str) -> int | None:
    return next((i for i, p in enumerate(MATH_LAYERS) if _under(name, (p,))), None)


def test_math_packages_are_layered():
    """formats <- kernels <- state <- layers <- models: no import runs back up."""
    wrong = sorted((m, t) for m, targets in import_graph().items() if _layer(m) is not None
                   for t in targets if _layer(t) is not None and _layer(t) > _layer(m))
    assert not wrong, f"imports from a higher package: {wrong}"


def test_the_worker_sees_models_only_through_the_registry_and_the_interface():
    """A new model is a model file and a config file: the worker never names a model class."""
    allowed = {"deepinfer.models.registry", "deepinfer.models.interface"}
    wrong = sorted((m, t) for m, targets in import_graph().items() if _under(m, ("deepinfer.worker",))
                   for t in targets if _under(t, ("deepinfer.models",)) and t not in allowed)
    assert not wrong, f"worker modules importing a model module: {wrong}"


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported before any other deepinfer module (deepinfer's package init imports
    almost nothing, so a cycle through a package's __init__ shows up here, not hidden by import order)."""
    import subprocess
    import sys

    names = sorted(n for n in _modules(ROOT) if not n.endswith("__main__"))
    code = ("import importlib, sys, json\nimport torch  # noqa: F401 (loaded once, kept)\nbad = []\n"
            f"for n in {names!r}:\n"
            "    for m in [m for m in sys.modules if m == 'deepinfer' or m.startswith('deepinfer.')]:\n"
            "        del sys.modules[m]\n"
            "    try:\n        importlib.import_module(n)\n"
            "    except Exception as e:\n        bad.append(f'{n}: {type(e).__name__}: {e}')\n"
            "print(json.dumps(bad))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout[-3000:]
