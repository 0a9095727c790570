"""deepinfer's import graph is layered (design: worker -> models -> layers -> kernels, no cycles):
no two modules reach each other through imports, whether at module level or inside a function (a
function-level import that only dodges a cycle still ties the two modules together), no two packages
reach each other either, the model math imports nothing from the serving side, and nothing outside
deepinfer/models names a model class (models/interface.py is the seam)."""
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


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node of `graph` (node -> its targets)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph of the package at `root`."""
    return strongly_connected(import_graph(root))


def package_of(module: str) -> str:
    """deepinfer.<pkg> for a module inside a subpackage; a top-level module (deepinfer.llm) and the root
    package (deepinfer) are nodes of their own."""
    return ".".join(module.split(".")[:2])


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """The import graph collapsed to packages (package_of): an edge for every import between two of them."""
    out: dict[str, set[str]] = {}
    for m, targets in import_graph(root).items():
        src = package_of(m)
        out.setdefault(src, set()).update(package_of(t) for t in targets if package_of(t) != src)
    return out


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


# Package edges a package-level cycle may still run through, each naming why it is there and who removes it.
# Only edges from or to deepinfer/distributed, deepinfer/llm.py or deepinfer/executor may be listed.
ALLOWED_PACKAGE_EDGES: set[tuple[str, str]] = set()  # none left
EXEMPTABLE = ("deepinfer.distributed", "deepinfer.llm", "deepinfer.executor")


def test_the_package_finder_sees_a_cycle_through_two_packages(tmp_path):
    pkg = tmp_path / "deepinfer"
    for sub in ("engine", "spec"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "scheduler.py").write_text("from deepinfer.spec.schedule import plan\n")
    (pkg / "spec" / "schedule.py").write_text("def plan():\n    from deepinfer.engine import outputs\n")
    (pkg / "engine" / "outputs.py").write_text("")
    (pkg / "llm.py").write_text("from deepinfer.engine import scheduler\n")
    assert import_cycles(tmp_path / "deepinfer") == []  # no module cycle ...
    assert strongly_connected(package_graph(pkg)) == [["deepinfer.engine", "deepinfer.spec"]]  # ... a package one


def test_no_import_cycles_between_deepinfer_packages():
    """Collapsed to packages (deepinfer.<pkg>; top-level modules on their own), the import graph is acyclic."""
    assert all(_under(a, EXEMPTABLE) or _under(b, EXEMPTABLE) for a, b in ALLOWED_PACKAGE_EDGES)
    graph = {a: {b for b in targets if (a, b) not in ALLOWED_PACKAGE_EDGES} for a, targets in package_graph().items()}
    cycles = strongly_connected(graph)
    detail = {tuple(c): sorted((m, t) for m, ts in import_graph().items() for t in ts
                               if package_of(m) in c and package_of(t) in c and package_of(m) != package_of(t))
              for c in cycles}
    assert not cycles, f"packages that import each other (module edges inside each cycle): {detail}"


def _defined_classes(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)}


def model_classes_named_outside(root: Path = ROOT) -> list[tuple[str, str]]:
    """(module outside deepinfer.models, class) for every class defined in deepinfer/models/ (outside
    its interface module) that the module imports by name or reaches as an attribute of an imported
    deepinfer.models module."""
    known = _modules(root)
    models = {n: p for n, p in known.items() if _under(n, ("deepinfer.models",))}
    interface = _defined_classes(models["deepinfer.models.interface"]) if "deepinfer.models.interface" in models \
        else set()
    concrete = set().union(*(_defined_classes(p) for n, p in models.items()
                             if n != "deepinfer.models.interface")) - interface
    found = set()
    for name, path in known.items():
        if _under(name, ("deepinfer.models",)):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases = set()  # local names bound to a deepinfer.models module
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _under(a.name, ("deepinfer.models",)):
                        aliases.add(a.asname or a.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    if _under(f"{base}.{a.name}", ("deepinfer.models",)) and f"{base}.{a.name}" in known:
                        aliases.add(a.asname or a.name)
                    elif _under(base, ("deepinfer.models",)) and a.name in concrete:
                        found.add((name, a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in concrete:
                head = node.value
                while isinstance(head, ast.Attribute):
                    head = head.value
                dotted = ast.unparse(node.value)
                if isinstance(head, ast.Name) and (dotted in aliases or head.id in aliases):
                    found.add((name, node.attr))
    return sorted(found)


ALLOWED_MODEL_NAMES: set[tuple[str, str]] = set()  # none left: the loader annotates with interface.ModelConfig


def test_the_model_name_finder_sees_imports_and_module_attributes(tmp_path):
    pkg = tmp_path / "deepinfer"
    (pkg / "models").mkdir(parents=True)
    (pkg / "worker").mkdir()
    for f in ("__init__.py", "models/__init__.py", "worker/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "models" / "interface.py").write_text("class CausalLM:\n    pass\n")
    (pkg / "models" / "net.py").write_text("class Net:\n    pass\n")
    (pkg / "worker" / "a.py").write_text("from deepinfer.models.net import Net\n")
    (pkg / "worker" / "b.py").write_text("from deepinfer.models import net\nx = net.Net\n")
    (pkg / "worker" / "c.py").write_text("import deepinfer.models.net\nx = deepinfer.models.net.Net\n")
    (pkg / "worker" / "d.py").write_text("from deepinfer.models.interface import CausalLM\n")
    assert model_classes_named_outside(pkg) == [("deepinfer.worker.a", "Net"), ("deepinfer.worker.b", "Net"),
                                                ("deepinfer.worker.c", "Net")]


def test_no_module_outside_models_names_a_model_class():
    """Serving, parallelism and tools read a model through models/interface.py (its Protocols and
    dataclasses) and build one through the registry: none names a class defined in deepinfer/models/."""
    wrong = [hit for hit in model_classes_named_outside() if hit not in ALLOWED_MODEL_NAMES]
    assert not wrong, f"modules naming a model class: {wrong}"


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
